"""The executor through its public API, with real worker processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import workers
from conftest import (
    end_process,
    live_children,
    no_thread_to_be_had,
    own_segments,
    seconds_to_ctrl_c,
    shm_used,
    spawn_python,
    wait_until,
    zbus_segments,
)
from workers import EchoWorker, UndecodableStartWorker

import zbus
from zbus import codec, protocol
from zbus.config import usable_cores
from zbus.ring import RingReader

MiB = 2**20


@pytest.fixture(scope="module")
def ex():
    with zbus.Executor(EchoWorker, nproc_per_node=2, worker_kwargs={"tag": "t"}) as executor:
        yield executor


def test_results_in_rank_order_with_kwargs(ex):
    assert ex.world_size == 2 and ex.output_rank == 0
    assert ex.collective_rpc("rank_value", args=(3,)) == [30, 31]
    assert ex.collective_rpc("echo", args=(1, (2, b"x")), kwargs={"k": [None, 1.5]}) == [
        ((1, (2, b"x")), {"k": [None, 1.5]})] * 2


def test_unique_reply_rank(ex):
    assert ex.collective_rpc("rank_value", args=(1,), unique_reply_rank=1) == 11
    assert ex.collective_rpc("rank_value", args=(1,), unique_reply_rank=ex.output_rank) == 10
    with pytest.raises(ValueError):
        ex.collective_rpc("noop", unique_reply_rank=2)


def test_torchrun_environment_and_worker_attributes(ex):
    infos = ex.collective_rpc("whoami")
    assert [i["rank"] for i in infos] == [0, 1]
    for r, info in enumerate(infos):
        env = info["env"]
        assert env["RANK"] == str(r) and env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2" and env["NODE_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == "1"
        assert info["tag"] == "t" and info["world_size"] == 2
    assert len({infos[0]["pid"], infos[1]["pid"], os.getpid()}) == 3  # two workers, not the driver


def test_non_blocking_futures_complete_in_issue_order(ex):
    futs = [ex.collective_rpc("rank_value", args=(i,), non_block=True) for i in range(200)]
    assert isinstance(futs[0], concurrent.futures.Future)
    assert [f.seq for f in futs] == list(range(futs[0].seq, futs[0].seq + 200))
    assert futs[0].reply_ranks == [0, 1]
    # result() of the last completes all the earlier ones first
    assert futs[-1].result(timeout=30) == [1990, 1991]
    assert all(f.done() for f in futs)
    assert [f.result() for f in futs] == [[10 * i, 10 * i + 1] for i in range(200)]


def test_a_finished_call_goes_with_its_future_not_at_the_next_collection(ex):
    """A non-blocking call's record and the replies it holds are freed by reference
    counting once its future is done and dropped (with 16 calls in flight of up to
    1 MiB replies, waiting for the collector grew the leader's RSS by 8.7 MiB in the
    namespace soak). Sabotage: the future keeps its call (``future._call = None``
    removed from ``Call.settle``) → the 50 calls below are all still there."""
    import gc

    from zbus.executor import Call

    gc.collect()
    gc.disable()
    try:
        for i in range(50):
            ex.collective_rpc("rank_value", args=(i,), non_block=True).result(timeout=30)
        ex.collective_rpc("rank_value", args=(0,), timeout=30)
        left = sum(1 for o in gc.get_objects() if type(o) is Call)
    finally:
        gc.enable()
    assert left == 0


def test_a_call_completed_in_the_background_is_not_kept_by_the_completer(ex):
    """The completer thread keeps no reference to the last call it read (its loop's
    local held it, with its replies, until the next call: the test above failed
    once in CI). Sabotage: read the heads in ``_run`` itself again → 1 call left."""
    import gc

    from zbus.executor import Call

    fut = ex.collective_rpc("rank_value", args=(1,), non_block=True)
    deadline = time.monotonic() + 30
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert fut.result(timeout=0) == [10, 11]
    del fut
    gc.collect()
    assert sum(1 for o in gc.get_objects() if type(o) is Call) == 0


def test_a_future_settled_by_another_callers_reads_returns_at_once(ex):
    """Thread B's blocking call holds the reply lock until its own call is done, and
    on the way settles an earlier non-blocking call: ``result(timeout=2)`` on that
    call's future returns as soon as it is settled, not when B's call ends. Before,
    it waited for the lock: a TimeoutError after 2 s on a call done after 0.3 s
    (without a timeout, as long as B's call lasts). Sabotage: wait for the lock in
    one piece in ``Executor._complete_until`` -> TimeoutError."""
    first = ex.collective_rpc("sleep", args=(0.3,), non_block=True)
    later = threading.Thread(target=ex.collective_rpc, args=("sleep",), kwargs={"args": (3,), "timeout": 30})
    later.start()
    try:
        wait_until(lambda: ex._recv_lock._owner == later.ident, 5, "B took the reply lock")
        start = time.monotonic()
        assert first.result(timeout=2) == [0, 1]
        took = time.monotonic() - start
    finally:
        later.join(30)
    assert took < 1.0, took


def test_non_blocking_futures_complete_by_themselves(ex):
    """done(), add_done_callback, concurrent.futures.wait and asyncio.wrap_future
    work with nobody calling result(). Sabotage: no completer (futures that finish
    only inside result()) leaves every wait here to time out."""
    fut = ex.collective_rpc("rank_value", args=(2,), non_block=True)
    seen: list = []
    fut.add_done_callback(lambda f: seen.append(f.result(0)))
    done, _ = concurrent.futures.wait([fut], timeout=10)
    assert done == {fut} and seen == [[20, 21]]

    async def awaited():
        return await asyncio.wrap_future(ex.collective_rpc("rank_value", args=(3,), non_block=True))
    assert asyncio.run(asyncio.wait_for(awaited(), 10)) == [30, 31]
    futs = [ex.collective_rpc("rank_value", args=(i,), non_block=True) for i in range(50)]
    assert ex.collective_rpc("rank_value", args=(9,), timeout=10) == [90, 91]  # blocking, in between
    assert not concurrent.futures.wait(futs, timeout=30).not_done
    assert [f.result(0) for f in futs] == [[10 * i, 10 * i + 1] for i in range(50)]
    futs = [ex.collective_rpc("rank_value", args=(i,), non_block=True) for i in range(5)]
    assert [f.result(0) for f in concurrent.futures.as_completed(futs, timeout=10)]
    polled = ex.collective_rpc("rank_value", args=(7,), non_block=True)
    wait_until(polled.done, 10, "a future polled with done() completes")
    assert polled.result(0) == [70, 71]


def test_a_call_is_not_held_back_by_the_next_one(ex, monkeypatch):
    """An engine's batch queue: call N (0.5 s) and call N+1 (2 s) are both sent,
    and N's ``result()`` is asked for while the background completer is already
    reading N's replies. ``result()`` must return when N is answered, not once
    N+1 is answered too. Sabotage: the completer goes on to read N+1 while a
    caller waits for the reply lock (as it did) → N's result takes 2.5 s, not
    0.5 s (with the completer's reading slices as long as the calls; with its 50 ms
    slices, by up to 50 ms, a step or more of an engine)."""
    monkeypatch.setattr(ex._completer, "SLICE_S", 5.0)
    first = ex.collective_rpc("sleep", args=(0.5,), non_block=True)
    second = ex.collective_rpc("sleep", args=(2.0,), non_block=True)
    time.sleep(0.1)  # past the completer's grace: it reads the first call's replies
    t0 = time.monotonic()
    first.result(timeout=10)
    took = time.monotonic() - t0
    print(f"result() of a 0.5 s call with a 2 s call behind it took {took:.2f} s")
    assert not second.done()
    assert took < 1.4, took
    second.result(timeout=10)


def test_polling_after_calls_is_bounded_and_calls_still_work():
    """``poll_after_call_s``: workers and the driver poll that long after each call
    before sleeping; a value past 1 s (a busy worker for good) is refused."""
    with pytest.raises(ValueError, match="poll_after_call_s"):
        zbus.Executor(EchoWorker, poll_after_call_s=5.0)
    with zbus.Executor(EchoWorker, nproc_per_node=2, poll_after_call_s=0.01) as polling:
        assert [polling.collective_rpc("rank_value", args=(i,)) for i in range(50)][-1] == [490, 491]


def test_polling_after_a_call_does_not_outlast_the_callers_deadline():
    """With ``poll_after_call_s=1.0`` (the most allowed) the driver polls its reply
    queue for 1 s before it sleeps: a call with a 0.1 s timeout, and ``result``
    with 0.05 s, still time out in time. Sabotage: poll for the policy's whole
    ``spin_s``/``yield_s`` in ``_Ring._wait`` (as before): both take 1 s."""
    with zbus.Executor(EchoWorker, nproc_per_node=2, poll_after_call_s=1.0) as polling:
        polling.collective_rpc("rank_value", args=(1,), timeout=10)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            polling.collective_rpc("sleep", args=(1.5,), timeout=0.1)
        assert time.monotonic() - start < 0.6
        pending = polling.collective_rpc("sleep", args=(1.5,), timeout=10, non_block=True)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            pending.result(timeout=0.05)
        assert time.monotonic() - start < 0.55


def _sleeps(pid: int) -> int:
    """How often the process's main thread blocked (its voluntary context switches;
    a sched_yield is not one)."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


@pytest.mark.skipif(usable_cores() > 4, reason="a worker per core and one more on a small node")
def test_workers_of_a_node_with_more_waiting_processes_than_cores_sleep_right_after_a_call(monkeypatch):
    """With as many workers as usable cores (and the driver: one waiter too many), a
    worker sleeps on its doorbell as soon as its call is done, where it yielded for
    200 us first: on 2 vCPUs those yields took the CPU of the process it waited for
    (3 nodes of 2 workers: round trip 539-542 us with, 271-289 us without; see
    docs/benchmarks.md). 300 calls back to back, all reply: the workers block after
    most of them (counted, not timed: 0.57-1.0 a call each; one preempted between its
    reply and its look at the ring finds the next call there), where in their yield
    window the next call came first. Sabotage: ``WaitPolicy.from_env`` ignoring
    ``waiters`` -> 0.0-0.02 sleeps a call."""
    monkeypatch.delenv("ZBUS_YIELD_US", raising=False)
    monkeypatch.delenv("ZBUS_SPIN_US", raising=False)
    with zbus.Executor(EchoWorker, nproc_per_node=usable_cores()) as ex:
        pids = [p.pid for p in ex._workers.procs]
        ex.collective_rpc("rank_value", args=(0,), timeout=30)
        before = [_sleeps(pid) for pid in pids]
        for i in range(300):
            ex.collective_rpc("rank_value", args=(i,), timeout=30)
        per_call = [(_sleeps(pid) - b) / 300 for pid, b in zip(pids, before)]
    print(f"sleeps per call: {per_call}")
    assert sum(per_call) / len(per_call) > 0.2  # (the sabotage: 0.02 at most)


def test_callables_travel_by_import_path_and_code_never_does(ex):
    """Sabotage: a lambda that is pickled, or refused with a vague message."""
    assert ex.collective_rpc(workers.add_rank, args=(1,), kwargs={"y": 2}) == [3, 4]
    with pytest.raises(TypeError, match="never sends code.*module level"):
        ex.collective_rpc(lambda w: 1)

    def local(worker):
        return 1
    with pytest.raises(TypeError, match="lambda, closure"):
        ex.collective_rpc(local)


def test_async_results_come_in_order_without_blocking_the_next_call(ex):
    slow = ex.collective_rpc("later", args=("slow", 0.5), non_block=True)
    t0 = time.monotonic()
    fast = ex.collective_rpc("rank_value", args=(5,), non_block=True)
    assert fast.result(timeout=10) == [50, 51]
    assert slow.done() and slow.result() == ["slow", "slow"]
    assert time.monotonic() - t0 >= 0.4  # the fast reply queued behind the slow one


FORKED_CHILD = """
import os, sys
import workers, zbus

with zbus.Executor(workers.EchoWorker, nproc_per_node=2) as ex:
    pending = ex.collective_rpc("later", args=("parent's", 0.5), non_block=True, timeout=30)
    pid = os.fork()
    if pid == 0:
        try:
            if sys.argv[1] == "shuts down":  # it left the with-block (sys.exit, a returning function)
                ex.shutdown()
            else:
                for call in (lambda: ex.collective_rpc("echo", args=("child",), timeout=10),
                             lambda: pending.result(10)):
                    try:
                        call()
                    except zbus.ZbusError as e:
                        print("child:", e, flush=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    print(pending.result(10), ex.collective_rpc("echo", args=(1,), timeout=10), flush=True)
"""


def test_a_local_reply_over_the_message_limit_is_refused_by_its_worker(monkeypatch):
    """A local rank's reply over ``ZBUS_MAX_MESSAGE`` (1 MiB for the driver and its
    workers) fails its call with why, sending nothing: the driver reads no 8 MiB,
    and serves on. Before, the worker streamed it whole, the driver took an 8 MiB
    buffer for it (kept in its pool), copied it all, then refused to decode it.
    Sabotage: no size check in ``ShmSender.put`` -> "cannot decode the reply", and
    the driver's pool holds the 8 MiB."""
    monkeypatch.setattr(codec, "MAX_MESSAGE", MiB)  # (the driver's, read at import)
    with zbus.Executor(EchoWorker, nproc_per_node=1, env={"ZBUS_MAX_MESSAGE": "1M"}) as ex:
        with pytest.raises(zbus.RemoteError, match=r"a message of 83886\d\d bytes is over the 1048576 bytes "
                                                   r"the driver takes \(ZBUS_MAX_MESSAGE\)"):
            ex.collective_rpc("zeros", args=(8 * MiB,), timeout=30)
        assert max(map(len, ex._receivers[0].ring._pool._buffers), default=0) < MiB
        assert ex.collective_rpc("echo", args=(1,), timeout=30) == [((1,), {})]


