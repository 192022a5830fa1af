"""A leader for tests/test_fuzz.py, in a process of its own so that its memory
and its survival can be measured from outside: ``python fuzz_leader.py PORT``
(``ZBUS_SECRET`` set for a keyed cluster) leads a 2-node cluster of
``workers.EchoWorker``, then answers one JSON command a line on stdin with one
JSON line on stdout:

- ``{"op": "stats"}``: dropped messages, whether the I/O thread lives, node 1's
  heartbeats, this process's peak RSS (``ru_maxrss``) and the executor's failure;
- ``{"op": "wait_dropped", "n": N}``: the same, once N messages were dropped (or
  after 5 s);
- ``{"op": "call", "x": X}``: ``rank_value(X)`` on every rank;
- ``{"op": "quit"}``: shut down and exit 0."""

from __future__ import annotations

import gc
import json
import resource
import sys
import time

import numpy as np
import psutil
import torch
import workers

import zbus
from zbus import codec


def stats(ex: zbus.Executor) -> dict:
    lead = ex._leader
    return {"dropped": lead.dropped, "io_alive": lead.membership._thread.is_alive(),
            "session": lead.path.session,
            "heartbeats": lead.metrics.heartbeats.get(1, 0),
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss": psutil.Process().memory_info().rss,
            "failure": None if lead.failure.error is None else repr(lead.failure.error)}


def main() -> None:
    port = int(sys.argv[1])
    # what a hostile peer can make the leader import once (torch, numpy) is loaded
    # first, so the peak measured below is what messages cost
    codec.decode(codec.encode([torch.ones(2), np.ones(2), (b"x" * 20000,)]))
    with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                       master_port=port, liveness_s=2.0, join_timeout=60) as ex:
        assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
        gc.collect()
        print(json.dumps({"ready": stats(ex)}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "call":
                result = ex.collective_rpc("rank_value", args=(cmd["x"],), timeout=30)
                print(json.dumps({"result": result, **stats(ex)}), flush=True)
                continue
            if cmd["op"] == "wait_dropped":
                deadline = time.monotonic() + 5
                while ex._leader.dropped < cmd["n"] and time.monotonic() < deadline:
                    time.sleep(0.002)
            print(json.dumps(stats(ex)), flush=True)


if __name__ == "__main__":
    main()
