"""The soak, short: 3000 calls of 0 B to 32 MiB across 3 nodes (the full one is
``python tests/soak.py --calls 1000000``, see docs/reliability.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TEST_PATH


@pytest.mark.timeout(300)
def test_soak_nothing_lost_duplicated_reordered_and_memory_flat():
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "soak.py"),
                          "--calls", "3000"], capture_output=True, text=True, timeout=280,
                         env=dict(os.environ, PYTHONPATH=TEST_PATH))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"soak: {r}")
    assert (r["lost"], r["duplicated"], r["reordered"], r["corrupted"]) == (0, 0, 0, 0)
    assert r["rss_growth"] < 0.10, r
    assert r["follower_exit_codes"] == [0, 0]
