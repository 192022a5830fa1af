"""Benchmark: collective_rpc round trips and payloads beside multiprocessing pipes and pyzmq.

    python benchmarks/rpc.py [--seconds S] [--json PATH]

The same as `zbus bench rpc payload idle import`; see docs/benchmarks.md for the figures.
"""

import sys

from zbus.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *"rpc payload idle import".split(), *sys.argv[1:]]))
