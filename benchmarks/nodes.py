"""Benchmark: multi-node round trips and leader egress, relay beside direct fan-out.

    python benchmarks/nodes.py [--seconds S] [--json PATH]

The same as `zbus bench nodes`; see docs/benchmarks.md for the figures.
"""

import sys

from zbus.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *"nodes".split(), *sys.argv[1:]]))
