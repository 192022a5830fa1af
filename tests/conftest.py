"""Session guards: the suite must leave no zbus shared-memory segment, no child
process and no socket file behind. Tests import worker classes from ``tests/workers.py``."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

SHM = "/dev/shm"
# This checkout and tests/ (worker classes live in tests/workers.py).
TEST_PATH = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             os.path.dirname(os.path.abspath(__file__))])


def zbus_segments() -> set[str]:
    """zbus's segments, and those vLLM's CPU all-reduce names after zbus's rendezvous,
    but not those of another live run on the machine (:func:`foreign_segments`): a
    test's ``zbus_segments() - before`` counts what this run made."""
    names = {n for n in os.listdir(SHM) if n.startswith("zbus-") or "?zbus_node=" in n}
    return names - foreign_segments(names)


def shm_used() -> int:
    """Bytes /dev/shm holds, named or not: a segment whose name is gone holds its
    memory until its last mapping goes (zbus reserves a segment's size at once)."""
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


# Every process this run starts inherits this mark in its environment, so the guard
# also finds one that outlived its parent and was reparented to init, out of reach
# of ``children()`` (a double fork, or an engine left behind by a client that died).
RUN_MARK = f"ZBUS_TEST_RUN={os.getpid()}-{time.time_ns()}"
os.environ["ZBUS_TEST_RUN"] = RUN_MARK.partition("=")[2]


def marked_processes() -> list[psutil.Process]:
    """Processes other than this one started with this run's mark, wherever they
    are in the process tree (a zombie's environment reads empty: not counted)."""
    mark = RUN_MARK.encode() + b"\0"
    out = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read():
                    out.append(psutil.Process(pid))
        except (OSError, psutil.Error):  # gone meanwhile, or not ours to read
            pass
    return out


def leftover_processes() -> list[psutil.Process]:
    """This process's live descendants and any other process of this run."""
    seen = {p.pid: p for p in live_children(psutil.Process())}
    for p in marked_processes():
        seen.setdefault(p.pid, p)
    return list(seen.values())


def live_children(proc: psutil.Process) -> list[psutil.Process]:
    """``proc``'s descendants still running. One that exits while it is looked at
    is simply gone (psutil raises NoSuchProcess, or ZombieProcess, a subclass)."""
    alive = []
    for c in proc.children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                alive.append(c)
        except psutil.NoSuchProcess:
            pass
    return alive


def describe(procs: list[psutil.Process]) -> list:
    """Command lines for an error message; a process gone meanwhile says so."""
    out = []
    for c in procs:
        try:
            out.append(c.cmdline())
        except psutil.Error:
            out.append(f"pid {c.pid} (exited)")
    return out


def foreign_segments(names: set[str]) -> set[str]:
    """Those of ``names`` whose creator (``zbus-<pidns>-<pid>-...``) is alive and is
    neither this process, one of its descendants nor one of this run's (an
    orphan, :func:`marked_processes`): another run's, on a shared
    machine. A segment a test leaked has a creator that is dead (counted) or a
    child still running (the guard's child check names it)."""
    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True)),
            *(p.pid for p in marked_processes())}
    out = set()
    for n in names:
        parts = n.split("-")
        if n.startswith("zbus-") and len(parts) > 3 and parts[2].isdigit():
            pid = int(parts[2])
            if pid not in mine and psutil.pid_exists(pid):
                out.add(n)
    return out


def socket_files() -> set[str]:
    """The socket files in the temp folder: ZeroMQ's ``ipc://`` endpoints, which
    closing a socket does not always remove (vLLM binds its engine's there)."""
    folder, out = tempfile.gettempdir(), set()
    for name in os.listdir(folder):
        try:
            if stat.S_ISSOCK(os.lstat(os.path.join(folder, name)).st_mode):
                out.add(name)
        except OSError:  # gone meanwhile
            pass
    return out


def own_segments(names: set[str]) -> set[str]:
    """Those of ``names`` that this process created (``zbus-<pidns>-<pid>-...``)."""
    return {n for n in names if n.startswith("zbus-") and n.split("-")[2] == str(os.getpid())}


# A mutation run (mutmut sets MUTANT_UNDER_TEST; see docs/mutation.md) shares
# /dev/shm with whatever else runs on the machine: there, only the segments of the
# process that runs the tests count.
MUTATION_RUN = "MUTANT_UNDER_TEST" in os.environ
if MUTATION_RUN:
    # The same examples for every mutant, and a failing one reported as found: no
    # shrinking (minutes with mutmut's call hooks), no deadline or health check that a
    # loaded machine could fail in place of the mutant.
    from hypothesis import HealthCheck, Phase, settings

    settings.register_profile("mutation", derandomize=True, deadline=None, database=None,
                              phases=[Phase.explicit, Phase.generate],
                              suppress_health_check=list(HealthCheck))
    settings.load_profile("mutation")


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    before, sockets = zbus_segments(), socket_files()
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = leftover_processes()
        left = zbus_segments() - before
        if MUTATION_RUN:
            left = own_segments(left)
        if not children and not left:
            break
        time.sleep(0.1)
    what = describe(children)
    for c in children:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    assert not children, f"the tests left child processes: {what}"
    assert not left, f"the tests left shared-memory segments: {sorted(left)}"
    files = socket_files() - sockets
    assert not files, f"the tests left socket files in {tempfile.gettempdir()}: {sorted(files)[:10]}"


