"""The command line: every subcommand's help is complete and names its settings."""

from __future__ import annotations

import subprocess
import sys

import pytest

HELP = {
    None: ["demo", "follower", "keygen", "status", "bench", "--log-level"],
    "demo": ["--nnodes", "--nproc-per-node", "--master-addr", "--master-port", "--steps", "--metrics-port",
             "ZBUS_MASTER_ADDR", "--secret-file", "--insecure", "ZBUS_INSECURE"],
    "follower": ["--master-addr", "--master-port", "--nproc-per-node", "--node-rank", "--advertise-addr",
                 "--join-timeout", "--allow-import-calls", "--allow-worker", "--curve-dir",
                 "--secret-file", "ZBUS_SECRET", "LWS_LEADER_ADDRESS", "ZBUS_NODE_RANK", "ZBUS_JOIN_TIMEOUT"],
    "keygen": ["--nodes", "DIR/leader"],
    "status": ["--master-addr", "--master-port", "--json", "--timeout", "--curve-dir", "--secret-file"],
    "bench": ["--seconds", "--json", "--plot", "--from-json", "ring, rpc, payload"],
}


@pytest.mark.parametrize("command", list(HELP))
def test_help_is_complete(command):
    argv = [sys.executable, "-m", "zbus.cli", *([command] if command else []), "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    missing = [word for word in HELP[command] if word not in text]
    assert not missing, missing


def test_keygen_makes_the_folders(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zbus.cli", "keygen", str(tmp_path / "k"), "--nodes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == [str(tmp_path / "k" / n)
                                                         for n in ("leader", "node-1", "node-2")]
