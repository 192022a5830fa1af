"""Session guards: the suite must leave no zbus shared-memory segment and no child
process behind. Tests import worker classes from ``tests/workers.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

SHM = "/dev/shm"
# This checkout and tests/ (worker classes live in tests/workers.py).
TEST_PATH = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             os.path.dirname(os.path.abspath(__file__))])


def zbus_segments() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("zbus-")}


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    before = zbus_segments()
    yield
    me = psutil.Process()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = [c for c in me.children(recursive=True) if c.is_running()
                    and c.status() != psutil.STATUS_ZOMBIE]
        left = zbus_segments() - before
        if not children and not left:
            return
        time.sleep(0.1)
    for c in children:
        c.kill()
    assert not children, f"the tests left child processes: {[c.cmdline() for c in children]}"
    assert not left, f"the tests left shared-memory segments: {sorted(left)}"


def spawn_python(code: str, *args: str, **kwargs) -> psutil.Popen:
    """Start ``python -c code args`` with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=TEST_PATH)
    env.update(kwargs.pop("env", {}))
    return psutil.Popen([sys.executable, "-c", code, *args], env=env, **kwargs)


def end_process(proc: psutil.Popen, timeout: float = 10) -> None:
    """End a process the test started, by pid: wait, then kill."""
    try:
        proc.wait(timeout)
    except (psutil.TimeoutExpired, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(5)