@pytest.mark.parametrize("child", ["shuts down", "calls"])
def test_a_forked_child_leaves_the_parents_executor_serving(child):
    """A process forked from the driver, with a call of the parent's pending, shuts
    its copy of the executor down (it left a ``with`` block, say), or calls it and
    waits for the pending call: the parent's workers serve on, the parent's call
    and its next one get their own answers. Before, the copy's shutdown sent STOP into
    the parent's ring, told its monitor to stop and closed the rings: the parent's
    next call failed; the copy's call went through the parent's ring as the
    parent's next call number, and the parent's next call returned the child's
    answers (its own never reached a worker). Sabotage: no pid check in
    ``MultiprocExecutor.shutdown`` -> the parent's call fails; none in its
    ``collective_rpc`` -> the parent's call returns ``("child",)``; none in
    ``_complete_until`` -> the child takes the pending call's replies (a first
    version checked ``collective_rpc`` alone), and the parent waits out its timeouts."""
    proc = spawn_python(FORKED_CHILD, child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        end_process(proc)
    said = ["child: this executor belongs to the process that made it; a process forked from it "
            "cannot call its workers nor wait for their replies"] * 2 if child == "calls" else []
    assert proc.returncode == 0, err[-2000:]
    assert out.splitlines() == [*said, "[\"parent's\", \"parent's\"] [((1,), {}), ((1,), {})]"], (
        out, err[-2000:])


REAPER_REFUSED_ONCE = """
import gc, threading, time
import psutil, workers, zbus

start = threading.Thread.start
refused = []


def refusing(thread):
    if thread.name == "zbus-reaper" and not refused:
        refused.append(thread)
        raise RuntimeError("can't start new thread")
    start(thread)


threading.Thread.start = refusing
try:
    zbus.Executor(workers.EchoWorker, nproc_per_node=1)
except RuntimeError as e:
    print("first:", e, flush=True)
ex = zbus.Executor(workers.EchoWorker, nproc_per_node=1)
worker = psutil.Process(ex.collective_rpc("whoami", timeout=30)[0]["pid"])
del ex
gc.collect()
try:
    worker.wait(15)
    print("ended", flush=True)
except psutil.TimeoutExpired:
    print("running", flush=True)
    worker.kill()
"""


def test_an_executor_dropped_after_a_reaper_that_could_not_start_is_shut_down():
    """The first executor of a process cannot start its reaper thread (a pids
    limit) and fails; a later one, dropped without a shutdown, is shut down by the
    reaper all the same (its worker ends). Before, the failed thread was kept as
    the reaper: none was ever started again, and dropped executors' workers ran
    until the driver exited. Sabotage: assign ``_reaper`` before its start in
    ``_start_reaper`` again -> "running"."""
    proc = spawn_python(REAPER_REFUSED_ONCE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        end_process(proc)
    assert out.splitlines() == ["first: can't start new thread", "ended"], (out, err[-2000:])


def test_a_future_whose_reply_thread_cannot_start_fails_its_call_not_the_worker():
    """A method returns a Future in a worker where no thread can be had (a pids
    limit): that call fails with the reason, and the worker serves on. Before, the
    failed start escaped the worker's loop: the worker died (exit 1) and the
    executor failed with it. Sabotage: no ``except RuntimeError`` in
    ``ReplyPipe.send`` -> WorkerDiedError."""
    with zbus.Executor(EchoWorker, nproc_per_node=1) as ex:
        pid = ex.collective_rpc("whoami", timeout=30)[0]["pid"]
        ex.collective_rpc("refuse_threads", args=("zbus-replies",), timeout=30)
        with pytest.raises(zbus.RemoteError, match="no thread to send the reply of call"):
            ex.collective_rpc("later", args=(1, 0.01), timeout=30)
        assert ex.collective_rpc("whoami", timeout=30)[0]["pid"] == pid


def test_tensors_in_and_out_non_contiguous_included(ex):
    torch = pytest.importorskip("torch")
    x = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    assert ex.collective_rpc("tensor_sum", args=(x,)) == [66.0, 66.0]
    out = ex.collective_rpc("tensor_back", args=(x,))
    assert torch.equal(out[0], x * 2) and torch.equal(out[1], x)
    assert out[1].shape == (4, 3) and out[1].stride() == x.stride()
    big = torch.randn(1024, 1024)  # 4 MiB: streams through the 1 MiB chunks
    assert ex.collective_rpc("tensor_sum", args=(big,))[0] == pytest.approx(big.sum().item(), rel=1e-4)


def test_a_large_argument_is_lent_from_the_ring_and_one_kept_keeps_its_bytes(ex):
    """A worker decodes a 1 MiB tensor where it lies in the call ring (a private
    mapping of the ring's segment), a 1 KiB one from a copy. Writes to a lent
    argument stay in that worker. Arguments a worker keeps keep their bytes while
    40 more MiB of calls pass through the 32 MiB ring. Sabotage: no ``lend=True``
    in the worker's ``RingReader.attach`` -> the 1 MiB argument is in anonymous
    memory; no copy in ``Loan.end`` for a kept view -> the kept sums differ."""
    torch = pytest.importorskip("torch")
    ring = ex._bcast.ring.name
    ones = torch.ones(2**18)  # 1 MiB
    assert ex.collective_rpc("mapping_of_argument", args=(ones,)) == [f"/dev/shm/{ring}"] * 2
    assert f"/dev/shm/{ring}" not in ex.collective_rpc("mapping_of_argument", args=(torch.ones(256),))
    assert ex.collective_rpc("add_one_then_sum", args=(ones, 0.3)) == [2.0 * 2**18, 2.0**18]
    sums = []
    for i in range(40):
        t = torch.full((2**18,), float(i))
        ex.collective_rpc("keep", args=(t,))
        sums.append(t.sum().item())
    assert ex.collective_rpc("kept_sums") == [sums, sums]


def _lent_again(ex, torch) -> bool:
    """Whether a 1 MiB argument is lent to both workers again within the copies
    an earlier test's keeping left them."""
    ring = f"/dev/shm/{ex._bcast.ring.name}"
    ones = torch.ones(2**18)
    return any(ex.collective_rpc("mapping_of_argument", args=(ones,), timeout=30) == [ring] * 2
               for _ in range(RingReader.COPY_AFTER_KEPT + 1))


def test_a_kept_argument_whose_copy_fails_for_a_while_does_not_end_the_worker(ex):
    """A worker keeps a lent 1 MiB argument that the kernel cannot make its own
    for 0.3 s (a read-only page: EINVAL, as no memory would be). Its next receive
    fails, is tried again after a pause, and succeeds: the same processes answer
    the next calls and the kept argument keeps its bytes. Sabotage: ``serve``
    calls ``recv`` without ``_receive`` -> the worker ends (WorkerDiedError)."""
    torch = pytest.importorskip("torch")
    assert _lent_again(ex, torch)  # (else the argument is copied: no loan to end, nothing tested)
    pids = ex.collective_rpc("keep_with_a_read_only_page", args=(torch.full((2**18,), 7.0), 0.3))
    assert ex.collective_rpc("whoami", timeout=30)[0]["pid"] == pids[0]
    assert ex.collective_rpc("kept_sums") == [[7.0 * 2**18]] * 2


def test_a_child_forked_by_a_call_never_acts_as_the_worker(ex):
    """A call forks a child on rank 0 that returns from the call, or calls
    ``sys.exit(0)``, instead of ending with ``os._exit``. The child ends at once
    (status 1, or its own 0) without replying, reading the ring or closing what
    is the worker's; the workers go on serving, large calls lent as before.
    Sabotage: no ``_end_if_forked`` in ``handle`` -> the driver takes the
    child's reply for rank 0's; none in ``main``'s ``finally`` -> the child detaches
    the worker's reader and closes its replies: the worker dies."""
    torch = pytest.importorskip("torch")
    pids = [w["pid"] for w in ex.collective_rpc("whoami")]
    assert ex.collective_rpc("fork_a_child_that", args=("return",), timeout=30) == [1, None]
    assert ex.collective_rpc("fork_a_child_that", args=("exit",), timeout=30) == [0, None]
    assert [w["pid"] for w in ex.collective_rpc("whoami", timeout=30)] == pids
    assert _lent_again(ex, torch), "a 1 MiB argument is no longer lent"
    assert [w["pid"] for w in ex.collective_rpc("whoami", timeout=30)] == pids


def test_a_call_that_raises_does_not_keep_its_lent_arguments(ex):
    """A method that raises with a lent argument: the traceback holds the frames
    that hold it. The worker's loop drops its own references to the message and
    the result, so nothing keeps the argument and the next large call is lent
    too (a kept one would make the worker copy its next 8). Sabotage: no
    ``result = None`` at the end of ``worker.handle`` -> the next call's argument
    is in anonymous memory."""
    torch = pytest.importorskip("torch")
    ring = f"/dev/shm/{ex._bcast.ring.name}"
    ones = torch.ones(2**18)
    assert _lent_again(ex, torch), "a 1 MiB argument is never lent"
    with pytest.raises(zbus.RemoteError, match="failed with 262144 elements"):
        ex.collective_rpc("fail_with", args=(ones,))
    assert ex.collective_rpc("mapping_of_argument", args=(ones,)) == [ring] * 2


def test_remote_error_carries_details_and_worker_survives(ex):
    with pytest.raises(zbus.RemoteError) as info:
        ex.collective_rpc("boom", args=("bad input",))
    err = info.value
    assert err.rank == 0 and err.type_name == "ValueError" and err.message == "bad input"
    assert "ValueError: bad input" in str(err) and "in boom" in err.remote_traceback
    assert isinstance(err, zbus.ZbusError)
    assert ex.collective_rpc("rank_value", args=(2,)) == [20, 21]


def test_unknown_and_private_methods_are_refused(ex):
    """Refused (a ZbusError saying why), not run: an error the lookup raised would
    come as a RemoteError. Sabotage: ``getattr(worker, name)`` without a default in
    ``resolve_method`` -> an AttributeError's RemoteError."""
    for method, why in [("no_such_method", "unknown method 'no_such_method' on EchoWorker"),
                        ("_private", "method '_private' refused: private names"),
                        ("__init__", "method '__init__' refused: private names"),
                        ("workers:_private_func", "refused: private names")]:
        with pytest.raises(zbus.ZbusError, match=re.escape(why)) as e:
            ex.collective_rpc(method)
        assert type(e.value) is zbus.ZbusError, e.value
    assert ex.collective_rpc("noop") == [None, None]


@pytest.mark.parametrize("backend", ["mp", "inproc"])
def test_a_rank_timeout_or_keyword_no_call_can_carry_is_refused_before_it_is_sent(ex, backend, tmp_path):
    """A float or bool ``unique_reply_rank`` (or ``output_rank``), a NaN timeout,
    keyword names that are no strings: refused before anything is sent, the next
    call answered; a numpy rank and an infinite timeout are taken. Before, with
    ``mp``: a rank of 1.0 or True was sent, every worker dropped the call as no
    call (its envelope's rank must be an int), and the executor was stuck on it
    (TypeError at every later call) or failed; ``timeout=inf`` raised OverflowError
    from a lock; ``{1: 2}`` was sent and refused by every rank. With ``inproc``,
    ``timeout=0`` ran the method. Sabotage: the range check alone in
    ``rank_of`` (as before) -> no TypeError for 1.0; ``deadline_of`` without its
    ``TIMEOUT_MAX`` -> OverflowError; no ``remaining`` before ``run_call`` in the
    inproc ``collective_rpc`` -> the mark is made."""
    import numpy as np

    e = ex if backend == "mp" else zbus.Executor(EchoWorker, backend="inproc")
    last = e.world_size - 1
    try:
        for rank in (float(last), True, "0"):
            with pytest.raises(TypeError, match="unique_reply_rank must be a whole number"):
                e.collective_rpc("rank_value", args=(1,), unique_reply_rank=rank, timeout=10)
        with pytest.raises(ValueError, match="NaN"):
            e.collective_rpc("rank_value", args=(1,), timeout=float("nan"))
        with pytest.raises(TypeError, match="keyword argument names must be strings"):
            e.collective_rpc("echo", kwargs={1: 2}, timeout=10)
        assert e.collective_rpc("echo", kwargs={np.str_("k"): 1}, timeout=10)[0] == ((), {"k": 1})
        with pytest.raises(TypeError, match="output_rank must be a whole number"):
            zbus.Executor(EchoWorker, backend=backend, output_rank=0.0)
        mark = tmp_path / "m"
        with pytest.raises(TimeoutError):
            e.collective_rpc("mark", args=(str(mark),), timeout=0)
        assert e.collective_rpc("rank_value", args=(1,), unique_reply_rank=np.int64(last),
                                timeout=math.inf) == 10 + last
        assert e.collective_rpc("rank_value", args=(2,), timeout=1e12) == [20 + r for r in range(last + 1)]
        assert not list(tmp_path.iterdir()), "a call of timeout 0 ran"
    finally:
        if e is not ex:
            e.shutdown()


@pytest.mark.parametrize("backend", ["mp", "inproc"])
def test_a_sent_calls_future_cannot_be_cancelled(ex, backend):
    """Once ``collective_rpc(non_block=True)`` returns, every rank has the call: its
    future is running, ``cancel()`` says False, and its result comes. Before, the
    future was pending: ``cancel()`` said True (as ``asyncio.wait_for`` does on a
    wrapped future's timeout) and the result, computed all the same, was dropped.
    Sabotage: no ``future.sent()`` once the call is sent."""
    e = ex if backend == "mp" else zbus.Executor(EchoWorker, backend="inproc")
    try:
        future = e.collective_rpc("sleep", args=(0.2,), non_block=True)
        assert future.running() or future.done()
        assert future.cancel() is False
        assert future.result(30) == list(range(e.world_size))
    finally:
        if e is not ex:
            e.shutdown()


def test_a_non_blocking_call_failed_as_it_is_sent_returns_its_failed_future(monkeypatch):
    """Another thread fails the executor (a worker's death, a node lost) while a
    non-blocking call is being sent, after its ranks got it: the call returns its
    future, which holds that failure. Before, marking the sent future running
    raised RuntimeError ("Future in unexpected state") in the caller, in place of
    the future. Sabotage: ``set_running_or_notify_cancel()`` for ``sent()``."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=1)
    publish = ex._publish

    def failed_meanwhile(*args):
        publish(*args)
        other = threading.Thread(target=ex.failure.fail, args=(zbus.ExecutorFailedError("lost meanwhile"),))
        other.start()
        other.join(10)
    monkeypatch.setattr(ex, "_publish", failed_meanwhile)
    try:
        future = ex.collective_rpc("noop", non_block=True, timeout=30)
        assert "lost meanwhile" in str(future.exception(10))
    finally:
        ex.shutdown()


def test_a_metrics_port_of_0_is_none(monkeypatch):
    """``metrics_port=0`` (as ``int(os.getenv("PORT", 0))`` gives it) serves no
    metrics, even with ``ZBUS_METRICS_PORT`` set (an explicit argument wins), and so
    does ``ZBUS_METRICS_PORT=0``. Before settings were parsed by name, 0 fell back
    to the variable, whose "0" was refused. Sabotage: no ``or None`` after
    ``typed_setting`` -> "outside 1..65535"; ``metrics_port or None`` given to it
    (a first version) -> the variable's port served."""
    from zbus.cluster import free_port_pair

    for argument, variable in ((0, str(free_port_pair())), (None, "0")):
        monkeypatch.setenv("ZBUS_METRICS_PORT", variable)
        with zbus.Executor(EchoWorker, nproc_per_node=1, metrics_port=argument) as ex:
            assert ex.metrics_port is None and ex.collective_rpc("noop", timeout=30) == [None]


def test_an_inproc_worker_that_fails_to_start_is_a_startup_error():
    """As with ``mp`` (docs/api.md's example): ``StartupError`` naming the worker's
    own error; what is no worker at all is refused as ``mp`` refuses it, a
    TypeError or ValueError. Before, ``inproc`` raised the bare TypeError. Sabotage:
    no ``try`` round ``build_worker`` in ``InprocExecutor``; no ``_check_spec``
    there (as a first version) -> StartupError for ``int``."""
    with pytest.raises(zbus.StartupError, match="worker rank 0 failed to start: TypeError: .*no_such_arg"):
        zbus.Executor(EchoWorker, backend="inproc", worker_kwargs={"no_such_arg": 1})
    for backend in ("mp", "inproc"):
        with pytest.raises(TypeError, match="must be a zbus.Worker subclass"):
            zbus.Executor(int, backend=backend)
        with pytest.raises(ValueError, match="give a class or an import path"):
            zbus.Executor("workers.EchoWorker", backend=backend)


def test_import_path_calls(ex):
    assert ex.collective_rpc("workers:add_rank", args=(1,), kwargs={"y": 2}) == [3, 4]
    with pytest.raises(zbus.RemoteError, match="ModuleNotFoundError"):
        ex.collective_rpc("no_such_module:func")


def test_timeout_then_late_replies_are_discarded(ex):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        ex.collective_rpc("sleep", args=(1.0,), timeout=0.3)
    # the caller's own deadline: one thread wake-up in this process, 0.7 s of slack,
    # and still below the 1 s a call that waits for the reply would take
    assert time.monotonic() - t0 < 1.0
    # the next call gets its own answer, not the late one of the timed-out call
    assert ex.collective_rpc("rank_value", args=(7,), timeout=10) == [70, 71]


def test_future_result_timeout_leaves_call_pending(ex):
    fut = ex.collective_rpc("sleep", args=(0.5,), non_block=True)
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.1)
    assert fut.result(timeout=10) == [0, 1]


def test_a_non_blocking_call_fails_by_itself_at_its_timeout(ex):
    """A worker that does not answer in time (alive, busy): the future of a call
    sent with ``timeout`` fails with TimeoutError at that timeout, with nobody
    calling ``result()`` (an engine waits on ``wait`` or callbacks, or calls
    ``result()`` without a timeout, as vLLM's does); ``result()`` without a timeout
    raises it too, at the call's deadline. The late replies are dropped and the next
    call gets its own. Sabotage: no ``_expire_due()`` in the completer → ``wait``
    ends with the future not done; ``_complete`` ignoring the call's deadline →
    the second ``result()`` waits the 1.5 s sleep out and returns."""
    t0 = time.monotonic()
    slow = ex.collective_rpc("sleep", args=(1.5,), non_block=True, timeout=0.3)
    done, _ = concurrent.futures.wait([slow], timeout=5)
    waited = time.monotonic() - t0
    assert slow in done and isinstance(slow.exception(), TimeoutError), slow
    assert 0.3 <= waited < 1.2, waited
    assert ex.collective_rpc("rank_value", args=(7,), timeout=10) == [70, 71]
    t0 = time.monotonic()
    slow = ex.collective_rpc("sleep", args=(1.5,), non_block=True, timeout=0.3)
    with pytest.raises(TimeoutError):
        slow.result()
    assert time.monotonic() - t0 < 1.2
    assert ex.collective_rpc("rank_value", args=(8,), timeout=10) == [80, 81]


def test_a_non_blocking_call_behind_a_stream_of_quick_calls_fails_at_its_timeout(ex):
    """30 calls of 20 ms each, then one with a 0.2 s timeout that no one waits on
    with ``result()``: it fails with TimeoutError when its time is past, though
    every call ahead of it was answered within a wait's 50 ms slice. Before, only a
    slice that ended without its head's replies checked the calls behind it: this
    one was never checked, and got its result at about 0.6 s. Sabotage: no
    ``_expire_due()`` in ``_complete_head`` -> its result, no TimeoutError (on a
    machine loaded enough that a 20 ms call takes a slice, a slice checks it and
    the sabotage passes: 3 runs of 3 failed here)."""
    ahead = [ex.collective_rpc("sleep", args=(0.02,), non_block=True) for _ in range(30)]
    late = ex.collective_rpc("rank_value", args=(1,), non_block=True, timeout=0.2)
    done, _ = concurrent.futures.wait([late], timeout=30)
    assert late in done and isinstance(late.exception(), TimeoutError), late
    assert [f.result(timeout=30) for f in ahead] == [[0, 1]] * 30
    assert ex.collective_rpc("rank_value", args=(7,), timeout=10) == [70, 71]


def test_overdue_counts_the_calls_past_their_timeout_not_those_pending(ex):
    """``overdue``: calls whose timeout passed without all their replies (a worker
    stuck: later replies queue behind them), not calls merely pending. Sabotage:
    ``overdue`` as the number of pending calls -> 1 for the pending call."""
    pending = ex.collective_rpc("sleep", args=(1.0,), non_block=True, timeout=30)
    assert ex.overdue == 0
    with pytest.raises(TimeoutError):
        ex.collective_rpc("sleep", args=(0.5,), timeout=0.2)
    assert ex.overdue == 1
    assert pending.result(timeout=10) == [0, 1]
    assert ex.collective_rpc("rank_value", args=(5,), timeout=10) == [50, 51] and ex.overdue == 0


def test_a_non_blocking_call_times_out_while_a_blocking_caller_waits_for_ever(ex):
    """A blocking call without a timeout holds the replies while it waits; a
    non-blocking call queued before it still fails at its own timeout. Sabotage:
    ``_complete_head(deadline)`` in one piece in ``_complete_until`` (as before): the
    future is not done until the worker answers, 2 s later."""
    slow = ex.collective_rpc("sleep", args=(2.0,), non_block=True, timeout=0.3)
    t0 = time.monotonic()
    got: list = []
    blocking = threading.Thread(target=lambda: got.append(ex.collective_rpc("rank_value", args=(3,))))
    blocking.start()  # no timeout
    try:
        wait_until(lambda: ex._recv_lock._owner == blocking.ident or slow.done(), 5,
                   "the blocking caller holding the replies")
        done, _ = concurrent.futures.wait([slow], timeout=5)
        waited = time.monotonic() - t0
        assert slow in done and isinstance(slow.exception(), TimeoutError), slow
        assert waited < 1.2, waited
    finally:
        blocking.join(10)
    assert got == [[30, 31]]


def test_a_worker_that_exits_fails_the_executor_with_its_death():
    """Rank 0's worker (whose replies are read first) leaves by ``SystemExit`` (an
    exit in a method, SIGTERM): it closes its reply queue on its way out, 0.5 s
    before its process ends. The executor fails
    with that death (rank, exit code), not with the closed queue taken for a
    shutdown. Sabotage: raise ``ZbusError("executor is shut down")`` on the closed
    queue in ``_complete_head`` (as before): the failure is "completing calls
    failed: ... executor is shut down". Or let ``RpcFuture._complete`` raise the
    failure it met: ``exception()`` raises it instead of returning it."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    try:
        pending = ex.collective_rpc("die", kwargs={"rank": 0, "how": "exit"}, non_block=True)
        error = pending.exception(timeout=20)  # returned, not raised
        assert isinstance(error, zbus.WorkerDiedError), repr(error)
        assert error.rank == 0 and error.exitcode == 7
        assert ex.failure.error is error
    finally:
        ex.shutdown()


def test_the_failure_raised_again_and_again_keeps_no_frames_of_its_raises():
    """Once failed, every call, health check and failed future raises the one
    error: each raise added its frames (and so their locals) to that error's
    traceback, kept with it for good. Sabotage: ``raise self.error`` in
    ``Failure.raise_if_failed`` and ``raise e`` in ``RpcFuture.result`` (as
    before) -> hundreds of frames."""
    import traceback

    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    try:
        pending = ex.collective_rpc("die", kwargs={"rank": 0, "how": "exit"}, non_block=True)
        error = pending.exception(timeout=20)
        assert isinstance(error, zbus.WorkerDiedError) and ex.failure.error is error
        for _ in range(50):
            for attempt in (pending.result, ex.check_health, lambda: ex.collective_rpc("rank_value", (1,))):
                with pytest.raises(zbus.WorkerDiedError):
                    attempt()
        assert len(traceback.extract_tb(error.__traceback__)) < 10
    finally:
        ex.shutdown()


def test_a_worker_that_closes_its_replies_keeps_the_callers_deadline():
    """Rank 0 leaves by ``SystemExit`` and its process lingers 3 s: a call with a
    0.3 s timeout times out in time, and the executor then fails with that death
    (rank, exit code). Sabotage: wait the whole ``EXIT_REPORT_S`` in
    ``_replies_ended`` (as before): the call raises ExecutorFailedError ("closed
    its replies and has not exited") after 2 s, and that is the failure."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            ex.collective_rpc("die", kwargs={"rank": 0, "how": "exit", "linger": 3.0}, timeout=0.3)
        assert time.monotonic() - start < 1.5
        error = wait_until(lambda: ex.failure.error, 10, "the executor failed")
        assert isinstance(error, zbus.WorkerDiedError) and (error.rank, error.exitcode) == (0, 7), repr(error)
    finally:
        ex.shutdown()


def test_a_done_callback_may_call_the_executor_while_its_queues_are_full(monkeypatch):
    """A done-callback runs once the thread completing its future has let go of
    the executor's locks, so it may call the executor, blocking or not. Here the
    call ring and the reply rings (4 x 1 KiB) are full of 2 KiB echoes when the
    first call completes, and the driver is blocked sending the next echo: the
    callback's calls must answer, and every echo with them. Sabotage: complete the
    futures in ``Call.settle`` (under the reply lock, as before): the blocking call
    raises ZbusError ("must not wait"), and the non-blocking one waits for the
    send lock held by the driver, whose send waits for room that only the reply
    lock's holder makes: both time out."""
    monkeypatch.setenv("ZBUS_RING", "1Kx4")
    blob = b"x" * 2048
    seen: list = []

    def callback(_f):
        for non_block in (False, True):
            try:
                seen.append(ex.collective_rpc("rank_value", args=(2,), timeout=5, non_block=non_block))
            except Exception as e:  # noqa: BLE001 - the test looks at it
                seen.append(e)

    with zbus.Executor(EchoWorker, nproc_per_node=2) as ex:
        first = ex.collective_rpc("sleep", args=(0.3,), non_block=True)
        first.add_done_callback(callback)
        echoes = [ex.collective_rpc("echo", args=(i, blob), timeout=8, non_block=True) for i in range(30)]
        wait_until(lambda: len(seen) == 2, 20, "the callback ran")
        assert seen[0] == [20, 21], repr(seen[0])
        assert seen[1].result(timeout=10) == [20, 21]
        assert [f.result(timeout=10) for f in echoes] == [[((i, blob), {})] * 2 for i in range(30)]
        assert ex.collective_rpc("rank_value", args=(3,), timeout=10) == [30, 31]


def test_a_done_callback_may_wait_for_a_later_future(ex):
    """Futures complete in issue order, one thread at a time; a callback of the
    first may still ask for the second's result: it completes out of turn.
    Sabotage: ``_complete_asked`` without its out-of-turn completion: the
    callback's ``result(2)`` waits for its own thread and raises TimeoutError."""
    first = ex.collective_rpc("sleep", args=(0.3,), non_block=True)
    second = ex.collective_rpc("rank_value", args=(2,), non_block=True)
    seen: list = []

    def callback(_f):
        try:
            seen.append(second.result(timeout=2))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            seen.append(e)

    first.add_done_callback(callback)
    assert second.result(timeout=10) == [20, 21]
    wait_until(lambda: seen, 10, "the callback ran")
    assert seen == [[20, 21]]


def timed_outcome(read, seen: list) -> None:
    """Append what ``read()`` returns or raises, then the seconds it took."""
    start = time.monotonic()
    try:
        seen.append(read())
    except Exception as e:  # noqa: BLE001 - the test looks at it
        seen.append(e)
    seen.append(time.monotonic() - start)


def test_a_callback_asking_for_a_future_just_settled_elsewhere_gets_it(ex, monkeypatch):
    """The completer settles call 2 while a callback of call 1, in another thread,
    asks for call 2's result: the settled call's future must be queued with its
    outcome, not after. Sabotage: queue it after ``Call.settle`` releases its lock
    (where ``rpc_done`` runs, slowed here by 1.5 s to widen the window): the
    callback finds the call done, its future in no queue, and waits out its 3 s."""
    rpc_done = ex.metrics.rpc_done
    slowed: list = []

    def slow_rpc_done(*args):
        if threading.current_thread().name == "zbus-completer" and not slowed:
            slowed.append(True)
            time.sleep(1.5)
        return rpc_done(*args)

    monkeypatch.setattr(ex.metrics, "rpc_done", slow_rpc_done)
    first = ex.collective_rpc("sleep", args=(0.2,), non_block=True)
    second = ex.collective_rpc("sleep", args=(0.2,), non_block=True)
    seen: list = []

    def callback(_f):
        time.sleep(0.5)  # the completer is in call 2's rpc_done by now
        timed_outcome(lambda: second.result(timeout=3), seen)

    first.add_done_callback(callback)
    assert first.result(timeout=10) == [0, 1]
    wait_until(lambda: len(seen) == 2, 10, "the callback ran")
    assert slowed and seen[0] == [0, 1] and seen[1] < 1.0, seen


def test_an_expired_future_is_queued_once(ex):
    """A call past its timeout queues its future's TimeoutError once, however long
    the callbacks ahead of it take. Sabotage: ``Call.expire`` without its
    ``expired`` flag: each 50 ms slice queues it again while a 2 s callback runs
    (5, 14, 23, 32 entries)."""
    first = ex.collective_rpc("sleep", args=(0.1,), non_block=True)
    late = ex.collective_rpc("sleep", args=(2.5,), non_block=True, timeout=0.3)
    queued: list = []

    def callback(_f):
        for _ in range(4):
            time.sleep(0.4)
            queued.append(len(ex._completions))

    first.add_done_callback(callback)
    first.result(timeout=10)
    assert isinstance(late.exception(timeout=10), TimeoutError)
    assert max(queued) <= 1, queued
    assert ex.collective_rpc("rank_value", args=(1,), timeout=10) == [10, 11]


def test_a_failure_callback_reads_a_pending_future_at_once():
    """A worker closes its replies and lingers: the completer, reading replies
    under the reply lock, fails the executor after ``EXIT_REPORT_S``, and a
    failure callback there reads a pending future. It gets the failure at once:
    no other thread could complete that future before this one lets go of the
    lock. Sabotage: ``_complete_asked`` completing out of turn only inside
    ``_run_completions`` (not under a lock): ``exception(4)`` raises TimeoutError
    after 4 s."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    seen: list = []
    try:
        future = ex.collective_rpc("die", kwargs={"rank": 0, "how": "exit", "linger": 3.0}, non_block=True)

        ex.register_failure_callback(lambda: timed_outcome(lambda: future.exception(timeout=4), seen))
        wait_until(lambda: len(seen) == 2, 20, "the failure callback ran")
        assert seen[0] is ex.failure.error and seen[1] < 1.0, seen
    finally:
        ex.shutdown()


def test_a_failure_callback_run_by_the_reader_of_replies_shuts_down_at_once():
    """The worker closes its replies and takes 4 s to exit (``SystemExit``, then a
    slow ``atexit`` hook): the caller reading them fails the executor after
    ``EXIT_REPORT_S`` while it holds the reply lock, and runs the failure callback,
    which shuts the executor down. Before, that shutdown waited 5 s for the lock
    its own thread held (vLLM's engine gives its callback 5 s). Sabotage: take the
    locks in ``_shut_down_once`` without ``held_here`` -> 5 s or more."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=1)
    took = {}

    def shut_down() -> None:
        start = time.monotonic()
        ex.shutdown()
        took["s"] = time.monotonic() - start

    ex.register_failure_callback(shut_down)
    try:
        with pytest.raises(zbus.ZbusError):
            ex.collective_rpc("die", args=(None, "exit", 4.0), timeout=30)
    finally:
        ex.shutdown()
    assert took["s"] < 4.0, took


def test_an_inproc_shutdown_fails_the_calls_still_waiting_for_an_answer():
    """A method may return a Future, answered later; ``backend="inproc"``'s shutdown
    left such a call pending: its future waited for an answer that may never come
    (a blocking caller without a timeout, for good). Now it fails with ZbusError,
    as the other backend's pending calls do, and an answer that comes after is
    dropped; the thread that sent later answers then ends. Sabotage: no settling
    in ``InprocExecutor.shutdown`` -> TimeoutError; no ``ReplyPipe.close`` there
    -> the thread waits for more answers for good."""
    ex = zbus.Executor(EchoWorker, backend="inproc")
    pending = ex.collective_rpc("later", args=(1, 2.5), non_block=True)
    ex.shutdown()
    assert isinstance(pending.exception(timeout=1), zbus.ZbusError)
    ex._replies.thread.join(10)  # the answer comes, goes nowhere, and the thread ends
    assert not ex._replies.thread.is_alive()
    assert "shut down" in str(pending.exception(timeout=0))


def test_an_inproc_call_whose_answer_never_comes_times_out_by_itself_and_ends_nothing_later(monkeypatch):
    """``backend="inproc"``: a non-blocking call with a timeout whose method
    returned a Future that never completes fails by itself with TimeoutError at
    that timeout, as the other backend's calls do; the shutdown then ends the
    thread that waited for that Future. Before, the future stayed undone until
    the shutdown (no one expired it), and the thread waited on the Future for
    the rest of the process. Sabotage: no timer in ``InprocExecutor.collective_rpc``
    -> not done within 5 s; ``result.result()`` in ``ReplyPipe._drain`` again ->
    the thread lives on. A done-callback's KeyboardInterrupt, run by the timer, is
    logged as on zbus's other threads; it escaped the timer thread (named as any
    thread, not "zbus-"). Sabotage: no name for the timer -> the thread's
    excepthook sees it."""
    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_type))
    ex = zbus.Executor(EchoWorker, backend="inproc")
    try:
        future = ex.collective_rpc("never", non_block=True, timeout=1.0)
        ran = threading.Event()

        def interrupt(_: object) -> None:
            ran.set()
            if threading.current_thread() is not threading.main_thread():  # (run here if done by now)
                raise KeyboardInterrupt

        future.add_done_callback(interrupt)
        done, _ = concurrent.futures.wait([future], 5)
        assert done and isinstance(future.exception(timeout=0), TimeoutError)
        assert ran.wait(5)
        for timer in [t for t in threading.enumerate() if isinstance(t, threading.Timer)
                      and getattr(t.function, "__name__", "") == "expire"]:  # (the call's, whatever its name)
            timer.join(5)  # (its end, where an escaped exception would be seen)
        assert escaped == []
    finally:
        ex.shutdown()
    ex._replies.thread.join(5)
    assert not ex._replies.thread.is_alive()


def test_inproc_calls_from_many_threads_each_get_their_own_answer():
    """``backend="inproc"`` called from 8 threads at once (its methods run on the
    caller's thread): each call gets a number of its own and its own answer.
    Sabotage: number the calls without ``_numbering`` -> two calls share a number,
    one is never answered (KeyError in the reply, or a TimeoutError)."""
    ex = zbus.Executor(EchoWorker, backend="inproc")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps
    try:
        results: dict[int, list] = {}

        def calls(t: int) -> None:
            futures = [ex.collective_rpc("rank_value", args=(1000 * t + i,), non_block=True)
                       for i in range(300)]
            results[t] = [f.result(timeout=10) for f in futures]

        threads = [threading.Thread(target=calls, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
        ex.shutdown()
    assert results == {t: [[10 * (1000 * t + i)] for i in range(300)] for t in range(8)}


def test_a_done_callback_run_by_a_shutdown_may_shut_down_too(monkeypatch):
    """A shutdown fails the pending calls, and their futures complete in its
    thread: a callback there that calls ``shutdown()`` again returns at once (its
    own thread is the one shutting down). Sabotage: no check of the first
    shutdown's thread in ``shutdown``: the callback waits ``SHUTDOWN_WAIT_S`` (5 s
    here) for itself."""
    monkeypatch.setattr(zbus.executor, "SHUTDOWN_WAIT_S", 5.0)
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    took: list = []

    def callback(_f):
        start = time.monotonic()
        ex.shutdown()
        took.append(time.monotonic() - start)

    try:
        future = ex.collective_rpc("sleep", args=(5,), non_block=True)
        future.add_done_callback(callback)
        time.sleep(0.3)
    finally:
        ex.shutdown()
    assert isinstance(future.exception(0), zbus.ZbusError)
    assert len(took) == 1 and took[0] < 1.0, took


def test_an_inproc_executor_whose_reply_thread_runs_goes_once_dropped():
    """``backend="inproc"``: once a method answered with a Future (the reply pipe's
    thread then runs), a dropped executor still goes: that thread holds it weakly.
    Sabotage: give ``ReplyPipe`` ``self._deliver`` unwrapped -> still there."""
    import gc
    import weakref

    ex = zbus.Executor(EchoWorker, backend="inproc")
    assert ex.collective_rpc("later", args=(1, 0.05), non_block=True).result(timeout=5) == [1]
    assert ex._replies.thread is not None
    dropped = weakref.ref(ex)
    ex = None
    gc.collect()
    wait_until(lambda: dropped() is None, 10, "the dropped executor to go")


def test_an_inproc_callback_of_a_later_reply_may_call_the_executor():
    """``backend="inproc"``: a method that returns a Future answers from the reply
    thread, under the reply pipe's lock; the future's callback calls the executor
    once the lock is released. Sabotage: ``InprocExecutor._holds_a_lock`` returning
    False: the callback runs under the lock, and its call waits for it for good
    (its 2 s timeout is not looked at: nothing is seen within 5 s)."""
    ex = zbus.Executor(EchoWorker, backend="inproc")
    seen: list = []

    def callback(_f):
        try:
            seen.append(ex.collective_rpc("rank_value", args=(2,), timeout=2))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            seen.append(e)

    try:
        future = ex.collective_rpc("later", args=(1, 0.1), non_block=True)
        future.add_done_callback(callback)
        assert future.result(timeout=5) == [1]
        wait_until(lambda: seen, 5, "the callback ran")
        assert seen == [[20]]
    finally:
        ex.shutdown()


def a_callback_reads_the_second(ex, first_s: float, seen: list) -> tuple:
    """Two non-blocking calls, ``sleep(first_s)`` and ``sleep(5)``; a done-callback
    of the first records what the second's ``exception(3)`` gives, and how long it
    took (``timed_outcome``)."""
    first = ex.collective_rpc("sleep", args=(first_s,), non_block=True)
    second = ex.collective_rpc("sleep", args=(5,), non_block=True)
    first.add_done_callback(lambda _f: timed_outcome(lambda: second.exception(timeout=3), seen))
    return first, second


def test_a_callback_of_a_failed_future_reads_another_at_once():
    """A worker is killed with two calls pending: the failure settles both before
    their futures complete, so a callback of the first reads the second's error at
    once. Sabotage: settle and complete each pending call in turn in
    ``_fail_pending`` (``complete=True``): the second is in no queue yet, and the
    callback's ``exception(3)`` times out (without a timeout, the thread that
    watches the workers would wait for good)."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    seen: list = []
    try:
        a_callback_reads_the_second(ex, 5, seen)
        ex._workers.procs[0].kill()
        wait_until(lambda: len(seen) == 2, 20, "the callback ran")
        assert isinstance(seen[0], zbus.WorkerDiedError) and seen[1] < 1.0, seen
    finally:
        ex.shutdown()


def test_a_callback_waiting_for_another_future_as_the_executor_fails_gets_the_failure(monkeypatch):
    """A done-callback (run by the thread that completes futures) waits for a later
    call's future; a worker dies meanwhile. The callback's wait woke to the failure
    and left the future to be settled by the failure, whose thread then queued it for
    the thread that completes futures: the callback's own, which waited for it (for
    good without a timeout, and no other future completed). The failure's settling
    is held back 0.2 s here, as a slow thread start would. Sabotage: no
    ``call.settle`` in ``RpcFuture._read_replies``'s ``except`` -> TimeoutError
    after 3 s."""
    from zbus.executor import MultiprocExecutor

    end_soon = MultiprocExecutor._end_workers_soon
    monkeypatch.setattr(MultiprocExecutor, "_end_workers_soon",
                        lambda self: (time.sleep(0.2), end_soon(self)))
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    seen: list = []
    try:
        first, second = a_callback_reads_the_second(ex, 0.2, seen)
        wait_until(first.done, 20, "the first call's result")
        time.sleep(0.2)  # (the callback waits for the second's replies)
        ex._workers.procs[0].kill()
        wait_until(lambda: len(seen) == 2, 20, "the callback's wait ended")
        assert isinstance(seen[0], zbus.WorkerDiedError) and seen[1] < 1.0, seen
        assert second.done() and second.exception(0) is seen[0]
    finally:
        ex.shutdown()


def test_calls_a_failure_meets_as_one_is_being_settled_complete_in_issue_order(monkeypatch):
    """The reader of a call's replies took it off the pending calls before settling
    it: a failure right then settled the later calls first, and their futures
    completed (their callbacks ran) before the earlier call's. Here its settling
    is slowed 0.5 s and a worker killed meanwhile. Sabotage: ``popleft()`` before
    ``head.finish()`` in ``_complete_head`` -> the second call's callback first."""
    from zbus.executor import Call

    finish = Call.finish
    slowed: list = []

    def slow_finish(call):
        if call.future is not None and not slowed:
            slowed.append(call.seq)
            time.sleep(0.5)
        finish(call)

    monkeypatch.setattr(Call, "finish", slow_finish)
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    order: list = []
    try:
        first = ex.collective_rpc("rank_value", args=(1,), non_block=True)
        second = ex.collective_rpc("sleep", args=(5,), non_block=True)
        for name, future in (("first", first), ("second", second)):
            future.add_done_callback(lambda f, name=name: order.append(name))
        wait_until(lambda: slowed, 20, "the first call's replies read")
        ex._workers.procs[0].kill()
        wait_until(lambda: len(order) == 2, 20, "both futures complete")
        assert order == ["first", "second"], order
        assert isinstance(second.exception(0), zbus.WorkerDiedError)
    finally:
        ex.shutdown()


def test_a_callback_that_raises_systemexit_stops_no_completion(ex):
    """``sys.exit()`` in a done-callback run by the completer (Future catches only
    Exception): the completer logs it and lives on; the next futures complete by
    themselves. Sabotage: ``_run_completions`` without its ``except BaseException``:
    the completer thread ends, and a later future is not done within 3 s."""
    first = ex.collective_rpc("sleep", args=(0.2,), non_block=True)
    first.add_done_callback(lambda _f: sys.exit(0))
    second = ex.collective_rpc("rank_value", args=(2,), non_block=True)
    assert not concurrent.futures.wait([first, second], timeout=10).not_done
    third = ex.collective_rpc("rank_value", args=(3,), non_block=True)
    assert not concurrent.futures.wait([third], timeout=3).not_done
    assert third.result(0) == [30, 31] and ex._completer._thread.is_alive()


def test_ctrl_c_in_a_callback_during_shutdown_leaves_no_future_pending():
    """A shutdown fails three pending futures; the first one's callback raises
    KeyboardInterrupt, which reaches the caller of ``shutdown()`` once the other
    two are complete too. Sabotage: ``_run_completions`` without its ``except
    BaseException``: two futures stay pending for good."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    futures = [ex.collective_rpc("sleep", args=(5,), non_block=True) for _ in range(3)]

    def interrupt(_f):
        raise KeyboardInterrupt

    futures[0].add_done_callback(interrupt)
    time.sleep(0.2)
    with pytest.raises(KeyboardInterrupt):
        ex.shutdown()
    assert not concurrent.futures.wait(futures, timeout=3).not_done
    assert not ex._workers.alive()


def test_result_keeps_its_timeout_while_another_thread_runs_callbacks(ex):
    """The completer runs a 3 s callback of call 1 while call 2 settles: call 2's
    future completes after that callback, and ``result(1.5)`` raises at 1.5 s.
    Sabotage: ``result`` giving ``Future.result`` its whole timeout again after
    reading replies (as it did): TimeoutError after about 2.7 s."""
    first = ex.collective_rpc("sleep", args=(0.2,), non_block=True)
    first.add_done_callback(lambda _f: time.sleep(3))
    second = ex.collective_rpc("sleep", args=(1.0,), non_block=True)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        second.result(timeout=1.5)
    assert time.monotonic() - start < 2.0
    assert second.result(timeout=10) == [0, 1]


def test_an_inproc_callback_on_the_reply_thread_waiting_for_a_later_reply_gets_an_error():
    """``backend="inproc"``: a later reply's callback runs on the thread that sends
    the later replies; a blocking call there whose reply queues behind that thread
    raises ZbusError at once. Sabotage: no check in ``InprocExecutor._complete_until``:
    the call waits out its 3 s timeout (without one, for good)."""
    ex = zbus.Executor(EchoWorker, backend="inproc")
    seen: list = []
    try:
        future = ex.collective_rpc("later", args=(1, 0.1), non_block=True)
        future.add_done_callback(lambda _f: timed_outcome(
            lambda: ex.collective_rpc("later", args=(2, 0.1), timeout=3), seen))
        assert future.result(timeout=5) == [1]
        wait_until(lambda: len(seen) == 2, 10, "the callback ran")
        assert isinstance(seen[0], zbus.ZbusError) and "inproc" in str(seen[0]) and seen[1] < 1.0, seen
    finally:
        ex.shutdown()


def test_a_completer_thread_not_to_be_had_loses_no_future_and_stops_no_shutdown(monkeypatch):
    """The thread that completes futures by themselves cannot start (a pids limit):
    the call goes out, its future is the caller's and completes when read; the
    next call starts the thread, and its future completes by itself; the shutdown
    stops every worker cleanly. Before, the thread was kept unstarted: the call
    raised RuntimeError (its future lost), no future ever completed by itself
    again, and ``shutdown()`` raised ("cannot join thread before it is started")
    before it stopped the workers, which were killed. Sabotage: keep the thread
    before its start in ``Completer._start`` (and let the error out)."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    try:
        refused = no_thread_to_be_had(monkeypatch, "zbus-completer", times=1)
        first = ex.collective_rpc("rank_value", args=(1,), non_block=True)
        assert len(refused) == 1
        assert first.result(timeout=30) == [10, 11]
        second = ex.collective_rpc("rank_value", args=(2,), non_block=True)
        wait_until(second.done, 10, "the second future done by itself")
        assert second.result(0) == [20, 21]
    finally:
        monkeypatch.undo()
        ex.shutdown()
    assert [p.returncode for p in ex._workers.procs] == [0, 0]


def test_a_worker_monitor_not_to_be_had_leaves_no_worker_running(monkeypatch):
    """The thread that watches the workers cannot start (a pids limit the new
    workers reached): the executor's start fails with that error, and every worker
    it started is ended and reaped at once, no pipe left open. Before, the start
    raised after the workers were running and out of the executor's reach: nothing
    stopped them, their death pipe stayed open, and they lived on until they found
    the ring gone. Sabotage: start the thread after the ``try`` in
    ``LocalWorkers.__init__``."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    fds = len(os.listdir("/proc/self/fd"))
    no_thread_to_be_had(monkeypatch, "zbus-worker-monitor")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        zbus.Executor(EchoWorker, nproc_per_node=2)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    try:
        assert left == [], f"workers left: {left}"
        assert len(os.listdir("/proc/self/fd")) <= fds
    finally:
        for p in left:
            p.kill()
            p.wait(10)


def test_a_worker_death_fails_the_pending_calls_with_no_thread_to_be_had(tmp_path, monkeypatch):
    """A worker dies while the process can start no thread (a pids limit reached):
    the thread that would end the other workers at once does not start, and the
    pending call fails with the death all the same (the shutdown ends them). Before,
    that start raised before the pending calls were failed: a non-blocking call's
    ``result()`` waited forever (``result(10)``: TimeoutError). Sabotage: the start
    before ``_fail_pending`` without ``run_every`` in ``_on_failure``."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    try:
        mark = tmp_path / "in-call"
        pending = ex.collective_rpc("sleep_marked", args=(str(mark), 30), non_block=True)
        wait_until(lambda: os.path.exists(f"{mark}.1"), 30, "rank 1 inside the call")

        no_thread_to_be_had(monkeypatch, "zbus-end-workers")
        ex._workers.procs[1].send_signal(signal.SIGKILL)
        with pytest.raises(zbus.WorkerDiedError):
            pending.result(timeout=10)
        monkeypatch.undo()
    finally:
        monkeypatch.undo()
        ex.shutdown()
    assert not ex._workers.alive()


def test_worker_sigkill_mid_call_fails_pending_and_later_calls(tmp_path):
    """Rank 1 is SIGKILLed once it is inside a 30 s call: the pending calls fail
    with ``WorkerDiedError`` within ms (bounded at 5 s), later ones at once, and the failure
    callbacks run. Sabotage: no pidfd watch of the workers (the watcher thread
    returns at once): the call waits out its 10 s and raises ``TimeoutError``."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    failed = []
    ex.register_failure_callback(lambda: failed.append(True))
    try:
        mark = tmp_path / "in-call"
        pending = ex.collective_rpc("sleep_marked", args=(str(mark), 30), non_block=True)
        pid = ex.collective_rpc("whoami", non_block=True)
        victim = psutil.Process(ex._workers.procs[1].pid)
        wait_until(lambda: os.path.exists(f"{mark}.1"), 30, "rank 1 inside the call")
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        with pytest.raises(zbus.WorkerDiedError) as info:
            pending.result(timeout=10)
        # pidfd wakes the watcher thread at once, which wakes the caller: two thread
        # wake-ups in this process, no process to start or schedule (measured: ms;
        # bound well under the sabotage's 10 s, for a loaded machine)
        assert time.monotonic() - t0 < 5.0
        assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
        assert isinstance(info.value, zbus.ExecutorFailedError)
        with pytest.raises(zbus.WorkerDiedError):
            pid.result(timeout=1)
        t0 = time.monotonic()
        with pytest.raises(zbus.WorkerDiedError):
            ex.collective_rpc("noop")
        assert time.monotonic() - t0 < 1.0  # no wait: the call checks the failure first
        with pytest.raises(zbus.WorkerDiedError):
            ex.check_health()
        deadline = time.monotonic() + 1.0  # the callback runs right after waiters are woken
        while not failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed == [True]
        late = []
        ex.register_failure_callback(lambda: late.append(True))
        assert late == [True]
    finally:
        ex.shutdown()
    assert not ex._workers.alive()


def test_a_second_shutdown_returns_once_the_first_is_done(tmp_path):
    """Two threads shut the executor down at once: the second returns when the
    workers are gone, as the first does, not at once while
    the first still stops them (each worker's ``atexit`` hook takes 1 s).
    Sabotage: ``shutdown`` returning at once when it is not the first (as it did):
    the second returns with both workers alive."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    ex.collective_rpc("count_at_exit", args=(str(tmp_path / "exit"), 1.0), timeout=10)
    first = threading.Thread(target=ex.shutdown)
    try:
        first.start()
        wait_until(lambda: ex._closed, 10, "the first shutdown begun")
        ex.shutdown()
        assert not ex._workers.alive()
    finally:
        first.join(30)
        ex.shutdown()
    assert not first.is_alive()


def test_a_shutdown_from_a_failure_callback_does_not_wait_on_the_failures_own_stop(tmp_path):
    """A worker dies; a failure callback, run by the thread that watches the
    workers, shuts the executor down while the failure's own stop of the workers
    (rank 1 deaf to SIGTERM: SIGKILLed 2.2 s later) joins that same thread. The
    shutdown ends with the workers, not 5 s later. Sabotage: ``LocalWorkers.close``
    joining the watcher while it holds its lock -> 7.5 s."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    took = []

    def shut_down():
        t0 = time.monotonic()
        ex.shutdown()
        took.append(time.monotonic() - t0)

    try:
        ex.register_failure_callback(shut_down)
        mark = tmp_path / "deaf"
        ex.collective_rpc("stubborn_sleep_marked", args=(str(mark), 60), non_block=True)
        wait_until(lambda: os.path.exists(f"{mark}.0") and os.path.exists(f"{mark}.1"), 30,
                   "both workers deaf to SIGTERM")
        ex._workers.procs[0].kill()
        wait_until(lambda: took, 20, "the shutdown from the failure callback")
        assert took[0] < 4.5, f"the shutdown took {took[0]:.1f} s"
    finally:
        ex.shutdown()
    assert not ex._workers.alive()


def test_background_futures_fail_with_the_executor():
    """A worker death fails a pending non-blocking call's future by itself.
    Sabotage: a failure that leaves pending futures undone (the loop over them in
    ``MultiprocExecutor._on_failure`` removed) makes the wait time out."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    try:
        pid = ex.collective_rpc("whoami")[1]["pid"]
        fut = ex.collective_rpc("sleep", args=(60,), non_block=True)
        os.kill(pid, signal.SIGKILL)
        assert not concurrent.futures.wait([fut], timeout=10).not_done
        assert isinstance(fut.exception(0), zbus.WorkerDiedError)
    finally:
        ex.shutdown()


def test_worker_abort_is_reported():
    with zbus.Executor(EchoWorker, nproc_per_node=2) as ex:
        with pytest.raises(zbus.WorkerDiedError) as info:
            ex.collective_rpc("die", kwargs={"rank": 0, "how": "abort"}, timeout=10)
        assert info.value.rank == 0 and info.value.exitcode == -signal.SIGABRT


def test_startup_failure_raises_with_traceback_and_ends_every_process():
    """A failed start raises with the worker's traceback, ends every worker and
    removes the segments it made. Sabotage: no ``self.shutdown()`` on a failed
    start in ``Executor.__init__``: the workers still end (the failure aborts the
    rings), but the segments stay and the wait for them fails."""
    before = {p.pid for p in psutil.Process().children()}
    segments = zbus_segments()
    with pytest.raises(zbus.StartupError, match="start-up failure on rank 1") as info:
        zbus.Executor(EchoWorker, nproc_per_node=2, worker_kwargs={"fail_rank": 1})
    assert "Traceback" in str(info.value)
    with pytest.raises(zbus.StartupError, match="zbus_module_that_does_not_exist"):
        zbus.Executor(workers.BrokenImportWorker, nproc_per_node=1)
    with pytest.raises(zbus.StartupError, match="not a zbus.Worker"):
        zbus.Executor("workers:NotAWorker", nproc_per_node=1)
    wait_until(lambda: {p.pid for p in live_children(psutil.Process())} <= before, 5,
               "the workers of the failed starts ended")
    wait_until(lambda: not own_segments(zbus_segments() - segments), 5,
               "the segments of the failed starts removed")


def test_startup_timeout_ends_a_start_that_hangs():
    """A worker whose start never ends: the executor gives up after its
    ``startup_timeout`` (2 s) with a ``StartupError`` saying so, well before the
    worker's 60 s, and ends the worker. Sabotage: no deadline on the wait for the
    workers' READY (``deadline = deadline_of(None)`` in the executor's start):
    the start waits out the worker's 60 s and succeeds."""
    before = {p.pid for p in live_children(psutil.Process())}
    t0 = time.monotonic()
    with pytest.raises(zbus.StartupError, match=r"workers not ready within 2\.0 s"):
        zbus.Executor(workers.SlowStartWorker, nproc_per_node=1, startup_timeout=2.0)
    # 2 s, then the stuck worker is stopped (up to 5 s of grace, then SIGTERM)
    assert time.monotonic() - t0 < 30
    wait_until(lambda: {p.pid for p in live_children(psutil.Process())} <= before, 10,
               "the stuck worker ended")


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="valid: mp, inproc"):
        zbus.Executor(EchoWorker, backend="threads")
    with pytest.raises(TypeError, match="not a subclass of zbus.Executor"):
        zbus.Executor(EchoWorker, backend="workers:EchoWorker")
    with pytest.raises(TypeError, match="zbus.Worker"):
        zbus.Executor(workers.NotAWorker)
    with pytest.raises(ValueError, match="output_rank"):
        zbus.Executor(EchoWorker, nproc_per_node=2, output_rank=2)


def test_worker_class_in_driver_script_gets_a_clear_error():
    proc = spawn_python(
        "import zbus\n"
        "class W(zbus.Worker):\n    pass\n"
        "try:\n    zbus.Executor(W)\nexcept TypeError as e:\n    print(e)\n",
        stdout=subprocess.PIPE)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        end_process(proc)
    assert b"defined in the driver script" in out


def test_custom_backend_by_import_path():
    with zbus.Executor(EchoWorker, backend="workers:CustomExecutor") as ex:
        assert isinstance(ex, workers.CustomExecutor)
        assert ex.collective_rpc("rank_value", args=(1,)) == [10]
        assert workers.CustomExecutor.calls >= 1


def test_inproc_backend_same_api():
    with zbus.Executor(EchoWorker, backend="inproc") as ex:
        assert ex.world_size == 1
        assert ex.collective_rpc("rank_value", args=(2,)) == [20]
        assert ex.collective_rpc("rank_value", args=(2,), unique_reply_rank=0) == 20
        fut = ex.collective_rpc("later", args=(5, 0.1), non_block=True)
        assert fut.result(timeout=5) == [5]
        with pytest.raises(zbus.RemoteError, match="ValueError: boom"):
            ex.collective_rpc("boom")
        with pytest.raises(zbus.ZbusError, match="refused"):
            ex.collective_rpc("_private")
        assert ex.collective_rpc("workers:add_rank", args=(1,)) == [1]


def test_shutdown_is_idempotent_and_frees_everything():
    """The segments (broadcast ring, one response queue per worker) hold their
    memory while the executor runs, without names once it has started; the
    shutdown frees the memory."""
    before, used = zbus_segments(), shm_used()
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    assert shm_used() - used >= ex._bcast.handle.size + 2 * ex._resp_handles[0].size - 2**20
    assert zbus_segments() - before == set()
    procs = list(ex._workers.procs)
    ex.shutdown()
    ex.shutdown()
    assert all(p.poll() == 0 for p in procs)  # asked to stop: clean exit
    assert zbus_segments() - before == set()  # (other processes may remove theirs meanwhile)
    assert shm_used() - used < 2**20
    with pytest.raises(zbus.ZbusError, match="shut down"):
        ex.collective_rpc("noop")


def test_shutdown_is_bounded_when_a_worker_outlives_sigkill(monkeypatch):
    """A worker deaf to SIGTERM that SIGKILL does not end either (a process in
    uninterruptible sleep in a hung device driver; here its SIGKILL is not sent):
    shutdown still returns, after the grace, SIGTERM and KILL_WAIT_S for all the
    workers together (a hung driver hangs them all), and says so.
    Sabotage: no bound on the wait in ``LocalWorkers.kill`` (``while self.alive():
    time.sleep(0.01)``) → shutdown never returns."""
    import threading

    from zbus import processes

    ex = zbus.Executor(EchoWorker, nproc_per_node=3)
    pids = [p.pid for p in ex._workers.procs]
    try:
        ex.collective_rpc("stubborn_sleep", args=(60,), non_block=True)
        time.sleep(0.5)  # inside the call, SIGTERM ignored
        monkeypatch.setattr(processes, "KILL_WAIT_S", 2.0)
        signal_worker = processes.LocalWorkers._signal  # SIGKILLs that end nothing:
        monkeypatch.setattr(processes.LocalWorkers, "_signal", lambda self, p, sig, group=False: None
                            if sig == signal.SIGKILL else signal_worker(self, p, sig, group))
        kill, kill_took = processes.LocalWorkers.kill, []

        def timed_kill(workers):
            start = time.monotonic()
            kill(workers)
            kill_took.append(time.monotonic() - start)
        monkeypatch.setattr(processes.LocalWorkers, "kill", timed_kill)
        t0 = time.monotonic()
        closing = threading.Thread(target=ex.shutdown, daemon=True)
        closing.start()
        closing.join(40)
        took = time.monotonic() - t0
        print(f"shutdown returned after {took:.1f} s with the workers still there")
        assert not closing.is_alive(), "shutdown did not return"
        assert kill_took and kill_took[0] < 2.0 + 1.5, f"SIGKILLs waited for in turn: {kill_took}"
        assert all(psutil.pid_exists(pid) for pid in pids)
    finally:
        monkeypatch.undo()
        for pid, p in zip(pids, ex._workers.procs):
            os.kill(pid, signal.SIGKILL)
            p.wait(10)
        ex.shutdown()


def test_shutdown_from_another_thread_gives_blocked_callers_a_zbus_error():
    """Sabotage: shutdown() without waking and waiting for the blocked callers
    (unmapping the rings under them): they get ValueError or BufferError from the
    released memory instead of a ZbusError."""
    from blocked_calls import errors_of_callers_blocked_at_shutdown

    ex = zbus.Executor(EchoWorker, nproc_per_node=1)
    try:
        errors = errors_of_callers_blocked_at_shutdown(ex)
    finally:
        ex.shutdown()
    assert {name: type(e) for name, e in errors.items()} == {
        name: zbus.ZbusError for name in ("receiving", "sending", "queued")}, errors
    assert all("shut down" in str(e) for e in errors.values()), errors


@pytest.mark.parametrize("killed", ["driver", "every_process"])
def test_driver_sigkill_ends_workers_and_frees_shared_memory(killed):
    """SIGKILL the driver (its workers end and free what they map), or the driver
    and its workers at once, as vLLM's server ends its engine's process tree:
    nothing is left to remove a name, so none may be left. Sabotage: no
    ``_unlink_names`` after the workers are ready in ``MultiprocExecutor._start``
    -> ``[every_process]`` leaves the 3 names and their memory."""
    before, used = zbus_segments(), shm_used()
    proc = spawn_python(
        "import zbus, workers, time\n"
        "ex = zbus.Executor(workers.EchoWorker, nproc_per_node=2)\n"
        "print(' '.join(str(i['pid']) for i in ex.collective_rpc('whoami')), flush=True)\n"
        "time.sleep(60)\n", stdout=subprocess.PIPE)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and shm_used() - used > 2**20
        for pid in ([proc.pid, *pids] if killed == "every_process" else [proc.pid]):
            os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
                any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                    for p in pids) or zbus_segments() - before or shm_used() - used >= 2**20):
            time.sleep(0.05)
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                       for p in pids)
        assert zbus_segments() - before == set()  # (other processes may remove theirs meanwhile)
        assert shm_used() - used < 2**20
    finally:
        end_process(proc)


