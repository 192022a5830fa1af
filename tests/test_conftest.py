"""The session guard itself must not fail on a child that exits while it looks."""

from __future__ import annotations

import psutil
from conftest import describe, live_children, spawn_python


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
