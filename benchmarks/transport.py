"""Benchmark: the shared-memory ring beside raw pyzmq over ipc (round trip; GB/s at 1, 16, 64 MiB).

    python benchmarks/transport.py [--seconds S] [--json PATH]

The same as `zbus bench ring`; see docs/benchmarks.md for the figures.
"""

import sys

from zbus.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *"ring".split(), *sys.argv[1:]]))
