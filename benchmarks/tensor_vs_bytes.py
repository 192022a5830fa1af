"""Benchmark: a 1 KiB tensor against 1 KiB of bytes, and 16 MiB tensors that miss
the workers' receive-buffer pool; `collective_rpc` to 2 local workers, reply from
worker 0 (the `payload` scenario's shape).

    python benchmarks/tensor_vs_bytes.py [--seconds S] [--against CHECKOUT ...]

This checkout and each ``--against`` one (a ``git worktree`` of an older commit,
say) get a driver process of their own, with their own 2 workers; blocks of calls
alternate checkout by checkout and case by case, so a noisy machine slows all of
them alike. Prints the median of each case per checkout and the tensor/bytes
ratios. Figures: docs/benchmarks.md, "1 KiB tensor vs bytes".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# (case, method, block): "random" holds torch.randn's bytes, which make the header of
# a message that carries them inline (bytes under 16 KiB) cost more to check.
CASES = [("1 KiB bytes", "size", 20), ("1 KiB tensor", "size", 20),
         ("1 KiB bytes, random", "size", 20), ("1 KiB tensor, random", "size", 20),
         ("16 MiB tensor, pool hit", "size", 2), ("16 MiB tensor, pool miss", "tvb_keep:keep", 2)]

# Called by import path, so that any checkout's workers have it: a worker that holds
# its last 6 inputs keeps all its receive buffers in use, and every call misses the pool.
KEEP = """
def keep(worker, data):
    worker.tvb_kept = [*getattr(worker, "tvb_kept", [])[-5:], data]
    return data.nbytes
"""

DRIVER = r'''
import json, sys, time
import torch
from zbus.bench import BenchWorker
from zbus.executor import Executor
r = torch.randn(256)
data = {"1 KiB bytes": bytes(1024), "1 KiB tensor": torch.zeros(256),
        "1 KiB bytes, random": bytes(r.view(torch.uint8).tolist()), "1 KiB tensor, random": r,
        "16 MiB tensor, pool hit": torch.zeros(4 * 2**20), "16 MiB tensor, pool miss": torch.zeros(4 * 2**20)}
with Executor(BenchWorker, nproc_per_node=2) as ex:
    print("ready", flush=True)
    for line in sys.stdin:
        case, method, n = json.loads(line)
        call = lambda d=data[case]: ex.collective_rpc(method, args=(d,), unique_reply_rank=0)
        for _ in range(3):  # untimed: the workers slept while another checkout ran
            call()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        print(json.dumps(times), flush=True)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--against", nargs="*", default=[], metavar="CHECKOUT")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = [here, *(os.path.abspath(c) for c in args.against)]
    tmp = tempfile.mkdtemp(prefix="zbus-bench-")
    with open(os.path.join(tmp, "tvb_keep.py"), "w") as f:
        f.write(KEEP)
    drivers = []
    for path in checkouts:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, tmp]))
        p = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=path)
        if p.stdout.readline().strip() != "ready":
            sys.exit(f"the driver in {path} did not start")
        drivers.append(p)
    times: dict[tuple[int, str], list[float]] = {(i, c): [] for i in range(len(drivers)) for c, _, _ in CASES}
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end:
            for case, method, block in CASES:
                for i, p in enumerate(drivers):
                    p.stdin.write(json.dumps([case, method, block]) + "\n")
                    p.stdin.flush()
                    times[(i, case)] += json.loads(p.stdout.readline())
    finally:
        for p in drivers:
            p.stdin.close()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    names = [os.path.relpath(c) if c != here else "this checkout" for c in checkouts]
    print(f"{'median':26s}" + "".join(f"{n[-24:]:>26s}" for n in names))
    for case, _, _ in CASES:
        print(f"{case:26s}" + "".join(f"{med[(i, case)]:23.1f} us" for i in range(len(drivers)))
              + f"   ({len(times[(0, case)])} calls each)")
    for tensor, bytes_ in (("1 KiB tensor", "1 KiB bytes"), ("1 KiB tensor, random", "1 KiB bytes"),
                           ("1 KiB tensor, random", "1 KiB bytes, random")):
        print(f"{tensor + ' / ' + bytes_:47s}" + "".join(
            f"{med[(i, tensor)] / med[(i, bytes_)]:8.2f}" for i in range(len(drivers))))


if __name__ == "__main__":
    main()
