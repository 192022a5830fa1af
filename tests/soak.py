"""Soak: many RPCs of mixed sizes across a 3-node cluster on loopback, with replies
of mixed sizes too, and the memory (RSS) of each process (the leader, the agents,
the workers) compared after warm-up and at the end (see ``rss`` and
``fixed_mmap_threshold``).

Every call carries its number and its payload's checksum; every worker checks the
numbers it sees (one skipped: lost on the way; one seen again: duplicated) and
answers with them, its payload's checksum and a slice of a block that the driver
knows too. Each failure is counted, not raised:

- ``lost``: replies that never came (a call that failed or timed out counts its
  world size; the run stops there, with ``error`` saying why) and calls a worker
  never saw;
- ``duplicated``: calls a worker saw twice, replies that carry a number already
  answered;
- ``reordered``: replies of another call, or from another rank than their place;
- ``corrupted_calls``: payloads whose checksum differs at the worker;
- ``corrupted_replies``: reply bytes that differ from what was asked for.

    python tests/soak.py --calls 1000000          # the full soak (hours here)
    python tests/soak.py --calls 3000             # what CI runs (tests/test_soak.py)

Prints one JSON line with the counts and RSS figures.
"""

from __future__ import annotations

import argparse
import collections
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
REPLY_BLOCK = 2 * 2**20  # replies are slices of this block, made from the seed on both ends


def reply_block(seed: int) -> bytes:
    return random.Random(seed).randbytes(REPLY_BLOCK)


class SoakWorker(zbus.Worker):
    def __init__(self, seed: int = 1):
        self.block = memoryview(reply_block(seed))
        self.next = 0  # the call number this worker should see next
        self.skipped = self.repeated = 0

    def check(self, seq: int, payload: bytes, start: int, size: int) -> tuple:
        if seq > self.next:
            self.skipped += seq - self.next
        elif seq < self.next:
            self.repeated += 1
        self.next = max(self.next, seq + 1)
        reply = self.block[start:start + size]
        return self.rank, seq, zlib.crc32(payload), reply, self.skipped, self.repeated


def sizes(rng: random.Random, n: int, max_bytes: int, small: int, mid: int) -> list[int]:
    """Mostly up to ``small``, some up to ``mid``, a few up to ``max_bytes``; the first
    ones span every size class, so the warm-up reaches the steady state."""
    out = [max_bytes >> k for k in range(0, 8)] * 2
    for _ in range(n - len(out)):
        r = rng.random()
        top = small if r < 0.9 else (mid if r < 0.99 else max_bytes)
        out.append(rng.randint(0, top))
    return out[:n]


def rss(procs: dict[str, psutil.Process], low: dict[str, int]) -> None:
    """Lower ``low`` to each process's RSS now where that is less: the least of many
    samples leaves out what is only in flight (a 32 MiB call, the calls the
    leader keeps to send again, which empty at each call over 1 MiB)."""
    for name, p in procs.items():
        try:
            now = p.memory_info().rss
        except psutil.NoSuchProcess:
            now = 0
        low[name] = min(low.get(name, now), now)


def label(p: psutil.Process, followers: list) -> str:
    """"agent 1", "worker 3" (its rank), "leader"."""
    if p.pid == os.getpid():
        return "leader"
    for rank, f in enumerate(followers, 1):
        if p.pid == f.pid:
            return f"agent {rank}"
    try:
        return f"worker {p.environ().get('RANK', p.pid)}"
    except psutil.Error:
        return f"process {p.pid}"


MMAP_THRESHOLD = 128 * 1024