LEFT_FOR_THE_SWEEP_S = 5.0  # how long a test's ended processes' names get to go
PROCESS_END_S = 10.0  # how long the processes a test started get to end once it returned


@pytest.fixture(autouse=True)
def no_process_left_by_the_test():
    """After each test, no process it started is left (a module's fixtures, set up
    before, keep theirs). The session's check at its end missed a process that a
    test forgot and that ended by itself before then (a reader that leaves when
    idle for a minute, a follower at its liveness limit). Sabotage: no kill loop
    in the ``peer`` fixture of tests/test_queues.py -> its test fails here."""
    before = {p.pid for p in leftover_processes()}
    yield
    deadline = time.monotonic() + PROCESS_END_S
    while True:
        left = [p for p in leftover_processes() if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    what = describe(left)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert not left, f"the test left processes running {PROCESS_END_S:.0f} s after it returned: {what}"


@pytest.fixture(autouse=True)
def no_segment_left_for_the_sweep():
    """After each test, no zbus segment whose creator has ended may be left. The
    next executor's or node's start removes such segments (``shm.sweep_stale``), so
    the session's own check, at its end, would not see a leak of any test but the
    last: it is caught here, by the test that made it. Sabotage: no ``shm.unlink``
    in ``NodeAgent._close`` and ``self.ring.close(unlink=False)`` there -> a
    follower whose worker fails to start leaves its ring's name, and its test fails
    here (the session's check passed: the next test's start swept the name)."""
    from zbus import shm

    before = zbus_segments()
    yield
    if MUTATION_RUN:
        return
    deadline = time.monotonic() + LEFT_FOR_THE_SWEEP_S
    while True:
        left = {n for n in zbus_segments() - before if n.startswith("zbus-") and not shm.owner_alive(n)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"the test left shared memory of processes that ended: {sorted(left)}"


def wait_until(condition, timeout: float, what: str, interval: float = 0.01):
    """Poll ``condition()`` until it returns something true, and return that; fail
    the test saying what never happened once ``timeout`` s have passed. Tests wait
    with this for what another thread or process does, never by a plain sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)


def spawn_python(code: str, *args: str, **kwargs) -> psutil.Popen:
    """Start ``python -c code args`` with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=TEST_PATH)
    env.update(kwargs.pop("env", {}))
    return psutil.Popen([sys.executable, "-c", code, *args], env=env, **kwargs)


def seconds_to_ctrl_c(action, after: float = 0.2) -> float:
    """Run ``action()`` with Ctrl-C ``after`` seconds in (a kernel timer's SIGALRM,
    which lands wherever this process is, GIL held or not, and whose handler raises
    KeyboardInterrupt in the main thread): how long it took to end with it. Fails
    the test if it ended without it."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    with borrowed_alarm(interrupt):
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, after)
        try:
            action()
        except KeyboardInterrupt:
            return time.monotonic() - start
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    raise AssertionError("it ended without the Ctrl-C")


@contextlib.contextmanager
def borrowed_alarm(handler):
    """SIGALRM handled by ``handler`` within, its timer free to set; then the
    previous handler and what was left of the previous timer back. pytest-timeout
    times each test with this timer: a helper that set it to 0 and left would take
    the test's timeout away for the rest of it."""
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:  # (an overdue timer fires at once, as it would have)
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, left - (time.monotonic() - start)))


def next_line(proc: subprocess.Popen, deadline: float) -> str:
    """The next line of ``proc``'s stdout (a pipe), "" at its end; AssertionError
    once ``deadline`` (``time.monotonic()``) has passed. A thread reads the pipe,
    so a process that goes silent cannot hold the test past the deadline."""
    lines = getattr(proc, "_test_lines", None)
    if lines is None:
        lines = proc._test_lines = queue.SimpleQueue()

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put("")  # the end
        threading.Thread(target=read, name=f"lines of {proc.pid}", daemon=True).start()
    try:
        return lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise AssertionError(f"no line from process {proc.pid} in time") from None


def no_thread_to_be_had(monkeypatch, name: str, times: int = 10**6) -> list:
    """Starts of threads named ``name`` fail, as at a pids limit, ``times`` times;
    the list of those refused."""
    refused: list = []

    class NoThreadToBeHad(threading.Thread):
        def start(self) -> None:
            if self.name == name and len(refused) < times:
                refused.append(self)
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(threading, "Thread", NoThreadToBeHad)
    return refused


def end_process(proc: psutil.Popen, timeout: float = 10) -> None:
    """End a process the test started, by pid: wait, then kill."""
    try:
        proc.wait(timeout)
    except (psutil.TimeoutExpired, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(5)
