"""Benchmark: the CPU each process of a 3-node cluster uses per call, and the round
trip, on loopback: this process leads 3 nodes x 2 workers of
``zbus.bench.BenchWorker`` (two ``zbus follower`` processes join it), makes 500
no-op calls untimed, then ``--calls`` timed, each answered by the last rank, and
reads every process's CPU times (and the leader's and agents' threads') before and after.

    python benchmarks/node_cpu.py [--calls N]

With 9 processes on few cores the round trip follows the CPU they all use per
call. Figures: docs/benchmarks.md ("The relay in C"); for an A/B, run it with
``PYTHONPATH`` set to each checkout, alternately.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

import zbus
from zbus.bench import BenchWorker
from zbus.cluster import free_port_pair


def cpu(p: Any) -> float:
    return p.user_time + p.system_time if hasattr(p, "user_time") else sum(p.cpu_times()[:2])


def thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # (a thread that ended)
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000)
    n = ap.parse_args().calls
    port = free_port_pair()
    env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE="2", ZBUS_ALLOW_WORKERS="zbus.bench")
    followers = [subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", str(r)],
                                  env=env) for r in (1, 2)]
    try:
        with zbus.Executor(BenchWorker, nnodes=3, nproc_per_node=2, master_addr="127.0.0.1",
                           master_port=port) as ex:
            last = ex.world_size - 1
            procs = {"leader": psutil.Process()}
            for p in psutil.Process().children(recursive=True):
                role = "agent" if "follower" in " ".join(p.cmdline()) else "worker"
                procs[f"{role} {p.pid}"] = p
            threaded = {k: p for k, p in procs.items() if not k.startswith("worker")}
            for _ in range(500):
                ex.collective_rpc("noop", unique_reply_rank=last)
            before = {k: cpu(p) for k, p in procs.items()}
            threads = {t.id: cpu(t) for p in threaded.values() for t in p.threads()}
            times = []
            for _ in range(n):
                t = time.perf_counter()
                ex.collective_rpc("noop", unique_reply_rank=last)
                times.append(time.perf_counter() - t)
            for k, p in procs.items():
                print(f"{k:<16} {(cpu(p) - before[k]) / n * 1e6:7.1f} us CPU per call")
            for k, p in threaded.items():
                for t in p.threads():
                    used = (cpu(t) - threads.get(t.id, 0.0)) / n * 1e6
                    if used:
                        print(f"  {k} thread {t.id} ({thread_name(p.pid, t.id)}): {used:.1f} us")
            total = sum(cpu(p) - before[k] for k, p in procs.items()) / n * 1e6
            print(f"all processes    {total:7.1f} us CPU per call")
            print(f"round trip, median {statistics.median(times) * 1e6:.1f} us ({n} calls)")
    finally:
        for f in followers:
            try:
                f.wait(30)
            except subprocess.TimeoutExpired:
                f.kill()
                f.wait(10)


if __name__ == "__main__":
    main()
