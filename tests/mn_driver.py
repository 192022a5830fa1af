"""The leader side of the multi-node tests; run inside the leader's namespace as
``python mn_driver.py SCENARIO``. Prints JSON lines the test reads."""

from __future__ import annotations

import json
import sys
import time

import psutil
import workers

import zbus

PORT = 29650


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def executor(worker=workers.EchoWorker, **kw) -> zbus.Executor:
    kw = {"liveness_s": 3.0, **kw}
    return zbus.Executor(worker, nnodes=3, nproc_per_node=2, master_addr="leader", master_port=PORT,
                         join_timeout=60, startup_timeout=120, **kw)


def basic() -> None:
    with executor() as ex:
        infos = ex.collective_rpc("whoami", timeout=30)
        out(world_size=ex.world_size, values=ex.collective_rpc("rank_value", args=(4,), timeout=30),
            ranks=[i["env"]["RANK"] for i in infos], master=[i["env"]["MASTER_ADDR"] for i in infos],
            unique=ex.collective_rpc("rank_value", args=(1,), unique_reply_rank=5, timeout=30))


def dist() -> None:
    with executor(workers.DistWorker) as ex:
        out(sums=ex.collective_rpc("all_reduce", args=(1,), timeout=60))
        ex.collective_rpc("close", timeout=30)


def relay() -> None:
    payload, n = b"x" * (4 * 2**20), 5
    with executor() as ex:
        ex.collective_rpc("noop", timeout=30)
        before = psutil.net_io_counters(pernic=True)["eth0"].bytes_sent
        for _ in range(n):
            ex.collective_rpc("tensor_len", args=(b"x",), unique_reply_rank=0, timeout=30)
        ex.collective_rpc("noop", timeout=30)  # every node has had all of them (calls keep order)
        small = psutil.net_io_counters(pernic=True)["eth0"].bytes_sent - before
        before = psutil.net_io_counters(pernic=True)["eth0"].bytes_sent
        for _ in range(n):
            ex.collective_rpc("tensor_len", args=(payload,), unique_reply_rank=0, timeout=30)
        ex.collective_rpc("noop", timeout=30)
        sent = psutil.net_io_counters(pernic=True)["eth0"].bytes_sent - before
        out(per_broadcast=sent / n, small_per_broadcast=small / n, payload=len(payload))


def big_call(ex: zbus.Executor) -> None:
    """A 64 MiB call: its answers and how long it took, or its error."""
    start = time.monotonic()
    try:
        lens = ex.collective_rpc("tensor_len", args=(b"x" * (64 * 2**20),), timeout=120)
        out(lens=lens, seconds=time.monotonic() - start)
    except zbus.ZbusError as e:
        out(error=type(e).__name__, message=str(e), seconds=time.monotonic() - start)


def big(wait_s: float = 0.0) -> None:
    """A 64 MiB call on links that take seconds to carry it (the test slows the
    leader's), with a liveness limit of 1 s; with ``wait_s``, announced that long
    before it goes (as behind a full node or a local ring still busy)."""
    with executor(liveness_s=1.0) as ex:
        ex.collective_rpc("noop", timeout=30)
        if wait_s:
            publish = ex._bcast.publish_frames

            def late(*args, **kwargs):
                ex._bcast.publish_frames = publish
                time.sleep(wait_s)  # (the leader heartbeats meanwhile)
                return publish(*args, **kwargs)
            ex._bcast.publish_frames = late
        big_call(ex)


def big_behind_a_full_node(agent_pid: int) -> None:
    """Node 1's agent stopped (SIGSTOP) until its queue is full (small calls time
    out sending), then a 64 MiB call, node 1 let go 1 s later: the call's
    announcement waits for node 1's room, as the call does."""
    import os
    import signal
    import threading

    with executor(liveness_s=5.0) as ex:  # (node 1 is stopped for less)
        ex.collective_rpc("noop", timeout=30)
        os.kill(agent_pid, signal.SIGSTOP)
        try:
            for _ in range(2000):  # (bounded: the kernel's buffers, then ZeroMQ's 64 messages)
                try:
                    ex.collective_rpc("tensor_len", args=(bytes(512 * 1024),), non_block=True, timeout=0.5)
                except TimeoutError:
                    break
            else:
                raise AssertionError("node 1's queue never filled")
        finally:
            threading.Timer(1.0, os.kill, args=(agent_pid, signal.SIGCONT)).start()
        big_call(ex)


def lost() -> None:
    with executor() as ex:
        ex.collective_rpc("noop", timeout=30)
        pending = ex.collective_rpc("sleep", args=(60,), non_block=True)
        out(ready=True)
        try:
            pending.result(timeout=60)
            out(error=None)
        except zbus.ZbusError as e:
            later = time.monotonic()
            try:
                ex.collective_rpc("noop", timeout=5)
            except zbus.ZbusError as e2:
                fast = time.monotonic() - later < 0.5 and type(e2) is type(e)
            out(error=type(e).__name__, node_rank=getattr(e, "node_rank", None),
                host=getattr(e, "host", None), message=str(e), later_fails_at_once=fast)


