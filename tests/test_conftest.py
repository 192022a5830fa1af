"""The session guard itself: it must not fail on a child that exits while it looks,
nor count another run's segments, and must count a leak."""

from __future__ import annotations

import os

import psutil
from conftest import describe, foreign_segments, live_children, spawn_python


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