def fixed_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at its 128 KiB default in this process and in
    those started from it. glibc raises the threshold each time it frees a mapped
    block (up to 32 MiB): blocks of up to that size then come from the heap and
    stay in RSS once freed, a step as large as the largest message, which is no
    leak but would hide one. A fixed threshold maps large blocks and unmaps them
    when freed, so RSS follows what is in use."""
    import ctypes

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the agents and workers
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD, this process
    except (OSError, AttributeError):  # not glibc: nothing to fix
        pass


def soak(calls: int, max_bytes: int, window: int, seed: int, warmup: float = 0.3,
         reply_bytes: int = 2**20, timeout: float = 60.0) -> dict:
    fixed_mmap_threshold()
    port = free_port_pair()
    env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE="2", ZBUS_ALLOW_WORKERS="soak",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    followers = [subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", str(r)],
                                  env=env) for r in (1, 2)]
    rng = random.Random(seed)
    n = collections.Counter(lost=0, duplicated=0, reordered=0, corrupted_calls=0, corrupted_replies=0)
    error = None
    answered = 0
    # RSS after warm-up (the least over the next tenth of the calls) and at the end
    # (the least over the last tenth and after the last call)
    warm_rss: dict[str, int] = {}
    end_rss: dict[str, int] = {}
    warm_from, end_from, every = int(calls * warmup), int(calls * 0.9), max(1, calls // 300)
    try:
        # by import path: this file may be __main__ here, and workers import it as "soak"
        with zbus.Executor("soak:SoakWorker", nnodes=3, nproc_per_node=2, master_addr="127.0.0.1",
                           master_port=port, join_timeout=120, worker_kwargs={"seed": seed}) as ex:
            world = ex.world_size
            me = psutil.Process()
            procs = {label(p, followers): p for p in [me, *me.children(recursive=True)]}
            last_seq = [-1] * world  # the last call number each rank answered
            worker_counts = [(0, 0)] * world  # (skipped, repeated) each worker reported last
            block = reply_block(seed)
            plan = sizes(rng, calls, max_bytes, 4096, 2**20)
            replies_plan = sizes(rng, calls, reply_bytes, 4096, 2**18)
            # Payloads are slices of one random block: the leader's own memory then
            # measures zbus, not this script's allocations.
            payloads = memoryview(rng.randbytes(max_bytes + 2**20))
            pending: collections.deque = collections.deque()

            def check(seq: int, crc: int, start: int, size: int, fut, wait: float = timeout) -> None:
                nonlocal answered
                want = zlib.crc32(block[start:start + size])
                for place, reply in enumerate(fut.result(timeout=wait)):
                    try:
                        rank, got_seq, got_crc, data, skipped, repeated = reply
                        last_seq[rank]  # noqa: B018 - an index check
                    except (TypeError, ValueError, IndexError):
                        n["corrupted_replies"] += 1
                        continue
                    if got_seq <= last_seq[rank]:
                        n["duplicated"] += 1
                    elif rank != place or got_seq != seq:
                        n["reordered"] += 1
                    last_seq[rank] = max(last_seq[rank], got_seq)
                    n["corrupted_calls"] += got_crc != crc
                    n["corrupted_replies"] += len(data) != size or zlib.crc32(data) != want
                    worker_counts[rank] = (skipped, repeated)
                answered += 1

            t0 = time.monotonic()
            try:
                for seq, size in enumerate(plan):
                    start = rng.randint(0, len(payloads) - size)
                    payload = payloads[start:start + size]
                    r_size = replies_plan[seq]
                    r_start = rng.randint(0, REPLY_BLOCK - r_size)
                    fut = ex.collective_rpc("check", args=(seq, payload, r_start, r_size),
                                            non_block=True, timeout=timeout)
                    pending.append((seq, zlib.crc32(payload), r_start, r_size, fut))
                    while len(pending) >= window or (pending and seq == calls - 1):
                        check(*pending[0])
                        pending.popleft()
                    if seq % every == 0 and warm_from <= seq < warm_from + calls // 10:
                        rss(procs, warm_rss)
                    elif seq % every == 0 and seq >= end_from:
                        rss(procs, end_rss)
            except (zbus.ZbusError, TimeoutError) as e:  # in a call, or in sending one
                error = f"{type(e).__name__}: {e}"
                for call in pending:  # the rest fail with the executor, or are stuck behind it
                    try:
                        check(*call, wait=0)
                    except (zbus.ZbusError, TimeoutError):
                        n["lost"] += world
            elapsed = time.monotonic() - t0
            rss(procs, end_rss)
        n["lost"] += sum(s for s, _ in worker_counts)
        n["duplicated"] += sum(r for _, r in worker_counts)
        codes = [f.wait(60) for f in followers]
    finally:
        for f in followers:
            if f.poll() is None:
                f.kill()
                f.wait()
    mib = 2**20
    return {"calls": calls, "answered": answered, **n, "error": error,
            "seconds": round(elapsed, 1), "calls_per_s": round(answered / elapsed, 1),
            "bytes_sent": sum(plan), "reply_bytes": sum(replies_plan) * world,
            "rss_after_warmup_mib": {k: round(v / mib, 1) for k, v in warm_rss.items()},
            "rss_end_mib": {k: round(v / mib, 1) for k, v in end_rss.items()},
            "rss_growth_mib": {k: round((end_rss[k] - v) / mib, 1) for k, v in warm_rss.items()},
            "follower_exit_codes": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--max-bytes", type=int, default=32 * 2**20)
    parser.add_argument("--reply-bytes", type=int, default=2**20, help="largest reply")
    parser.add_argument("--window", type=int, default=16, help="calls in flight")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=0.3, help="share of calls before RSS is taken")
    args = parser.parse_args()
    print(json.dumps(soak(args.calls, args.max_bytes, args.window, args.seed, args.warmup,
                          args.reply_bytes)), flush=True)


if __name__ == "__main__":
    main()
