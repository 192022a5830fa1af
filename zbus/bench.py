"""``zbus bench``: a fixed benchmark suite, each figure beside a baseline measured
in the same run.

Every scenario is bounded in time. zbus and its baseline are measured in
alternating blocks, so a noisy machine slows both alike; the table shows medians,
p99 and the ratio zbus/baseline, pair by pair. ``--json PATH`` writes every row.

Scenarios: ``ring`` (raw ring broadcast vs pyzmq ipc), ``rpc`` (no-op
collective_rpc, 1/2/4 workers, vs multiprocessing pipes, with CPU per call),
``payload`` (bytes and tensors 1 KiB..64 MiB to 2 workers, vs pyzmq ipc and
memcpy), ``nodes`` (2 and 3 nodes, relay vs direct fan-out, vs pyzmq TCP
request/reply, leader egress), ``curve`` (CurveZMQ vs no keys), ``idle`` (CPU of
an idle worker, wake-up after idle), ``import`` (``import zbus`` time), ``vllm``
(vLLM's decode step on zbus vs vLLM's own executor, one node and two hosts).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable

from . import ring
from .baselines import PipeBaseline, ZmqBaseline, await_subscribers
from .errors import ZbusError
from .processes import end_followers
from .worker import Worker

KiB, MiB = 2**10, 2**20


@dataclass
class Row:
    scenario: str
    case: str
    median_us: float
    p99_us: float
    baseline: str = ""
    baseline_median_us: float = 0.0
    extra: dict = field(default_factory=dict)
    unit: str = "us"  # of median and p99: "us", "%" (CPU) or "B" (bytes)

    @property
    def ratio(self) -> float | None:
        return self.median_us / self.baseline_median_us if self.baseline_median_us else None


class BenchWorker(Worker):
    """The worker every scenario drives."""

    def noop(self, *args: Any) -> None:
        return None

    def size(self, data: Any) -> int:
        return int(getattr(data, "nbytes", None) or len(data))


def _stats(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e6, s[int(0.99 * (len(s) - 1))] * 1e6


def paired_ratio(a: list[float], b: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of ``a[i] / b[i]`` over blocks measured side by side (so slow
    stretches of a noisy machine cancel out), and a 95 % bootstrap interval of it
    (seeded: the same samples give the same interval)."""
    import random

    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def paired(a: Callable[[], None], b: Callable[[], None] | None, seconds: float,
           block: int = 20, cpu: tuple[Callable[[], float], Callable[[], float]] | None = None,
           gap: float = 0.0) -> tuple[list[float], list[float]]:
    """Time calls of ``a`` and ``b`` in alternating blocks for about ``seconds``.
    With ``cpu`` (two functions giving each side's CPU seconds so far), the CPU
    time per call of each side is left in ``paired.cpu_per_call``. ``gap``
    seconds of rest follow each block of ``b``, for a baseline whose processes
    keep spinning for a while after their last message; ``a`` then runs a quarter
    block untimed, so neither side is timed on a machine just woken from idle."""
    def rest() -> None:
        time.sleep(gap)
        for _ in range(block // 4):  # untimed: a machine idle that long wakes slowly
            a()

    for f in (a, b):
        if f is not None:
            for _ in range(3):
                f()
    if b is not None and gap:  # (b's warm-up was its last message too)
        rest()
    sa: list[float] = []
    sb: list[float] = []
    used = [0.0, 0.0]
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(sa) < 5:
        for side, (f, out) in enumerate(((a, sa), (b, sb))):
            if f is None:
                continue
            c0 = cpu[side]() if cpu else 0.0
            for _ in range(block):
                t = time.perf_counter()
                f()
                out.append(time.perf_counter() - t)
            if cpu:
                used[side] += cpu[side]() - c0
            if side == 1 and gap:
                rest()
    paired.cpu_per_call = (used[0] / max(1, len(sa)), used[1] / max(1, len(sb)))
    return sa, sb


def cpu_seconds(pids: list[int]) -> Callable[[], float]:
    """CPU seconds (user + system) used so far by this process's calling thread
    and the processes ``pids``."""
    import psutil

    procs = [psutil.Process(p) for p in pids]
    return lambda: time.thread_time() + sum(sum(p.cpu_times()[:2]) for p in procs)


def row(scenario: str, case: str, sa: list[float], sb: list[float], baseline: str = "",
        **extra: Any) -> Row:
    m, p = _stats(sa)
    return Row(scenario, case, m, p, baseline, _stats(sb)[0] if sb else 0.0, extra)


# --- scenarios --------------------------------------------------------------------


def bench_ring(seconds: float) -> list[Row]:
    """Raw ring broadcast round trip: writer -> 2 reader processes -> reply from
    reader 0, beside raw pyzmq over ipc in the same run; and GB/s for big messages."""
    from .config import RingGeometry
    from .ring import RingReader, RingWriter, create

    geo = RingGeometry.from_env()
    out = RingWriter.create(2, geo)
    back_handle, back, zb, readers, rows = None, None, None, [], []
    try:
        back_handle = create(1, geo)
        back = RingReader.attach(back_handle, 0)
        ctx = multiprocessing.get_context("spawn")
        readers = [ctx.Process(target=_ring_echo, args=(out.handle.to_dict(), i, back_handle.to_dict()),
                               daemon=True) for i in range(2)]
        for p in readers:
            p.start()
        step = partial(_ring_step, out, back)
        zb = ZmqBaseline(2)
        small = [b"x" * 64]
        sa, sb = paired(lambda: step(small), lambda: zb.call(b"x" * 64), seconds)
        rows.append(row("ring", "64 B round trip, 2 readers", sa, sb, "pyzmq ipc"))
        for size in (1 * MiB, 16 * MiB, 64 * MiB):
            data = bytearray(size)
            sa, sb = paired(lambda d=data: step([d]), lambda d=data: zb.call(d), seconds, block=2)
            r = row("ring", f"{size // MiB} MiB broadcast, 2 readers", sa, sb, "pyzmq ipc")
            r.extra = {"GB/s": size / (r.median_us / 1e6) / 1e9,
                       "baseline GB/s": size / (r.baseline_median_us / 1e6) / 1e9}
            rows.append(r)
    finally:
        _end_ring_bench(out, back_handle, back, readers, zb)
    return rows


def _end_ring_bench(out: Any, back_handle: Any, back: Any, readers: list, zb: Any) -> None:
    """Stop the ring bench's readers and free its rings and its baseline. The rings'
    names go first: a second Ctrl-C in the waits below leaves none."""
    from . import shm

    shm.unlink(out.name)
    if back_handle is not None:
        shm.unlink(back_handle.name)
    try:
        try:
            out.send([b"stop"], timeout=RING_STEP_S)
        except (TimeoutError, ZbusError):  # a reader gone: it does not read the stop
            pass
        for p in readers:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
    finally:
        out.close()
        if back is not None:
            back.close()
        if zb is not None:
            zb.close()


RING_STEP_S = 30.0  # the longest a ring step may take: a reader gone makes it time out


def _ring_step(out: Any, back: Any, frames: list) -> None:
    out.send(frames, timeout=RING_STEP_S)
    back.recv(timeout=RING_STEP_S)


def _ring_echo(handle: dict, index: int, back: dict) -> None:
    from .processes import die_with_parent
    from .ring import RingReader, RingWriter

    die_with_parent()
    ring = RingReader.attach(handle, index)
    out = RingWriter.attach(back) if index == 0 else None
    while True:
        stop = bytes(ring.recv()[0][:4]) == b"stop"  # keeps no view: the buffer is reused
        if stop:
            break
        if out is not None:
            out.send([b"ok"])
    ring.close()
    if out is not None:
        out.close(unlink=False)


def bench_rpc(seconds: float) -> list[Row]:
    """No-op collective_rpc round trip, 1 / 2 / 4 local workers, beside
    multiprocessing pipes doing the same fan-out in the same run."""
    from .executor import Executor

    rows = []
    for n in (1, 2, 4):
        with Executor(BenchWorker, nproc_per_node=n) as ex:
            for unique in (True, False):
                base = PipeBaseline(n, all_reply=not unique)
                try:
                    kw = {"unique_reply_rank": 0} if unique else {}
                    cpu = (cpu_seconds([p.pid for p in ex._workers.procs]),
                           cpu_seconds([p.pid for p in base.procs]))
                    sa, sb = paired(lambda kw=kw: ex.collective_rpc("noop", **kw), base.call, seconds,
                                    cpu=cpu)
                finally:
                    base.close()
                what = "reply from rank 0" if unique else "all reply"
                r = row("rpc", f"no-op, {n} worker{'s' * (n > 1)}, {what}", sa, sb, "multiprocessing pipes")
                za, zb = paired.cpu_per_call
                r.extra = {"CPU us/call": za * 1e6, "baseline CPU us/call": zb * 1e6}
                rows.append(r)
    return rows


def memcpy_seconds(size: int) -> float:
    import numpy as np

    src, dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
    best = []
    for _ in range(7):
        t = time.perf_counter()
        np.copyto(dst, src)
        best.append(time.perf_counter() - t)
    return statistics.median(best)


def bench_payload(seconds: float) -> list[Row]:
    """Payloads 1 KiB .. 64 MiB (bytes and CPU tensors) to 2 local workers, one
    reply; beside raw pyzmq ipc, with single-thread memcpy bandwidth for scale."""
    import torch

    from .executor import Executor

    rows = []
    zb = ZmqBaseline(2)
    try:
        with Executor(BenchWorker, nproc_per_node=2) as ex:
            for size in (1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB):
                for kind in ("bytes", "tensor"):
                    data = bytes(size) if kind == "bytes" else torch.zeros(size // 4)
                    raw = bytes(size)
                    sa, sb = paired(lambda d=data: ex.collective_rpc("size", args=(d,), unique_reply_rank=0),
                                    lambda r=raw: zb.call(r), seconds / 2, block=2 if size >= MiB else 20)
                    r = row("payload", f"{_size(size)} {kind} to 2 workers", sa, sb, "pyzmq ipc")
                    r.extra = {"GB/s": size / (r.median_us / 1e6) / 1e9}
                    if size >= 16 * MiB:
                        r.extra["memcpy GB/s"] = size / memcpy_seconds(size) / 1e9
                        r.extra["x memcpy"] = r.extra["GB/s"] / r.extra["memcpy GB/s"]
                    rows.append(r)
            pipes = PipeBaseline(2, all_reply=False)
            try:
                for size in (MiB, 16 * MiB):
                    data, raw = torch.zeros(size // 4), bytes(size)
                    sa, sb = paired(lambda d=data: ex.collective_rpc("size", args=(d,), unique_reply_rank=0),
                                    lambda r=raw: pipes.call(r), seconds / 2, block=2)
                    rows.append(row("payload", f"{_size(size)} tensor to 2 workers", sa, sb,
                                    "multiprocessing pipes"))
            finally:
                pipes.close()
    finally:
        zb.close()
    return rows


VLLM_SPIN_S = 1.1  # vLLM's readers spin for 1 s after their last message


def bench_compare(seconds: float) -> list[Row]:
    """``--compare``: the same shapes (a no-op, then 1 KiB .. 64 MiB tensors to 2
    local workers, the reply from worker 0) through zbus and, pair by pair,
    through what a user would use instead: raw pyzmq over ipc and over TCP,
    multiprocessing pipes, and vLLM's MessageQueue when it imports. Baselines
    that take bytes get the tensor's size in bytes; vLLM gets the tensor."""
    from .baselines import VllmBaseline, vllm_available
    from .executor import Executor

    # (name, how to start it, rest after each of its blocks, whether it takes the tensor)
    baselines: list[tuple[str, Callable[[], Any], float, bool]] = [
        ("pyzmq ipc", lambda: ZmqBaseline(2), 0.0, False),
        ("pyzmq TCP", lambda: ZmqBaseline(2, "127.0.0.1"), 0.0, False),
        ("multiprocessing pipes", lambda: PipeBaseline(2), 0.0, False)]
    why = vllm_available()
    if why:
        print(f"compare: {why}; docs/benchmarks.md says how to install it", file=sys.stderr)
    else:
        baselines.append(("vLLM MessageQueue", lambda: VllmBaseline(2), VLLM_SPIN_S, True))
    rows = []
    with Executor(BenchWorker, nproc_per_node=2) as ex:
        zbus_cpu = cpu_seconds([p.pid for p in ex._workers.procs])
        for name, make, gap, takes_tensor in baselines:
            base = make()
            try:
                for size in (0, KiB, MiB, 16 * MiB, 64 * MiB):
                    rows.append(_compare_one(ex, base, name, size, seconds, gap, takes_tensor, zbus_cpu))
            finally:
                base.close()
    return rows


def _compare_one(ex: Any, base: Any, name: str, size: int, seconds: float, gap: float,
                 takes_tensor: bool, zbus_cpu: Callable[[], float]) -> Row:
    import torch

    tensor = torch.zeros(size // 4) if size else None
    if size:
        mine = lambda: ex.collective_rpc("size", args=(tensor,), unique_reply_rank=0)  # noqa: E731
    else:
        mine = lambda: ex.collective_rpc("noop", unique_reply_rank=0)  # noqa: E731
    arg = tensor if takes_tensor else (bytes(size) if size else b"noop")
    theirs = lambda: base.call(arg)  # noqa: E731
    big = size >= 16 * MiB
    block = (10 if big else 200) if gap else (2 if big else 20)
    cpu = None if size else (zbus_cpu, cpu_seconds([p.pid for p in base.procs]))
    sa, sb = paired(mine, theirs, seconds, block=block, cpu=cpu, gap=gap)
    r = row("compare", f"{'no-op' if not size else _size(size) + ' tensor'} to 2 workers", sa, sb, name)
    if cpu:
        za, zb = paired.cpu_per_call
        r.extra = {"CPU us/call": za * 1e6, "baseline CPU us/call": zb * 1e6}
    elif big:
        copy = size / memcpy_seconds(size) / 1e9
        r.extra = {"GB/s": size / (r.median_us / 1e6) / 1e9,
                   "baseline GB/s": size / (r.baseline_median_us / 1e6) / 1e9, "memcpy GB/s": copy}
    return r


def bench_idle(seconds: float) -> list[Row]:
    """CPU of an idle worker over 5 s; wake-up of the first call after 1 s / 10 s idle
    (the median of 5 and 3 tries; the p99 column shows the slowest)."""
    import psutil

    from .executor import Executor

    rows = []
    with Executor(BenchWorker, nproc_per_node=2) as ex:
        ex.collective_rpc("noop")
        worker = psutil.Process(ex._workers.procs[0].pid)
        cpu0 = sum(worker.cpu_times()[:2])
        time.sleep(5)
        busy = (sum(worker.cpu_times()[:2]) - cpu0) / 5
        rows.append(Row("idle", "idle worker CPU (% of a core, 5 s)", busy * 100, busy * 100, unit="%"))
        warm, _ = paired(lambda: ex.collective_rpc("noop"), None, min(seconds, 1.0))
        for idle, times in ((1, 5), (10, 3)):  # a median of a few: one wake-up is noisy
            firsts = []
            for _ in range(times):
                time.sleep(idle)
                t = time.perf_counter()
                ex.collective_rpc("noop")
                firsts.append(time.perf_counter() - t)
            r = Row("idle", f"first call after {idle} s idle (median of {times})",
                    statistics.median(firsts) * 1e6, max(firsts) * 1e6, "warm call",
                    statistics.median(warm) * 1e6)
            rows.append(r)
    return rows


def bench_import() -> list[Row]:
    code = ("import time, sys; t = time.perf_counter(); import zbus; "
            "print(time.perf_counter() - t, 'torch' in sys.modules)")
    times, torch_loaded = [], False
    for _ in range(5):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        t, loaded = out.stdout.split()
        times.append(float(t))
        torch_loaded |= loaded == "True"
    m = statistics.median(times) * 1e6
    return [Row("import", "import zbus", m, max(times) * 1e6, extra={"torch imported": torch_loaded})]


# --- multi-node ---------------------------------------------------------------------

NODES_PORT = 29660


def nodes_driver(nnodes: int, seconds: float, host: str, sentinels: list[int], iface: str) -> None:
    """Runs on the leader node: zbus over ``nnodes`` x 2 workers beside direct
    fan-out and a pyzmq TCP request/reply; prints one JSON row per line."""
    import psutil
    import torch
    import zmq

    from .executor import Executor

    def spawn(node: int, code: str) -> Any:
        argv = [sys.executable, "-c", code]
        if sentinels:
            argv = ["nsenter", "-t", str(sentinels[node]), "-m", "-u", "-n", "--", *argv]
        return subprocess.Popen(argv)

    def egress() -> int:
        return psutil.net_io_counters(pernic=True)[iface].bytes_sent

    ctx = zmq.Context()
    pub, pull, req = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL), ctx.socket(zmq.REQ)
    rpub, rpull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)  # through one relay per node
    ports = [s.bind_to_random_port(f"tcp://{host}") for s in (pub, pull, req, rpub, rpull)]
    # Every baseline has zbus's topology: 2 workers on each node, the leader's own
    # among them (they hear each call, as zbus's local workers do, over ipc here).
    ranks = [node for node in range(nnodes) for _ in range(2)]
    last = len(ranks) - 1
    here = "ipc://@zbus-bench-{}-" + str(os.getpid())  # abstract: one per network namespace
    pub.bind(here.format("direct"))
    rpub.bind(here.format("relayed"))
    procs: list[Any] = []
    relays: list[Any] = []

    def direct(payload: Any) -> None:
        pub.send_multipart([str(last).encode(), payload], copy=len(payload) < 65536)
        pull.recv()

    def direct_to_all(payload: Any) -> None:
        pub.send_multipart([b"all", payload], copy=False)
        for _ in ranks:
            pull.recv()

    def relayed(payload: Any) -> None:
        rpub.send_multipart([str(last).encode(), payload], copy=len(payload) < 65536)
        rpull.recv()

    def reqrep(payload: Any) -> None:
        req.send_multipart([b"x", payload], copy=len(payload) < 65536)
        req.recv()

    def emit(r: Row) -> None:
        print(json.dumps(dict(asdict(r))), flush=True)

    def subscriber(node: int, source: str, push: str, rank: int) -> None:
        code = f"from zbus.baselines import sub_worker as w; w('{source}', '{push}', {rank})"
        procs.append(spawn(node, code))

    try:  # (whatever fails, the baselines' processes are ended below)
        for rank, node in enumerate(ranks):
            subscriber(node, here.format("direct") if node == 0 else f"tcp://{host}:{ports[0]}",
                       f"tcp://{host}:{ports[1]}", rank)
        procs.append(spawn(1, f"from zbus.baselines import rep_worker as w; w('tcp://{host}:{ports[2]}')"))
        for node in range(1, nnodes):
            relays.append(spawn(node, f"from zbus.baselines import relay as r; r('tcp://{host}:{ports[3]}', "
                                      f"'{here.format(f'relay-{node}')}')"))
        for rank, node in enumerate(ranks):
            subscriber(node, here.format("relayed" if node == 0 else f"relay-{node}"),
                       f"tcp://{host}:{ports[4]}", rank)
        await_subscribers(pub, pull, len(ranks))
        await_subscribers(rpub, rpull, len(ranks))
        with Executor(BenchWorker, nnodes=nnodes, nproc_per_node=2, master_addr=host,
                      master_port=NODES_PORT) as ex:
            world = ex.world_size
            for size in (0, MiB, 16 * MiB):
                data, raw = (torch.zeros(size // 4), bytes(size)) if size else ((), b"")
                call = (lambda: ex.collective_rpc("noop", unique_reply_rank=world - 1)) if not size else \
                    (lambda d=data: ex.collective_rpc("size", args=(d,), unique_reply_rank=world - 1))
                blk = 2 if size >= MiB else 20
                sa, sb = paired(call, lambda r=raw: direct(r), seconds / 2, block=blk)
                case = f"{nnodes} nodes, {'no-op' if not size else _size(size)}, reply from rank {world - 1}"
                emit(row("nodes", case, sa, sb, "direct fan-out"))
                sa, sb = paired(call, lambda r=raw: relayed(r), seconds / 2, block=blk)
                emit(row("nodes", case, sa, sb, "pyzmq relay per node"))
                sa, sb = paired(call, lambda r=raw: reqrep(r), seconds / 2, block=blk)
                emit(row("nodes", case, sa, sb, "pyzmq TCP req/rep"))
            payload, n = torch.zeros(4 * MiB), 5  # 16 MiB
            # Every rank answers, so each broadcast is counted once all of it was sent.
            for name, send in (("zbus relay", lambda: ex.collective_rpc("size", args=(payload,))),
                               ("direct fan-out", lambda: direct_to_all(bytes(payload.numpy())))):
                before = egress()
                for _ in range(n):
                    send()
                per = (egress() - before) / n
                emit(Row("egress", f"{nnodes} nodes x 2 workers: {name}", per, per,
                         extra={"payloads per broadcast": per / (16 * MiB)}, unit="B"))
    finally:  # (never waiting: a peer that never connected must not hold this up)
        for sock, stop in ((pub, [b"stop"]), (rpub, [b"stop"]), (req, [b"stop", b""])):
            try:
                sock.send_multipart(stop, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # (one that never subscribed waits for ever)
                p.kill()
                p.wait(10)
        for p in relays:  # a relay runs until it is ended
            p.kill()
            p.wait(10)
        ctx.destroy(linger=0)


def bench_nodes(seconds: float) -> list[Row]:
    """2 and 3 nodes x 2 workers, in network namespaces when this runs as root
    (each node its own address and /dev/shm), else on loopback."""
    from . import netns

    rows: list[Row] = []
    why = netns.unavailable()
    if why:
        print(f"nodes: {why}; measuring on loopback instead", file=sys.stderr)
    for nnodes in (2, 3):
        rows += _run_nodes(nnodes, seconds, why is None)
    return rows


def _run_nodes(nnodes: int, seconds: float, use_netns: bool) -> list[Row]:
    from . import netns

    env = {"ZBUS_NPROC_PER_NODE": "2", "ZBUS_MASTER_PORT": str(NODES_PORT)}
    code = "import sys, json; from zbus.bench import nodes_driver; nodes_driver(*json.loads(sys.argv[1]))"
    if not use_netns:
        env["ZBUS_MASTER_ADDR"] = "127.0.0.1"
        followers = [subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", str(r),
                                       "--allow-worker", "zbus.bench"], env=dict(os.environ, **env))
                     for r in range(1, nnodes)]
        args = [nnodes, seconds, "127.0.0.1", [], "lo"]
        try:  # its own session: past the timeout, it and every process it started are killed
            driver = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                stdout, stderr = driver.communicate(timeout=600)
            finally:  # (what it started is killed even if it ended: they would hold its pipes)
                try:
                    os.killpg(driver.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                driver.wait()
        finally:
            end_followers(followers)
        return _parse_rows(subprocess.CompletedProcess(driver.args, driver.returncode, stdout, stderr))
    with netns.NetnsCluster(nnodes) as c:
        env["ZBUS_MASTER_ADDR"] = "leader"
        for node in c.nodes[1:]:
            node.start([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", str(node.index),
                        "--allow-worker", "zbus.bench"], env=env)
        args = [nnodes, seconds, c.nodes[0].address, [n.sentinel.pid for n in c.nodes], "eth0"]
        # Without keys (the curve scenario measures them): only these namespaces reach its ports.
        proc = c.nodes[0].python("-c", code, json.dumps(args), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env={"ZBUS_INSECURE": "1"})
        stdout, stderr = proc.communicate(timeout=600)
        return _parse_rows(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))


VLLM_PORT = 29700  # vLLM's own multi-node rendezvous in the two-host run


def bench_vllm(seconds: float) -> list[Row]:
    """vLLM's decode step on zbus beside vLLM's own executor (zbus.vllm.bench): TP=2
    on this node, then over two namespace hosts against vLLM's multi-node mp."""
    from . import netns

    # vLLM binds its engines' ZeroMQ sockets as files in VLLM_RPC_BASE_PATH (the
    # temp folder by default) and leaves them there: a folder of this run's instead.
    with tempfile.TemporaryDirectory(prefix="zbus-vllm-rpc-") as rpc:
        rpc_env = {"VLLM_RPC_BASE_PATH": rpc}
        rows = _parse_rows(subprocess.run([sys.executable, "-m", "zbus.vllm.bench", "one", "--seconds",
                                           str(seconds)], capture_output=True, text=True, timeout=1800,
                                          env=dict(os.environ, **rpc_env)))
        why = netns.unavailable()
        if why:
            print(f"vllm: no two-host run: {why}", file=sys.stderr)
            return rows
        return rows + bench_vllm_hosts(seconds, rpc_env)


def bench_vllm_hosts(seconds: float, rpc_env: dict[str, str]) -> list[Row]:
    """TP=2 over two namespace hosts, one worker each: zbus (the other host runs
    ``zbus follower``) beside vLLM's multi-node mp (its headless follower)."""
    from . import netns
    from .vllm.bench import headless_follower, tiny_model

    with tempfile.TemporaryDirectory(prefix="zbus-vllm-model-") as model, netns.NetnsCluster(2) as c:
        leader, host = c.nodes
        tiny_model(model)
        keys = {"ZBUS_SECRET": "zbus-bench-vllm-two-hosts", "ZBUS_NODE_RANK": "1"}
        host.start([os.path.join(os.path.dirname(sys.executable), "zbus"), "follower", "--master-addr",
                    leader.address, "--nproc-per-node", "1", "--allow-import-calls"],
                   env={"VLLM_HOST_IP": host.address, **keys})
        host.start(headless_follower(model, leader.address, VLLM_PORT),
                   env={"VLLM_HOST_IP": host.address, **rpc_env},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = leader.python("-m", "zbus.vllm.bench", "two", "--seconds", str(seconds), "--iface", "eth0",
                             "--master-addr", leader.address, "--port", str(VLLM_PORT),
                             env={"ZBUS_NNODES": "2", "ZBUS_MASTER_ADDR": leader.address,
                                  "ZBUS_BENCH_MODEL": model, "VLLM_HOST_IP": leader.address, **keys,
                                  **rpc_env},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = proc.communicate(timeout=1800)
        return _parse_rows(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))


def bench_curve(seconds: float) -> list[Row]:
    """The cost of CurveZMQ: two 2-node clusters on loopback, one keyed, one not,
    measured in alternating blocks: no-op and 16 MiB round trips."""
    import torch
    import zmq

    from .cluster import free_port_pair
    from .curve import keygen
    from .executor import Executor

    if not zmq.has("curve"):
        return []
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="zbus-bench-keys-") as keys:
        keygen(keys, 1)
        ports = disjoint_port_pairs(2, free_port_pair)
        base = [sys.executable, "-m", "zbus.cli", "follower", "--node-rank", "1", "--allow-worker",
                "zbus.bench"]
        env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_NPROC_PER_NODE="1")
        followers = [subprocess.Popen([*base, "--curve-dir", os.path.join(keys, "node-1")],
                                      env=dict(env, ZBUS_MASTER_PORT=str(ports[0]))),
                     subprocess.Popen(base, env=dict(env, ZBUS_MASTER_PORT=str(ports[1])))]
        try:
            with Executor(BenchWorker, nnodes=2, master_addr="127.0.0.1", master_port=ports[0],
                          curve_dir=os.path.join(keys, "leader")) as keyed, \
                    Executor(BenchWorker, nnodes=2, master_addr="127.0.0.1", master_port=ports[1]) as plain:
                for size in (0, 16 * MiB):
                    args = (torch.zeros(size // 4),) if size else ()
                    method = "size" if size else "noop"
                    sa, sb = paired(
                        lambda m=method, a=args: keyed.collective_rpc(m, args=a, unique_reply_rank=1),
                        lambda m=method, a=args: plain.collective_rpc(m, args=a, unique_reply_rank=1),
                        seconds, block=2 if size else 20)
                    what = "16 MiB broadcast" if size else "no-op round trip"
                    rows.append(row("curve", f"2 nodes, {what}, CurveZMQ", sa, sb, "no keys (same run)"))
        finally:
            end_followers(followers)
    return rows


def disjoint_port_pairs(n: int, pick: Callable[[], int]) -> list[int]:
    """``n`` ports p from ``pick`` whose pairs (p, p + 1) do not overlap: each pair is
    free when picked, and two picked before either is bound may share a port (a
    CI run's second leader found its first port taken by the first's second)."""
    ports: list[int] = []
    for _ in range(100 * n):
        port = pick()
        if all(abs(port - p) > 1 for p in ports):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise OSError(f"no {n} disjoint pairs of free ports")


def _parse_rows(out: subprocess.CompletedProcess) -> list[Row]:
    if out.returncode != 0:  # (vLLM logs its errors to stdout)
        errors = "\n".join(line for line in out.stdout.splitlines() if " ERROR " in line)
        raise RuntimeError(f"benchmark failed:\n{errors[-3000:]}\n{out.stderr[-3000:]}")
    return [Row(**json.loads(line)) for line in out.stdout.splitlines() if line.startswith("{")]


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


SCENARIOS: dict[str, Callable[[float], list[Row]]] = {
    "ring": bench_ring, "rpc": bench_rpc, "payload": bench_payload, "nodes": bench_nodes,
    "curve": bench_curve, "idle": bench_idle,
    "import": lambda seconds: bench_import(), "compare": bench_compare, "vllm": bench_vllm,
}
# compare: with --compare; vllm: by name, in a venv with vLLM (make bench-vllm)
DEFAULT_SCENARIOS = [name for name in SCENARIOS if name not in ("compare", "vllm")]


def _size_of(case: str) -> int | None:
    """The payload size a case names ("16 MiB tensor to 2 workers"), else None."""
    n, unit = case.split(" ")[:2]
    return int(n) * {"KiB": KiB, "MiB": MiB}[unit] if unit in ("KiB", "MiB") and n.isdigit() else None


def plot_series(rows: list[Row]) -> dict[str, list[tuple[int, float]]]:
    """Median latency (us) against payload size, per system, from the ``payload``
    and ``compare`` rows; zbus figures measured several times keep their median."""
    points: dict[str, dict[int, list[float]]] = {}

    def add(name: str, size: int, us: float) -> None:
        points.setdefault(name, {}).setdefault(size, []).append(us)

    for r in rows:
        size = _size_of(r.case)
        if size is None or r.scenario not in ("payload", "compare"):
            continue
        kind = r.case.split(" ")[2]
        if r.scenario == "payload" and r.baseline == "pyzmq ipc":
            add(f"zbus, {kind}", size, r.median_us)
            if kind == "tensor":
                add("pyzmq ipc", size, r.baseline_median_us)
        elif r.scenario == "compare":
            add("zbus, tensor", size, r.median_us)
            add(r.baseline, size, r.baseline_median_us)
        if "memcpy GB/s" in r.extra and kind == "tensor":
            add("one memcpy (same size)", size, size / (r.extra["memcpy GB/s"] * 1e9) * 1e6)
    return {name: sorted((size, statistics.median(v)) for size, v in by_size.items())
            for name, by_size in points.items()}


def plot_svg(rows: list[Row], path: str) -> None:
    """Two log-log panels, median latency and bandwidth against payload size, zbus
    beside its baselines: a plain SVG file, no plotting library needed."""
    series = plot_series(rows)
    if not series:
        raise ValueError("no payload rows to plot: run the 'payload' or 'compare' scenario")
    bandwidth = {name: [(x, x / (y / 1e6) / 1e9) for x, y in pts] for name, pts in series.items()}
    w, h = 1110, 440
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="Helvetica" '
           f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>',
           '<text x="70" y="18" font-size="13">2 local workers, reply from worker 0: median latency and '
           'bandwidth against payload size (log-log)</text>']
    out += _panel(series, 70, 370, h, "us", "latency")
    out += _panel(bandwidth, 540, 370, h, "GB/s", "bandwidth")
    colors = _colors(series)
    for i, name in enumerate(series):
        y = 40 + 18 * i
        out.append(f'<line x1="935" x2="955" y1="{y}" y2="{y}" stroke="{colors[name]}" stroke-width="2"/>'
                   f'<text x="960" y="{y + 4}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def _colors(series: dict) -> dict[str, str]:
    palette = ["#1f5fbf", "#7fa8e8", "#d9534f", "#f0ad4e", "#5cb85c", "#8e44ad", "#999999", "#333333"]
    return {name: palette[i % len(palette)] for i, name in enumerate(series)}


def _panel(series: dict[str, list[tuple[int, float]]], left: int, width: int, h: int, unit: str,
           title: str) -> list[str]:
    """One log-log panel (axes, grid, a line per series), ``left`` px from the edge."""
    import math

    bottom, top = 50, 40
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    lx = (math.log10(min(xs)), math.log10(max(xs)) + 1e-9)
    ly = (math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys))) + 1e-9)
    px = lambda x: left + (math.log10(x) - lx[0]) / (lx[1] - lx[0]) * width  # noqa: E731
    py = lambda y: h - bottom - (math.log10(y) - ly[0]) / (ly[1] - ly[0]) * (h - top - bottom)  # noqa: E731
    out = [f'<text x="{left}" y="{top - 6}" font-size="12">{title} ({unit})</text>']
    for e in range(int(ly[0]), int(ly[1]) + 1):
        y = py(10**e)
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{10**e:g}</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{_size(x)}</text>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{h - bottom}" stroke="black"/>'
               f'<line x1="{left}" x2="{left + width}" y1="{h - bottom}" y2="{h - bottom}" stroke="black"/>')
    for name, c in _colors(series).items():
        pts = series[name]
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>' for x, y in pts]
    return out