def blip() -> None:
    """Checksummed calls, 8 in flight, non-stop for 8 s while the test cuts a link
    briefly. Each worker takes 50 ms a call, so a call waits some 0.4 s for its
    answer: the calls handed over just before the cut are still in flight when it
    takes effect. Says ``streaming`` once 8 calls are answered (the test cuts the
    link after that). Reports the calls, the wrong replies, the error that ended them
    if one did, and when each call was handed over (``collective_rpc`` returned)
    and answered (its future done), by ``time.monotonic()``, which the test's
    process reads too."""
    import collections
    import random
    import zlib

    rng = random.Random(5)
    with executor() as ex:
        ex.collective_rpc("noop", timeout=30)
        out(ready=True)
        sent: list[float] = []
        answered: list[float | None] = []
        pending: collections.deque = collections.deque()
        bad, error = 0, None
        try:
            end = time.monotonic() + 8
            while pending or time.monotonic() < end:
                if len(pending) < 8 and time.monotonic() < end:
                    i = len(sent)
                    payload = rng.randbytes(rng.randint(0, 200_000))
                    answered.append(None)
                    fut = ex.collective_rpc("crc", args=(i, payload, 0.05), non_block=True, timeout=30)
                    sent.append(time.monotonic())
                    fut.add_done_callback(lambda f, i=i: answered.__setitem__(i, time.monotonic()))
                    pending.append((i, zlib.crc32(payload), fut))
                    continue
                i, crc, fut = pending.popleft()
                bad += sum(tuple(r) != (i, crc) for r in fut.result(timeout=30))
                if i == 7:
                    out(streaming=True)
        except (zbus.ZbusError, TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
        out(calls=len(sent), bad=bad, error=error, sent=sent, answered=answered)


def hold(busy: bool = False) -> None:
    """Wait to be killed; with ``busy`` every worker is inside a long call."""
    with executor() as ex:
        ex.collective_rpc("noop", timeout=30)
        if busy:
            ex.collective_rpc("sleep", args=(120,), non_block=True)
            time.sleep(0.5)  # the call reaches every worker
        out(ready=True)
        time.sleep(120)


def full_ring() -> None:
    """Node 1's workers hang; 3000 calls follow (the leader's own rings hold them
    all), more than node 1's ring and its agent's read-ahead (1024) take. Then
    wait to be killed."""
    import os

    os.environ["ZBUS_RING"] = "256x8192"  # this node's rings: 8192 small calls in flight
    with executor() as ex:
        ex.collective_rpc("noop", timeout=30)
        ex.collective_rpc("sleep_on_node", args=(1, 600), non_block=True)
        sent, why = 0, None
        try:
            while sent < 3000:
                ex.collective_rpc("noop", non_block=True, timeout=1)
                sent += 1
        except TimeoutError as e:
            why = str(e)
        time.sleep(2.0)  # node 1's agent reads ahead what reached it (1024 calls)
        out(ready=True, sent=sent, why=why)
        time.sleep(120)


def reset(size: int = 50_000, echo: bool = False) -> None:
    """Checksummed calls of ``size`` bytes (each its own), answered with their
    payload too if ``echo``, without a timeout, 16 in flight, non-stop for 6 s
    while the test resets node 2's connections. Reports the replies that were
    wrong and the longest wait for one call; one past 6 s counts as a hang (then
    exits at once). Also how many calls the leader sent again and how many
    copies of replies it dropped (sent again by a worker, and had)."""
    import os
    import threading
    import zlib

    with executor() as ex:
        ex.collective_rpc("noop", timeout=30)
        out(ready=True)
        st = {"calls": 0, "bad": 0, "error": None, "waiting": None, "longest": 0.0, "done": False}

        def check(call: tuple) -> None:
            i, payload, fut = call
            st["waiting"] = t0 = time.monotonic()
            replies = fut.result()  # no timeout: a lost call would hang here
            st["longest"] = max(st["longest"], time.monotonic() - t0)
            st["waiting"] = None
            want = (i, zlib.crc32(payload), payload) if echo else (i, zlib.crc32(payload))
            st["bad"] += sum(tuple(r) != want for r in replies)

        def run() -> None:
            pending = []
            try:
                end = time.monotonic() + 6
                while time.monotonic() < end:
                    i = st["calls"]
                    payload = i.to_bytes(4, "little") * (size // 4)  # its own per call
                    pending.append((i, payload, ex.collective_rpc("crc", args=(i, payload, 0.0, echo),
                                                                  non_block=True)))
                    st["calls"] += 1
                    if len(pending) >= 16:
                        check(pending.pop(0))
                while pending:
                    check(pending.pop(0))
            except zbus.ZbusError as e:
                st["longest"] = max(st["longest"], time.monotonic() - (st["waiting"] or time.monotonic()))
                st["error"] = e
            st["done"] = True

        threading.Thread(target=run, daemon=True).start()
        hung = False
        while not st["done"] and not hung:
            time.sleep(0.05)
            hung = st["waiting"] is not None and time.monotonic() - st["waiting"] > 6.0
        e = st["error"]
        out(calls=st["calls"], bad=st["bad"], hung=hung, longest=st["longest"],
            error=type(e).__name__ if e else None, node_rank=getattr(e, "node_rank", None),
            message=str(e) if e else None, calls_again=ex._leader.calls_again,
            replies_again=ex._leader.replies_again)
        if hung:
            os._exit(0)


if __name__ == "__main__":
    {"basic": basic, "big": big, "big_late": lambda: big(wait_s=16.0), "dist": dist, "relay": relay,
     "lost": lost, "hold": hold, "blip": blip, "big_full": lambda: big_behind_a_full_node(int(sys.argv[2])),
     "hold_busy": lambda: hold(busy=True), "full_ring": full_ring,
     "reset": reset, "reset_big": lambda: reset(size=1_500_000),
     "reset_replies": lambda: reset(size=500_000, echo=True)}[sys.argv[1]]()
