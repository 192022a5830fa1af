"""Which module may import which: a follower's agent runs no driver.

Sabotage: import ``LocalWorkers`` from ``zbus.executor`` in ``zbus/agent.py``
again (or make ``zbus/__init__.py`` import the executor eagerly) -> fails."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

from conftest import TEST_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_node_agent_does_not_import_the_driver():
    check = ("import sys, zbus.agent, zbus.cli, zbus.worker\n"
             "assert 'zbus.executor' not in sys.modules, sorted(m for m in sys.modules if 'zbus' in m)\n"
             "import zbus\n"
             "assert zbus.Executor.__module__ == 'zbus.executor'\n")
    out = subprocess.run([sys.executable, "-c", check], env={"PYTHONPATH": TEST_PATH},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_every_package_of_the_source_tree_goes_into_the_wheel():
    """``pip install .`` (a wheel, the nodes' image) installs the packages that
    pyproject.toml lists: a package left out is missing where zbus is installed
    other than in place. ``zbus.vllm`` was: ``distributed_executor_backend=
    "zbus.vllm.ZbusExecutor"`` failed with ModuleNotFoundError. Sabotage:
    ``packages = ["zbus"]`` again."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # ([tool.setuptools]'s list)
        listed = ast.literal_eval(re.search(r"^packages = (\[.*?\])", f.read(), re.M).group(1))
    found = sorted(os.path.relpath(d, ROOT).replace(os.sep, ".")
                   for d, _, files in os.walk(os.path.join(ROOT, "zbus")) if "__init__.py" in files)
    assert sorted(listed) == found == ["zbus", "zbus.vllm"]
