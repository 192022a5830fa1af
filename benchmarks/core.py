"""Benchmark: the compiled core against its Python twins, on the calls every step pays;
`collective_rpc` to 2 local workers.

    python benchmarks/core.py [--seconds S]

Two drivers, each with its own 2 workers: one on the compiled core, one with
``ZBUS_PURE_PYTHON=1``. Blocks of calls alternate driver by driver and case by case,
so a noisy machine slows both alike. Prints each case's median per core, the ratio,
and the CPU time per call of each driver and its workers. Figures:
docs/benchmarks.md, "The compiled core".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = [("no-op, reply from rank 0", "noop", True), ("no-op, all reply", "noop", False),
         ("1 KiB bytes, reply from rank 0", "size", True), ("1 KiB tensor, reply from rank 0", "size", True),
         ("64 KiB bytes, reply from rank 0", "size", True)]
BLOCK = 50

DRIVER = r'''
import json, sys, time, psutil, torch
from zbus import ring
from zbus.bench import BenchWorker
from zbus.executor import Executor
data = {"1 KiB bytes": bytes(1024), "1 KiB tensor": torch.zeros(256), "64 KiB bytes": bytes(65536)}
with Executor(BenchWorker, nproc_per_node=2) as ex:
    procs = [psutil.Process(), *(psutil.Process(p.pid) for p in ex._workers.procs)]
    print(json.dumps(ring.CORE), flush=True)
    for line in sys.stdin:
        case, method, unique, n = json.loads(line)
        args = (data[case.split(",")[0]],) if method == "size" else ()
        kw = {"unique_reply_rank": 0} if unique else {}
        call = lambda: ex.collective_rpc(method, args=args, **kw)
        for _ in range(3):  # untimed: the workers slept while the other driver ran
            call()
        cpu = sum(sum(p.cpu_times()[:2]) for p in procs)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        print(json.dumps([times, sum(sum(p.cpu_times()[:2]) for p in procs) - cpu]), flush=True)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    drivers = {}
    for pure in ("", "1"):
        env = dict(os.environ, PYTHONPATH=here, ZBUS_PURE_PYTHON=pure)
        p = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env, cwd=here)
        drivers[json.loads(p.stdout.readline())] = p
    if set(drivers) != {"compiled", "python"}:
        sys.exit(f"expected one driver on each core, got {sorted(drivers)}: is the core built?")
    times = {(core, c): [] for core in drivers for c, _, _ in CASES}
    cpu = {(core, c): 0.0 for core in drivers for c, _, _ in CASES}
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end:
            for case, method, unique in CASES:
                for core, p in drivers.items():
                    p.stdin.write(json.dumps([case, method, unique, BLOCK]) + "\n")
                    p.stdin.flush()
                    block, used = json.loads(p.stdout.readline())
                    times[(core, case)] += block
                    cpu[(core, case)] += used
    finally:
        for p in drivers.values():
            p.stdin.close()
            p.wait()
    print(f"{'2 workers, median (CPU per call)':34s}{'compiled':>22s}{'python':>22s}{'ratio':>8s}")
    for case, _, _ in CASES:
        med = {core: statistics.median(times[(core, case)]) * 1e6 for core in drivers}
        per = {core: cpu[(core, case)] / len(times[(core, case)]) * 1e6 for core in drivers}
        print(f"{case:34s}" + "".join(f"{med[c]:9.1f} us ({per[c]:5.0f} us)" for c in ("compiled", "python"))
              + f"{med['compiled'] / med['python']:8.2f}   ({len(times[('compiled', case)])} calls each)")


if __name__ == "__main__":
    main()