def load_rows(path: str) -> list[Row]:
    with open(path) as f:
        data = json.load(f)
    return [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in data["rows"]]


def machine() -> dict:
    import psutil

    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform(), "core": ring.CORE,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def _fmt(value: float, unit: str) -> str:
    if unit == "us":
        return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.0f} us"
    if unit == "B":
        return f"{value / 1e6:.1f} MB"
    return f"{value:.1f} {unit}"


def format_markdown(rows: list[Row]) -> str:
    """The rows as a Markdown table (docs/benchmarks.md is made with it)."""
    lines = ["| scenario | case | zbus median | p99 | baseline (same run) | baseline median | ratio "
             "| notes |", "|---|---|---:|---:|---|---:|---:|---|"]
    for r in rows:
        notes = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.extra.items())
        base = _fmt(r.baseline_median_us, r.unit) if r.baseline_median_us else ""
        lines.append(f"| {r.scenario} | {r.case} | {_fmt(r.median_us, r.unit)} | {_fmt(r.p99_us, r.unit)} | "
                     f"{r.baseline} | {base} | {f'{r.ratio:.2f}' if r.ratio else ''} | {notes} |")
    return "\n".join(lines)


def format_table(rows: list[Row]) -> str:
    lines = [f"{'scenario':<8} {'case':<40} {'median':>12} {'p99':>12}  {'baseline':<22} "
             f"{'base med':>10} {'ratio':>6}  extra"]
    for r in rows:
        ratio = f"{r.ratio:6.2f}" if r.ratio else "      "
        extra = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.extra.items())
        unit = r.unit
        lines.append(f"{r.scenario:<8} {r.case:<40} {r.median_us:10.1f}{unit:>2} {r.p99_us:10.1f}{unit:>2}  "
                     f"{r.baseline:<22} {r.baseline_median_us:10.1f} {ratio}  {extra}")
    return "\n".join(lines)