def test_the_rest_of_a_call_whose_send_timed_out_goes_out_without_another_call(monkeypatch, tmp_path):
    """A 1 MiB call to a worker busy for 1.5 s, in a 256 KiB ring: its send times out
    with the call begun (so it stays pending, to be answered), and the rest goes out
    in the background once the worker reads: the worker runs it with no other call
    made. Before, the rest waited for the driver's next send, however long: across
    nodes, the remote ranks, which had the whole call, waited in any collective it
    held. Sabotage: no ``flush_soon`` in ``_send_cut_short`` -> the mark never comes."""
    monkeypatch.setenv("ZBUS_RING", "64Kx4")
    ex = zbus.Executor(workers.EchoWorker, nproc_per_node=1)
    try:
        busy = ex.collective_rpc("sleep", args=(1.5,), non_block=True)
        with pytest.raises(TimeoutError):
            ex.collective_rpc("mark", args=(str(tmp_path / "m"), b"x" * 2**20), timeout=0.3)
        assert len(ex._pending) == 2  # the call stays, to be answered
        wait_until(lambda: (tmp_path / "m.0").exists(), 15, "the worker running the call")
        busy.result(10)
        assert ex.collective_rpc("rank_value", args=(3,), timeout=10) == [30]
        ex.check_health()
    finally:
        ex.shutdown()


