"""The docker-compose test cluster, checked statically (no Docker engine here;
tests/test_multinode.py runs the same commands in network namespaces)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from compose import COMPOSE, REPO, load


def test_compose_file_is_valid_under_the_compose_specification():
    tool = shutil.which("check-jsonschema", path=os.path.dirname(sys.executable)) or shutil.which(
        "check-jsonschema")
    assert tool, "check-jsonschema is a test dependency"
    r = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", COMPOSE],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_topology_leader_and_two_followers_with_private_shm():
    services = load()["services"]
    assert set(services) == {"leader", "node1", "node2"}
    for name, svc in services.items():
        assert svc["build"]["dockerfile"] == "nodes/Dockerfile"
        assert svc["shm_size"] and svc.get("ipc") not in ("host", "shareable")
        assert svc["healthcheck"]["test"][1] == "nodes/healthy.sh"
        assert svc["hostname"] == name
        env = svc["environment"]
        assert env["ZBUS_MASTER_ADDR"] == "leader" and env["ZBUS_NNODES"] == "3"
    assert services["leader"]["command"] == ["nodes/leader.sh"]
    assert [services[n]["environment"]["ZBUS_NODE_RANK"] for n in ("node1", "node2")] == ["1", "2"]
    for n in ("node1", "node2"):
        assert services[n]["command"] == ["nodes/follower.sh"]


def test_entrypoints_exist_and_run_the_roles():
    for script, role in (("leader.sh", "zbus demo --nnodes"), ("follower.sh", "zbus follower"),
                         ("healthy.sh", "ZBUS_HEALTH_FILE")):
        path = os.path.join(REPO, "nodes", script)
        assert os.access(path, os.X_OK), path
        assert role in open(path).read()
    dockerfile = open(os.path.join(REPO, "nodes", "Dockerfile")).read()
    assert "torch==2.13.0" in dockerfile and "download.pytorch.org/whl/cpu" in dockerfile
    assert "ZBUS_HEALTH_FILE" in dockerfile


def test_the_image_builds_zbus_with_its_compiled_core():
    """What ``pip`` needs to build zbus's wheel with its core is copied into a stage
    that has a compiler. Sabotage: setup.py left out of the COPY (the wheel would
    build without the core, which is optional) → fails."""
    dockerfile = open(os.path.join(REPO, "nodes", "Dockerfile")).read()
    build = dockerfile.split("FROM ")[1]  # the first stage: it builds the wheel
    copied = {src for line in build.splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]}
    assert {"pyproject.toml", "setup.py", "README.md", "zbus"} <= copied, copied
    assert "gcc" in build and "pip wheel" in build
    assert "COPY --from=build /wheels" in dockerfile