CLUSTER_SETTINGS = ("ZBUS_NNODES", "ZBUS_NPROC_PER_NODE", "ZBUS_MASTER_ADDR", "ZBUS_MASTER_PORT",
                    "ZBUS_NODE_RANK", "ZBUS_SECRET", "ZBUS_SECRET_FILE", "ZBUS_CURVE_DIR",
                    "ZBUS_METRICS_PORT", "ZBUS_ADVERTISE_ADDR", "LWS_GROUP_SIZE", "LWS_LEADER_ADDRESS",
                    "LWS_WORKER_INDEX")


# What rows of another shape raise as they are read, printed or drawn (json's are ValueErrors)
_UNREADABLE = (ValueError, TypeError, KeyError, AttributeError)


def run(scenarios: list[str], seconds: float, json_path: str | None, out: Any = sys.stdout,
        plot_path: str | None = None, from_json: str | None = None, markdown: bool = False) -> int:
    if from_json:  # only redraw from an earlier run
        try:
            rows = load_rows(from_json)
            text = format_markdown(rows) if markdown else format_table(rows)
        except _UNREADABLE as e:
            print(f"--from-json {from_json}: not the rows of 'zbus bench --json' "
                  f"({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
            return 2
        print(text, file=out)
        if plot_path:
            try:
                plot_svg(rows, plot_path)
            except _UNREADABLE as e:  # (no payload rows, or rows of another shape)
                print(f"--plot: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                return 2
        return 0
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:  # (before any runs: a typo must not cost the scenarios before it)
        print(f"unknown scenario {unknown[0]!r}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    if plot_path and not set(scenarios) & {"payload", "compare"}:
        print("--plot draws the 'payload' or 'compare' scenario: run one of them", file=sys.stderr)
        return 2
    rows: list[Row] = []
    # Each scenario places and keys its own processes: a cluster's settings in the
    # environment (a compose service's ZBUS_NNODES, a ZBUS_SECRET) must not change them.
    saved = {name: os.environ.pop(name) for name in CLUSTER_SETTINGS if name in os.environ}
    try:
        for name in scenarios:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows += SCENARIOS[name](seconds)
    finally:
        os.environ.update(saved)
    print(f"zbus core: {ring.CORE}", file=out)
    print(format_markdown(rows) if markdown else format_table(rows), file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": machine(), "command": " ".join(sys.argv),
                       "rows": [dict(asdict(r), ratio=r.ratio) for r in rows]}, f, indent=1)
    if plot_path:
        plot_svg(rows, plot_path)
    return 0