def test_a_call_whose_rest_cannot_be_kept_fails_the_executor_saying_so(monkeypatch, tmp_path):
    """A 1 MiB call's send times out in the full 256 KiB ring (the worker sleeps in
    the call before), and the copy of its rest, which the caller's buffer must not
    be, fails (no memory): the caller gets the MemoryError and the executor fails
    saying why, at once. Before, the rest kept pointing into the caller's buffer
    and was streamed later, whatever it then held. Sabotage: no ``ring.aborted``
    check in ``_send_cut_short`` -> the executor serves on over an aborted ring
    (failing later, with a worker's death)."""
    from zbus import ring

    monkeypatch.setenv("ZBUS_RING", "64Kx4")
    ex = zbus.Executor(workers.EchoWorker, nproc_per_node=1)
    try:
        ex.collective_rpc("sleep", args=(2.0,), non_block=True)

        def no_memory(*args):
            raise MemoryError
        monkeypatch.setattr(ring, "bytes", no_memory, raising=False)  # (its copy's one use)
        with pytest.raises(MemoryError):
            ex.collective_rpc("mark", args=(str(tmp_path / "m"), b"x" * 2**20), timeout=0.3)
        monkeypatch.delattr(ring, "bytes")
        assert isinstance(ex.failure.error, zbus.ExecutorFailedError)
        assert "call 2 could not be finished in this node's ring" in str(ex.failure.error)
    finally:
        ex.shutdown()


