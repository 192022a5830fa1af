"""Forming a cluster on loopback: joins, start-up faults, late followers.

Followers are real ``zbus follower`` processes (or, for a wrong protocol version,
a raw ZeroMQ client speaking the join protocol); every fault must give a clear
error naming the node, never a hang."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib

import psutil
import pytest
import workers
import zmq
from conftest import (
    TEST_PATH,
    end_process,
    next_line,
    no_thread_to_be_had,
    shm_used,
    spawn_python,
    wait_until,
    zbus_segments,
)

import zbus
from zbus import codec, protocol, shm
from zbus.cluster import TOPIC_HEARTBEAT, TOPIC_RPC, free_port_pair, node_topic
from zbus.config import RingGeometry
from zbus.processes import node_shm_prefix
from zbus.shm import unlink_prefixed


def follower(port: int, *args: str, nproc: int = 1, env: dict | None = None,
             first: str = "") -> subprocess.Popen:
    """``zbus follower`` for the leader on ``port``; ``first``: Python run before it
    (a setting of the agent's made smaller for a test)."""
    import os

    env = dict(os.environ, PYTHONPATH=TEST_PATH, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE=str(nproc), ZBUS_ALLOW_WORKERS="workers", **(env or {}))
    run = ["-c", f"{first}\nimport sys\nfrom zbus.cli import main\nsys.exit(main(sys.argv[1:]))"] if first \
        else ["-m", "zbus.cli"]
    return subprocess.Popen([sys.executable, *run, "follower", "--join-timeout", "60", *args],
                            env=env, stderr=subprocess.PIPE, text=True)


class Lines:
    """What a process writes to a pipe, read by a thread as it comes, so a test can
    wait for a line without blocking on the pipe."""

    def __init__(self, stream):
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def has(self, needle: str) -> bool:
        return any(needle in line for line in list(self.lines))


def leader(port: int, worker=workers.EchoWorker, nnodes: int = 3, liveness_s: float = 2.0,
           **kw) -> zbus.Executor:
    return zbus.Executor(worker, nnodes=nnodes, nproc_per_node=1, master_addr="127.0.0.1",
                         master_port=port, liveness_s=liveness_s, **kw)


def test_follower_started_early_waits_and_one_that_joined_early_is_kept_alive():
    """Node 1 starts before the leader and waits; it joins, and node 2 joins more
    than twice the 2 s liveness limit later (measured by the leader's on_join
    calls); node 1 is still there, its READY kept: the call answers on every rank.
    The leader starts only once node 1 has said it waits for it (its second join
    try, 2 s after the first). Sabotage: start the late follower at once (drop the
    time.sleep(5.0)): the join gap assertion fails. Or make ``NodeAgent._join``
    log nothing while it waits: the wait for "waiting for the leader" fails."""
    port = free_port_pair()
    early = follower(port, "--node-rank", "1")
    early_log = Lines(early.stderr)
    late = None
    try:
        wait_until(lambda: early_log.has("waiting for the leader"), 30,
                   "node 1 waiting for a leader that is not there yet")
        result = {}
        joined = {}  # nodes joined (the leader counts as one) -> when first seen
        node_1_in = threading.Event()

        def on_join(n, total):
            joined.setdefault(n, time.monotonic())
            if n >= 2:
                node_1_in.set()

        def lead():
            with leader(port, join_timeout=60, on_join=on_join) as ex:
                result["values"] = ex.collective_rpc("rank_value", args=(1,), timeout=30)

        t = threading.Thread(target=lead)
        t.start()
        assert node_1_in.wait(60)
        time.sleep(5.0)  # the gap under test: more than twice the 2 s liveness limit after node 1's join
        late = follower(port, "--node-rank", "2")
        t.join(90)
        assert result["values"] == [10, 11, 12]
        assert 2 in joined and 3 in joined, joined  # node 1 joined alone first
        assert joined[3] - joined[2] > 2 * 2.0, joined
        assert early.wait(30) == 0 and late.wait(30) == 0
    finally:
        for p in (early, late):
            if p is not None:
                end_process(p)


def test_a_slow_on_join_holds_up_no_join_nor_heartbeat():
    """``on_join`` runs without the lock the I/O thread admits nodes and files
    replies under: told node 1 joined, it starts node 2 and takes 4 s (twice the
    liveness limit), and node 2 is admitted meanwhile while node 1 keeps hearing
    heartbeats. Before, it ran holding that lock: node 2's subscription stopped the
    I/O thread, node 1 heard no heartbeat for 4 s and left ("leader lost"), and
    start-up failed. Sabotage: call ``on_join`` inside ``with self.cond`` again."""
    port = free_port_pair()
    procs = [follower(port, "--node-rank", "1")]

    def on_join(n, total):
        if n == 2 and len(procs) == 1:
            procs.append(follower(port, "--node-rank", "2"))
            time.sleep(4.0)  # a slow callback (the behaviour under test), not a wait for something

    try:
        with leader(port, join_timeout=60, on_join=on_join) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11, 12]
        assert [p.wait(30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            end_process(p)


@pytest.mark.parametrize("fault,needle", [
    ("duplicate_rank", "already taken"),
    ("world_size", "every node needs 1"),
], ids=["duplicate_rank", "world_size"])
def test_start_up_faults_name_the_node_and_do_not_hang(fault, needle):
    port = free_port_pair()
    procs = []
    try:
        if fault == "duplicate_rank":
            procs = [follower(port, "--node-rank", "1"), follower(port, "--node-rank", "1")]
        else:
            procs = [follower(port, "--node-rank", "1", nproc=2)]
        t0 = time.monotonic()
        with pytest.raises(zbus.StartupError, match=needle) as info:
            leader(port, join_timeout=60)
        assert time.monotonic() - t0 < 30
        assert socket.gethostname() in str(info.value)
        refused = [p for p in procs if p.wait(30) == 1]
        assert refused and "refused this node" in refused[0].stderr.read()
    finally:
        for p in procs:
            end_process(p)


def test_wrong_protocol_version_is_refused_by_name():
    port = free_port_pair()
    ctx = zmq.Context()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    node_id = "f" * 16
    for topic in (TOPIC_RPC, TOPIC_HEARTBEAT, node_topic(node_id)):
        sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(f"tcp://127.0.0.1:{port}")
    push.connect(f"tcp://127.0.0.1:{port + 1}")
    info = {"version": 99, "nproc": 1, "host": "old-node", "address": "127.0.0.1", "node_rank": 1, "pid": 1}
    stop = threading.Event()

    def keep_joining():
        while not stop.is_set():
            push.send_multipart(codec.encode(["join", node_id, info]))
            stop.wait(0.3)

    t = threading.Thread(target=keep_joining)
    t.start()
    try:
        with pytest.raises(zbus.StartupError, match="old-node speaks protocol 99"):
            leader(port, nnodes=2, join_timeout=30)
        got = None
        while sub.poll(2000):
            topic, *frames = sub.recv_multipart()
            if topic == node_topic(node_id):
                got = codec.decode(frames)
                break
        assert got is not None and got[0] == "reject" and "protocol 99" in got[1]
    finally:
        stop.set()
        t.join(5)
        ctx.destroy(linger=0)


def test_a_worker_that_fails_to_start_on_a_follower_tells_the_driver_why():
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        # The leader's own worker starts, so the follower surely joins before the failure.
        with pytest.raises(zbus.StartupError, match=r"(?s)rank 1 failed to start.*zbus_module_that_does"):
            leader(port, worker=workers.FollowerLacksAModuleWorker, nnodes=2, join_timeout=60)
        assert proc.wait(30) == 0  # the leader said bye
    finally:
        end_process(proc)


def test_a_follower_that_cannot_start_its_workers_tells_the_driver_why_at_once():
    """A follower whose start fails after the leader's welcome (a bad ``ZBUS_RING``
    here; /dev/shm full or a refused pidfd alike) tells the leader why, and the
    start fails at once naming the node and the reason. Sabotage: tell the leader
    only once the node is a member (``leaving``, as before): the driver waits out
    its ``join_timeout`` and learns only that rank 1 is missing."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1", env={"ZBUS_RING": "bogus"})
    try:
        started = time.monotonic()
        why = r"node 1 .*refused to start the workers: .*ZBUS_RING='bogus'"
        with pytest.raises(zbus.StartupError, match=why):
            leader(port, nnodes=2, join_timeout=60)
        assert time.monotonic() - started < 30  # (not the join_timeout)
        assert proc.wait(30) == 1
    finally:
        end_process(proc)


def test_a_remote_workers_start_up_error_is_told_while_the_cluster_still_forms():
    """Node 1's worker fails to start while node 2 has not joined: the start fails
    at once with that worker's own traceback. Sabotage: read only the local ranks'
    reports in ``_startup_failure`` (as before: the nodes' ranks were added once
    every node had joined) -> "a worker died during start-up", no traceback."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with pytest.raises(zbus.StartupError, match=r"(?s)rank 1 failed to start.*zbus_module_that_does"):
            leader(port, worker=workers.FollowerLacksAModuleWorker, nnodes=3, join_timeout=60)
        proc.wait(30)
    finally:
        end_process(proc)


def test_a_leader_on_an_ipv6_address_is_joined_and_answers_status():
    """Sabotage: no ``IPV6`` option on the agent's sockets (as before): ZeroMQ
    retries the v6 address for ever, the node never joins."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no ::1 here")
    from zbus.cluster import query_status

    port = free_port_pair()
    proc = follower(port, "--node-rank", "1", "--master-addr", "::1")
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="::1",
                           master_port=port, join_timeout=30) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
            assert query_status("::1", port, timeout=10)["world_size"] == 2
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_join_timeout_names_the_missing_node_ranks():
    port = free_port_pair()
    proc = follower(port, "--node-rank", "2")
    try:
        with pytest.raises(zbus.StartupError, match=r"missing node ranks: \[1\]"):
            leader(port, join_timeout=3)
    finally:
        end_process(proc)


def test_output_rank_may_be_any_rank_of_the_cluster():
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with leader(port, nnodes=2, output_rank=1, join_timeout=60) as ex:
            assert ex.output_rank == 1
            assert ex.collective_rpc("rank_value", args=(2,), unique_reply_rank=ex.output_rank) == 21
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_settings_come_from_zbus_then_leaderworkerset_variables(monkeypatch):
    from zbus.cluster import ClusterSettings

    for name in ("ZBUS_NNODES", "ZBUS_NPROC_PER_NODE", "ZBUS_MASTER_ADDR", "ZBUS_MASTER_PORT",
                 "ZBUS_LIVENESS_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "lws-leader.ns.svc")
    monkeypatch.setenv("LWS_GROUP_SIZE", "4")
    s = ClusterSettings.resolve()
    assert (s.nnodes, s.master_addr, s.master_port, s.liveness_s) == (4, "lws-leader.ns.svc", 29650, 10.0)
    monkeypatch.setenv("ZBUS_NNODES", "2")
    monkeypatch.setenv("ZBUS_MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("ZBUS_NPROC_PER_NODE", "8")
    s = ClusterSettings.resolve()
    assert (s.nnodes, s.master_addr, s.nproc_per_node) == (2, "10.1.2.3", 8)
    assert ClusterSettings.resolve(nnodes=3, master_addr="h").nnodes == 3
    monkeypatch.setenv("LWS_WORKER_INDEX", "3")
    from zbus.agent import NodeAgent

    agent = NodeAgent()
    try:
        assert agent.node_rank == 3 and agent.settings.master_addr == "10.1.2.3"
    finally:
        agent._close()


def test_a_follower_takes_its_settings_as_an_operator_writes_them(monkeypatch):
    """``ZBUS_ALLOW_WORKERS="a, b"`` allows ``b`` (it allowed " b", so the node
    refused ``b``'s workers and the whole start failed); a node rank under 1 is
    refused by name (-1 went on the wire as "any", the leader gave it a rank and
    the node refused its welcome: the cluster's start failed); a leader's name
    that can never resolve is refused at once, not tried again for the join
    timeout. Sabotage: no ``strip`` in ``NodeAgent.__init__`` ->
    ``workers:EchoWorker`` refused; no rank check there -> no SettingError; no
    ``except SettingError: raise`` in ``NodeAgent._connect`` -> 20 s of tries."""
    from zbus.agent import NodeAgent

    monkeypatch.setenv("ZBUS_ALLOW_WORKERS", "zbus.bench, workers ,")
    agent = NodeAgent(master_addr="127.0.0.1")
    try:
        agent._check_worker("workers:EchoWorker")
        with pytest.raises(zbus.ZbusError, match="is not allowed on this node"):
            agent._check_worker("other:Worker")
    finally:
        agent._close()
    for rank in (0, -1):
        monkeypatch.setenv("ZBUS_NODE_RANK", str(rank))
        with pytest.raises(zbus.SettingError, match=f"node rank {rank}: a follower's rank is 1 or more"):
            NodeAgent(master_addr="127.0.0.1")
    monkeypatch.delenv("ZBUS_NODE_RANK")
    agent = NodeAgent(master_addr="leader..local", join_timeout=20)  # (an empty label: never a name)
    try:
        began = time.monotonic()
        with pytest.raises(zbus.SettingError, match="'leader..local' is no host name"):
            agent._join()
        assert time.monotonic() - began < 5
    finally:
        agent._close()


@pytest.mark.timeout(60)
def test_a_followers_join_timeout_bounds_resolving_and_joining_together(monkeypatch):
    """The leader's name resolves only after 2 s of a 3 s join timeout, and no
    leader answers: the follower gives up 3 s after it began. Before, resolving
    and joining had a timeout each (up to twice the limit: 5 s here). Sabotage: a
    deadline of its own in ``NodeAgent._join`` after ``_connect`` -> 5 s. (The
    resolver is the one thing stood in for: no name here resolves late.)"""
    import zbus.agent
    from zbus.agent import NodeAgent

    began = time.monotonic()

    def resolve_late(host: str) -> str:
        if time.monotonic() < began + 2.0:
            raise zbus.ZbusError(f"cannot resolve {host!r}: not yet")
        return "127.0.0.1"

    monkeypatch.setattr(zbus.agent, "resolve_ip", resolve_late)
    agent = NodeAgent(master_addr="leader", master_port=free_port_pair(), node_rank=1, join_timeout=3.0)
    try:
        with pytest.raises(zbus.ZbusError, match="no leader answered"):
            agent._join()
        took = time.monotonic() - began
    finally:
        agent._close()
    assert 2.0 < took < 4.2, f"gave up after {took:.1f} s of a 3 s join timeout"


def test_explicit_settings_win_over_defaults_and_bad_ones_are_refused(monkeypatch):
    """Sabotage: resolve with ``master_port or env or default`` again: port 0 becomes
    29650 silently, liveness_s=0 becomes 10, and no ValueError is raised. A liveness
    limit outside the range every follower takes is refused by the leader too
    (before: 1000 s or 0.2 s formed no cluster, every follower refusing its welcome,
    and ``inf`` broke the leader's I/O loop: a join timeout naming no setting).
    Sabotage: check ``liveness_s > 0`` only -> no ValueError for 1000."""
    from zbus.cluster import ClusterSettings

    for name in ("ZBUS_NNODES", "ZBUS_NPROC_PER_NODE", "ZBUS_MASTER_ADDR", "ZBUS_MASTER_PORT",
                 "ZBUS_LIVENESS_S", "LWS_GROUP_SIZE", "LWS_LEADER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ZBUS_MASTER_PORT", "4000")
    assert ClusterSettings.resolve(master_port=5000).master_port == 5000
    assert ClusterSettings.resolve().master_port == 4000
    for kwargs, needle in [({"master_port": 0}, "master_port 0"), ({"master_port": 65535}, "65535"),
                           ({"nnodes": 0}, "at least 1"), ({"nproc_per_node": 0}, "at least 1"),
                           ({"master_addr": ""}, "empty"), ({"liveness_s": 0}, "outside 0.5..600"),
                           ({"liveness_s": 1000}, "outside"), ({"liveness_s": float("inf")}, "outside"),
                           ({"liveness_s": float("nan")}, "outside")]:
        with pytest.raises(ValueError, match=needle):
            ClusterSettings.resolve(**kwargs)
    monkeypatch.setenv("ZBUS_MASTER_PORT", "0")
    with pytest.raises(ValueError, match="master_port 0"):
        ClusterSettings.resolve()
    with pytest.raises(ValueError, match="master_port 0"):
        zbus.Executor(workers.EchoWorker, nnodes=2, master_port=0, master_addr="127.0.0.1")


JOIN_AND_HANG = """
import sys, time, zmq
from zbus import codec
from zbus.config import RingGeometry
from zbus.cluster import TOPIC_HEARTBEAT, TOPIC_RPC, node_topic
from zbus.protocol import PROTOCOL_VERSION
port, node_id = int(sys.argv[1]), "e" * 16
ctx = zmq.Context()
sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
for topic in (TOPIC_RPC, TOPIC_HEARTBEAT, node_topic(node_id)):
    sub.setsockopt(zmq.SUBSCRIBE, topic)
sub.connect(f"tcp://127.0.0.1:{port}")
push.connect(f"tcp://127.0.0.1:{port + 1}")
info = {"version": PROTOCOL_VERSION, "nproc": 1, "host": "doomed", "address": "127.0.0.1",
        "node_rank": 1, "pid": 1}
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    push.send_multipart(codec.encode(["join", node_id, info]))
    if sub.poll(300) and sub.recv_multipart()[0] == node_topic(node_id):
        print("welcomed", flush=True)
        time.sleep(60)  # never answers the probes: SIGKILLed here
print("never welcomed", flush=True)
"""


def test_a_node_killed_while_joining_is_dropped_and_its_rank_taken_by_a_new_one():
    """Sabotage: the old leader (probing entries never expire, and count as taken):
    the new follower is refused with "already taken" and start-up fails. Dropping
    only the call to _expire_probing: the join waits forever (join timeout)."""
    port = free_port_pair()
    doomed = subprocess.Popen([sys.executable, "-c", JOIN_AND_HANG, str(port)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=TEST_PATH))
    result, fresh = {}, None

    def lead():
        try:
            with leader(port, nnodes=2, join_timeout=60) as ex:
                result["values"] = ex.collective_rpc("rank_value", args=(1,), timeout=30)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    t = threading.Thread(target=lead)
    t.start()
    try:
        assert doomed.stdout.readline().strip() == "welcomed"  # bounded: it gives up after 60 s
        doomed.kill()  # SIGKILL between the welcome and the answer to the probes
        doomed.wait(10)
        fresh = follower(port, "--node-rank", "1")
        t.join(90)
        assert not t.is_alive()
        assert result.get("values") == [10, 11], result
        assert fresh.wait(30) == 0
    finally:
        t.join(60)
        for p in (doomed, fresh):
            if p is not None:
                end_process(p)


def test_shutdown_from_another_thread_gives_a_leaders_blocked_callers_a_zbus_error():
    """Sabotage: shutdown() without waking and waiting for the blocked callers
    (closing rings and sockets under them): they get ValueError, BufferError or
    ZMQError instead of a ZbusError."""
    from blocked_calls import errors_of_callers_blocked_at_shutdown

    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    ex = None
    try:
        ex = leader(port, nnodes=2, join_timeout=60)
        errors = errors_of_callers_blocked_at_shutdown(ex)
        assert {name: type(e) for name, e in errors.items()} == {
            name: zbus.ZbusError for name in ("receiving", "sending", "queued")}, errors
        proc.wait(30)  # its worker is stuck too: the node leaves, cleanly or as leader lost
    finally:
        if ex is not None:
            ex.shutdown()
        end_process(proc)


@pytest.mark.parametrize("nnodes", [1, 2])
def test_an_executor_dropped_without_a_shutdown_stops_its_workers_and_nodes(nnodes):
    """An executor nobody holds goes, and shuts down as it goes: its workers and
    its nodes exit 0. Its own threads (the completer, the worker monitor, the
    leader's I/O thread) and its failure callback hold it weakly. Sabotage: the
    completer holds it strongly (as before), or ``LocalWorkers`` gets
    ``self._worker_died``, or the failure ``self._on_failure``, or (2 nodes) the
    leader ``self.status``, unwrapped: it is still there, its workers run on."""
    import gc
    import weakref

    port = free_port_pair()
    proc = follower(port) if nnodes > 1 else None
    ex = None
    try:
        ex = leader(port, nnodes=nnodes, join_timeout=60)
        assert ex.collective_rpc("rank_value", args=(1,), non_block=True).result(30) == [
            10, 11][:nnodes]  # (a non-blocking call starts the completer thread)
        workers, dropped = ex._workers, weakref.ref(ex)
        ex = None
        gc.collect()
        wait_until(lambda: dropped() is None, 30, "the dropped executor to go")
        assert [p.wait(10) for p in workers.procs] == [0]
        if proc is not None:
            assert proc.wait(30) == 0
    finally:
        if ex is not None:
            ex.shutdown()
        if proc is not None:
            end_process(proc)


@pytest.mark.parametrize("executor", ["kept", "dropped"])
def test_a_driver_that_exits_without_a_shutdown_exits_and_its_workers_end(executor):
    """A driver that ends with an executor still referenced (``kept``: a module
    global) exits at once, and its workers end on their own, as orphans do. One
    dropped just before the end (``dropped``: the last reference a future's) is
    shut down before the driver exits: its workers are stopped, not orphaned.
    Sabotage: start a shutdown thread in ``__del__`` (the first version of this
    fix) -> ``kept`` hangs (no thread runs at the interpreter's exit, and the start
    waits for it); no ``atexit`` join of the reaper -> ``dropped``'s workers are
    orphaned (the reaper, a daemon, is cut short)."""
    from conftest import spawn_python

    code = ("import workers, zbus\n"
            "ex = zbus.Executor(workers.EchoWorker, nproc_per_node=2)\n"
            "print(*(p.pid for p in ex._workers.procs), flush=True)\n"
            "future = ex.collective_rpc('rank_value', args=(1,), non_block=True)\n"
            + ("ex = None\n" if executor == "dropped" else "")
            + "assert future.result(30) == [10, 11]\n"
            "future = None\n")
    proc = spawn_python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)  # (the workers share its stderr: until they end)
        assert proc.returncode == 0, err[-2000:]
        pids = [int(pid) for pid in out.split()]
        assert len(pids) == 2
        wait_until(lambda: not any(psutil.pid_exists(pid) for pid in pids), 15, "the workers to end")
        if executor == "dropped":
            assert "is gone" not in err, err[-2000:]
    finally:
        end_process(proc)


def test_free_port_pair_avoids_the_ports_the_kernel_hands_out():
    """Sabotage: pick the pair by bind(0) again: the port comes from the ephemeral
    range, where any bind(0) or outgoing connection may take it before the leader
    binds it (a flaky "address in use")."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    if lo - 10000 < 1000 and 65534 - hi < 1000:
        pytest.skip(f"the ephemeral range {lo}-{hi} leaves no room")
    for _ in range(20):
        port = free_port_pair()
        assert not (lo <= port <= hi or lo <= port + 1 <= hi), port
        for p in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_torch_rendezvous_port_comes_from_the_port_range(monkeypatch):
    from zbus.executor import reserve_port

    port = free_port_pair()
    monkeypatch.setenv("ZBUS_PORT_RANGE", f"{port}-{port + 1}")
    assert reserve_port("127.0.0.1") in (port, port + 1)


def test_status_of_a_running_leader_and_its_prometheus_metrics():
    """Sabotage: the follower's core not sent when it joins (or not shown) → its node
    says "unknown"; ``zbus status`` exits 0 for a failed executor, or catches only
    TimeoutError (a name that does not resolve: a traceback)."""
    import json
    import os
    import urllib.request

    port, metrics_port = free_port_pair(), free_port_pair()
    proc = follower(port, "--node-rank", "1", env={"ZBUS_PURE_PYTHON": "1"})  # this node's core: python
    try:
        with leader(port, nnodes=2, join_timeout=60, metrics_port=metrics_port) as ex:
            for i in range(20):
                ex.collective_rpc("rank_value", args=(i,), timeout=30)
            with pytest.raises(zbus.RemoteError):
                ex.collective_rpc("boom", timeout=30)
            cmd = [sys.executable, "-m", "zbus.cli", "status", "--master-addr", "127.0.0.1",
                   "--master-port", str(port)]
            env = dict(os.environ, PYTHONPATH=TEST_PATH)
            out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60, env=env)
            st = json.loads(out.stdout)
            assert st["world_size"] == 2 and st["rpcs"] == 21 and st["errors"] == {"RemoteError": 1}
            assert [n["node_rank"] for n in st["nodes"]] == [0, 1] and st["nodes"][1]["ranks"] == [1]
            assert [n["core"] for n in st["nodes"]] == [zbus.ring.CORE, "python"]
            assert 0 < st["latency_s"]["p50"] <= st["latency_s"]["p99"] and st["bytes_sent"] > 0
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env).stdout
            assert "world size 2" in text and "node 1" in text and "rpcs 21" in text
            assert f"ranks 0..0  core {zbus.ring.CORE}" in text and "ranks 1..1  core python" in text
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
            assert b"zbus_rpcs_total 21" in body and b'zbus_rpc_errors_total{kind="RemoteError"} 1' in body
            psutil.Process(proc.pid).children()[0].kill()  # node 1's worker: the executor fails
            wait_until(lambda: ex.failure.error is not None, 10, "the executor failing")
            failed = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
            assert failed.returncode == 1 and "FAILED" in failed.stdout, failed  # (a health check sees it)
        assert proc.wait(30) == 0
        gone = subprocess.run([sys.executable, "-m", "zbus.cli", "status", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "--timeout", "1"], capture_output=True,
                              text=True, timeout=60)
        assert gone.returncode == 1 and "no leader answered" in gone.stderr
        nameless = subprocess.run([sys.executable, "-m", "zbus.cli", "status", "--master-addr",
                                   "no-such-host.invalid", "--timeout", "1"], capture_output=True,
                                  text=True, timeout=60)
        assert nameless.returncode == 1 and "Traceback" not in nameless.stderr, nameless.stderr
    finally:
        end_process(proc)


def test_the_latency_histograms_count_is_of_the_same_snapshot_as_its_buckets():
    """A call completes while a scrape is made: the histogram's ``+Inf`` bucket (its
    count) and its sum are of the same snapshot as its finite buckets. Before, they
    were read afterwards, live: ``+Inf`` could exceed the last finite bucket with no
    call that slow (``histogram_quantile`` then gave the top bound). Sabotage:
    ``metrics.latency.n`` for ``+Inf`` in ``serve_prometheus`` (as before)."""
    import urllib.request

    from zbus import metrics

    class CallDuringScrape(metrics.Metrics):
        def snapshot(self):
            snap = super().snapshot()
            self.rpc_done(1e-6, None)  # (as another thread's call would)
            return snap

    stats = CallDuringScrape()
    stats.rpc_done(1e-6, None)
    port = free_port_pair()
    server, _ = metrics.serve_prometheus(stats, port, "127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    buckets = dict(line.rsplit(" ", 1) for line in body.splitlines()
                   if line.startswith("zbus_rpc_latency_seconds_bucket"))
    top = f'zbus_rpc_latency_seconds_bucket{{le="{metrics.BUCKETS[-1]!r}"}}'
    assert float(buckets['zbus_rpc_latency_seconds_bucket{le="+Inf"}']) == float(buckets[top]) == 1.0, body


def test_unauthenticated_leader_may_start_only_allowed_workers_with_a_safe_environment():
    import os

    port = free_port_pair()
    env = dict(os.environ, PYTHONPATH=TEST_PATH, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE="1")
    env.pop("ZBUS_ALLOW_WORKERS", None)
    strict = subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", "1"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(zbus.StartupError, match="refused to start the workers"):
            leader(port, nnodes=2, join_timeout=60)
        assert strict.wait(30) == 1 and "--allow-worker" in strict.stderr.read()
    finally:
        end_process(strict)
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")  # allows "workers"; import-path calls stay off
    # Sabotage for the environment: the old deny-list (RISKY_ENV = LD_, DYLD_, PYTHON, ZBUS_, PATH)
    # let every name below but LD_PRELOAD through; "VLLM_" among SAFE_ENV_PREFIXES again lets
    # VLLM_LOGGING_STREAM ("ext://mod.x": vLLM's logging config imports mod) and the two after it.
    risky = ["LD_PRELOAD", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_DEBUG_FILE", "NCCL_TOPO_FILE",
             "OPENSSL_CONF", "GCONV_PATH", "http_proxy", "HTTPS_PROXY", "HF_ENDPOINT", "VLLM_PLUGINS",
             "CUDA_HOME", "MY_SETTING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_USAGE_STATS_SERVER",
             "VLLM_USE_MODELSCOPE", "NCCL_NET", "NCCL_SOCKET_IFNAME", "VLLM_HOST_IP", "VLLM_PORT",
             "VLLM_API_KEY", "VLLM_LOGGING_STREAM", "VLLM_TRACE_FUNCTION", "VLLM_LORA_RESOLVER_HF_REPO_LIST",
             # files an OpenMP runtime (Intel's, LLVM's) or CUDA writes: "TOOL", "PIPE", "DUMP" refused
             "OMP_TOOL_VERBOSE_INIT", "OMP_TOOL", "CUDA_COREDUMP_PIPE", "CUDA_ENABLE_COREDUMP_ON_EXCEPTION",
             "CUDA_INJECTION64_PATH", "NCCL_PROFILER_PLUGIN"]
    safe = {"ZBUS_TEST_VALUE": "ok", "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "3"}
    try:
        with leader(port, nnodes=2, join_timeout=60, env={**{k: "evil" for k in risky}, **safe}) as ex:
            infos = ex.collective_rpc("env_of", args=([*risky, *safe],), timeout=30)
            assert infos[0] == {**{k: "evil" for k in risky}, **safe}  # the leader's own take all
            # a follower takes the safe names only (the risky ones keep the node's own value)
            assert {k: v for k, v in infos[1].items() if v == "evil"} == {}
            assert {k: infos[1][k] for k in safe} == safe
            with pytest.raises(zbus.ZbusError, match="rank 1: .*disabled on this node"):
                ex.collective_rpc("workers:add_rank", args=(1,), timeout=30)
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


@pytest.mark.parametrize("how,code", [("kill", -9), ("abort", -6)], ids=["kill", "abort"])
def test_a_follower_workers_death_fails_the_executor_quickly(how, code):
    """Rank 3 (node 1) kills itself inside a call: its agent sees the death and
    reports it, and the call fails with ``WorkerDiedError`` naming rank, exit code
    and node within 3 s; later calls fail; the live node still exits 0. Sabotage:
    an agent that reports no death (its ``died`` message never sent): the call
    waits out its 20 s, ``TimeoutError``."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1", nproc=2)
    try:
        ex = zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=2, master_addr="127.0.0.1",
                           master_port=port, liveness_s=2.0, join_timeout=60)
        try:
            t0 = time.monotonic()
            pending = ex.collective_rpc("die", kwargs={"rank": 3, "how": how}, non_block=True)  # others wait
            with pytest.raises(zbus.WorkerDiedError) as info:
                pending.result(timeout=20)
            # the call reaches the worker, which dies; the agent wakes on the death, the
            # leader's I/O thread on its report, then the caller: four processes to
            # schedule on a loaded 2-core machine (measured: about 0.1 s). Without the
            # report the call would wait its 20 s; the liveness limit does not apply
            # (the agent heartbeats on).
            assert time.monotonic() - t0 < 3.0
            assert info.value.rank == 3 and info.value.exitcode == code and "node 1" in str(info.value)
            with pytest.raises(zbus.WorkerDiedError):
                ex.collective_rpc("noop", timeout=5)
        finally:
            ex.shutdown()
        assert proc.wait(30) == 0  # the leader still said bye to the live node
    finally:
        end_process(proc)


@pytest.mark.parametrize("how, linger", [("exit", 60.0), ("exit_thread", 3600.0)], ids=["atexit", "thread"])
def test_a_follower_worker_that_leaves_by_an_exception_is_reported_dead(how, linger):
    """Rank 1 (node 1) leaves by ``SystemExit(7)`` from a method, with a slow
    ``atexit`` hook (60 s) or a thread that is no daemon (an hour) still running: it
    ends within ``FAILED_EXIT_S`` (5 s) whatever these do, so its agent reports the
    death and the call fails with it. Before, the interpreter's exit waited for
    them while the worker's rings and replies were already closed: nothing told the
    leader, the call waited its whole timeout (a minute, or for good), and every
    later call timed out too (a local worker's driver fails it after 2 s). Sabotage:
    ``raise`` instead of ``_end`` in ``zbus.worker.main``'s ``except`` -> pending
    after 15 s."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:
            pending = ex.collective_rpc("die", kwargs={"rank": 1, "how": how, "linger": linger},
                                        non_block=True)  # (rank 0 sleeps until the shutdown ends it)
            error = pending.exception(timeout=15)
            assert isinstance(error, zbus.WorkerDiedError), repr(error)
            assert (error.rank, error.exitcode) == (1, 7) and "node 1" in str(error)
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_a_join_while_the_last_on_join_runs_is_refused_and_the_cluster_starts():
    """Every node has joined but the driver's ``on_join`` still runs (slow): a join
    then is refused as after the cluster formed, and start-up goes on. Before,
    the cluster counted as formed only once ``on_join`` returned: the join was
    taken for a node that found no free rank, and start-up failed ("the
    cluster of 2 nodes is complete"). Sabotage: set ``formed`` in ``admit`` only
    (not in ``_on_subscribed``) -> StartupError."""
    port = free_port_pair()
    first = follower(port, "--node-rank", "1", env={"ZBUS_LOG_LEVEL": "INFO"})
    said = Lines(first.stderr)
    late = []

    def on_join(joined: int, total: int) -> None:
        if late:
            return
        wait_until(lambda: said.has("workers started"), 30, "node 1 welcomed")
        late.append(follower(port))  # a node more, any rank
        late[0].wait(30)

    try:
        with leader(port, nnodes=2, join_timeout=60, on_join=on_join) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
        assert late[0].returncode == 1 and "already formed" in late[0].stderr.read()
        assert first.wait(30) == 0
    finally:
        for p in (first, *late):
            end_process(p)


def test_a_join_after_the_cluster_formed_is_refused():
    port = free_port_pair()
    first = follower(port, "--node-rank", "1")
    late = None
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:
            late = follower(port)
            assert late.wait(30) == 1
            assert "already formed" in late.stderr.read()
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
        assert first.wait(30) == 0
    finally:
        for p in (first, late):
            if p is not None:
                end_process(p)


def test_a_hung_follower_worker_times_the_call_out_within_its_limit():
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                ex.collective_rpc("sleep", args=(3,), timeout=1.0)
            # the caller's own deadline (one thread wake-up, no process to schedule);
            # the 3 s answer would come 1.5 s too late for this bound
            assert time.monotonic() - t0 < 1.5
            ex.check_health()  # a hang is not a failure: the executor stays usable
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_a_remote_rank_that_raised_fails_the_call_while_the_local_rank_still_waits(tmp_path):
    """Rank 1, on a follower, raises while rank 0 waits 5 s: the call fails with
    rank 1's error at once, and the next call gets its own replies. Sabotage: no
    ``_settle_on_an_error`` call in ``Executor._on_wait_slice`` -> the error comes
    after rank 0 made its mark."""
    port, mark = free_port_pair(), tmp_path / "done"
    proc = follower(port, "--node-rank", "1")
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:
            with pytest.raises(zbus.RemoteError, match="rank 1 failed"):
                ex.collective_rpc("boom_on", args=(1, str(mark), 5.0), timeout=30)
            assert not os.path.exists(f"{mark}.0")
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_a_caller_reading_its_replies_keeps_heartbeats_and_control_messages_served():
    """A 4 s call waits on rank 1 alone (twice the 2 s liveness limit), so its caller
    reads the leader's socket itself; once the call is sent, 20 000 status requests
    flood that socket and ``zbus status`` asks too. The status is answered, no node
    is lost, the executor stays healthy. Sabotage: leave heartbeats to the I/O
    thread only (a caller reading the socket drops the heartbeats it reads instead
    of filing them): ``NodeLostError`` after 2 s."""
    from zbus.cluster import query_status

    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:  # the node is lost after 2 s unheard
            status = {}

            def ask():
                # while the call below waits, reading the leader's socket itself
                wait_until(lambda: ex._pending, 30, "the 4 s call sent")
                flood = zmq.Context.instance().socket(zmq.PUSH)
                flood.setsockopt(zmq.LINGER, 0)
                flood.connect(f"tcp://127.0.0.1:{port + 1}")
                for i in range(20000):  # each answered on the XPUB socket: a slow kind of message
                    flood.send_multipart(codec.encode(["status", f"t{i}"]))
                flood.close()
                status.update(query_status("127.0.0.1", port, timeout=10))

            asker = threading.Thread(target=ask)
            asker.start()
            # waits on rank 1 alone, so it reads the socket all along: twice the liveness limit
            assert ex.collective_rpc("sleep", args=(4,), unique_reply_rank=1, timeout=30) == 1
            asker.join(30)
            assert status["world_size"] == 2 and [n["node_rank"] for n in status["nodes"]] == [0, 1]
            ex.check_health()
            assert ex.collective_rpc("rank_value", args=(3,), timeout=30) == [30, 31]
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_a_welcome_over_a_nodes_message_limit_fails_the_start_at_once(monkeypatch):
    """Worker arguments of 2 MiB, a follower whose ``ZBUS_MAX_MESSAGE`` is 1 MiB:
    the start fails at once, naming the setting. Before, the welcome was sent:
    ZeroMQ dropped the node's connection at each try, the node joined again, and
    the start failed after the join timeout, "missing node ranks: [1]". Sabotage:
    no size check in ``Membership._welcome`` -> StartupError after 20 s naming
    the missing node rank."""
    monkeypatch.setenv("ZBUS_MAX_REPLY", "1M")  # (a node refuses a leader that takes larger replies)
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1", env={"ZBUS_MAX_MESSAGE": "1M"})
    try:
        start = time.monotonic()
        too_big = r"the welcome, with the worker's arguments, takes 20\d{5} bytes, over the 1048576 that"
        with pytest.raises(zbus.StartupError, match=too_big):
            leader(port, nnodes=2, join_timeout=20, worker_kwargs={"tag": b"x" * (2 * 2**20)})
        assert time.monotonic() - start < 15
    finally:
        end_process(proc)


def seconds_to_a_lost_leader(node, driver, said: str, settle_s: float) -> float:
    """Once ``driver`` printed ``said`` and ``settle_s`` more passed, SIGKILL it:
    how long ``node``'s follower then took to end (1: its leader lost)."""
    assert next_line(driver, time.monotonic() + 60).strip() == said
    time.sleep(settle_s)
    driver.kill()
    killed = time.monotonic()
    assert node.wait(20) == 1
    return time.monotonic() - killed


ANNOUNCED_NEVER_SENT = """
import sys, time
import workers, zbus
from zbus.errors import SendTimeout

ex = zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                   master_port=int(sys.argv[1]), liveness_s=1.0, join_timeout=60)
ex.collective_rpc("noop", timeout=30)
publish = ex._bcast.publish_frames

def after_the_coming(*args, **kwargs):  # the call is announced, then goes nowhere
    ex._bcast.publish_frames = publish
    raise SendTimeout("the ring is full", queued=False)
ex._bcast.publish_frames = after_the_coming
try:
    ex.collective_rpc("tensor_len", args=(bytes(64 * 2**20),), timeout=30)
except TimeoutError:
    print("announced, not sent", flush=True)
time.sleep(120)
"""


def test_a_call_announced_but_never_sent_is_withdrawn(tmp_path):
    """A 64 MiB call is announced to its node ("coming", which lets the leader be
    silent for the call's time at 10 MB/s, 6.7 s), then its send times out before
    anything went, and the leader withdraws it (a "coming" of 0 bytes). The driver
    is then SIGKILLed: the node takes its leader for lost within the liveness
    limit (1 s), as if nothing had been announced. Before, the announcement held
    until a call of that number came: every silence of the leader got 6.7 s more,
    for good. Sabotage: no withdrawal in ``MultiprocExecutor._send_cut_short`` ->
    the node exits after about 7.7 s."""
    port = free_port_pair()
    node = follower(port, "--node-rank", "1")
    driver = spawn_python(ANNOUNCED_NEVER_SENT, str(port), stdout=subprocess.PIPE, text=True)
    try:
        took = seconds_to_a_lost_leader(node, driver, "announced, not sent", 0.5)  # (the withdrawal's way)
        assert took < 3.5, took
    finally:
        end_process(driver)
        end_process(node)


READ_AHEAD_WHILE_HELD = """
import sys, time
import workers, zbus

ex = zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                   master_port=int(sys.argv[1]), liveness_s=1.0, join_timeout=60)
ex.collective_rpc("noop", timeout=30)
held = [ex.collective_rpc("sleep_on_node", args=(1, 60), non_block=True)]
held += [ex.collective_rpc("noop", non_block=True) for _ in range(8)]  # node 1's ring full: it reads ahead
held.append(ex.collective_rpc("tensor_len", args=(bytes(64 * 2**20),), non_block=True, timeout=60))
print("sent", flush=True)
time.sleep(120)
"""


def test_a_large_call_read_ahead_ends_its_announcement(tmp_path):
    """Node 1's worker is held in a call and its ring (4 chunks) is full, so its
    agent reads ahead: the announcement of a 64 MiB call ("coming": 6.7 s more of
    silence allowed), then the call itself. The call is in: the leader's silence
    is its own again, and the driver's SIGKILL is seen within the liveness limit
    (1 s). Before, the announcement held until the call was relayed (never, with
    the worker held): the node took 7.7 s to see its leader lost. Sabotage: no
    ``_heard_call`` in ``NodeAgent._read_ahead`` -> about 7.7 s."""
    port = free_port_pair()
    node = follower(port, "--node-rank", "1", env={"ZBUS_RING": "256x4"})
    driver = spawn_python(READ_AHEAD_WHILE_HELD, str(port), stdout=subprocess.PIPE, text=True)
    try:
        took = seconds_to_a_lost_leader(node, driver, "sent", 2.0)  # (64 MiB into the read-ahead: less)
        assert took < 3.5, took
    finally:
        end_process(driver)
        end_process(node)


def test_a_failure_as_a_call_is_encoded_sends_it_to_no_node(monkeypatch):
    """The executor fails after a call passed its check, before its first frame
    went (a worker's death seen on the monitor thread, say): the call fails with
    that failure, and no node gets it. Before, the call went to the nodes all the
    same, ahead of the leader's ``failed``: remote ranks ran a call the local ones
    never saw. Sabotage: no check of ``cancel`` in ``send_frames`` once the
    socket is taken -> the leader's record of calls sent moves on."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
            sent = ex._leader.path.calls.last
            encode = codec.encode

            def failing_as_it_encodes(obj):
                if obj == (("poison",), {}):
                    ex.failure.fail(zbus.ZbusError("a failure injected as the call is encoded"))
                return encode(obj)
            monkeypatch.setattr(codec, "encode", failing_as_it_encodes)
            with pytest.raises(zbus.ZbusError, match="injected"):
                ex.collective_rpc("echo", args=("poison",), timeout=10)
            assert ex._leader.path.calls.last == sent
    finally:
        end_process(proc)


def bare_leader(nnodes: int):
    """A leader with no executor and no local worker (liveness 1 s), and its port."""
    from zbus.cluster import ClusterSettings
    from zbus.leader import Leader
    from zbus.queues import Broadcaster

    port = free_port_pair()
    settings = ClusterSettings(nnodes=nnodes, nproc_per_node=1, master_addr="127.0.0.1", master_port=port,
                               liveness_s=1.0)
    return Leader(settings, lambda **kw: Broadcaster(0, **kw)), port


@pytest.mark.parametrize("when", ["decoding", "taken"])
@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_ctrl_c_as_a_reply_is_taken_loses_no_reply(where, when, monkeypatch):
    """A Ctrl-C (KeyboardInterrupt) lands as a reply is decoded, after it was read
    (a reply of tensors or dataclasses takes a while), or once decoded, before the
    executor kept it: the call is cut short, and the executor serves on, the next
    call answered right. Before, the reply was lost: the next call's reply was
    taken for it, and the executor failed with a protocol error (at once from a
    local rank, after the grace for a remote one). A reply is now kept by its
    receiver until the executor took it. Sabotage: read the ring again in
    ``ShmReceiver.get`` (no ``if self._frames is None``) -> local decoding fails;
    ``given_again`` always False -> remote decoding and both ``taken`` fail."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1") if where == "remote" else None
    try:
        ex = leader(port, nnodes=2, join_timeout=60) if proc else zbus.Executor(workers.EchoWorker)
        victim, armed = (1 if proc else 0), [True]

        def ctrl_c_once(reply):  # (a remote rank's, decoded, names the session first)
            if armed and threading.current_thread() is threading.main_thread() \
                    and type(reply) is list and reply[-4:-3] == [victim]:
                armed.clear()
                raise KeyboardInterrupt
        decode, accept = codec.decode, ex._accept

        def decode_then_ctrl_c(*args, **kwargs):
            reply = decode(*args, **kwargs)
            ctrl_c_once(reply)
            return reply

        def ctrl_c_then_accept(head, rank, reply):
            ctrl_c_once(reply)
            accept(head, rank, reply)
        if when == "decoding":
            monkeypatch.setattr(codec, "decode", decode_then_ctrl_c)
        else:
            monkeypatch.setattr(ex, "_accept", ctrl_c_then_accept)
        try:
            with pytest.raises(KeyboardInterrupt):
                ex.collective_rpc("rank_value", args=(1,), timeout=30)
            assert not armed
            want = [20 + rank for rank in range(ex.world_size)]
            assert ex.collective_rpc("rank_value", args=(2,), timeout=30) == want
            ex.check_health()
        finally:
            monkeypatch.undo()
            ex.shutdown()
    finally:
        if proc is not None:
            end_process(proc)


def test_a_ctrl_c_as_the_nodes_copy_of_a_call_is_recorded_gives_no_rank_another_calls_reply():
    """A Ctrl-C (KeyboardInterrupt) lands once the nodes' copy of a call is queued
    but before the leader recorded it (at the first step of the function that
    does). The nodes have the call and the local ring does not: the executor fails
    at once ("reached only some ranks"). Before, the call counted as sent to no
    rank and its number was given to the next call, which the nodes dropped as one
    they had: the next call's result held the remote rank's reply to the call
    before, silently. (The interrupt is raised by a profile hook in this thread.)
    Sabotage: ``on_queued`` after the ``try`` in ``queues.send_frames`` again ->
    the next call returns ``[20, 11]``."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:
            armed = [True]

            def ctrl_c_at_queued(frame, event, arg):
                if event == "call" and armed and frame.f_code.co_name == "queued" \
                        and frame.f_code.co_filename.endswith(os.path.join("zbus", "executor.py")):
                    armed.clear()
                    raise KeyboardInterrupt
            sys.setprofile(ctrl_c_at_queued)
            try:
                with pytest.raises(KeyboardInterrupt):
                    ex.collective_rpc("rank_value", args=(1,), timeout=30)
            finally:
                sys.setprofile(None)
            assert not armed
            try:
                got = ex.collective_rpc("rank_value", args=(2,), timeout=30)
            except zbus.ExecutorFailedError as e:
                got = e
            assert isinstance(got, zbus.ExecutorFailedError) and "reached only some ranks" in str(got), got
    finally:
        end_process(proc)


@pytest.mark.parametrize("when", ["filing", "between-frames", "as-taken"])
def test_a_ctrl_c_as_a_remote_reply_is_read_off_the_socket_loses_no_reply(when, monkeypatch):
    """A Ctrl-C (KeyboardInterrupt) lands in the caller's thread once a remote
    rank's reply was taken off the leader's socket: as it is filed, between its
    frames (the Python reader's), or as the compiled reader returns it (where a
    signal's handler runs). The call is cut short, and the executor serves on, the
    next call answered right. Before, the reply was in no other place: lost, so the
    next call waited for it, then failed the executor with a protocol error (or, with
    its frames cut apart, read the rest as a message of its own). Sabotage: re-raise
    at once in ``DataPath._read_one_py`` or ``_read_one_core`` (no second
    ``_rest_of`` or ``_file_taken``) -> the next call fails."""
    from zbus import datapath

    if when == "as-taken" and datapath._core is None:
        pytest.skip("the compiled core is not built")
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        armed = [True]

        def ctrl_c_once() -> None:
            if armed and threading.current_thread() is threading.main_thread():
                armed.clear()
                raise KeyboardInterrupt
        put, rest_of, core = datapath.RemoteReceiver.put, datapath._rest_of, datapath._core

        def ctrl_c_then_put(self, reply):
            if reply[0] == 1:
                ctrl_c_once()
            put(self, reply)

        def ctrl_c_between_frames(sock, frames):
            if frames[-1].more:
                ctrl_c_once()
            return rest_of(sock, frames)

        class CtrlCAsTaken:
            wait_message = core.wait_message if core is not None else None

            @staticmethod
            def take_message(sock, max_parts, user_id, into):
                took = core.take_message(sock, max_parts, user_id, into)
                if took and len(into[0][0]) > 1:  # (a reply of rank 1's, with its echo's frame)
                    ctrl_c_once()
                return took
        if when == "between-frames":
            monkeypatch.setattr(datapath, "_core", None)  # (the Python reader)
        ex = leader(port, nnodes=2, join_timeout=60)
        if when == "filing":
            monkeypatch.setattr(datapath.RemoteReceiver, "put", ctrl_c_then_put)
        elif when == "between-frames":
            monkeypatch.setattr(datapath, "_rest_of", ctrl_c_between_frames)
        else:
            monkeypatch.setattr(datapath, "_core", CtrlCAsTaken)
        try:
            big = b"x" * 100_000  # (echoed in a tuple: in a frame of its own)
            for _ in range(50):  # (until the caller, not the I/O thread, read the reply)
                try:
                    assert ex.collective_rpc("echo", args=(big,), timeout=30) == [((big,), {})] * 2
                except KeyboardInterrupt:
                    break
            assert not armed
            assert ex.collective_rpc("rank_value", args=(2,), timeout=30) == [20, 21]
            assert ex.collective_rpc("echo", args=(big, 1), timeout=30) == [((big, 1), {})] * 2
            ex.check_health()
        finally:
            monkeypatch.undo()
            ex.shutdown()
    finally:
        end_process(proc)


@pytest.mark.parametrize("where", ["envelope", "metrics"])
def test_a_ctrl_c_as_a_call_is_made_ready_to_send_loses_no_call(where, monkeypatch):
    """A Ctrl-C lands while a call is made ready to send: as its envelope is
    written, or as its bytes are counted. The call is cut short and the executor
    serves on. Before, the call's number was taken before those steps, outside the
    ``try`` that forgets a call no rank got: a Ctrl-C in the envelope left a number
    no node ever got (the follower found a gap, asked for that call, and the
    leader, which never had it, failed the node: NodeLostError); one in the count,
    an unsent call at the head of the pending ones (the next call's replies taken
    for it: a protocol error). Sabotage: ``self._seq += 1`` and the count before
    the ``try`` in ``collective_rpc``, as before."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        ex = leader(port, nnodes=2, join_timeout=60)
        try:
            armed = [True]
            target, name = (protocol, "call_envelope") if where == "envelope" else (ex.metrics, "sent")
            inner = getattr(target, name)

            def ctrl_c_once(*args, **kwargs):
                if armed and threading.current_thread() is threading.main_thread():
                    armed.clear()
                    raise KeyboardInterrupt
                return inner(*args, **kwargs)
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
            monkeypatch.setattr(target, name, ctrl_c_once)
            with pytest.raises(KeyboardInterrupt):
                ex.collective_rpc("rank_value", args=(2,), timeout=30)
            assert not armed
            for n in (3, 4):
                assert ex.collective_rpc("rank_value", args=(n,), timeout=30) == [10 * n, 10 * n + 1]
            assert ex.collective_rpc("rank_value", args=(5,), non_block=True).result(30) == [50, 51]
            ex.check_health()
        finally:
            monkeypatch.undo()
            ex.shutdown()
    finally:
        end_process(proc)


def test_a_leader_whose_io_thread_cannot_start_frees_its_ports(monkeypatch):
    """The leader's I/O thread cannot start (a pids limit): the executor's start
    fails with that error, and the leader's ports are free again. Before, the
    thread was kept unstarted, and the leader's close raised at its join
    ("cannot join thread before it is started", in place of the real error),
    in the step that closes the sockets. Sabotage: keep the thread before its
    start in ``Membership.start`` -> that error."""
    port = free_port_pair()
    refused = no_thread_to_be_had(monkeypatch, "zbus-leader-io")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        leader(port, nnodes=2, join_timeout=5)
    monkeypatch.undo()
    assert len(refused) == 1
    for p in (port, port + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_ctrl_c_in_the_leaders_close_still_frees_its_ports():
    """A second Ctrl-C during a shutdown lands in the leader's close (in the wait
    of its step after the I/O thread's end, here): every later step still runs, so
    the leader's ports are free and its I/O thread gone, and the node, told bye,
    exits 0. Before, the interrupt skipped the closing of its sockets and context:
    the ports stayed bound for the process's life, and a later shutdown returned
    at once. Sabotage: ``Leader.close``'s steps one after the other (no
    ``run_every``) -> the port is still bound."""
    port = free_port_pair()
    proc, ex = follower(port, "--node-rank", "1"), None
    try:
        ex = leader(port, nnodes=2, liveness_s=5.0, join_timeout=60)
        assert len(ex.collective_rpc("echo", timeout=30)) == 2

        reject_joining = ex._leader.membership.reject_joining

        def ctrl_c() -> None:  # once: a Ctrl-C let out of a test would end the whole session
            ex._leader.membership.reject_joining = reject_joining
            raise KeyboardInterrupt

        ex._leader.membership.reject_joining = ctrl_c  # (the step after the I/O thread's end)
        with pytest.raises(KeyboardInterrupt):
            ex.shutdown()
        ex.shutdown()  # returns at once
        assert proc.wait(30) == 0  # it heard the bye (a leader lost: exit 1, after 5 s)
        assert_leader_gone(port, port + 1)
    finally:
        if ex is not None:
            ex.shutdown()
        end_process(proc)


def assert_leader_gone(*ports: int) -> None:
    """No leader's I/O thread runs, and each of ``ports`` is free to listen on."""
    assert not [t for t in threading.enumerate() if t.name == "zbus-leader-io"]
    for p in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (past TIME_WAIT, not a listener)
            s.bind(("127.0.0.1", p))
            s.listen()


def test_a_ctrl_c_in_the_metrics_servers_shutdown_still_frees_the_leaders_ports():
    """As above, the Ctrl-C landing in the wait of the metrics server's shutdown
    (up to 0.5 s for its thread): the leader still closes. Before, the server and
    the leader were one step of the teardown: the leader's ports stayed bound and
    its I/O thread ran for the process's life. Sabotage: ``_free``'s steps one
    after the other again."""
    port, metrics = free_port_pair(), free_port_pair()
    proc, ex = follower(port, "--node-rank", "1"), None
    try:
        ex = leader(port, nnodes=2, liveness_s=5.0, join_timeout=60, metrics_port=metrics)
        assert len(ex.collective_rpc("echo", timeout=30)) == 2
        server = ex._metrics_server[0]
        real = server.shutdown

        def ctrl_c() -> None:  # once, as its wait ends
            server.shutdown = real
            real()
            raise KeyboardInterrupt

        server.shutdown = ctrl_c
        with pytest.raises(KeyboardInterrupt):
            ex.shutdown()
        assert proc.wait(30) == 0
        assert_leader_gone(port, port + 1, metrics)
    finally:
        if ex is not None:
            ex.shutdown()
        end_process(proc)


def test_the_leader_closes_its_xpub_only_once_no_thread_sends_on_it():
    """A ZeroMQ socket is not thread-safe: closed while another thread is inside a
    send on it, libzmq may crash. A thread holds ``xpub_lock`` (as a caller's send
    does) while ``DataPath.close`` runs: the XPUB stays open until it lets
    go, then closes. Sabotage: close the XPUB without taking the lock in
    ``DataPath.close`` -> it is closed while the lock is held."""
    lead, _ = bare_leader(nnodes=2)
    held, release = threading.Event(), threading.Event()

    def sender() -> None:
        with lead.xpub_lock:
            held.set()
            release.wait(5)

    threads = [threading.Thread(target=sender, daemon=True),
               threading.Thread(target=lead.path.close, args=(0.0,), daemon=True)]
    try:
        threads[0].start()
        assert held.wait(5)
        threads[1].start()
        wait_until(lambda: lead.path._pull_closed, 5, "close at its XPUB step")
        time.sleep(0.05)  # (the sabotaged close needs no more: it does not wait)
        assert not lead.bcast.xpub.closed, "the XPUB was closed while a thread sent on it"
        release.set()
        threads[1].join(5)
        assert lead.bcast.xpub.closed
    finally:
        release.set()
        for t in threads:
            if t.is_alive():
                t.join(5)
        lead.close()


def test_a_node_dropped_while_joining_is_told_again_when_it_answers_late():
    """A node welcomed as rank 1 whose answer to the probes comes after the liveness
    limit (a partition) is dropped, and the notice, sent while it could not hear,
    is lost. When its late ``subscribed`` arrives, the leader tells it again that it
    was dropped; a made-up id is not answered. Before, the late answer was ignored
    without a word: the node believed it held rank 1, kept alive by the leader's
    heartbeats, while formation waited for rank 1 until its timeout. Sabotage:
    return at once in ``Membership._on_subscribed`` for a node not being probed ->
    no notice; answer any id -> the made-up one is answered."""
    from zbus.protocol import PROTOCOL_VERSION

    lead, port = bare_leader(nnodes=2)
    lead.membership._welcome_spec = {"spec": {}, "torch_port": 0, "env": {}}  # (what admit sets)
    ctx = zmq.Context()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    subs = [sub]
    node_id = "e" * 16
    mine = node_topic(node_id)

    def heard(kind: str, within: float) -> list | None:
        end = time.monotonic() + within
        while (left := end - time.monotonic()) > 0 and subs[-1].poll(int(left * 1000) + 1):
            topic, *frames = subs[-1].recv_multipart()
            msg = codec.decode(frames) if topic == mine else None
            if msg and msg[0] == kind:
                return msg
        return None

    try:
        sub.setsockopt(zmq.SUBSCRIBE, mine)
        sub.connect(f"tcp://127.0.0.1:{port}")
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        lead.start()
        info = {"version": PROTOCOL_VERSION, "nproc": 1, "host": "partitioned", "address": "127.0.0.1",
                "node_rank": 1, "pid": 1}
        deadline = time.monotonic() + 20
        while not heard("welcome", 0.3):  # (it joins again until its welcome comes)
            assert time.monotonic() < deadline, "no welcome"
            push.send_multipart(codec.encode(["join", node_id, info]))
        sub.close(linger=0)  # the partition: what the leader says now is lost
        # (dropped, not "not probed": the welcome may be heard before the leader records the probing)
        wait_until(lambda: node_id in lead.membership._dropped_ids, 10, "the node dropped (liveness 1 s)")
        subs.append(ctx.socket(zmq.SUB))  # the link is back (the answer goes again until heard)
        subs[-1].setsockopt(zmq.SUBSCRIBE, mine)
        subs[-1].connect(f"tcp://127.0.0.1:{port}")
        got = None
        for _ in range(20):
            push.send_multipart(codec.encode(["subscribed", node_id]))  # its late answer
            if (got := heard("dropped", 0.5)) is not None:
                break
        assert got is not None, "the node was not told it was dropped"
        assert 1 not in lead.membership.nodes
        for _ in range(3):  # an id never dropped gets no answer: here one whose topic (a
            # prefix) would reach this node's as a call in parts, had it still been a member
            push.send_multipart(codec.encode(["subscribed", node_id + "R*"]))
        assert not subs[-1].poll(1000), "an answer to an id made up"
    finally:
        lead.close()
        for s in (*subs, push):
            s.close(linger=0)
        ctx.term()


def test_a_value_from_the_network_is_named_without_a_repr_of_its_bytes():
    """Log lines and errors (a protocol error, a failed start) name what came with
    ``brief``: 64 MiB of bytes in it cost a cut of 80, not a repr of 64 MiB (256
    MiB of text, which reprlib made whole before cutting it). Sabotage: a plain
    ``reprlib.Repr()`` -> 512 MiB at the peak (both reprs)."""
    import tracemalloc

    from zbus.errors import brief

    big = bytes(64 * 2**20)
    mutable = bytearray(big)
    tracemalloc.start()
    try:
        named = brief([1, 102, 0, big]), brief(mutable), brief(b"ab")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak / 2**20:.1f} MiB"
    assert named[0].startswith("[1, 102, 0, b'\\x00") and named[0].endswith(f"... ({len(big)} bytes)]")
    assert named[1].startswith("bytearray(b'\\x00") and named[2] == "b'ab'"
    assert max(len(n) for n in named) < 400


def test_a_tensor_array_or_error_from_the_network_is_named_without_its_repr():
    """Nor is a tensor's, an array's or an error info's whole repr made: torch
    prints every item of a tensor whose dimensions are all 2 (16x its bytes, and
    slow: the leader's reader of heartbeats named 10 forged 48 KiB tensors in 3.3
    s), and an error's fields are the sender's strings. Sabotage: no
    ``repr_instance`` in ``_Brief`` (reprlib's, as before) -> MiBs at the peak."""
    import tracemalloc

    import numpy as np
    import torch

    from zbus.errors import brief

    tensor = torch.zeros([2] * 16, dtype=torch.uint8)
    info = codec.ExceptionInfo("x.Error", "\x00" * 2**22, "")
    tracemalloc.start()
    try:
        named = (brief([1, 5, 2, tensor]), brief(np.zeros([2] * 16, np.uint8)), brief(info),
                 brief([1.5, True, None]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak / 2**20:.1f} MiB"
    assert named[0] == "[1, 5, 2, <Tensor of shape [2, 2, 2, 2, 2, 2, ...]>]"
    assert named[1] == "<ndarray of shape [2, 2, 2, 2, 2, 2, ...]>"
    assert named[2].startswith("ExceptionInfo(type_name='x.Error', message='\\x00") and len(named[2]) < 400
    assert named[3] == "[1.5, True, None]"


def test_the_leader_io_loop_survives_any_error_and_keeps_heartbeats():
    """Crafted messages on the PULL port, and an error inside the loop itself (as a
    bug or a message that breaks a handler would raise), are logged and counted;
    heartbeats go on. Fails if the I/O loop catches only ZMQError, or if a dropped
    message is formatted with str() of the whole value."""
    from zbus.errors import brief

    assert len(brief([[[[list(range(1000))]]]] * 1000)) < 200
    deep = []
    for _ in range(5000):
        deep = [deep]
    assert len(brief(deep)) < 100  # str(deep) raises RecursionError
    lead, port = bare_leader(nnodes=2)
    ctx = zmq.Context()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    try:
        broken = {"n": 0}
        real = lead.membership._read_subscriptions

        def flaky():
            if broken["n"] < 3:
                broken["n"] += 1
                raise RecursionError("maximum recursion depth exceeded")
            real()

        lead.membership._read_subscriptions = flaky
        lead.start()
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC_HEARTBEAT)
        sub.connect(f"tcp://127.0.0.1:{port}")
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        for frames in ([b"\x81\xa1a" * 1000 + b"\xc0"], [b"\x91" * 60 + b"\x90"], [b"\xc1garbage"],
                       codec.encode({"a": [[[[1]]]]}), codec.encode(["unknown", [[[[2]]]]])):
            push.send_multipart(frames)
        deadline = time.monotonic() + 10
        beats = 0
        while beats < 5 and time.monotonic() < deadline:
            if sub.poll(500):
                sub.recv_multipart()
                beats += 1
        assert beats >= 5, "heartbeats stopped"
        assert broken["n"] == 3 and lead.membership._thread.is_alive()
        assert lead.dropped >= 5 + 3
        assert lead.failure.error is None
    finally:
        sub.close(linger=0)
        push.close(linger=0)
        ctx.term()
        lead.close()


def test_liveness_runs_on_the_io_thread_while_a_caller_is_blocked_publishing():
    """A caller blocks inside a publish on a slow subscriber (it never reads, so its
    queue fills and the send waits, holding the XPUB socket). Meanwhile the leader's
    I/O thread still reads node 1's heartbeats and fails silent node 2 with
    ``NodeLostError`` within the 1 s liveness limit; the failure wakes the blocked
    caller (``Cancelled``). Liveness waits on no caller's thread. Sabotage: check
    liveness only once a heartbeat went out (indent ``self._check_liveness(...)``
    in ``Membership._step`` under the ``if self.path.send_control(...)``): no node
    is lost while the caller blocks, and it waits out its 10 s send instead."""
    from zbus.errors import Cancelled, SendTimeout
    from zbus.membership import NodeInfo

    lead, port = bare_leader(nnodes=3)
    ctx = zmq.Context()
    slow, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    state: dict = {"since": None, "error": None}

    def publish_until_blocked():
        try:
            while True:  # 1 MiB calls to a subscriber that reads none: the pipe and the kernel fill
                state["since"] = time.monotonic()
                lead.bcast.publish_frames([bytes(2**20)], 10.0, TOPIC_RPC, cancel=lead.failure.cancel,
                                          lock=lead.xpub_lock)
        except (Cancelled, SendTimeout) as e:
            state["error"] = e
            state["ended"] = time.monotonic()

    try:
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.setsockopt(zmq.SUBSCRIBE, TOPIC_RPC)
        slow.connect(f"tcp://127.0.0.1:{port}")
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        lead.membership.formed = True
        lead.start()
        caller = threading.Thread(target=publish_until_blocked, daemon=True)
        caller.start()
        wait_until(lambda: state["since"] is not None and time.monotonic() - state["since"] > 0.3, 20,
                   "the caller blocked in a publish")
        t0 = time.monotonic()
        for rank in (1, 2):
            lead.nodes[rank] = NodeInfo(rank, f"id{rank}", f"node{rank}", "127.0.0.1", 1, 0, t0)
        while lead.failure.error is None and time.monotonic() - t0 < 5:
            # node 1 lives, node 2 is silent
            push.send_multipart(codec.encode(["hb", 1, lead.path.session, 0]))
            time.sleep(0.05)
        lost = time.monotonic() - t0
        caller.join(10)
        error = lead.failure.error
        print(f"node 2 lost {lost:.2f} s after it fell silent, the caller blocked all along; "
              f"node 1's heartbeats read meanwhile: {lead.metrics.heartbeats.get(1, 0)}")
        assert isinstance(error, zbus.NodeLostError) and error.node_rank == 2, error
        assert lost < 1.0 + 1.0
        assert isinstance(state["error"], Cancelled), state["error"]  # woken by the failure
        assert state["since"] < t0  # in the publish that blocked before the nodes were added
        assert lead.metrics.heartbeats.get(1, 0) >= 5
    finally:
        slow.close(linger=0)
        push.close(linger=0)
        ctx.term()
        lead.close()


def test_heartbeats_reach_the_other_nodes_while_one_node_stalls_the_calls():
    """A node stops reading (its queue fills, so a call waits on it, holding the XPUB
    socket): the other nodes must still hear the leader, or they take it for lost
    and leave, and the failure blames them instead of the stalled node. While the
    call waits, the heartbeats go out on each node's own topic that has room, and
    the call stays waiting for all. Sabotage: send heartbeats as one broadcast
    only (no ``instead`` topics in ``DataPath._send_now``), or keep the socket
    for the whole wait (no ``turn.let_others()`` in ``queues._send_waiting``): no
    heartbeat reaches the healthy node while the call waits."""
    from zbus.errors import Cancelled, SendTimeout
    from zbus.membership import NodeInfo

    lead, port = bare_leader(nnodes=3)
    ctx = zmq.Context()
    slow, healthy, push = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    state: dict = {"since": None, "error": None}
    stop = threading.Event()

    def publish_until_blocked():
        try:
            while True:
                state["since"] = time.monotonic()
                lead.bcast.publish_frames([bytes(2**20)], 20.0, TOPIC_RPC, cancel=lead.failure.cancel,
                                          lock=lead.xpub_lock)
        except (Cancelled, SendTimeout) as e:
            state["error"] = e

    def nodes_live() -> None:  # for the leader, both nodes are alive
        while not stop.wait(0.05):
            for rank in (1, 2):
                push.send_multipart(codec.encode(["hb", rank, lead.path.session, 0]))

    def heartbeats_heard(seconds: float) -> int:
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            if healthy.poll(50, zmq.POLLIN):
                topic, *frames = healthy.recv_multipart()
                n += topic != TOPIC_RPC and codec.decode(frames)[0] == "hb"
        return n

    beating = threading.Thread(target=nodes_live, daemon=True)
    caller = threading.Thread(target=publish_until_blocked, daemon=True)
    try:
        slow.setsockopt(zmq.RCVHWM, 1)
        for sub, node_id in ((slow, "id2"), (healthy, "id1")):  # as a welcomed agent (R: any session)
            for topic in (TOPIC_RPC, TOPIC_HEARTBEAT, node_topic(node_id)):
                sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(f"tcp://127.0.0.1:{port}")
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        t0 = time.monotonic()
        for rank in (1, 2):
            lead.nodes[rank] = NodeInfo(rank, f"id{rank}", f"node{rank}", "127.0.0.1", 1, 0, t0)
        lead.membership.formed = True
        lead.start()
        beating.start()
        wait_until(lambda: heartbeats_heard(0.3) > 0, 20, "a first heartbeat on the healthy node")
        caller.start()
        # the healthy node reads its calls: only the stalled one fills
        wait_until(lambda: (heartbeats_heard(0.05), state["since"] is not None
                            and time.monotonic() - state["since"] > 0.3)[1], 20, "the caller blocked")
        blocked_at = state["since"]
        heard = heartbeats_heard(2.0)
        print(f"the call waited {time.monotonic() - blocked_at:.1f} s on the stalled node; "
              f"heartbeats heard by the other node meanwhile: {heard} (one per 0.2 s)")
        assert state["since"] == blocked_at and state["error"] is None  # still the same waiting call
        assert lead.failure.error is None
        assert heard >= 5
    finally:
        lead.failure.fail(zbus.ExecutorFailedError("the test is over"))  # wakes the caller
        for thread in (caller, beating):
            stop.set()
            if thread.is_alive():
                thread.join(5)
        lead.close()
        for sock in (slow, healthy, push):
            sock.close(linger=0)
        ctx.term()


def test_status_requests_from_a_peer_that_reads_no_answer_do_not_hold_up_heartbeats():
    """A peer subscribes to every status answer (``S``), reads none, and floods the
    leader's port with status requests: each answer that finds no room is dropped
    at once, and the I/O thread goes on heartbeating the nodes. Sabotage: answer
    with ``wait=True`` in ``Membership._answer_status`` (1 s for each answer that
    finds the peer full): no heartbeat for minutes."""
    with formed_leader_and_a_peer_that_reads_nothing(b"S") as (lead, healthy, push, _):
        lead.membership._status = lambda: {"pad": "x" * 16384}  # answers that fill the peer soon
        for i in range(3000):
            push.send_multipart(codec.encode(["status", f"t{i}"]))
        heard = heartbeats_heard(healthy, 3.0)
        print(f"heartbeats heard in 3 s while 3000 status answers went to a peer that reads none: {heard}")
        assert heard >= 8  # one per 0.2 s


@contextlib.contextmanager
def formed_leader_and_a_peer_that_reads_nothing(topic: bytes, rcvbuf: int = 0):
    """A formed leader (no executor) heartbeating, a peer subscribed to ``topic``
    that reads nothing, a subscriber to the heartbeats, and a PUSH socket to the
    leader's port: ``(leader, heartbeats, push, peer)``."""
    lead, port = bare_leader(nnodes=2)
    ctx = zmq.Context()
    hog, healthy, push = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    try:
        hog.setsockopt(zmq.RCVHWM, 1)
        if rcvbuf:
            hog.setsockopt(zmq.RCVBUF, rcvbuf)
        hog.setsockopt(zmq.SUBSCRIBE, topic)
        healthy.setsockopt(zmq.SUBSCRIBE, TOPIC_HEARTBEAT)
        for sub in (hog, healthy):
            sub.connect(f"tcp://127.0.0.1:{port}")
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        lead.membership.formed = True
        lead.start()
        wait_until(lambda: heartbeats_heard(healthy, 0.3) > 0, 20, "a first heartbeat")
        yield lead, healthy, push, hog
    finally:
        lead.close()
        for sock in (hog, healthy, push):
            sock.close(linger=0)
        ctx.term()


def test_a_join_that_waited_for_the_last_node_being_probed_is_refused_as_late():
    """Of 2 nodes, A is welcomed as node 1 and probed; B, joining for any rank,
    waits (A holds the last rank until it answers or expires). A answers: the
    cluster formed, and B is refused as a late join, failing nothing. Before, B's
    join was welcomed then, found the cluster complete, and failed start-up, where
    B a moment later would have been refused alone. (A and B are scripted on real
    sockets.) Sabotage: no ``formed`` branch in ``Membership._welcome_ready`` ->
    the leader fails ("node b.test refused")."""
    lead, port = bare_leader(nnodes=2)
    ctx = zmq.Context()
    a, b, push = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    try:
        for sub, node_id in ((a, "aa" * 8), (b, "bb" * 8)):
            sub.setsockopt(zmq.SUBSCRIBE, node_topic(node_id))
            sub.connect(f"tcp://127.0.0.1:{port}")
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        lead.start()

        def join(node_id: str) -> None:
            push.send_multipart(codec.encode(["join", node_id, {
                "version": protocol.PROTOCOL_VERSION, "nproc": 1, "host": f"{node_id[0]}.test",
                "address": "127.0.0.1", "node_rank": None, "pid": 1}]))

        def heard(sub: zmq.Socket, kind: str) -> bool:
            while sub.poll(100):
                if codec.decode(sub.recv_multipart()[1:])[0] == kind:
                    return True
            return False

        wait_until(lambda: join("aa" * 8) or heard(a, "welcome"), 20, "A welcomed")
        wait_until(lambda: join("bb" * 8) or "bb" * 8 in lead.membership._joins, 20, "B's join waiting")
        push.send_multipart(codec.encode(["subscribed", "aa" * 8]))
        wait_until(lambda: heard(b, "reject"), 20, "B refused")
        assert lead.membership.formed and lead.nodes[1].node_id == "aa" * 8
        assert lead.failure.error is None, lead.failure.error
        assert lead.dropped_by.get("late-join", 0) >= 1
    finally:
        lead.close()
        for sock in (a, b, push):
            sock.close(linger=0)
        ctx.term()


JOIN_INFO = {"version": protocol.PROTOCOL_VERSION, "nproc": 1, "host": "node-1", "address": "10.0.0.2",
             "node_rank": 1, "pid": 7}  # a well-formed join's fields


@contextlib.contextmanager
def a_forming_leader_and_a_push():
    """A leader of 2 nodes, forming, and a PUSH socket to its port: ``(leader, push)``."""
    lead, port = bare_leader(nnodes=2)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        lead.start()
        yield lead, push
    finally:
        lead.close()
        push.close(linger=0)
        ctx.term()


def test_a_join_whose_host_or_address_is_long_or_unprintable_is_dropped():
    """A join's host and address go into the leader's log lines, its failures'
    texts and ``zbus status``: a peer's join with a name of 1000 bytes (up to 60 KB
    passed), or one holding a newline or a terminal's escape, was kept whole while
    the cluster formed (each of its joins logged: a forged line, an escape run in
    the operator's terminal).
    Such a join is dropped as ``bad-join``; a real one is kept. Sabotage: the types
    alone in ``membership._join_types`` -> none dropped. A message limit under the
    least a node can have, or not a number, is dropped the same way (those would
    refuse every call, or fail each: sabotage: no ``max_message`` check in
    ``_join_field_ok`` -> the first is kept)."""
    with a_forming_leader_and_a_push() as (lead, push):
        bad = [{"host": "x" * 1000}, {"host": "n\nnode 9 joined: forged"}, {"host": "\x1b]0;owned\x07"},
               {"address": "1" * 300}, {"max_message": 2**16 - 1}, {"max_message": "4G"}]
        for i, fields in enumerate([*bad, {}]):
            push.send_multipart(codec.encode(["join", f"{i:016x}", dict(JOIN_INFO, **fields)]))
        wait_until(lambda: lead.dropped_by.get("bad-join") == len(bad), 10, "the bad joins dropped")
        wait_until(lambda: f"{len(bad):016x}" in lead.membership._joins, 10, "the real join kept")
        assert len(lead.membership._joins) == 1


def test_a_node_id_is_16_hex_digits_so_that_none_is_a_prefix_of_another():
    """ZeroMQ matches topics by prefix: a member subscribes ``N<its id>``, and a node
    that joined with that id and one more hex digit (the member's id is in the
    probes while it joins) had all the leader said on its own topic reach the
    member too: its welcome, heartbeats, calls sent again, up to the member's
    backlog. Sabotage: ``{1,32}`` again in ``membership._NODE_ID`` -> that join is
    kept."""
    with a_forming_leader_and_a_push() as (lead, push):
        for node_id in ("ab" * 8 + "0", "ab" * 7, "AB" * 8, "ab" * 8):
            push.send_multipart(codec.encode(["join", node_id, JOIN_INFO]))
        wait_until(lambda: "ab" * 8 in lead.membership._joins, 10, "the join of a 16-digit id kept")
        wait_until(lambda: lead.dropped_by.get("bad-join") == 3, 10, "the other ids dropped")
        assert list(lead.membership._joins) == ["ab" * 8]


def test_joins_after_formation_from_a_peer_that_reads_no_answer_do_not_hold_up_heartbeats():
    """A peer subscribes to every node topic (``N``), reads nothing, and floods the
    formed leader with joins: each is refused with a ``reject`` on its node topic
    that is dropped at once if it finds no room, so the I/O thread goes on
    heartbeating the nodes: 60 000 refused within 30 s, heartbeats on meanwhile.
    Node ids are 16 hex digits; a longer one is a malformed join. Sabotage:
    reject with ``wait=True`` in ``Membership._on_join`` -> once the peer's queues
    are full (about 37 000 refusals), each refusal waits for room: 40 000 refused
    in 30 s."""
    with formed_leader_and_a_peer_that_reads_nothing(b"N", rcvbuf=4096) as (lead, healthy, push, _):
        push.send_multipart(codec.encode(["join", "x" * 33, {}]))
        wait_until(lambda: lead.dropped_by.get("bad-join") == 1, 10, "the long node id dropped")
        stop, sent = threading.Event(), [0]

        def flood() -> None:  # on, while the heartbeats are counted
            while not stop.wait(0.01):
                for _ in range(500):  # paced: the leader's control backlog would drop a burst
                    try:
                        push.send_multipart(codec.encode(["join", f"{sent[0]:016x}", {}]), zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sent[0] += 1

        flooding = threading.Thread(target=flood)
        flooding.start()
        try:
            end = time.monotonic() + 30
            while lead.dropped_by.get("late-join", 0) < JOIN_FLOOD and time.monotonic() < end:
                time.sleep(0.1)
            refused = lead.dropped_by.get("late-join", 0)
            heard = heartbeats_heard(healthy, 3.0)
        finally:
            stop.set()
            flooding.join(10)
        print(f"heartbeats heard in 3 s after {refused} of {sent[0]} joins refused to a peer that reads "
              f"none: {heard}")
        assert heard >= 8 and refused >= JOIN_FLOOD  # one heartbeat per 0.2 s


def test_a_welcome_to_a_joiner_that_reads_nothing_holds_up_no_heartbeat():
    """A peer subscribes to its node topic, reads nothing (its queue is full), and
    sends a valid join: the leader's welcome finds no room and is dropped at once
    (a real joiner sends its join again every 2 s), so the I/O thread goes on
    heartbeating. Before, the welcome waited up to 5 s for room on the I/O thread,
    holding the XPUB's lock too. Sabotage: ``wait=True, timeout=5.0`` for the
    welcome in ``Membership._welcome``, as before -> no heartbeat for 5 s after the
    join. (``wait=True`` alone waits its 1 s: this test does not see that.)"""
    from zbus.protocol import PROTOCOL_VERSION

    lead, port = bare_leader(nnodes=2)
    ctx = zmq.Context()
    hog, healthy, push = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    hog_id = "0a1b" * 4
    try:
        hog.setsockopt(zmq.RCVHWM, 1)
        hog.setsockopt(zmq.RCVBUF, 4096)
        hog.setsockopt(zmq.SUBSCRIBE, node_topic(hog_id))
        healthy.setsockopt(zmq.SUBSCRIBE, TOPIC_HEARTBEAT)
        for sub in (hog, healthy):
            sub.connect(f"tcp://127.0.0.1:{port}")
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        lead.start()
        wait_until(lambda: heartbeats_heard(healthy, 0.3) > 0, 20, "a first heartbeat")
        wait_until(lambda: node_topic(hog_id) in lead.membership._subscribed, 10, "the peer's subscription")
        filled = 0
        while filled < 2000 and lead.path.send_control(node_topic(hog_id), ["filler", bytes(2**16)],
                                                       wait=False):
            filled += 1
        assert filled < 2000, "the peer's queue never filled"
        handled = lead.path._control_out  # (counted as a control message's handling begins)
        push.send_multipart(codec.encode(["join", hog_id, {
            "version": PROTOCOL_VERSION, "nproc": 1, "host": "hog", "address": "127.0.0.1", "node_rank": 1,
            "pid": 1}]))
        wait_until(lambda: lead.path._control_out > handled, 10, "the join handled")
        heard = heartbeats_heard(healthy, 3.0)
        print(f"heartbeats heard in the 3 s after the join: {heard}")
        assert not lead.membership._joins and not lead.dropped_by  # the join was taken
        assert heard >= 8  # one per 0.2 s
    finally:
        lead.close()
        for sock in (hog, healthy, push):
            sock.close(linger=0)
        ctx.term()



JOIN_FLOOD = 60_000  # refusals: more than the peer's queues and the kernel's buffers take


def heartbeats_heard(sub: zmq.Socket, seconds: float) -> int:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        if sub.poll(50, zmq.POLLIN):
            n += codec.decode(sub.recv_multipart()[1:])[0] == "hb"
    return n


def test_calls_sent_again_to_a_node_whose_queue_is_full_wait_for_its_next_ask(caplog):
    """Node 1 lost calls 1 to 3 (a reset connection) and asks for them again while
    its queue at the leader is full (its new connection not yet read): the leader
    sends what fits within 20 ms and the node asks again for the rest, as it does
    every 0.5 s until its own limit. The leader gave the node up ("missed calls")
    when the calls found no room within 1 s, as if they were no longer kept, and
    waited that second on its I/O thread. A gap across calls no longer kept still fails
    the node. Sabotage: return None in ``DataPath.resend`` when a send times out
    -> NodeLostError at the first ask."""
    from zbus.membership import NodeInfo

    caplog.set_level("DEBUG", logger="zbus.membership")
    topic = node_topic("n1")
    with formed_leader_and_a_peer_that_reads_nothing(topic, rcvbuf=4096) as (lead, _, push, node):
        lead.nodes[1] = NodeInfo(1, "n1", "n1.test", "127.0.0.1", 1, 1, time.monotonic())
        for seq in (1, 2, 3):
            lead.path.sent(seq, [b"call %d" % seq], [1])
        refused = 0
        for _ in range(100_000):  # fill the node's queue, until the kernel takes no more of it
            if lead.path.send_control(topic, "x" * 16384, wait=False):
                refused = 0
            elif (refused := refused + 1) < 5:
                time.sleep(0.05)
            else:
                break
        calls: list[bytes] = []

        def ask() -> None:  # with its heartbeat (liveness 1 s)
            push.send_multipart(codec.encode(["hb", 1, lead.path.session]))
            push.send_multipart(codec.encode(["gap", 1, lead.path.session, 1, 4]))
            time.sleep(0.1)

        def full_queue_answered() -> bool:
            ask()
            return "missed calls 1 to 4: 0 sent again" in caplog.text

        def calls_arrived() -> bool:  # its connection is read at last
            while node.poll(200):
                frames = node.recv_multipart()
                calls.extend(frames[1:] if frames[0] == topic + TOPIC_RPC else [])
            if len(calls) < 3:
                ask()
            return len(calls) >= 3

        wait_until(full_queue_answered, 10, "an ask answered while the queue is full")
        assert lead.failure.error is None, lead.failure.error
        wait_until(calls_arrived, 10, "the calls sent again")
        # (an ask may come while the first calls sent again are still queued)
        assert list(dict.fromkeys(calls)) == [b"call 1", b"call 2", b"call 3"]
        assert lead.failure.error is None
        push.send_multipart(codec.encode(["gap", 1, lead.path.session, 0, 4]))  # call 0 was never kept
        wait_until(lambda: lead.failure.error is not None, 10, "the node failed")
        assert "missed calls 0 to 4" in str(lead.failure.error)


def test_a_nodes_asks_for_lost_calls_are_answered_at_most_every_quarter_second():
    """A node (a key holder, say) asks for lost calls 300 times at once. Each ask
    was answered: the calls kept scanned and sent again, another copy queued for
    the node each time (one that reads none holds them all), the I/O thread busy
    with it rather than heartbeating. At most one ask of a node is answered every
    0.25 s (its agent asks every 0.5 s); the rest are dropped and counted.
    Sabotage: no ``GAP_EVERY_S`` check in ``Membership.handle`` -> 900 calls sent
    again."""
    from zbus.membership import GAP_EVERY_S, NodeInfo

    with formed_leader_and_a_peer_that_reads_nothing(node_topic("n1")) as (lead, _, push, _node):
        lead.nodes[1] = NodeInfo(1, "n1", "n1.test", "127.0.0.1", 1, 1, time.monotonic())
        for seq in (1, 2, 3):
            lead.path.sent(seq, [b"call %d" % seq], [1])
        start = time.monotonic()
        for _ in range(300):
            push.send_multipart(codec.encode(["gap", 1, lead.path.session, 1, 4]))
        # (each answered ask sends the 3 calls: the node's queue has room for them)
        wait_until(lambda: lead.calls_again + 3 * lead.dropped_by.get("gap-too-soon", 0) >= 900, 20,
                   "every ask handled")
        took = time.monotonic() - start
        answered = 300 - lead.dropped_by.get("gap-too-soon", 0)
        assert 1 <= answered <= 1 + took / GAP_EVERY_S, (answered, took)
        assert lead.calls_again == 3 * answered
        assert lead.failure.error is None, lead.failure.error


def test_an_ask_for_calls_the_node_has_since_relayed_fails_nothing():
    """Node 1 asked for calls 3 on again (a reset connection), and they reached it
    before the leader handled the ask: its heartbeat, read at once, says it has
    call 5, and the leader forgot its copies; the ask, which waits for the I/O
    thread, comes after. It asks for nothing the node lacks: nothing is sent, and
    nothing fails. Before, calls 3.. were no longer kept, and the leader failed the
    node ("missed calls 3 to 6"). Sabotage: no ``had`` check in ``DataPath.resend``
    -> NodeLostError."""
    from zbus.membership import NodeInfo

    with formed_leader_and_a_peer_that_reads_nothing(node_topic("n1")) as (lead, _, push, _node):
        lead.nodes[1] = NodeInfo(1, "n1", "n1.test", "127.0.0.1", 1, 1, time.monotonic())
        for seq in range(1, 6):
            lead.path.sent(seq, [b"call %d" % seq], [1])
        session = lead.path.session

        def beating(done):  # node 1's heartbeat, saying it has call 5 (liveness 1 s)
            push.send_multipart(codec.encode(["hb", 1, session, 5]))
            return done()

        wait_until(lambda: beating(lambda: not lead.path.calls._kept), 10, "the copies forgotten")
        handled = lead.path._control_out
        push.send_multipart(codec.encode(["gap", 1, session, 3, 6]))
        wait_until(lambda: beating(lambda: lead.path._control_out > handled), 10, "the ask handled")
        assert lead.failure.error is None, lead.failure.error
        assert lead.calls_again == 0


def test_a_sustained_burst_of_small_calls_keeps_the_slowest_node_alive():
    """Non-blocking calls non-stop for 3 x the 2 s liveness limit; node 1's worker is
    the slowest consumer (5 ms a call), and its agent never sleeps on the full ring
    (``ZBUS_YIELD_US`` 1 s: it waits by yielding, as under a steady load where space
    comes back within the yield phase). It still heartbeats on time, so the leader
    loses no node. Sabotage: heartbeat only from ``NodeAgent._serve``'s outer loop
    and ``_on_ring_full`` (drop the ``self._tick()`` of the inner loop):
    ``NodeLostError`` after about 2 s."""
    port = free_port_pair()
    env = dict(os.environ, PYTHONPATH=TEST_PATH, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE="1", ZBUS_ALLOW_WORKERS="workers", ZBUS_YIELD_US="1000000")
    proc = subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", "1"], env=env,
                            stderr=subprocess.DEVNULL)
    try:
        with leader(port, nnodes=2, join_timeout=60) as ex:
            end, calls, last = time.monotonic() + 6.0, 0, None
            while time.monotonic() < end:
                last = ex.collective_rpc("sleep_on_node", args=(1, 0.005), non_block=True)
                calls += 1
            last.result(timeout=60)
            ex.check_health()
            print(f"{calls} calls sent in 6 s, node 1 5 ms per call: no node lost")
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_a_failed_executor_tells_its_nodes_to_end_without_a_shutdown():
    """Node 1's worker is SIGKILLed: the executor fails, and node 2's agent and
    worker end within a few seconds though the driver never calls ``shutdown``.
    Sabotage: keep heartbeating after a failure (``hb`` instead of ``failed`` in
    ``Membership._step``): node 2 holds its worker until the driver shuts down."""
    with leader_and_two_followers() as (ex, procs, node2):
        pending = ex.collective_rpc("die", kwargs={"rank": 1}, non_block=True)
        with pytest.raises(zbus.WorkerDiedError):
            pending.result(timeout=20)
        assert_node_2_ends_at_once(procs, node2, "no shutdown")


def test_a_failed_executor_ends_its_own_workers_and_every_nodes_named_memory():
    """Every worker names shared memory with its node's prefix, then sleeps deaf
    to SIGTERM (as vLLM's CPU all-reduce in its native spin); node 1's worker is
    SIGKILLed. Without a shutdown, the leader's own worker ends as node 2's does,
    and both nodes' names are gone. Sabotage: no stop of the workers in
    ``MultiprocExecutor._on_failure``: rank 0 spins until shutdown; no
    ``shm.unlink_prefixed`` in ``LocalWorkers.stop`` and ``kill``: the names stay."""
    with leader_and_two_followers() as (ex, procs, node2):
        prefixes = [node_shm_prefix(ex.torch_port, n) for n in range(3)]
        try:
            pending = ex.collective_rpc("stubborn_node_shm", args=("held", 60), non_block=True)
            wait_until(lambda: all(os.path.exists(f"/dev/shm/{p}held") for p in prefixes), 20,
                       "every worker holding its node's name")
            psutil.Process(procs[0].pid).children()[0].kill()
            with pytest.raises(zbus.WorkerDiedError):
                pending.result(timeout=20)
            rank0 = psutil.Process(ex._workers.procs[0].pid)
            # grace 0.2 s, SIGTERM ignored for 2 s, then SIGKILL
            gone, alive = psutil.wait_procs([rank0, *node2], timeout=10)
            assert not alive, f"still running after the failure: {alive}"
            wait_until(lambda: not [n for n in os.listdir("/dev/shm") if n.startswith(tuple(prefixes))],
                       5, "the nodes' names removed once their workers ended")
        finally:
            for p in prefixes:
                unlink_prefixed(p)


def test_a_node_whose_every_process_is_sigkilled_leaves_no_segment():
    """Once call 1 has come (every worker of the cluster mapped its ring before),
    a node's ring has no name: SIGKILLing its agent and its worker at once leaves
    nothing in /dev/shm. Sabotage: no ``shm.unlink`` of the ring in
    ``NodeAgent._tick`` -> the name stays."""
    with leader_and_two_followers() as (ex, procs, node2):
        agent = node2[0]

        def named() -> set[str]:
            return {n for n in zbus_segments() if n.split("-")[2] == str(agent.pid)}

        assert named(), "node 2's ring is named while the cluster forms"
        assert [r["rank"] for r in ex.collective_rpc("whoami", timeout=20)] == [0, 1, 2]
        wait_until(lambda: not named(), 5, "node 2's ring without a name after call 1")
        used = shm_used()
        for p in node2:
            p.kill()
        assert psutil.wait_procs(node2, timeout=10)[1] == []
        # its memory went with its processes (before the leader's liveness limit
        # fails the executor and the other nodes free theirs)
        calls = RingGeometry.from_env(calls=True)
        assert used - shm_used() >= calls.chunk_bytes * calls.n_chunks - 2**20


def assert_node_2_ends_at_once(procs: list, node2: list, how: str) -> None:
    """Node 2's agent and worker end within 3 s of the executor's failure; its agent exits 0."""
    t0 = time.monotonic()
    gone, alive = psutil.wait_procs(node2, timeout=10)
    elapsed = time.monotonic() - t0
    print(f"node 2 ended {elapsed:.2f} s after the executor failed ({how})")
    assert not alive and elapsed < 3.0
    assert procs[1].wait(1) == 0


def test_a_failed_executor_ends_a_node_whose_relay_waits_on_a_stuck_worker():
    """Node 2's worker is stuck in a call and more calls than its ring holds wait
    behind it, so its agent waits for room in the ring. Then node 1's worker dies:
    node 2 still hears ``failed`` and ends at once. Sabotage: leave what the relay
    reads ahead for later (no ``self._ends(msg)`` in ``NodeAgent._read_ahead``): node 2
    holds its worker until the driver shuts down."""
    with leader_and_two_followers() as (ex, procs, node2):
        stuck = ex.collective_rpc("sleep_on_node", args=(2, 60), non_block=True)
        for _ in range(12):  # the ring holds 8
            ex.collective_rpc("whoami", non_block=True)
        # node 2's heartbeats name the last call its agent relayed: 8 past the stuck one,
        # and no further, is a full ring
        wait_until(lambda: ex._leader.path.calls._have.get(2, 0) >= stuck.seq + 8, 10,
                   "node 2's agent waiting for room in its ring")
        assert all(p.is_running() for p in node2)
        with pytest.raises(zbus.WorkerDiedError):
            ex.collective_rpc("die", kwargs={"rank": 1}, timeout=20)
        assert_node_2_ends_at_once(procs, node2, "its relay waiting")


def test_a_node_that_gives_up_tells_the_leader_why():
    """Node 2's agent gets a call it cannot read (here a call in parts that do not
    fit, on its node topic) and leaves the cluster: the executor fails at once with
    the node's reason, not a liveness limit later with "no heartbeat". Sabotage: no
    ``leaving`` message in ``NodeAgent.run``: the error says "no heartbeat"."""
    from zbus import protocol

    with leader_and_two_followers() as (ex, procs, node2):
        lead = ex._leader
        t0 = time.monotonic()
        assert lead.path.send_control(node_topic(lead.nodes[2].node_id) + TOPIC_RPC + protocol.PARTS,
                                      ["not", "parts"])
        assert procs[1].wait(10) == 1
        node_2_left_saying(ex, t0, "malformed call from the leader")


def node_2_left_saying(ex: zbus.Executor, since: float, why: str) -> None:
    """The executor fails (within 10 s) with node 2 lost, for the reason ``why``."""
    wait_until(lambda: ex.failure.error is not None, 10, "the executor failing")
    error = ex.failure.error
    print(f"failed {time.monotonic() - since:.2f} s later: {error}")
    assert isinstance(error, zbus.NodeLostError) and error.node_rank == 2, repr(error)
    assert why in str(error), str(error)


def test_a_follower_stopped_by_sigterm_ends_its_workers_and_tells_the_leader():
    """SIGTERM to node 2's agent (``docker stop``): it ends its worker and tells the
    leader it left, so the executor fails at once with that reason, not a
    liveness limit later with "no heartbeat"; the agent exits 143. Before, the
    signal ended the agent on the spot. Sabotage: no SIGTERM handler in
    ``zbus.cli.main`` -> the agent exits -15 and the error says "no heartbeat"."""
    with leader_and_two_followers() as (ex, procs, node2):
        t0 = time.monotonic()
        procs[1].terminate()
        assert procs[1].wait(15) == 143
        assert psutil.wait_procs(node2, timeout=10)[1] == []  # its worker ended with it
        node_2_left_saying(ex, t0, "stopped (SIGTERM")


def test_a_follower_stopped_by_sigterm_while_it_closes_leaves_no_ring(tmp_path):
    """Node 1's agent gives up (a call it cannot read) before call 1, so its ring
    still has its name; it waits for its worker, slow to end (an ``atexit`` hook of
    5 s), and SIGTERM lands then, as ``zbus demo`` ends its followers. The agent
    still removes its ring's name and ends its worker. Before, the signal's
    SystemExit cut its close short before the ring was closed: the name stayed in
    /dev/shm (a CI run of ``zbus demo``'s SIGTERM test failed so). The name is
    gone already while the agent waits for its worker. Sabotage: no ``shm.unlink``
    before the waits in ``NodeAgent._close`` -> the name is there while it waits
    (the ring's own close removes it once the wait is cut short); and that close's
    unlink too -> the agent's segment is left."""
    from zbus import protocol

    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        agent = psutil.Process(proc.pid)
        with leader(port, workers.SlowExitWorker, nnodes=2, join_timeout=60,
                    worker_kwargs={"path": str(tmp_path / "exit"), "seconds": 5.0}) as ex:
            node1 = [agent, *agent.children()]
            lead = ex._leader
            assert lead.path.send_control(node_topic(lead.nodes[1].node_id) + TOPIC_RPC + protocol.PARTS,
                                          ["not", "parts"])
            wait_until((tmp_path / "exit.1").exists, 10, "node 1's worker running its atexit hook")
            named = [n for n in zbus_segments() if n.split("-")[2] == str(proc.pid)]
            assert not named, f"node 1's agent waits for its worker with its ring named: {named}"
            proc.terminate()  # the agent waits 2 s for that worker, then SIGTERMs it
            assert proc.wait(15) == 143
            assert psutil.wait_procs(node1, timeout=10)[1] == []
        left = [n for n in zbus_segments() if n.split("-")[2] == str(proc.pid)]
        assert not left, f"node 1's agent left {left}"
    finally:
        end_process(proc)
        shm.sweep_stale()  # (what a failure left, for the next test's check)


def test_a_caller_waiting_to_send_when_the_executor_fails_sends_nothing():
    """A caller waits for the send lock (another caller sends) while node 2's worker
    dies: once it has the lock it raises the failure and sends nothing. Before,
    only a shutdown was checked there: the call went to the nodes, whose ranks ran
    one call more after the failure. Sabotage: no ``raise_if_failed`` after the
    send lock in ``collective_rpc`` -> the call is numbered and sent."""
    with leader_and_two_followers() as (ex, procs, node2):
        assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11, 12]
        seq = ex._seq
        outcome: list = []

        def call():
            try:
                outcome.append(ex.collective_rpc("rank_value", args=(2,), timeout=30))
            except BaseException as e:  # noqa: BLE001 - the test checks the type
                outcome.append(e)

        assert ex._send_lock.acquire(timeout=10)  # as a caller that sends
        try:
            t = threading.Thread(target=call)
            t.start()
            from blocked_calls import waits_for_the_send_lock

            wait_until(lambda: waits_for_the_send_lock(t), 10, "the caller waiting to send")
            node2[1].kill()
            wait_until(lambda: ex.failure.error is not None, 10, "the executor failing")
        finally:
            ex._send_lock.release()
        t.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], zbus.WorkerDiedError), outcome
        assert ex._seq == seq, "the call was numbered and sent after the failure"


@contextlib.contextmanager
def leader_and_two_followers(**kw):
    """A leader (``kw``: more of its settings) and followers 1 and 2, one worker
    each: (executor, the follower processes, node 2's agent and worker)."""
    port = free_port_pair()
    procs = [follower(port, "--node-rank", "1"), follower(port, "--node-rank", "2")]
    try:
        ex = leader(port, join_timeout=60, **kw)
        try:
            node2 = [psutil.Process(procs[1].pid), *psutil.Process(procs[1].pid).children()]
            assert len(node2) == 2  # agent + worker
            yield ex, procs, node2
        finally:
            ex.shutdown()
    finally:
        for p in procs:
            end_process(p)


def test_a_node_takes_the_heartbeat_on_its_own_topic_as_on_the_broadcast_one():
    """While a node stalls the broadcasts, the others get the leader's heartbeat on
    their node topic (see the test above): what it says counts there too. Here the
    leader says ``failed`` on node 2's topic alone: node 2 ends its worker and exits
    0 at once, node 1 goes on. Sabotage: handle heartbeats only on ``H`` in
    ``NodeAgent._serve``: node 2 ignores it and stays."""
    with leader_and_two_followers() as (ex, procs, node2):
        lead = ex._leader
        assert lead.path.send_control(node_topic(lead.nodes[2].node_id),
                                      ["failed", lead.path.session, "a test"])
        gone, alive = psutil.wait_procs(node2, timeout=3)
        assert not alive, "node 2 did not end on a failure said on its node topic"
        assert procs[1].wait(1) == 0
        assert procs[0].poll() is None


def test_a_stalled_node_keeps_no_other_node_from_hearing_the_leaders_bye():
    """Node 2's agent stops reading (SIGSTOP) with its queue full, and the driver
    shuts down: node 1 still hears ``stopping`` and ``bye``, ends its worker and
    exits 0 at once. Before, both went as one broadcast, which waited on node 2 and
    gave up after 1 s: node 1 heard neither and exited 1 at its liveness limit, its
    clean stop told as a lost leader. Sabotage: no per-node copies in
    ``DataPath.tell_nodes`` (return after the broadcast) -> node 1 is still running
    8 s later. The leader's own worker gets its STOP too, and exits 0 at once:
    until 2026-12-06 the STOP whose broadcast timed out never reached the local
    ring, and the worker waited out its 5 s grace to end by SIGTERM (sabotage: no
    local copy in ``MultiprocExecutor._publish_stop`` -> exit code 143). So does
    node 1's worker, whose STOP did not come either: the bye ends the ring it reads
    (until 2026-12-07 it waited out its grace too, and was sent SIGTERM; sabotage:
    no ``ring.end()`` on ``bye`` in ``NodeAgent._ends`` -> node 1 says so)."""
    with node_2_stalled() as (ex, procs):
        ex.shutdown()
        assert ex.failure.error is None  # a clean stop: "bye", not "failed"
        assert [p.returncode for p in ex._workers.procs] == [0]
        assert procs[0].wait(8) == 0
        said = procs[0].stderr.read()
        assert "asked to stop: SIGTERM" not in said, said


@contextlib.contextmanager
def node_2_stalled():
    """``leader_and_two_followers`` with node 2's agent stopped (SIGSTOP) and its
    queue full: (executor, the follower processes). Liveness 10 s: the leader does
    not lose node 2 (and say "failed", which reaches node 1 on its own topic)
    while a shutdown waits on it."""
    with leader_and_two_followers(liveness_s=10.0) as (ex, procs, node2):
        lead = ex._leader
        topic = node_topic(lead.nodes[2].node_id)
        node2[0].suspend()
        try:
            filled = 0
            while filled < 2000 and lead.path.send_control(topic, ["filler", bytes(2**18)], wait=False):
                filled += 1
            assert filled < 2000, "node 2's queue never filled"
            yield ex, procs
        finally:
            node2[0].resume()


def test_a_shutdown_that_cancels_a_caller_blocked_on_a_stalled_node_still_stops_its_own_worker():
    """As above, with a caller blocked sending a call (no timeout) to the stalled
    node: the shutdown cancels it (ZbusError), and then its STOP still reaches the
    leader's own worker, which exits 0 at once. Before, the STOP went with the
    executor's cancel event, which the shutdown had just set: nothing was sent, and
    the worker waited out its 5 s grace to end by SIGTERM (143). Sabotage:
    ``self.failure.cancel`` again for the STOP in ``MultiprocExecutor._publish_stop``."""
    with node_2_stalled() as (ex, _):
        got = []

        def call() -> None:
            try:
                ex.collective_rpc("echo", args=(1,))
            except Exception as e:  # noqa: BLE001 - the test reads it
                got.append(e)

        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: ex._send_lock._owner == caller.ident, 10, "the caller sending")
        time.sleep(0.3)  # (its send waiting on node 2)
        assert caller.is_alive() and not got
        ex.shutdown()
        caller.join(10)
        assert [type(e) for e in got] == [zbus.ZbusError], got
        assert [p.returncode for p in ex._workers.procs] == [0]  # (not SIGTERM at its grace's end)


def test_the_nodes_of_a_leader_before_at_the_same_address_keep_no_node_alive_and_fail_nothing():
    """A leader restarted at its address hears the nodes of the one before it until
    they see it a stranger: ZeroMQ reconnects their sockets there, and their
    messages name node ranks its own nodes hold. Such an orphan's heartbeats kept
    a stalled node alive for good, and its "leaving" (an orphan stopped by SIGTERM)
    or "died" failed the cluster; its workers' replies to calls numbered as this
    leader's answered them. A member's messages and its workers' replies name its
    leader's session, and another's are dropped (``other-session``). Here an
    orphan of session ``0 * 16`` answers a call in flight on rank 1, says node 1
    left, its worker died and calls went missing: nothing fails, the call gets
    its real replies, the cluster serves; then it heartbeats for node 2 every 50 ms
    while node 2's agent is stopped (SIGSTOP): node 2 is still lost for "no
    heartbeat" within the 2 s liveness limit. Sabotage: no ``msg[2] !=
    self.session`` in ``Membership.handle`` -> the executor fails with node 1 "it
    left"; no ``tagged[0] != self._reply_tag`` in ``DataPath._checked_message`` ->
    the call's result has the orphan's answer."""
    with leader_and_two_followers() as (ex, procs, node2):
        lead = ex._leader
        ctx = zmq.Context()
        orphan = ctx.socket(zmq.PUSH)
        orphan.connect(f"tcp://127.0.0.1:{lead.settings.master_port + 1}")
        session = "0" * 16
        try:
            in_flight = ex.collective_rpc("later", args=("real", 1.0), non_block=True)
            for msg in ([session, 1, in_flight.seq, 0, "the orphan's"],
                        ["leaving", 1, session, "the node agent was stopped (SIGTERM or Ctrl-C)"],
                        ["died", 1, session, 1, -9], ["gap", 1, session, 1, 5], ["hb", 1, session, 7]):
                orphan.send_multipart(codec.encode(msg), flags=zmq.NOBLOCK)
            wait_until(lambda: lead.dropped_by.get("other-session", 0) >= 4 or ex.failure.error is not None,
                       10, "the orphan's messages dropped")
            assert ex.failure.error is None, ex.failure.error
            assert in_flight.result(30) == ["real"] * 3
            assert lead.dropped_by.get("other-session", 0) == 5, lead.dropped_by
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11, 12]
            node2[0].suspend()
            try:
                start = time.monotonic()
                while ex.failure.error is None and time.monotonic() - start < 10:
                    orphan.send_multipart(codec.encode(["hb", 2, session, 8]), flags=zmq.NOBLOCK)
                    time.sleep(0.05)
                lost = time.monotonic() - start
                assert isinstance(ex.failure.error, zbus.NodeLostError), ex.failure.error
                assert ex.failure.error.node_rank == 2 and "no heartbeat" in str(ex.failure.error)
                assert lost < 2.0 + 1.5, lost
            finally:
                node2[0].resume()
        finally:
            ctx.destroy(linger=0)


def test_a_follower_waiting_to_join_keeps_its_health_file_fresh(tmp_path):
    """A follower with no leader touches ``ZBUS_HEALTH_FILE`` while it waits, so a
    liveness probe (``nodes/healthy.sh``) does not restart it before the leader
    comes. Sabotage: no ``touch_health()`` in ``NodeAgent._join``: the file is
    never made."""
    health = tmp_path / "health"
    env = dict(os.environ, PYTHONPATH=TEST_PATH, ZBUS_MASTER_ADDR="127.0.0.1",
               ZBUS_MASTER_PORT=str(free_port_pair()), ZBUS_HEALTH_FILE=str(health))
    proc = subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--join-timeout", "60"],
                            env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not health.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.exists()
        first = health.stat().st_mtime
        # the agent retries its join every 2 s, touching the file each time
        wait_until(lambda: health.stat().st_mtime > first, 10, "the health file touched again")
        assert proc.poll() is None
        healthy = os.path.join(TEST_PATH.split(os.pathsep)[0], "nodes", "healthy.sh")
        ok = subprocess.run([healthy, "15"], env=env, timeout=30)
        assert ok.returncode == 0
    finally:
        proc.terminate()
        end_process(proc)


@pytest.mark.parametrize("in_parts", [False, True], ids=["whole", "in_parts"])
def test_the_calls_a_node_holds_after_lost_ones_are_bounded_in_bytes(in_parts):
    """Call 2 never reaches node 1 (a reset connection), and 2 MiB calls follow:
    node 1 holds them until the lost one comes again, at most ``BACKLOG_BYTES``
    (4 MiB here), then leaves, saying why. Before, only their count was bounded
    (1024: 64 GiB of 64 MiB weight chunks), and node 1 held all 12 until the
    leader's answer ended it. Sabotage: no byte count in ``NodeAgent._relay`` ->
    node 1 exits 0 on the leader's ``failed``, never saying "too many calls held".
    ``in_parts``: calls cut in 1 MiB parts, as a keyed link carries them; a frame
    in parts was counted as its number of parts (2 "bytes" a call), and node 1
    held them all (sabotage: ``len(f)`` for each frame in ``_call_bytes``)."""
    from zbus import protocol
    from zbus.queues import deadline_of, send_frames

    port = free_port_pair()
    proc = follower(port, "--node-rank", "1", first="import zbus.agent\nzbus.agent.BACKLOG_BYTES = 4 << 20")
    try:
        log = Lines(proc.stderr)
        with leader(port, nnodes=2, join_timeout=60) as ex:
            ex.collective_rpc("noop")
            lead, first = ex._leader, ex._leader.path.sent_seq + 2  # sent_seq + 1 is "lost"
            with lead.xpub_lock:  # all 12 queued before the leader answers node 1's ask
                for seq in range(first, first + 12):
                    frames = [protocol.call_envelope(seq, "noop", -1, 1), bytes(2 << 20)]
                    counts, parts = protocol.in_parts(frames) if in_parts else (b"", frames)
                    call = [lead.rpc_topic + protocol.PARTS, counts, *parts] if in_parts \
                        else [lead.rpc_topic, *frames]
                    send_frames(lead.path.bcast.xpub, call, deadline_of(10), "a test call")
            assert proc.wait(20) == 1
        wait_until(lambda: log.has("too many calls held"), 5, "node 1 saying why it left")
    finally:
        end_process(proc)


def test_replies_sent_again_are_taken_in_call_order_and_copies_dropped():
    """A remote rank's replies after a reset connection: its worker sends again
    what it kept, so a reply may come twice or after later ones. Each ``get``
    returns the reply of the call it wants, copies are dropped and counted, and
    a reply overtaken by later ones that never comes gives way after the grace
    (the caller's check then fails on the later one) rather than a wait for
    ever. Sabotage: take the replies in the order they came, as before (in
    ``RemoteReceiver._take``: ``seq = next(iter(self._replies))``) → fails
    (call 2 gets call 3's reply)."""
    from zbus.datapath import RemoteReceiver

    cond = threading.Condition()
    rx = RemoteReceiver(2, cond, try_read=lambda timeout: False, grace=0.3)  # nobody else reads a socket
    with cond:
        for seq in (-1, 1, 3, 2, 3, 1):  # READY; 3 overtakes 2; copies of 3 and of 1
            rx.put([2, seq, 0, f"reply {seq}"])
    assert rx.get(1) == [2, -1, 0, "reply -1"]  # READY: whatever comes first
    assert [rx.get(1, want=s)[3] for s in (1, 2, 3)] == ["reply 1", "reply 2", "reply 3"]
    with cond:
        rx.put([2, 2, 0, "reply 2"])  # a copy of one already taken
        rx.put([2, 5, 0, "reply 5"])  # 4 lost for good
    assert rx.again == 3
    assert not rx.poll(4) and rx.poll(5)
    t0 = time.monotonic()
    assert rx.get(5, want=4)[1] == 5  # after the grace: the caller sees 5 where it wanted 4
    assert 0.25 < time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError):
        rx.get(0.1, want=6)


def test_sent_calls_keep_what_a_node_may_lack_and_only_whole_runs_are_sent_again():
    """Copies are dropped once every node has them (a worker's reply or an agent's
    heartbeat says so, never past the calls sent) or past the byte limit, oldest
    first; a run with a dropped call is not sent again; a call over the limit is
    not copied at all (before, a call of gigabytes was copied under the socket's
    lock, then dropped). Sabotage: drop ``min(seq, self.last)`` in
    ``SentCalls.has`` (a peer names a call not yet sent) -> the next call's copy
    is forgotten at once and ``since(4)`` is None; copy every call (as before) ->
    the peak."""
    from zbus.datapath import SentCalls

    calls = SentCalls(limit=300)
    for seq in (1, 2, 3):
        calls.add(seq, [b"e", bytearray(b"x" * 50)], [1, 2])
    calls.has(1, 2)
    calls.forget([1, 2])  # node 2 has nothing yet
    assert calls.since(1) == [[b"e", b"x" * 50]] * 3
    calls.has(2, 99)  # past the calls sent: counts as 3
    calls.forget([1, 2])
    assert calls.since(1) is None and calls.since(3) == [[b"e", b"x" * 50]]
    calls.has(1, 99)  # both past the calls sent: neither may forget call 4 before it is sent
    calls.add(4, [b"e", b"y" * 50], [1, 2])
    assert calls.since(4) == [[b"e", b"y" * 50]] and calls.last == 4
    for seq in range(5, 12):  # 51 bytes each: past 300 the oldest go
        calls.add(seq, [b"e", b"z" * 50], [1, 2, 3])
    assert calls.since(6) is None and len(calls.since(7)) == 5  # 5 x 51 bytes: within 300
    big = bytearray(10**6)  # over the limit: not copied (it would be dropped at once), the rest go too
    tracemalloc.start()
    try:
        calls.add(12, [b"e", big], [1, 2, 3])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10**5, peak
    assert calls.last == 12 and calls.since(7) is None and calls.since(12) is None
    calls.add(13, [b"e", b"w" * 50], [1, 2, 3])
    assert calls.since(13) == [[b"e", b"w" * 50]] and calls.since(12) is None


def test_a_call_over_a_nodes_message_limit_is_refused_before_it_is_sent(monkeypatch):
    """A follower's ``ZBUS_MAX_MESSAGE`` is 1 MiB: a call whose arguments take
    2 MiB, or a byte over 1 MiB, is refused at once with a ``CodecError`` naming
    node 1 and the setting, and sent to no rank; one of exactly 1 MiB reaches both
    ranks, and the executor serves on. Before, the leader sent them: at 2 MiB
    ZeroMQ dropped the node's connection at each try, the node heard no heartbeat
    and left, and the executor failed ("no heartbeat for 2.0 s"); a byte over, each
    rank there answered that it could not decode it. Sabotage: no size check in
    ``collective_rpc``, or the node's ``max_message`` left out of its join -> no
    CodecError."""
    monkeypatch.setenv("ZBUS_MAX_REPLY", "1M")  # (a node refuses a leader that takes larger replies)
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1", env={"ZBUS_MAX_MESSAGE": "1M"})
    try:
        with leader(port, nnodes=2) as ex:
            def size(n: int) -> int:  # as collective_rpc encodes crc's arguments
                return sum(memoryview(f).nbytes for f in codec.encode(((0, b"y" * n), {})))

            n = 2**20 - (size(2**19) - 2**19)
            assert size(n) == 2**20
            for over in (2**20, 1):
                with pytest.raises(zbus.CodecError, match=rf"take {2**20 + over} bytes, over the 1048576 "
                                                          r"that node 1 \(.+\) takes \(ZBUS_MAX_MESSAGE\)"):
                    ex.collective_rpc("crc", args=(0, b"y" * (n + over)), timeout=20)
            assert ex.collective_rpc("crc", args=(0, b"y" * n), timeout=20) == [(0, zlib.crc32(b"y" * n))] * 2
            assert ex.collective_rpc("whoami", timeout=10)[1]["rank"] == 1
    finally:
        end_process(proc, 30)
