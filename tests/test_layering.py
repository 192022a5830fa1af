"""Which module may import which: a follower's agent runs no driver.

Sabotage: import ``LocalWorkers`` from ``zbus.executor`` in ``zbus/agent.py``
again (or make ``zbus/__init__.py`` import the executor eagerly) -> fails."""

from __future__ import annotations

import subprocess
import sys

from conftest import TEST_PATH


def test_the_node_agent_does_not_import_the_driver():
    check = ("import sys, zbus.agent, zbus.cli, zbus.worker\n"
             "assert 'zbus.executor' not in sys.modules, sorted(m for m in sys.modules if 'zbus' in m)\n"
             "import zbus\n"
             "assert zbus.Executor.__module__ == 'zbus.executor'\n")
    out = subprocess.run([sys.executable, "-c", check], env={"PYTHONPATH": TEST_PATH},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
