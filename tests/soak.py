"""Soak: many RPCs of mixed sizes across a 3-node cluster, with replies of mixed
sizes too, and the memory (RSS) of each process (the leader, the agents,
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

The nodes run on loopback, or with ``--netns`` (root) in 3 network namespace hosts
(zbus.netns) while the followers' links are taken down for 0.5-3 s and their TCP
connections reset (``ss -K``) in turn (see ``soak_netns``).

    python tests/soak.py --calls 1000000          # the full soak (hours here)
    python tests/soak.py --calls 3000             # what CI runs (tests/test_soak.py)
    python tests/soak.py --netns --calls 1000000  # across hosts, links disrupted (make soak-netns)

Prints one JSON line with the counts and RSS figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
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
    """The soak on loopback: this process leads, its followers are its children."""
    fixed_mmap_threshold()
    port = free_port_pair()
    env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE="2", ZBUS_ALLOW_WORKERS="soak",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    followers = [subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", str(r)],
                                  env=env) for r in (1, 2)]
    try:
        result = run_calls(calls, max_bytes, window, seed, warmup, reply_bytes, timeout,
                           master_addr="127.0.0.1", port=port, followers=followers)
        codes = [f.wait(60) for f in followers]
    finally:
        for f in followers:
            if f.poll() is None:
                f.kill()
                f.wait()
    return {**result, "follower_exit_codes": codes}


def processes(followers: list) -> dict[str, psutil.Process]:
    """This process, its children, and each follower's agent and workers (the
    agents are this process's children on loopback, another's in namespaces)."""
    me = psutil.Process()
    found = {p.pid: p for p in [me, *me.children(recursive=True)]}
    for f in followers:
        if f.pid not in found:
            agent = psutil.Process(f.pid)
            found.update({p.pid: p for p in [agent, *agent.children(recursive=True)]})
    return {label(p, followers): p for p in found.values()}


def run_calls(calls: int, max_bytes: int, window: int, seed: int, warmup: float, reply_bytes: int,
              timeout: float, master_addr: str, port: int, followers: list,
              progress=None) -> dict:
    """Lead the 3-node cluster, make the calls and check them; ``followers`` are
    the agents (anything with a ``pid``), ``progress(seq)`` runs every
    ``calls // 1000`` calls."""
    rng = random.Random(seed)
    n = collections.Counter(lost=0, duplicated=0, reordered=0, corrupted_calls=0, corrupted_replies=0)
    error = None
    answered = 0
    # RSS after warm-up (the least over the next tenth of the calls) and at the end
    # (the least over the last tenth and after the last call)
    warm_rss: dict[str, int] = {}
    end_rss: dict[str, int] = {}
    warm_from, end_from, every = int(calls * warmup), int(calls * 0.9), max(1, calls // 300)
    every_progress = max(1, calls // 1000)
    # by import path: this file may be __main__ here, and workers import it as "soak"
    with zbus.Executor("soak:SoakWorker", nnodes=3, nproc_per_node=2, master_addr=master_addr,
                       master_port=port, join_timeout=120, worker_kwargs={"seed": seed}) as ex:
        world = ex.world_size
        procs = processes(followers)
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
                if progress is not None and seq % every_progress == 0:
                    progress(seq)
        except (zbus.ZbusError, TimeoutError) as e:  # in a call, or in sending one
            error = f"{type(e).__name__}: {e}"
            for call in pending:  # the rest fail with the executor, or are stuck behind it
                try:
                    check(*call, wait=0)
                except (zbus.ZbusError, TimeoutError):
                    n["lost"] += world
        elapsed = time.monotonic() - t0
        rss(procs, end_rss)
        leader = getattr(ex, "_leader", None)  # what the disruptions cost: calls and replies sent again
        again = {"calls_sent_again": leader.calls_again, "reply_copies_dropped": leader.replies_again}
    n["lost"] += sum(s for s, _ in worker_counts)
    n["duplicated"] += sum(r for _, r in worker_counts)
    mib = 2**20
    return {"calls": calls, "answered": answered, **n, "error": error, **again,
            "seconds": round(elapsed, 1), "calls_per_s": round(answered / elapsed, 1),
            "bytes_sent": sum(plan), "reply_bytes": sum(replies_plan) * world,
            "rss_after_warmup_mib": {k: round(v / mib, 1) for k, v in warm_rss.items()},
            "rss_end_mib": {k: round(v / mib, 1) for k, v in end_rss.items()},
            "rss_growth_mib": {k: round((end_rss[k] - v) / mib, 1) for k, v in warm_rss.items()}}


# --- the soak across network namespace hosts, with the links disrupted -------------

NETNS_PORT = 29650
FLAP_S = (0.5, 3.0)  # how long a link stays down: well within the liveness limit (10 s)


def netns_leader(args: argparse.Namespace) -> None:
    """The leader's side, run inside the leader's namespace by :func:`soak_netns`:
    prints a progress line (``{"progress": seq}``) every thousandth of the calls,
    then the result."""
    fixed_mmap_threshold()
    followers = [psutil.Process(int(p)) for p in args.follower_pids.split(",")]

    def progress(seq: int) -> None:
        print(json.dumps({"progress": seq}), flush=True)

    print(json.dumps(run_calls(args.calls, args.max_bytes, args.window, args.seed, args.warmup,
                               args.reply_bytes, 60.0, master_addr="leader", port=NETNS_PORT,
                               followers=followers, progress=progress)), flush=True)


class Disruptor(threading.Thread):
    """Disrupts a random follower's link to the leader when the calls reach each of
    ``milestones`` (call numbers), flaps and resets in turn: a flap takes its
    link down for ``FLAP_S`` seconds (TCP stalls, then carries on); a reset kills
    every TCP connection of its namespace to the leader (``ss -K``), dropping
    whatever they held. Each is recorded in ``done``."""

    def __init__(self, cluster, milestones: list[int], seed: int, progress):
        super().__init__(name="disruptor", daemon=True)
        self.cluster, self.milestones, self.progress = cluster, milestones, progress
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.done: list[dict] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            kinds = ["flap", "reset"] if self.rng.random() < 0.5 else ["reset", "flap"]
            t0 = time.monotonic()
            for i, at in enumerate(self.milestones):
                while self.progress() < at:
                    if self.stop.wait(0.02):
                        return
                node = self.rng.choice(self.cluster.nodes[1:])
                record = {"kind": kinds[i % 2], "node": node.index, "call": self.progress(),
                          "at_s": round(time.monotonic() - t0, 2)}
                if record["kind"] == "flap":
                    record["down_s"] = round(self.rng.uniform(*FLAP_S), 2)
                    node.link(up=False)
                    time.sleep(record["down_s"])
                    node.link(up=True)
                else:
                    record["connections"] = self.reset(node)
                self.done.append(record)
        except Exception as e:  # noqa: BLE001 - reported with the result
            self.error = f"{type(e).__name__}: {e}"

    def reset(self, node) -> int:
        """Kill every TCP connection of ``node`` to the leader; how many it killed."""
        leader_ip = self.cluster.nodes[0].address
        out = subprocess.run(["ip", "netns", "exec", node.ns, "ss", "-K", "-t", "-n", "dst", leader_ip],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return sum(1 for line in out.splitlines() if leader_ip in line)


def soak_netns(calls: int, max_bytes: int, window: int, seed: int, warmup: float,
               reply_bytes: int, disruptions: int, limit_s: float | None = None) -> dict:
    """The soak across 3 namespace hosts (zbus.netns): the leader runs in its own
    host, each follower in its own, while a :class:`Disruptor` flaps their links
    and resets their connections ``disruptions`` times, spread over 5-85 % of the
    calls (a disruption stalls the calls, so each one meets calls in flight). The
    result adds the disruptions, the followers' exit codes and what was left on
    each host. A leader still running after ``limit_s`` is killed."""
    from zbus.netns import NetnsCluster

    fixed_mmap_threshold()  # inherited by every process of every host
    env = {"ZBUS_MASTER_ADDR": "leader", "ZBUS_MASTER_PORT": str(NETNS_PORT), "ZBUS_NPROC_PER_NODE": "2",
           "ZBUS_ALLOW_WORKERS": "soak", "ZBUS_INSECURE": "1",
           "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    milestones = [int(calls * (0.05 + 0.8 * (i + 0.5) / disruptions)) for i in range(disruptions)]
    t0 = time.monotonic()
    with NetnsCluster(3) as cluster:
        followers = [node.start([sys.executable, "-m", "zbus.cli", "follower", "--node-rank",
                                 str(node.index)], env=env) for node in cluster.nodes[1:]]
        pids = ",".join(str(f.pid) for f in followers)
        leader = cluster.nodes[0].python(
            os.path.abspath(__file__), "--netns-leader", "--follower-pids", pids, "--calls", str(calls),
            "--max-bytes", str(max_bytes), "--window", str(window), "--seed", str(seed), "--warmup",
            str(warmup), "--reply-bytes", str(reply_bytes), env=env, stdout=subprocess.PIPE, text=True)
        reached = [-1]
        disruptor = Disruptor(cluster, milestones, seed, lambda: reached[0])
        result = None
        watchdog = threading.Timer(limit_s, leader.kill) if limit_s else None
        if watchdog is not None:
            watchdog.daemon = True  # (a soak cut short by SIGTERM exits without waiting for it)
            watchdog.start()
        for line in leader.stdout:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "progress" in msg:
                reached[0] = msg["progress"]
                if disruptor.ident is None:
                    disruptor.start()
            else:
                result = msg
        if watchdog is not None:
            watchdog.cancel()
        disruptor.stop.set()
        if disruptor.ident is not None:
            disruptor.join(10)
        for node in cluster.nodes[1:]:
            node.link(up=True)  # in case the run ended inside a flap
        codes = [leader.wait(60), *(wait_exit(f, 60) for f in followers)]
        left = {}
        deadline = time.monotonic() + 10
        for node in cluster.nodes:
            while (node.pids() or node.shm_segments()) and time.monotonic() < deadline:
                time.sleep(0.1)
            left[node.name] = {"pids": node.pids(), "segments": node.shm_segments()}
    if result is None:
        result = {"calls": calls, "answered": 0, "error": f"the leader ended ({codes[0]}) without a result"}
    kinds = collections.Counter(d["kind"] for d in disruptor.done)
    return {**result, "leader_exit_code": codes[0], "follower_exit_codes": codes[1:],
            "flaps": kinds["flap"], "resets": kinds["reset"], "disruptor_error": disruptor.error,
            "disruptions": disruptor.done, "left_behind": {k: v for k, v in left.items() if any(v.values())},
            "wall_s": round(time.monotonic() - t0, 1)}


def wait_exit(proc, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--max-bytes", type=int, default=32 * 2**20)
    parser.add_argument("--reply-bytes", type=int, default=2**20, help="largest reply")
    parser.add_argument("--window", type=int, default=16, help="calls in flight")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=0.3, help="share of calls before RSS is taken")
    parser.add_argument("--netns", action="store_true",
                        help="3 network namespace hosts (root), links flapped and connections reset")
    parser.add_argument("--disruptions", type=int, default=None,
                        help="with --netns: link flaps and resets, in turn (default: one per 2000 calls)")
    parser.add_argument("--limit-s", type=float, default=None,
                        help="with --netns: kill the leader after this many seconds")
    parser.add_argument("--netns-leader", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--follower-pids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # SIGTERM (a test's limit) unwinds as an exception: the followers are ended and
    # the namespaces deleted by the ``finally`` and ``with`` blocks on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.netns_leader:
        netns_leader(args)
    elif args.netns:
        disruptions = args.disruptions if args.disruptions is not None else max(2, args.calls // 2000)
        print(json.dumps(soak_netns(args.calls, args.max_bytes, args.window, args.seed, args.warmup,
                                    args.reply_bytes, disruptions, args.limit_s)), flush=True)
    else:
        print(json.dumps(soak(args.calls, args.max_bytes, args.window, args.seed, args.warmup,
                              args.reply_bytes)), flush=True)


if __name__ == "__main__":
    main()
