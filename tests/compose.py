"""The compose file, read as the test clusters use it: each service's command and
environment, so the namespace clusters run exactly what compose would."""

from __future__ import annotations

import os
import sys

from ruamel.yaml import YAML

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPOSE = os.path.join(REPO, "docker-compose.yml")


def load() -> dict:
    with open(COMPOSE) as f:
        return YAML(typ="safe").load(f)


def service(name: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a compose service, runnable from this checkout."""
    svc = load()["services"][name]
    argv = [os.path.join(REPO, a) if a.startswith("nodes/") else a for a in svc["command"]]
    env = {k: str(v) for k, v in svc.get("environment", {}).items()}
    # `zbus` is the console script next to this interpreter, as in the image.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return argv, env
