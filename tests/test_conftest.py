"""The session guard itself: it must not fail on a child that exits while it looks,
nor count another run's segments, and must count a leak."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import (
    describe,
    foreign_segments,
    leftover_processes,
    live_children,
    marked_processes,
    seconds_to_ctrl_c,
    spawn_python,
    wait_until,
)


def test_leftover_check_tolerates_children_that_exit_meanwhile():
    """Sabotage: call ``c.status()`` / ``c.cmdline()`` unguarded (as the guard did):
    the exited child raises psutil.NoSuchProcess."""
    proc = spawn_python("pass")
    try:
        assert proc.wait(30) == 0  # exited and reaped: every query of it now raises
        assert describe([proc]) == [f"pid {proc.pid} (exited)"]
        assert proc not in live_children(psutil.Process())
    finally:
        if proc.is_running():
            proc.kill()


ORPHAN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
os._exit(0)  # leave the sleeper to init, as a crashed parent would
"""


def environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def test_an_orphan_of_this_run_is_a_leftover_and_its_segments_are_ours():
    """A process whose parent exited is reparented to init, out of ``children()``'s
    sight: the guard finds it by this run's mark in its environment. Sabotage:
    ``leftover_processes`` returns only ``live_children`` (the orphan is missed),
    or ``marked_processes`` looks for ``ZBUS_TEST_RUN=`` alone (another run's
    process is counted)."""
    parent = spawn_python(ORPHAN, stdout=subprocess.PIPE, text=True)
    orphan = None
    try:
        orphan = psutil.Process(int(parent.stdout.readline()))
        assert parent.wait(30) == 0
        wait_until(lambda: orphan.ppid() != parent.pid, 10, "the orphan reparented")
        assert orphan.pid not in {c.pid for c in live_children(psutil.Process())}
        assert orphan.pid in {p.pid for p in leftover_processes()}
        assert foreign_segments({f"zbus-1-{orphan.pid}-1-0"}) == set()
    finally:
        parent.stdout.close()
        if orphan is not None:
            orphan.kill()
            orphan.wait(10)
    other_run = psutil.Popen(["sleep", "30"], env=dict(os.environ, ZBUS_TEST_RUN="another-run"))
    try:  # a process of another run on the machine is not this run's
        wait_until(lambda: environ(other_run.pid), 10, "sleep's environment set up by exec")
        assert other_run.pid not in {p.pid for p in marked_processes()}
    finally:
        other_run.kill()
        other_run.wait(10)


def test_segments_of_another_live_run_are_not_counted_but_leaks_are():
    """Another test run on the machine (a live process outside this one's tree)
    owns its segments; a segment whose creator is dead, or is this process or a
    child of it, was left by these tests. Sabotage: ``foreign_segments`` returns
    every name (leaks go unseen: the dead creator's name is dropped), or none (the
    other run's name is counted)."""
    other = psutil.Popen(["sleep", "30"], start_new_session=True)  # stands for another run
    child = spawn_python("pass")
    try:
        assert child.wait(30) == 0
        dead = child.pid  # exited and reaped: a leak of a finished test process
        names = {f"zbus-1-{other.pid}-1-0", f"zbus-1-{dead}-1-0", f"zbus-1-{os.getpid()}-1-0",
                 f"{4242}?zbus_node=0-x"}
        assert foreign_segments(names) == set()  # `other` is our child: still ours
        other_parent = psutil.Process(other.pid).ppid()
        assert other_parent == os.getpid()
    finally:
        other.kill()
        other.wait(10)
    outsider = psutil.Process(1).pid  # alive, and no descendant of this process
    names = {f"zbus-1-{outsider}-1-0", f"zbus-1-{dead}-1-0", f"zbus-1-{os.getpid()}-1-0"}
    assert foreign_segments(names) == {f"zbus-1-{outsider}-1-0"}


@pytest.mark.timeout(60)
def test_a_ctrl_c_helper_gives_the_test_its_timeout_back():
    """``seconds_to_ctrl_c`` (and the ring's ``Interrupts``) borrow the SIGALRM
    timer that pytest-timeout times the test with. Sabotage: end the borrowing with
    ``setitimer(ITIMER_REAL, 0)`` alone, as before: no timer is left, and a test
    that hung after its Ctrl-C ran until CI's own limit."""
    before = signal.getitimer(signal.ITIMER_REAL)[0]
    handler = signal.getsignal(signal.SIGALRM)
    assert 0 < before <= 60
    seconds_to_ctrl_c(lambda: time.sleep(5), 0.05)
    assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] < before
    assert signal.getsignal(signal.SIGALRM) is handler