def test_a_future_fails_at_its_deadline_while_the_ring_waits_to_be_flushed(monkeypatch, tmp_path):
    """A non-blocking call with a 1 s timeout to a worker that sleeps 4 s, then a
    1 MiB call whose send times out in the full 256 KiB ring: the completer thread
    takes turns flushing the ring and reading replies, so the first future fails
    at its deadline with nobody asking it. Sabotage: flush before reading every
    time (``_flushed_last`` never set) -> the future is done only when the worker
    answers, 4 s in, with its result."""
    monkeypatch.setenv("ZBUS_RING", "64Kx4")
    ex = zbus.Executor(workers.EchoWorker, nproc_per_node=1)
    try:
        hung = ex.collective_rpc("sleep", args=(4.0,), non_block=True, timeout=1.0)
        with pytest.raises(TimeoutError):
            ex.collective_rpc("mark", args=(str(tmp_path / "m"), b"x" * 2**20), timeout=0.3)
        wait_until(hung.done, 10, "the hung call's future failing at its deadline")
        assert isinstance(hung.exception(0), TimeoutError)
    finally:
        ex.shutdown()


def test_a_worker_stuck_writing_a_reply_no_one_reads_ends_at_a_shutdown(monkeypatch):
    """A call that timed out, whose 1 MiB reply fills the worker's 256 KiB reply
    ring: the worker waits to write the rest, not for STOP. The shutdown aborts the
    reply rings before it waits for the workers, so the worker's write fails and it
    ends (exit 0) at once. Before: it was SIGTERMed after the 5 s grace (exit 143).
    Sabotage: the reply rings aborted after ``workers.stop`` (in ``_wake_callers``
    only) -> 5 s, 143."""
    monkeypatch.setenv("ZBUS_RING", "64Kx4")
    ex = zbus.Executor(workers.EchoWorker, nproc_per_node=1)
    try:
        with pytest.raises(TimeoutError):
            ex.collective_rpc("crc", args=(1, b"x" * 2**20, 0.5, True), timeout=0.2)
        time.sleep(1.0)  # the worker is in its reply by now, the ring full
        t0 = time.monotonic()
        ex.shutdown()
        took = time.monotonic() - t0
    finally:
        ex.shutdown()
    print(f"shutdown took {took:.2f} s")
    assert ex._workers.procs[0].returncode == 0 and took < 3


