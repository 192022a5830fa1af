"""The one failure state (zbus.failure.Failure) and that the executor and its
leader share it: every error path sees the same error object.

Sabotage for the unit tests: let a later error win (in ``Failure.fail`` drop
``self.error is not None or`` from the first check) -> the first-error and the
concurrent tests fail (two winners, the error changes). For the end-to-end
tests: give the leader a failure of its own (in ``MultiprocExecutor._start``
pass ``None`` instead of ``self.failure`` to ``Leader``) -> a local worker's
death never reaches the leader (its error is None, the node is not told) and a
remote one's never reaches the caller (the call waits out its timeout)."""

from __future__ import annotations

import copy
import pickle
import sys
import threading
import time

import pytest
from conftest import end_process
from test_cluster import follower, leader

import zbus
from zbus.cluster import free_port_pair
from zbus.errors import SendTimeout
from zbus.failure import Failure


@pytest.mark.parametrize("error", [zbus.WorkerDiedError(3, -9, "on node 1 (h1)"),
                                   zbus.NodeLostError(2, "h2", "it left"),
                                   SendTimeout("broadcast timed out", queued=True)],
                         ids=["worker-died", "node-lost", "send-timeout"])
def test_an_error_with_fields_of_its_own_pickles_and_copies_whole(error):
    """The executor's failure is a ``WorkerDiedError`` or a ``NodeLostError``: passed
    to another process (multiprocessing, an engine's client) or copied, it was made
    again from its message alone, and ``__init__`` wanted its rank and exit code:
    TypeError. Sabotage: no ``__reduce__`` on ``WorkerDiedError`` -> TypeError."""
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(again) is type(error) and str(again) == str(error)
        assert vars(again) == vars(error)


def test_the_first_error_wins_and_callbacks_run_once_with_it():
    failure = Failure()
    seen = []
    failure.on_failure(seen.append)
    first, second = zbus.ExecutorFailedError("first"), zbus.ExecutorFailedError("second")
    assert not failure.cancel.is_set()
    assert failure.fail(first) is True
    assert failure.fail(second) is False
    assert failure.error is first and seen == [first]
    assert failure.cancel.is_set()
    with pytest.raises(zbus.ExecutorFailedError, match="first"):
        failure.raise_if_failed()


def test_a_ctrl_c_as_the_failure_is_logged_still_sets_cancel_and_runs_the_callbacks():
    """A Ctrl-C (a logging handler's KeyboardInterrupt, which ``logging`` lets
    through) as the failure is logged: it goes on, but ``cancel`` is set and every
    callback runs first. Before, the error was set and the callbacks taken, then
    nothing: no wait was woken, no ring aborted, vLLM's engine never heard (its
    callback list was gone), and a later ``fail`` is a no-op. Sabotage: the
    logging outside the ``try`` in ``Failure.fail``."""
    import logging

    class Interrupting(logging.Handler):
        def emit(self, record):
            raise KeyboardInterrupt

    failure, got = Failure(), []
    failure.on_failure(got.append)
    handler = Interrupting()
    logger = logging.getLogger("zbus.failure")
    logger.addHandler(handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            failure.fail(ValueError("x"))
    finally:
        logger.removeHandler(handler)
    assert failure.cancel.is_set() and [str(e) for e in got] == ["x"]
    assert type(failure.error) is ValueError


def test_a_callback_registered_after_the_failure_runs_at_once():
    failure = Failure()
    error = zbus.NodeLostError(1, "h")
    failure.fail(error)
    seen = []
    failure.on_failure(seen.append)
    assert seen == [error]


def test_callbacks_run_outside_the_lock_and_a_raising_one_stops_no_other():
    """A callback may call back in (register, fail again) without a deadlock."""
    failure = Failure()
    seen = []

    def reentrant(error):
        assert failure.fail(zbus.ZbusError("again")) is False
        failure.on_failure(lambda e: seen.append(("late", e)))

    def broken(error):
        raise RuntimeError("a callback's bug")

    error = zbus.ZbusError("x")
    for cb in (reentrant, broken, seen.append):
        failure.on_failure(cb)
    failure.fail(error)
    assert seen == [("late", error), error]


@pytest.mark.parametrize("thread_name", ["zbus-worker-monitor", "a-callers-thread"])
def test_a_callbacks_systemexit_stops_no_other_callback(thread_name):
    """A failure callback that calls ``sys.exit`` (a natural "stop the program"
    hook) skipped every callback after it, and ended the thread that watches the
    workers without a word. The rest run first; then a caller's thread gets the
    SystemExit, zbus's own thread logs it and goes on. Sabotage: catch only
    ``Exception`` in ``failure._run`` -> the later callback never runs."""
    failure, seen, out = Failure(), [], []
    failure.on_failure(lambda e: sys.exit(3))
    failure.on_failure(seen.append)
    error = zbus.WorkerDiedError(1, -9)

    def run():
        try:
            out.append(failure.fail(error))
        except SystemExit as e:
            out.append(f"exit {e.code}")

    t = threading.Thread(target=run, name=thread_name)
    t.start()
    t.join(10)
    assert seen == [error] and failure.error is error
    assert out == (["exit 3"] if thread_name == "a-callers-thread" else [True])


def test_nothing_fails_once_closed():
    failure = Failure()
    seen = []
    failure.on_failure(seen.append)
    failure.close()
    assert failure.fail(zbus.WorkerDiedError(0, 0)) is False
    assert failure.error is None and seen == [] and not failure.cancel.is_set()
    failure.cancel_waits()  # a shutdown wakes its callers without failing
    assert failure.cancel.is_set() and failure.error is None


def _race(n: int) -> tuple[Failure, list, list]:
    """``n`` threads released at once, each failing with an error of its own."""
    failure = Failure()
    seen, won = [], []
    failure.on_failure(seen.append)
    start = threading.Barrier(n)

    def fail(error):
        start.wait(10)
        if failure.fail(error):
            won.append(error)

    threads = [threading.Thread(target=fail, args=(zbus.ExecutorFailedError(f"thread {i}"),))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return failure, seen, won


def test_concurrent_failures_have_one_winner():
    for _ in range(20):
        failure, seen, won = _race(8)
        assert len(won) == 1 and failure.error is won[0] and seen == won

@pytest.mark.timeout(180)
@pytest.mark.parametrize("dies", [0, 1], ids=["local_worker", "remote_worker"])
def test_a_worker_death_is_one_error_for_caller_leader_callbacks_and_status(dies):
    """Rank 0 runs beside the leader, rank 1 on a follower (its death comes as the
    agent's report to the leader). Either way the caller, the leader, a callback
    and ``status()`` see the one error object, and the follower is told without
    a shutdown (it exits 0)."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        ex = leader(port, nnodes=2, join_timeout=60)
        try:
            seen = []
            ex.register_failure_callback(lambda: seen.append(ex.failure.error))
            fut = ex.collective_rpc("die", kwargs={"rank": dies}, non_block=True)
            with pytest.raises(zbus.WorkerDiedError) as info:
                fut.result(timeout=30)
            error = info.value
            assert error.rank == dies and ("on node 1" in str(error)) == (dies == 1)
            assert ex.failure.error is error and ex._leader.failure.error is error
            with pytest.raises(zbus.WorkerDiedError) as later:
                ex.collective_rpc("noop", timeout=5)
            assert later.value is error
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen == [error]
            assert ex.status()["failed"] == str(error)
            assert proc.wait(30) == 0  # told "failed" by the leader: no shutdown yet
        finally:
            ex.shutdown()
    finally:
        end_process(proc)

