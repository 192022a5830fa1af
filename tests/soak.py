"""Soak: many RPCs of mixed sizes across a 3-node cluster on loopback, every reply
checked against a per-call checksum; lost, duplicated and reordered replies
counted (all must be 0), and the memory (RSS) of the leader, the agents and the
workers compared after warm-up and at the end.

    python tests/soak.py --calls 1000000          # the full soak (hours here)
    python tests/soak.py --calls 3000             # what CI runs (tests/test_soak.py)

Prints one JSON line with the counts and RSS figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import zlib

import psutil

import zbus
from zbus.cluster import free_port_pair

HERE = os.path.dirname(os.path.abspath(__file__))


class SoakWorker(zbus.Worker):
    def check(self, seq: int, payload: bytes) -> tuple:
        return self.rank, seq, zlib.crc32(payload)


def sizes(rng: random.Random, n: int, max_bytes: int) -> list[int]:
    """Mostly small calls, some of a MiB, a few up to ``max_bytes``; the first ones
    span every size class, so the warm-up reaches the steady state."""
    out = [max_bytes >> k for k in range(0, 8)] * 2
    for _ in range(n - len(out)):
        r = rng.random()
        top = 4096 if r < 0.9 else (2**20 if r < 0.99 else max_bytes)
        out.append(rng.randint(0, top))
    return out


def rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def soak(calls: int, max_bytes: int, window: int, seed: int, warmup: float = 0.3) -> dict:
    port = free_port_pair()
    env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE="2", ZBUS_ALLOW_WORKERS="soak",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    followers = [subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", str(r)],
                                  env=env) for r in (1, 2)]
    rng = random.Random(seed)
    lost = duplicated = reordered = corrupted = 0
    try:
        # by import path: this file may be __main__ here, and workers import it as "soak"
        with zbus.Executor("soak:SoakWorker", nnodes=3, nproc_per_node=2, master_addr="127.0.0.1",
                           master_port=port, join_timeout=120) as ex:
            procs = [psutil.Process()] + [psutil.Process(f.pid) for f in followers]
            procs += [c for p in procs[:1] for c in p.children(recursive=True)
                      if c.pid not in {q.pid for q in procs}]
            pending: list = []
            warm_rss = 0
            t0 = time.monotonic()
            plan = sizes(rng, calls, max_bytes)
            # Payloads are slices of one random block: the leader's own memory then
            # measures zbus, not this script's allocations.
            block = memoryview(rng.randbytes(max_bytes + 2**20))
            for seq, size in enumerate(plan):
                start = rng.randint(0, len(block) - size)
                payload = block[start:start + size]
                pending.append((seq, zlib.crc32(payload), ex.collective_rpc("check", args=(seq, payload),
                                                                            non_block=True, timeout=120)))
                if len(pending) >= window or seq == calls - 1:
                    for want_seq, crc, fut in pending:
                        replies = fut.result(timeout=120)
                        ranks = [r[0] for r in replies]
                        if len(replies) < ex.world_size:
                            lost += ex.world_size - len(replies)
                        if len(set(ranks)) != len(ranks):
                            duplicated += 1
                        if ranks != sorted(ranks) or any(r[1] != want_seq for r in replies):
                            reordered += 1
                        corrupted += sum(r[2] != crc for r in replies)
                    pending.clear()
                if seq == int(calls * warmup):
                    warm_rss = rss(procs)
            elapsed = time.monotonic() - t0
            end_rss = rss(procs)
        codes = [f.wait(60) for f in followers]
    finally:
        for f in followers:
            if f.poll() is None:
                f.kill()
                f.wait()
    return {"calls": calls, "lost": lost, "duplicated": duplicated, "reordered": reordered,
            "corrupted": corrupted, "seconds": round(elapsed, 1), "calls_per_s": round(calls / elapsed, 1),
            "rss_after_warmup_mib": round(warm_rss / 2**20, 1), "rss_end_mib": round(end_rss / 2**20, 1),
            "rss_growth": round(end_rss / warm_rss - 1, 4) if warm_rss else None,
            "bytes_sent": sum(plan), "follower_exit_codes": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--max-bytes", type=int, default=32 * 2**20)
    parser.add_argument("--window", type=int, default=16, help="calls in flight")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=0.3, help="share of calls before RSS is taken")
    args = parser.parse_args()
    print(json.dumps(soak(args.calls, args.max_bytes, args.window, args.seed, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
