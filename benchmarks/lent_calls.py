"""Benchmark: large tensor calls back to back, lent to the workers or copied.

    python benchmarks/lent_calls.py [--mib 16 64] [--rings 1Mx8 1Mx32 1Mx80] [--calls N] [--rounds R]

For each ring geometry (``ZBUS_RING``) and size, an executor with 2 local workers
takes ``--calls`` calls of a tensor of that size, reply from worker 0, each call
followed by one single-thread memcpy of the same size in the same process, so
both see the same machine. A call is lent (no copy out of the ring) when its
message fits the ring of calls, and copied when it does not. Geometries alternate
round by round. Prints the medians and their ratio. Figures: docs/benchmarks.md,
"Calls decoded where they lie".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ONE = r'''
import statistics, sys, time
import torch
from zbus import Executor
from zbus.bench import BenchWorker

size, calls = int(sys.argv[1]) << 20, int(sys.argv[2])
t = torch.zeros(size // 4)
src, dst = bytearray(size), bytearray(size)
zb, mc = [], []
with Executor(BenchWorker, nproc_per_node=2) as ex:
    for _ in range(10):
        ex.collective_rpc("size", args=(t,), unique_reply_rank=0)
    for _ in range(calls):
        a = time.perf_counter()
        ex.collective_rpc("size", args=(t,), unique_reply_rank=0)
        b = time.perf_counter()
        dst[:] = src
        zb.append(b - a)
        mc.append(time.perf_counter() - b)
print(statistics.median(zb), statistics.median(mc))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rings", nargs="+", default=["1Mx8", "1Mx32", "1Mx80"])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    got: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for mib in args.mib:
            for ring in args.rings:
                out = subprocess.run([sys.executable, "-c", ONE, str(mib), str(args.calls)], check=True,
                                     capture_output=True, text=True, timeout=600,
                                     env={**os.environ, "ZBUS_RING": ring}).stdout.split()
                got.setdefault((mib, ring), []).append((float(out[0]), float(out[1])))
    print(f"{'size':>7} {'ZBUS_RING':>10} {'call':>10} {'memcpy':>10} {'x memcpy':>9}   "
          f"(median of {args.rounds} rounds of {args.calls} calls)")
    for (mib, ring), runs in got.items():
        call = statistics.median(r[0] for r in runs)
        copy = statistics.median(r[1] for r in runs)
        print(f"{mib:>4} MiB {ring:>10} {call * 1e6:>8.0f}us {copy * 1e6:>8.0f}us {copy / call:>9.2f}")


if __name__ == "__main__":
    main()