@pytest.mark.parametrize("cut", ["ctrl-c", "deadline"])
def test_a_call_whose_send_ctrl_c_cut_short_is_forgotten(cut):
    """Ctrl-C, or the call's deadline, while a call waits to send (here: behind the
    rest of an earlier call that timed out on a full ring): no rank got it, so its
    number is free again and the next call is answered. Before, after Ctrl-C it
    stayed pending: the next call's reply was read as its own and failed the
    executor ("protocol error: expected the reply to call 3"). Sabotage: no
    ``_send_cut_short`` in ``collective_rpc`` -> both fail."""
    interrupt = ("threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
                 "try:\n"
                 "    ex.collective_rpc('rank_value', args=(1,), timeout=10)\n"
                 "except KeyboardInterrupt:\n" if cut == "ctrl-c" else
                 "try:\n"
                 "    ex.collective_rpc('rank_value', args=(1,), timeout=0.3)\n"
                 "except TimeoutError:\n")
    proc = spawn_python(
        "import os, signal, threading, zbus, workers\n"
        "ex = zbus.Executor(workers.EchoWorker, nproc_per_node=1)\n"
        "ex.collective_rpc('sleep', args=(2,), non_block=True)\n"
        "try:\n"
        "    ex.collective_rpc('echo', args=(b'x' * 2**20,), timeout=0.2)  # a 256 KiB ring\n"
        "except TimeoutError:\n"
        "    print('timed out', flush=True)\n"
        f"{interrupt}"
        "    print('interrupted', flush=True)\n"
        "print(ex.collective_rpc('rank_value', args=(4,), timeout=10), flush=True)\n"
        "ex.shutdown()\n", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={"ZBUS_RING": "64Kx4"})
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        end_process(proc)
    assert out.split("\n")[:3] == ["timed out", "interrupted", "[40]"], (out, err[-2000:])


def driver_of_two_workers(setup: str, then: str, *argv: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A driver process with 2 EchoWorkers (``ex``) that runs the code ``setup``,
    prints its workers' pids (read here), then runs ``then``."""
    proc = spawn_python(
        "import zbus, workers, time, sys\n"
        "ex = zbus.Executor(workers.EchoWorker, nproc_per_node=2)\n"
        f"{setup}\n"
        "print(' '.join(str(i['pid']) for i in ex.collective_rpc('whoami')), flush=True)\n"
        f"{then}\n", *argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        workers = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
    except BaseException:  # (its workers end with it)
        proc.kill()
        end_process(proc)
        raise
    return proc, workers


def kill_driver(proc: subprocess.Popen, workers: list[psutil.Process]) -> None:
    """SIGKILL the driver; its orphaned workers must end within 10 s."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert psutil.wait_procs(workers, timeout=10)[1] == []


def test_workers_end_with_a_sigkilled_driver_whose_forked_child_lives_on():
    """The driver forks a child that outlives it (multiprocessing's fork start
    method, a DataLoader's workers): SIGKILL the driver and its workers still end,
    their death pipe at EOF. Before, the child held the pipe's write end and the
    workers served on, holding their GPUs, as long as it lived. Sabotage: no
    ``os.register_at_fork`` in zbus/processes.py -> they outlive the 10 s."""
    proc, workers = driver_of_two_workers(
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)", "time.sleep(60)")
    child = [c for c in psutil.Process(proc.pid).children() if c.pid not in {w.pid for w in workers}]
    try:
        assert len(child) == 1
        kill_driver(proc, workers)
    finally:
        for c in child:
            c.kill()
        if proc.poll() is None:  # the test failed before it killed the driver
            proc.kill()
        end_process(proc)
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass


FORK_AS_WORKERS_START = """
import os, time
import zbus, zbus.processes, workers

real = zbus.processes.worker_env
calls = []


def forking(*args):  # a fork between the workers' starts (another thread's, say)
    calls.append(1)
    if len(calls) == 2 and os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    return real(*args)


zbus.processes.worker_env = forking
ex = zbus.Executor(workers.EchoWorker, nproc_per_node=2)
print(' '.join(str(i['pid']) for i in ex.collective_rpc('whoami')), flush=True)
time.sleep(60)
"""


def test_workers_end_with_a_sigkilled_driver_that_forked_as_they_started():
    """The driver forks a child that outlives it while its workers are being
    started (between two of them): SIGKILL the driver and they still end. Before,
    the death pipe's write end was closed in forked children only once every
    worker had started, and a child forked before held it open: the workers
    served on as long as it lived. Sabotage: ``_alive.add(self)`` at the end of
    ``LocalWorkers.__init__`` again -> they outlive the 10 s."""
    proc = spawn_python(FORK_AS_WORKERS_START, stdout=subprocess.PIPE)
    started: list[psutil.Process] = []
    try:
        workers = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]
        started = psutil.Process(proc.pid).children()
        assert len(workers) == 2 and len(started) == 3  # and the forked child
        kill_driver(proc, workers)
    finally:
        for p in started:
            if running(p):
                p.kill()
        if proc.poll() is None:
            proc.kill()
        end_process(proc)


def test_a_worker_whose_call_ring_is_gone_as_it_starts_ends_with_one_line():
    """The driver gave up (a node refused it) while a worker's interpreter started,
    and removed the node's rings: the worker ends with exit code 1 and a line
    saying so. Before, it printed ``FileNotFoundError``'s traceback under the
    driver's own error. Sabotage: no ``except FileNotFoundError`` round the
    attach in ``worker.main`` -> a traceback."""
    import json

    from zbus import ring, shm

    handle = ring.create(1)
    shm.unlink(handle.name)
    death_r, death_w = os.pipe()
    place = {"rank": 0, "local_rank": 0, "node_rank": 0, "local_world_size": 1, "world_size": 1,
             "bcast": handle.to_dict(), "resp": {}, "death_fd": death_r, "segments": []}
    proc = spawn_python("from zbus.worker import main; main()", env={"ZBUS_WORKER": json.dumps(place)},
                        pass_fds=(death_r,), stderr=subprocess.PIPE, text=True)
    os.close(death_r)
    try:
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1, err
        assert "call ring is gone" in err and "Traceback" not in err, err
    finally:
        os.close(death_w)
        end_process(proc)


def test_an_error_on_a_rank_that_does_not_answer_is_logged_by_it(tmp_path, capfd):
    """Only rank 0 answers the call (``unique_reply_rank``, as vLLM's steps), and
    rank 1 raises: rank 1 logs the error with its traceback (as vLLM's own workers
    do), so the cause of a step that then hangs in rank 0's collective shows. Before,
    the exception was dropped unseen. Sabotage: no ``elif status != protocol.OK``
    in ``worker.handle`` -> nothing logged."""
    with zbus.Executor(workers.EchoWorker, nproc_per_node=2) as ex:
        assert ex.collective_rpc("boom_on", args=(1, str(tmp_path / "m"), 0), unique_reply_rank=0,
                                 timeout=30) == 0
        err = ""

        def logged() -> bool:
            nonlocal err
            err += capfd.readouterr().err
            return "ValueError: rank 1 failed" in err

        wait_until(logged, 10, "rank 1's error logged")
    assert "[node 0 rank 1]" in err and "call 1 ('boom_on') failed here, and rank 0 answers it" in err, err
    assert "Traceback" in err and "[node 0 rank 0]" not in err, err


def test_a_metrics_port_taken_fails_the_start_before_any_worker_starts(monkeypatch):
    """The metrics server starts first: a port already taken fails the executor's
    start before a worker process (or, with nodes, a join) is made. Before, it
    was bound once every rank was ready, and a taken port then tore the whole
    cluster down (with vLLM, minutes of model loading). Sabotage: start the
    metrics server at the end of ``MultiprocExecutor._start`` (as before) -> the
    workers were started."""
    import socket

    from zbus import executor

    started = []

    class Recorded(executor.LocalWorkers):
        def __init__(self, *args, **kwargs):
            started.append(1)
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(executor, "LocalWorkers", Recorded)
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError, match="in use"):
            zbus.Executor(EchoWorker, nproc_per_node=2, metrics_port=taken.getsockname()[1])
        assert started == []
    finally:
        taken.close()


def test_workers_orphaned_inside_a_call_run_their_atexit_hooks(tmp_path):
    """A library's clean-up registered with ``atexit`` (vLLM's CPU all-reduce removes
    its shared memory so) still runs when the driver is SIGKILLed while the workers
    are busy in a call. Sabotage: an orphaned worker that ends with ``os._exit`` at
    once leaves no mark."""
    mark = str(tmp_path / "exit")
    proc, workers = driver_of_two_workers(
        "ex.collective_rpc('mark_at_exit', args=(sys.argv[1],))",
        "ex.collective_rpc('sleep_marked', args=(sys.argv[1] + '.busy', 60), non_block=True)\n"
        "time.sleep(60)", mark)
    try:
        wait_until(lambda: all(os.path.exists(f"{mark}.busy.{r}") for r in (0, 1)), 60, "calls begun")
        kill_driver(proc, workers)
        assert all(os.path.exists(f"{mark}.{r}") for r in (0, 1))
    finally:
        end_process(proc)


def test_orphaned_workers_run_on_exit_before_atexit_hooks_that_hang(tmp_path):
    """What a worker names with ``zbus.worker.on_exit`` (vLLM's CPU all-reduce
    segments) is removed when the driver is SIGKILLed, even behind an ``atexit``
    hook that hangs. Sabotage: ``on_exit`` as a plain ``atexit`` hook: the hanging
    hook runs first, the worker is ended after ORPHAN_EXIT_S, no mark."""
    mark = str(tmp_path / "exit")
    proc, workers = driver_of_two_workers(
        "ex.collective_rpc('mark_on_exit', args=(sys.argv[1],))", "time.sleep(60)", mark)
    try:
        kill_driver(proc, workers)
        assert all(os.path.exists(f"{mark}.{r}") for r in (0, 1))
    finally:
        end_process(proc)


def test_an_orphaned_worker_whose_on_exit_clean_up_hangs_still_ends(tmp_path):
    """A clean-up named by ``zbus.worker.on_exit`` hangs (60 s) when the driver is
    SIGKILLed: the orphaned workers end within ``kill_driver``'s 10 s all the same,
    their ``atexit`` hooks run. Sabotage: the orphan watcher runs the clean-ups on
    its own thread, unbounded (as before) -> the workers live on for 60 s."""
    mark = str(tmp_path / "exit")
    proc, workers = driver_of_two_workers(
        "ex.collective_rpc('mark_at_exit', args=(sys.argv[1],))\n"
        "ex.collective_rpc('hang_in_on_exit', args=(60,))", "time.sleep(60)", mark)
    try:
        kill_driver(proc, workers)
        assert all(os.path.exists(f"{mark}.{r}") for r in (0, 1))
    finally:
        end_process(proc, 0)
        for p in workers:
            if running(p):
                p.kill()


def test_an_orphaned_worker_that_cannot_start_a_thread_for_its_clean_up_still_ends():
    """The driver is SIGKILLed in a worker process where no thread can be had (a
    pids limit): its orphan watcher cannot run the clean-ups on threads of their
    own, and ends the worker without them. Before, the failed start ended the
    watcher (the worker's only way to learn its driver is gone) by an exception,
    and the worker waited for calls for good. Sabotage: no ``except RuntimeError``
    in ``zbus.worker._for_a_while`` -> the workers outlive the 10 s."""
    proc, workers = driver_of_two_workers(
        "ex.collective_rpc('refuse_threads', args=('zbus-on-exit', 'zbus-atexit'))", "time.sleep(60)")
    try:
        kill_driver(proc, workers)
    finally:
        end_process(proc, 0)
        for p in workers:
            if running(p):
                p.kill()


def test_workers_see_one_gpu_each_unless_the_executor_shows_them_their_nodes(monkeypatch):
    """By default each worker sees its own GPU (the ``local_rank``-th of its
    parent's); ``env={"ZBUS_GPUS": "node"}`` shows each every GPU of its node (what
    vLLM expects), and an unauthenticated leader may ask for that; an explicit
    ``CUDA_VISIBLE_DEVICES`` wins. Sabotage: ignore ``ZBUS_GPUS`` in ``worker_env``
    -> "node" workers see one GPU each."""
    from zbus.agent import safe_env_name
    from zbus.processes import GPUS_ENV, worker_env

    def seen(extra: dict) -> list[str]:
        return [worker_env({"rank": r, "local_rank": r, "world_size": 2, "local_world_size": 2,
                            "node_rank": 0}, "127.0.0.1", 29500, extra)["CUDA_VISIBLE_DEVICES"]
                for r in (0, 1)]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert seen({}) == ["2", "3"]
    assert seen({GPUS_ENV: "node"}) == ["2,3", "2,3"]
    assert seen({"CUDA_VISIBLE_DEVICES": "5"}) == ["5", "5"]
    assert safe_env_name(GPUS_ENV)


def test_a_worker_gets_one_thread_or_a_share_of_its_nodes_cores(monkeypatch):
    """``OMP_NUM_THREADS`` is 1 unless set; ``env={"ZBUS_THREADS": "share"}`` gives each
    worker the node's cores over its workers (what the vLLM executor asks for on
    GPUs, as vLLM's own gives its GPU workers for their start-up), saying so in
    ``ZBUS_THREADS=shared``; a value the environment sets wins. Sabotage: ignore
    ``ZBUS_THREADS`` in ``worker_env`` -> 1 thread."""
    from zbus.agent import safe_env_name
    from zbus.config import usable_cores
    from zbus.processes import THREADS_ENV, worker_env

    place = {"rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "node_rank": 0}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = lambda extra: {k: worker_env(place, "127.0.0.1", 29500, extra)[k]  # noqa: E731
                             for k in ("OMP_NUM_THREADS", THREADS_ENV)}
    assert threads({}) == {"OMP_NUM_THREADS": "1", THREADS_ENV: "one"}
    cores = str(usable_cores())  # (its affinity, capped by its cgroup's CPU quota)
    assert threads({THREADS_ENV: "share"}) == {"OMP_NUM_THREADS": cores, THREADS_ENV: "shared"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads({THREADS_ENV: "share"}) == {"OMP_NUM_THREADS": "3", THREADS_ENV: "share"}
    assert safe_env_name(THREADS_ENV) and safe_env_name("TOKENIZERS_PARALLELISM")


@pytest.mark.parametrize("how", ["shutdown", "driver_killed"])
def test_a_process_a_worker_started_ends_with_the_worker(tmp_path, how):
    """A worker's method starts a process that outlives the call (as a library's
    compile helper or server): it ends with the worker, at a shutdown or when the
    driver is SIGKILLed. Each worker leads a process group of its own, which its
    executor, or the orphaned worker itself, SIGKILLs at its end. Sabotage: no
    ``start_new_session`` in ``LocalWorkers`` -> both processes run on (60 s)."""
    mark = str(tmp_path / "child")
    proc, workers = driver_of_two_workers("ex.collective_rpc('start_a_process', args=(sys.argv[1],))",
                                          "sys.stdin.readline()\nex.shutdown()\ntime.sleep(60)"
                                          if how == "shutdown"
                                          else "time.sleep(60)", mark)
    started = []
    try:
        for r in (0, 1):
            with open(f"{mark}.{r}") as f:
                started.append(psutil.Process(int(f.read())))
        if how == "shutdown":
            proc.stdin.write(b"\n")  # (the workers' pids are read: the driver may shut down)
            proc.stdin.flush()
            assert psutil.wait_procs(workers, timeout=30)[1] == []
        else:
            kill_driver(proc, workers)
        wait_until(lambda: not any(running(p) for p in started), 10, "the started processes ended")
    finally:
        end_process(proc, 0)
        for p in (*workers, *started):
            if running(p):
                p.kill()


def test_a_worker_reaped_long_ago_has_its_group_signalled_no_more(monkeypatch):
    """Worker 0 dies and is reaped; the executor fails and stops worker 1. The
    shutdown that comes later signals no group of worker 0: its pid is free by
    then, and may lead another process's group. Sabotage: SIGKILL every
    worker's group at the end of ``LocalWorkers.stop`` (as at first) -> worker 0's
    pid signalled by the shutdown."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    try:
        dead = ex._workers.procs[0].pid
        with pytest.raises(zbus.WorkerDiedError):
            ex.collective_rpc("die", args=(0,), timeout=30)
        wait_until(lambda: ex._workers.procs[0].returncode is not None, 10, "worker 0 reaped")
        signalled, killpg = [], os.killpg
        monkeypatch.setattr(os, "killpg", lambda pgid, sig: (signalled.append(pgid), killpg(pgid, sig)))
        ex.shutdown()
        assert dead not in signalled, signalled
    finally:
        monkeypatch.undo()
        ex.shutdown()


def running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_atexit_hooks_run_once_when_the_driver_dies_while_a_worker_ends(tmp_path):
    """The driver is SIGKILLed while its stopped workers run their ``atexit`` hooks:
    the orphan watcher leaves the hooks to the main thread. Sabotage: the watcher
    runs them too (each hook twice, at once)."""
    mark = str(tmp_path / "hooks")
    proc, workers = driver_of_two_workers(
        "ex.collective_rpc('count_at_exit', args=(sys.argv[1], 3))", "ex.shutdown()", mark)
    try:
        wait_until(lambda: all(os.path.exists(f"{mark}.{r}") for r in (0, 1)), 30, "hooks begun")
        kill_driver(proc, workers)
        assert [open(f"{mark}.{r}").read() for r in (0, 1)] == ["ran\n", "ran\n"]
    finally:
        end_process(proc)


def test_stopped_workers_run_on_exit_and_atexit_hooks_and_exit_0(tmp_path):
    """A stopped worker ends with ``os._exit``, after its clean-up. Sabotage: no
    ``on_exit`` run at the end of the worker's loop, or no ``atexit`` hooks run
    before ``os._exit``: no mark."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    with ex:
        ex.collective_rpc("mark_on_exit", args=(str(tmp_path / "exit"), False))
        ex.collective_rpc("mark_at_exit", args=(str(tmp_path / "atexit"),))
        procs = list(ex._workers.procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert all(os.path.exists(tmp_path / f"{what}.{r}") for what in ("exit", "atexit") for r in (0, 1))


def test_a_clean_up_interrupted_by_sigterm_still_lets_the_others_run(tmp_path):
    """SIGTERM's handler raises SystemExit wherever the main thread is, a clean-up
    at exit included: the others still run, then the process exits with its code.
    Sabotage: only ``Exception`` caught around each clean-up (the rest skipped)."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=1)
    with ex:
        ex.collective_rpc("mark_on_exit", args=(str(tmp_path / "exit"), False))
        ex.collective_rpc("exit_in_on_exit", args=(143,))  # runs first: registered last
        procs = list(ex._workers.procs)
    assert [p.returncode for p in procs] == [143]
    assert os.path.exists(tmp_path / "exit.0")


def test_torch_distributed_all_reduce_across_workers():
    pytest.importorskip("torch")
    with zbus.Executor(workers.DistWorker, nproc_per_node=2, startup_timeout=120) as ex:
        assert ex.collective_rpc("all_reduce", args=(3,), timeout=60) == [6.0, 6.0]
        ex.collective_rpc("close", timeout=30)


@pytest.mark.parametrize("non_block", [False, True], ids=["blocking", "non_block"])
def test_a_rank_that_raised_fails_the_call_while_an_earlier_rank_still_waits(tmp_path, non_block):
    """Rank 1 raises while rank 0 waits for it (5 s here; in a collective of its
    own, for ever): the call fails with rank 1's error at once, not when rank 0 is
    done, and rank 0's late reply is taken and dropped: the next call gets its own
    replies. It counts as ``overdue`` meanwhile. Sabotage: no
    ``_settle_on_an_error`` call in ``_on_wait_slice`` -> the error comes after
    rank 0 made its mark; ``overdue`` by the timeout alone -> 0."""
    mark = tmp_path / "done"
    with zbus.Executor(EchoWorker, nproc_per_node=2) as ex:
        with pytest.raises(zbus.RemoteError, match="rank 1 failed") as info:
            out = ex.collective_rpc("boom_on", args=(1, str(mark), 5.0), timeout=30, non_block=non_block)
            if non_block:
                out.result(30)
        assert info.value.rank == 1 and not os.path.exists(f"{mark}.0")
        assert ex.overdue == 1  # given up on, its replies not all in: later ones queue behind it
        assert ex.collective_rpc("rank_value", args=(3,), timeout=30) == [30, 31]
        assert os.path.exists(f"{mark}.0") and ex.overdue == 0


def test_a_rank_that_raised_before_a_torch_collective_fails_the_call_and_the_others_end():
    """Rank 1 raises before an all-reduce that rank 0 entered (as a worker that
    fails in vLLM's ``init_device`` leaves the others in torch's rendezvous): the
    call fails with rank 1's error, and the shutdown ends rank 0, stuck in gloo.
    Sabotage: as above -> TimeoutError after 20 s."""
    pytest.importorskip("torch")
    with zbus.Executor(workers.DistWorker, nproc_per_node=2, startup_timeout=120) as ex:
        with pytest.raises(zbus.RemoteError, match="rank 1 failed before the all-reduce"):
            ex.collective_rpc("all_reduce_unless", args=(1, 3), timeout=20)
        procs = list(ex._workers.procs)
    assert all(p.poll() is not None for p in procs)


def test_many_small_non_blocking_calls_do_not_deadlock_on_full_queues():
    with zbus.Executor(EchoWorker, nproc_per_node=2) as ex:
        futs = [ex.collective_rpc("rank_value", args=(i,), non_block=True, timeout=30)
                for i in range(2000)]
        assert futs[-1].result(timeout=60) == [19990, 19991]
        assert [f.result() for f in futs[:3]] == [[0, 1], [10, 11], [20, 21]]


@pytest.mark.timeout(180)
def test_tensor_parallel_example_runs():
    pytest.importorskip("torch")
    example = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "tensor_parallel.py")
    proc = spawn_python(f"import runpy, sys; sys.argv = ['{example}', '--steps', '3']; "
                        f"sys.path.insert(0, '{os.path.dirname(example)}'); "
                        f"runpy.run_path('{example}', run_name='__main__')", stdout=subprocess.PIPE)
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        end_process(proc)
    assert proc.returncode == 0 and out.count(b"matches the single-process reference") == 3


def test_a_done_callback_of_a_future_past_its_timeout_reads_the_timeout(ex):
    """The completer expires a non-blocking call past its timeout and runs its
    future's callbacks: one that reads ``exception()`` and ``result()`` gets the
    TimeoutError (as zbus.vllm's mapped futures do). Sabotage: drop ``self.done()``
    from ``RpcFuture._complete``'s early return and complete futures under the
    reply lock (``_holds_a_lock`` returns False): the callback gets ZbusError
    ("... must not wait on the executor")."""
    seen: list = []

    def read(f):
        for outcome in (f.exception, f.result):
            try:
                seen.append(outcome())
            except BaseException as e:  # noqa: BLE001 - what it raised is the point
                seen.append(e)

    fut = ex.collective_rpc("sleep", args=(1.0,), timeout=0.2, non_block=True)
    fut.add_done_callback(read)
    wait_until(lambda: len(seen) == 2, 10, "the callback ran")
    assert [type(e) for e in seen] == [TimeoutError, TimeoutError], seen
    time.sleep(1.0)  # the workers are done sleeping
    assert ex.collective_rpc("rank_value", args=(1,), timeout=10) == [10, 11]


def test_a_base_exception_or_a_message_that_is_no_call_does_not_end_a_worker(ex):
    """A method that raises ``asyncio.CancelledError`` (a BaseException: from a
    cancelled task, say) is answered with it, and a message on the ring whose
    envelope is no call, or that has no frame, is dropped: the same workers serve
    the next call. Sabotage: catch only ``Exception`` in ``run_call``, or read the
    envelope outside the try in ``handle`` -> the workers exit, WorkerDiedError."""
    pids = [w["pid"] for w in ex.collective_rpc("whoami", timeout=30)]
    with pytest.raises(zbus.RemoteError, match="CancelledError: the task was cancelled"):
        ex.collective_rpc("cancelled", timeout=30)
    ex._bcast.ring.send([b"\x93\x01\x02\x03"], timeout=10)
    ex._bcast.ring.send([], timeout=10)
    assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
    assert [w["pid"] for w in ex.collective_rpc("whoami", timeout=30)] == pids


@pytest.mark.parametrize("backend", ["mp", "inproc"])
def test_an_error_whose_text_cannot_be_made_is_answered_and_the_worker_serves_on(backend):
    """A method raises an exception whose ``__str__`` raises: the caller gets a
    RemoteError naming its type, and the next call answers. Sabotage: take
    ``str(exc)`` as it is in ``ExceptionInfo.from_exception`` -> with worker
    processes a CodecError that does not name it; on ``inproc`` the caller gets
    the RuntimeError its ``__str__`` raised."""
    with zbus.Executor(EchoWorker, nproc_per_node=1, backend=backend) as ex:
        with pytest.raises(zbus.RemoteError, match="Unprintable"):
            ex.collective_rpc("unprintable", timeout=10)
        assert ex.collective_rpc("rank_value", args=(1,), timeout=10) == [10]


def test_an_error_whose_text_holds_bytes_that_are_not_utf8_travels_as_itself():
    """A worker's error names a file whose name is no UTF-8 (Python decodes it with
    ``surrogateescape``): the caller gets its type and text, the bytes in
    backslash form, at a call and at start-up. Before, msgpack refused the lone
    surrogate: the call's error came back as the worker's own CodecError ("cannot
    encode: UnicodeEncodeError"), and at start-up the worker exited 1 without
    telling why. Sabotage: no ``_utf8`` in the codec's error branch."""
    with zbus.Executor(EchoWorker, nproc_per_node=1) as ex:
        with pytest.raises(zbus.RemoteError) as got:
            ex.collective_rpc("boom_undecodable", timeout=10)
        assert got.value.type_name == "ValueError" and got.value.message == "cannot load model-\\udcff"
        assert "boom_undecodable" in got.value.remote_traceback
        assert ex.collective_rpc("rank_value", args=(1,), timeout=10) == [10]
    with pytest.raises(zbus.StartupError, match=r"ValueError: cannot load model-\\udcff"):
        zbus.Executor(UndecodableStartWorker, nproc_per_node=1, startup_timeout=30)


def test_a_reply_sent_later_is_not_kept_by_the_reply_thread():
    """The thread that sends the replies of returned futures keeps no reference to
    the last one (a lent argument in it would be copied out of the ring at the next
    receive, and the next large calls copied too). Sabotage: no ``del result`` in
    ``ReplyPipe._drain`` -> the value lives on."""
    import gc
    import weakref

    class Value:
        pass

    with zbus.Executor(EchoWorker, nproc_per_node=1, backend="inproc") as ex:
        value = Value()
        alive = weakref.ref(value)
        assert ex.collective_rpc("later", args=(value, 0.01), timeout=10) == [value]
        del value
        wait_until(lambda: gc.collect() >= 0 and alive() is None, 5, "the value freed")


def test_a_method_name_no_worker_would_read_is_refused_before_it_is_sent():
    """A method name of 70 000 characters made an envelope over the 64 KiB every
    worker reads: each dropped the message as no call, and the caller waited for
    replies that never came (for ever without a timeout). The name is refused
    before anything is sent, and the executor serves on. Sabotage: no length check
    in ``method_name`` -> TimeoutError after the call's 3 s."""
    with zbus.Executor(EchoWorker, nproc_per_node=2) as ex:
        with pytest.raises(ValueError, match="a method name of 70000 characters: at most 4096"):
            ex.collective_rpc("m" * 70_000, timeout=3)
        assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]


@pytest.mark.parametrize("payload", [[], [protocol.NO_ARGS]], ids=["arguments_undecodable", "no_arguments"])
def test_a_method_name_nested_deep_is_refused_not_the_end_of_the_worker(payload):
    """A call whose method is a list nested 1000 deep (1 KiB, an envelope
    ``read_envelope`` takes) is answered REFUSED, its name in a bounded repr, with
    arguments that cannot be decoded or none. Sabotage: name it with ``{method!r}``
    in ``handle``'s decode error, or ``{name!r}`` in ``resolve_method``: the repr
    raises RecursionError out of ``handle``, and the worker ends."""
    from zbus import codec
    from zbus.worker import ReplyPipe, handle

    worker = workers.EchoWorker.__new__(workers.EchoWorker)
    worker.rank = 0
    sent: list = []
    replies = ReplyPipe(sent.append, lambda seq: None)
    method = b"\x91" * 1000 + b"\xa1m"  # [[[...["m"]...]]]
    envelope = b"\x96\x01\x07" + method + b"\xff" + bytes([len(payload)]) + b"\x00"
    assert protocol.read_envelope(envelope)[:2] == [protocol.CALL, 7]
    assert handle(worker, [envelope, *payload], replies, False)
    [(seq, status, error)] = [codec.decode(codec.encode(r)) for r in sent]
    assert (seq, status) == (7, protocol.REFUSED) and "[[[" in error.message, error


def test_worker_message_handling_byte_for_byte():
    """Each reply is taken as the frames it is sent as (``codec.encode`` of what the
    worker hands on) and compared, frame for frame, with bytes written here with
    plain msgpack from the wire format (zbus.protocol, zbus.codec): an answer's
    value, an error's type and message (its traceback text alone is taken from
    what was sent), a large bytes value as a frame of its own.
    Sabotage: in ``run_call`` (zbus/worker.py) answer a raised exception with its
    text (``return f"{type(e).__name__}: {e}", protocol.RAISED``) → fails (the
    old test checked only the status, and "in str(value)"); send ``float(seq)``
    in ``handle`` → fails (7.0 == 7 once decoded)."""
    import msgpack

    from zbus import codec, protocol
    from zbus.worker import ReplyPipe, handle

    def pack(*items) -> bytes:
        return msgpack.packb(list(items), use_bin_type=True)

    def tup(*items) -> msgpack.ExtType:  # a tuple travels as an extension around its list
        return msgpack.ExtType(codec._TUPLE, pack(*items))

    worker = workers.EchoWorker.__new__(workers.EchoWorker)
    worker.rank, worker.tag, worker.calls = 0, "w", 0
    sent: list = []  # the frames of each reply, as bytes
    acks: list = []  # each call's "answered" (the driver has the replies up to it)
    replies = ReplyPipe(lambda reply: sent.append([bytes(f) for f in codec.encode(reply)]), acks.append)

    def call(method, payload, reply_rank=-1) -> list[bytes]:
        envelope = codec.encode([protocol.CALL, 7, method, reply_rank, len(payload), 6])
        assert handle(worker, [*envelope, *payload], replies, False)
        frames = sent.pop()
        assert not sent
        return frames

    def error(frames: list[bytes], status: int, type_name: str, message: str) -> None:
        traceback = getattr(codec.decode(frames)[2], "traceback", "")
        info = msgpack.ExtType(codec._EXCEPTION, pack(type_name, message, traceback))
        assert frames == [pack(7, status, info)]
        assert traceback.startswith("Traceback") or status == protocol.REFUSED

    # a call without arguments carries the one pre-encoded frame
    assert call("echo", [protocol.NO_ARGS]) == [pack(7, protocol.OK, tup(tup(), {}))]
    assert pack(7, protocol.OK, tup(tup(), {})) == b"\x93\x07\x00\xc7\x05\x01\x92\xd4\x01\x90\x80"
    assert call("echo", codec.encode(((1, "x"), {"k": 2}))) == [pack(7, protocol.OK, tup(tup(1, "x"),
                                                                                        {"k": 2}))]
    big = os.urandom(codec.OOB_THRESHOLD)  # a tuple's large bytes item: a frame of its own
    by_ref = msgpack.ExtType(codec._BYTES, pack(0, 0))  # kind bytes, frame 0 after the header
    assert call("echo", codec.encode(((big, 3.5), {}))) == [pack(7, protocol.OK, tup(tup(by_ref, 3.5), {})),
                                                             big]
    error(call("rank_value", [protocol.NO_ARGS]), protocol.RAISED, "TypeError",
          "EchoWorker.rank_value() missing 1 required positional argument: 'x'")
    frames = call("echo", [b"\xc1"])
    why = getattr(codec.decode(frames)[2], "message", "")
    assert why.startswith("cannot decode the arguments of 'echo': ")
    error(frames, protocol.REFUSED, "zbus.errors.ZbusError", why)
    for payload in (5, None, [1, 2, 3], ((), []), ((), {1: 2}), [(), {}]):  # decodable, not (args, kwargs)
        why = getattr(codec.decode(call("echo", codec.encode(payload)))[2], "message", "")
        assert why.startswith("cannot decode the arguments of 'echo': the arguments are not"), why
    assert worker.replying
    envelope = codec.encode([protocol.CALL, 8, "echo", 1, 1, 7])  # only rank 1 replies
    assert handle(worker, [*envelope, protocol.NO_ARGS], replies, False) and not sent
    assert not worker.replying  # the method could tell
    assert set(acks) == {6, 7} and acks[-1] == 7
    assert not handle(worker, codec.encode([protocol.STOP]), replies, False)
    for bad in ([b"\xc1"], [b"\x93\x01\x02\x03"], [b"\xd4\x63\x00"], codec.encode({"a": 1}),
                [b"\x91" * 1000 + b"\x01"], [b"\xdd\x00\x80\x00\x00" + b"\x90" * 64],  # deep; 8M items
                [codec.encode([protocol.CALL, 1, "m" * 70_000, 0, 1, 0])[0]]):
        with pytest.raises(zbus.errors.CodecError):
            protocol.read_envelope(bad[0])
        assert handle(worker, bad, replies, False)  # dropped: the worker serves on
    assert not sent


def test_a_call_forgotten_while_the_completer_reads_it_gives_its_number_to_the_next_call_whole(monkeypatch):
    """A non-blocking call is answered while a caller waits to send (its wait
    drains the replies: its future completes once the send lock is let go), so
    the completer, with that future undone, goes on to the call being sent. That
    send is cut short before any rank got it: the call is forgotten and its
    number is the next call's. The completer, had it read the forgotten call,
    would take the next call's replies for it and pop the next call unanswered:
    its caller got "executor is shut down" from a live executor. Sabotage: read
    a head still being sent (drop ``if not head.sent`` in
    ``Completer._read_heads``) -> that error."""
    from blocked_calls import waits_for_the_send_lock

    from zbus.errors import SendTimeout

    with zbus.Executor(EchoWorker, nproc_per_node=2) as ex:
        completer = ex._completer
        monkeypatch.setattr(completer, "GRACE_S", 1.0)  # the first call is left to the drain
        monkeypatch.setattr(completer, "SLICE_S", 5.0)  # a read of the head outlasts what follows
        publish, later, got = ex._publish, [], {}

        def call_next():
            try:
                got["value"] = ex.collective_rpc("rank_value", args=(2,), timeout=10)
            except BaseException as e:  # noqa: BLE001 - the test shows it
                got["error"] = e

        def cut_short(frames, size, deadline, nodes_got, cancel):
            """The call's wait to send drains the earlier call's replies (as ``on_full``
            does), the completer turns to this call, and the send ends undelivered."""
            if later:  # the next call: sent
                return publish(frames, size, deadline, nodes_got, cancel)
            wait_until(lambda: all(ex._receivers[r].poll(first.seq) for r in (0, 1)), 10, "replies in")
            ex._drain_ready()
            assert first._call not in ex._pending and not first.done()  # answered, its future not yet done
            later.append(threading.Thread(target=call_next))
            later[0].start()
            wait_until(lambda: waits_for_the_send_lock(later[0]), 10, "the next caller waits to send")
            wait_until(lambda: ex._recv_lock._owner == completer._thread.ident
                       or waits_for_the_send_lock(completer._thread, "_take"), 10,
                       "the completer turned to the call being sent")
            raise SendTimeout("send timed out", queued=False)

        first = ex.collective_rpc("rank_value", args=(1,), non_block=True)
        monkeypatch.setattr(ex, "_publish", cut_short)
        with pytest.raises(TimeoutError, match="timed out sending"):
            ex.collective_rpc("noop", timeout=10)
        later[0].join(15)
        assert got == {"value": [20, 21]}
        assert first.result(0) == [10, 11]
        assert ex.collective_rpc("rank_value", args=(3,), timeout=10) == [30, 31]


@pytest.mark.parametrize("where", ["waiting for the workers", "waiting to send", "twice"])
def test_ctrl_c_in_a_shutdown_still_ends_the_workers_fails_the_calls_and_frees_the_rings(tmp_path, where):
    """Ctrl-C while the shutdown waits for a worker stuck in a call (deaf to
    SIGTERM), or for the send lock a caller holds: the workers are killed at once,
    the pending call fails, the rings and queues are closed, and the
    KeyboardInterrupt reaches the caller. A later shutdown returns at once, so the
    first must finish every step. Before, the interrupt skipped every step after
    the wait: the workers ran on, the pending future never completed, the rings
    stayed mapped. Sabotage: run the shutdown's steps one after the other again
    (no ``finally``) in ``MultiprocExecutor._shut_down_once``, or begin its ``try``
    after the wait to send -> the future is not done. ``[twice]``: a second Ctrl-C
    raised as the kill that follows the first returns; the steps after it still run
    (before: they did not; sabotage: ``_tear_down``'s steps one after the other,
    no ``run_every``)."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    pids = [p["pid"] for p in ex.collective_rpc("whoami", timeout=30)]
    marker = str(tmp_path / "in")
    stuck = ex.collective_rpc("stubborn_sleep_marked", args=(marker, 60), non_block=True)
    wait_until(lambda: all(os.path.exists(f"{marker}.{r}") for r in (0, 1)), 30, "both workers in the call")

    holder, release = None, threading.Event()
    if where == "waiting to send":  # a caller holds the send lock (the shutdown waits 1 s, then 5 s)
        holder = threading.Thread(target=lambda: (ex._send_lock.acquire(), release.wait(30),
                                                  ex._send_lock.release()))
        holder.start()
        wait_until(lambda: ex._send_lock._owner == holder.ident, 10, "the send lock held")
    if where == "twice":
        kill = ex._workers.kill

        def kill_then_ctrl_c() -> None:  # once: a Ctrl-C let out of a test ends the session
            ex._workers.kill = kill
            kill()
            raise KeyboardInterrupt

        ex._workers.kill = kill_then_ctrl_c
    try:
        seconds_to_ctrl_c(ex.shutdown, 0.5 if holder else 1.0)  # (the workers: 5 s to end)
    finally:
        release.set()
        if holder is not None:
            holder.join(10)
        ex.shutdown()  # returns at once: the first shutdown ran
    assert stuck.done() and isinstance(stuck.exception(0), zbus.ZbusError)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    rings = [ex._bcast.ring, *(rx.ring for rx in ex._receivers[:2])]
    assert all(_released(r._q) for r in rings), "a ring is still mapped"


def _released(view: memoryview) -> bool:
    try:
        return view.nbytes < 0
    except ValueError:  # "operation forbidden on released memoryview object"
        return True


def test_exception_of_a_future_read_while_the_executor_shuts_down_returns_the_error():
    """A thread reads a non-blocking call's replies in ``exception()`` while another
    shuts the executor down: ``exception()`` returns the ZbusError (as it does
    for a failure, and as the inproc backend does), ``result()`` raises it, at
    once: not after the shutdown's wait for its workers (5 s here, the worker
    sleeping). Before, ``exception()`` raised it: the reader saw its queue aborted
    before the shutdown settled the call. Sabotage: re-raise every error but the
    failure in ``RpcFuture._read_replies`` -> ZbusError raised; leave the call to
    the shutdown to settle -> TimeoutError after 2 s."""
    ex = zbus.Executor(EchoWorker, nproc_per_node=2)
    future = ex.collective_rpc("sleep", args=(30,), non_block=True)
    got: list = []

    def read():
        try:
            got.append(("returned", future.exception(timeout=2)))
        except BaseException as e:  # noqa: BLE001 - the test checks which
            got.append(("raised", e))

    t = threading.Thread(target=read)
    t.start()
    try:
        wait_until(lambda: ex._recv_lock._owner == t.ident, 10, "the reader reading the replies")
    finally:
        ex.shutdown()
        t.join(30)
    assert len(got) == 1 and got[0][0] == "returned" and isinstance(got[0][1], zbus.ZbusError), got
    with pytest.raises(zbus.ZbusError, match="shut down"):
        future.result(0)


def test_a_kill_cut_short_still_removes_the_nodes_named_memory(monkeypatch):
    """A second Ctrl-C or SIGTERM lands while ``LocalWorkers.kill`` waits for its
    SIGKILLed workers to be reaped (a process holding a GPU takes its time to die):
    here its wait raises SystemExit(143), as that signal's handler does. What the
    workers named with the node's prefix (vLLM's CPU all-reduce segments, which no
    sweep knows) is removed all the same. Before, the removal came after the wait
    and was skipped. Sabotage: ``shm.unlink_prefixed`` after the wait in ``kill``,
    not in a ``finally`` -> the name stays."""
    def cut_short(timeout):
        raise SystemExit(143)

    with zbus.Executor(EchoWorker, nproc_per_node=1) as ex:
        workers_ = ex._workers
        name = f"/dev/shm/{workers_._shm_prefix}held"
        open(name, "w").close()
        try:
            with monkeypatch.context() as m:
                m.setattr(workers_, "wait", cut_short)
                with pytest.raises(SystemExit):
                    workers_.kill()
            assert not os.path.exists(name), "the node's name stayed"
        finally:
            if os.path.exists(name):
                os.unlink(name)
