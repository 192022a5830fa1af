"""Multi-node clusters for real: three nodes in network namespaces, each with its
own address, /dev/shm and host name; the followers run ``zbus follower`` as the
compose file does. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import compose
import psutil
import pytest
from conftest import TEST_PATH, next_line

from zbus.netns import NetnsCluster, unavailable

REASON = unavailable()
# the tests' own waits (up to 240 s for a driver's answer) run out before the test's timeout
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=f"no namespaces: {REASON}"),
              pytest.mark.timeout(420)]

LIVENESS = 3.0  # the drivers here use 3 s; compose's default is 10 s


NODE_CLEAN_S = 20.0  # how long a test's nodes get to end their processes and names
# After a leader's SIGKILL a node ends within its liveness limit of the last heartbeat
# heard, then its workers (at once, without their stop grace: 2 s more) and its names.
CLEAN_SLACK_S = 1.5


@pytest.fixture
def cluster():
    """Three nodes; after the test, each must be left with no process in its
    namespace and no ``zbus-*`` or node-prefixed name in its /dev/shm (closing the
    cluster kills and removes whatever is there, where the session's own check
    cannot look). Sabotage: none of the agent's three unlinks of its ring (after
    call 1, first in ``NodeAgent._close``, and ``self.ring.close(unlink=False)``
    there) -> each follower's ring name stays
    (``test_relay_sends_one_copy_per_follower_node`` fails here)."""
    with NetnsCluster(3) as c:
        yield c
        left: dict = {}

        def clean() -> bool:
            left.clear()
            for node in c.nodes:
                if node.pids() or node.shm_segments():
                    left[node.name] = (node.pids(), node.shm_segments())
            return not left
        deadline = time.monotonic() + NODE_CLEAN_S
        while not clean() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"nodes left processes or shared memory: {left}"


def start_followers(c: NetnsCluster, ranked: bool = True, logged: int | None = None) -> list:
    """Nodes 1 and 2 run their compose services' command and environment; with
    ``ranked=False`` without ZBUS_NODE_RANK, so the leader ranks them in join order.
    Node ``logged``'s log goes to its stdout, a pipe (read it with ``next_line``)."""
    procs = []
    for node in c.nodes[1:]:
        argv, env = compose.service(node.name)
        if not ranked:  # keys derived from ZBUS_SECRET need a rank: this cluster runs without
            del env["ZBUS_NODE_RANK"], env["ZBUS_SECRET"]
        env.update(PYTHONPATH=TEST_PATH, ZBUS_ALLOW_WORKERS="workers")
        log = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(node.start(argv, env=env, **(log if node.index == logged else {})))
    return procs


def logged_line(proc, text: str, timeout: float) -> str:
    """The next line of ``proc``'s log that holds ``text``, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while (line := next_line(proc, deadline)) and text not in line:
        pass
    assert line, f"ended ({proc.wait(10)}) without logging {text!r}"
    return line


def driver(c: NetnsCluster, scenario: str, keyed: bool = True):
    """The leader, keyed by the compose file's ZBUS_SECRET, or without keys (its
    followers started with ``ranked=False``), which a non-loopback leader refuses
    unless ZBUS_INSECURE=1."""
    keys = {"ZBUS_SECRET": compose.service("leader")[1]["ZBUS_SECRET"]} if keyed else {"ZBUS_INSECURE": "1"}
    return c.nodes[0].python(os.path.join(os.path.dirname(__file__), "mn_driver.py"), scenario,
                             env={"PYTHONPATH": TEST_PATH, **keys}, stdout=subprocess.PIPE, text=True)


def read_json(proc, timeout: float = 120) -> dict:
    """The driver's next JSON line, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = next_line(proc, deadline)
        if not line:
            raise AssertionError(f"driver ended ({proc.wait(10)}) without output")
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("driver gave no output in time")


def wait_exit(procs, timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - psutil.TimeoutExpired
            codes.append(None)
    return codes


def test_three_nodes_results_ranks_and_clean_exit(cluster):
    followers = start_followers(cluster, ranked=False)
    proc = driver(cluster, "basic", keyed=False)
    result = read_json(proc)
    assert result["world_size"] == 6
    assert result["values"] == [40, 41, 42, 43, 44, 45]
    assert result["ranks"] == ["0", "1", "2", "3", "4", "5"]
    assert set(result["master"]) == {"leader"}
    assert result["unique"] == 15
    assert wait_exit([proc, *followers], 30) == [0, 0, 0]
    for node in cluster.nodes:
        assert node.shm_segments() == []
        assert node.pids() == []


@pytest.mark.parametrize("scenario", ["big", "big_late"])
def test_a_call_that_takes_longer_than_the_liveness_limit_to_arrive_is_no_lost_leader(cluster, scenario):
    """The leader's link carries 400 Mbit/s (``tc``): a 64 MiB call takes its two
    nodes about 3 s to receive, with a liveness limit of 1 s. Each node hears of
    it first ("coming") and waits for it; every rank answers. Before, the
    heartbeats queued behind the call were heard only once it was in: each node
    left ("leader lost: no heartbeat for 1.0 s") and the call failed with
    NodeLostError. ``big_late``: the call goes 16 s after its announcement (as
    behind a full node), more than the announcement's allowance (1 + 13.4 s):
    the nodes wait for it all the same. Sabotage: no ``say_coming`` in
    ``MultiprocExecutor._publish`` -> NodeLostError; the allowance counted from
    the announcement (as a first version did) -> ``big_late`` NodeLostError."""
    subprocess.run(["ip", "netns", "exec", cluster.nodes[0].ns, "tc", "qdisc", "add", "dev", "eth0", "root",
                    "tbf", "rate", "400mbit", "burst", "256kb", "latency", "100ms"], check=True, timeout=10)
    followers = start_followers(cluster)
    proc = driver(cluster, scenario)
    r = read_json(proc, timeout=180)
    print(f"a 64 MiB call on a 400 Mbit/s link: {r}")
    assert r.get("lens") == [64 * 2**20] * 6, r
    assert r["seconds"] > 1.5, r  # (it did take longer than the limit)
    assert wait_exit([proc, *followers], 60) == [0, 0, 0]


def test_a_large_call_behind_a_full_node_is_announced_to_it_too(cluster):
    """As above, at 100 Mbit/s with a liveness limit of 5 s (the call takes about
    11 s to cross), but node 1's agent is stopped until its queue is full, and
    let go 1 s after the call is made: the call's
    announcement is sent to node 1 as soon as it has room, ahead of the call,
    which waited for that room too; every rank answers. Before, the announcement
    went as a heartbeat, to the nodes that had room then: node 1 got the call
    unannounced and left ("no heartbeat"). Sabotage: ``say_coming`` by
    ``DataPath.send_beat`` (as before) -> NodeLostError for node 1."""
    subprocess.run(["ip", "netns", "exec", cluster.nodes[0].ns, "tc", "qdisc", "add", "dev", "eth0", "root",
                    "tbf", "rate", "100mbit", "burst", "256kb", "latency", "100ms"], check=True, timeout=10)
    followers = start_followers(cluster)
    keys = {"ZBUS_SECRET": compose.service("leader")[1]["ZBUS_SECRET"]}
    proc = cluster.nodes[0].python(os.path.join(os.path.dirname(__file__), "mn_driver.py"), "big_full",
                                   str(followers[0].pid), env={"PYTHONPATH": TEST_PATH, **keys},
                                   stdout=subprocess.PIPE, text=True)
    r = read_json(proc, timeout=240)
    print(f"a 64 MiB call behind a full node: {r}")
    assert r.get("lens") == [64 * 2**20] * 6, r
    assert wait_exit([proc, *followers], 60) == [0, 0, 0]


def test_torch_distributed_all_reduce_spans_the_nodes(cluster):
    pytest.importorskip("torch")
    followers = start_followers(cluster)
    proc = driver(cluster, "dist")
    assert read_json(proc, timeout=240)["sums"] == [6.0] * 6
    assert wait_exit([proc, *followers], 60) == [0, 0, 0]


def test_relay_sends_one_copy_per_follower_node(cluster):
    followers = start_followers(cluster)
    proc = driver(cluster, "relay")
    r = read_json(proc, timeout=180)
    extra = r["per_broadcast"] - r["small_per_broadcast"]
    # Two follower nodes with two workers each: the relay sends 2 copies, not 4.
    assert 1.9 * r["payload"] < extra < 2.3 * r["payload"], r
    print(f"leader egress per 4 MiB broadcast to 2 nodes x 2 workers: {extra / r['payload']:.3f} payloads")
    assert wait_exit([proc, *followers], 30) == [0, 0, 0]


@pytest.mark.parametrize("fault", ["sigkill_agent", "cut_link"])
def test_lost_node_raises_node_lost_within_the_limit(cluster, fault):
    followers = start_followers(cluster, logged=2)
    proc = driver(cluster, "lost")
    assert read_json(proc)["ready"]
    t0 = time.monotonic()
    if fault == "sigkill_agent":
        followers[1].send_signal(signal.SIGKILL)  # node 2's agent
    else:
        cluster.nodes[2].link(up=False)
    r = read_json(proc, timeout=30)
    elapsed = time.monotonic() - t0
    if fault == "cut_link":
        cluster.nodes[2].link(up=True)  # restored after the limit: too late, the node is out
    print(f"{fault}: NodeLostError after {elapsed:.2f} s (limit {LIVENESS} s)")
    assert r["error"] == "NodeLostError" and r["node_rank"] == 2 and r["host"] == "node2", r
    assert r["later_fails_at_once"]
    assert elapsed < LIVENESS * 1.5 + 1
    # The cut-off node, left alone, ends its workers and its shared memory itself.
    assert wait_exit([proc, followers[0]], 30) == [0, 0]
    assert wait_exit([followers[1]], LIVENESS * 2 + 5)[0] in (0, 1, -signal.SIGKILL)
    for node in cluster.nodes:
        deadline = time.monotonic() + 10
        while (node.pids() or node.shm_segments()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node.pids() == [] and node.shm_segments() == [], node.name


def test_a_death_report_lost_in_a_reset_connection_is_sent_again(cluster):
    """A worker of node 2 is SIGKILLed inside a long call while node 2's link is
    down, so its agent's ``died`` report waits in the kernel; then node 2's
    connections to the leader are reset (``ss -K``), which throws the report
    away, and the link comes back within the liveness limit. The node is alive
    and heartbeating, so only the report can tell the leader: the call must fail
    with ``WorkerDiedError`` naming that rank within the limit of the link's
    return, not wait for the long call. Sabotage: the agent sends each death
    once (no ``died`` again with the heartbeats) → the driver's call waits out
    its 60 s sleep and gives no output in time."""
    followers = start_followers(cluster, logged=2)
    proc = driver(cluster, "lost")
    assert read_json(proc)["ready"]
    node2 = cluster.nodes[2]
    agent = psutil.Process(followers[1].pid)
    deadline = time.monotonic() + 10
    while len(agent.children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = sorted(agent.children(), key=lambda p: p.pid)[-1]
    node2.link(up=False)
    worker.kill()
    worker.wait(10)
    logged_line(followers[1], "exited", 10)  # the agent saw the death: it reports it next
    time.sleep(0.2)  # (the report goes from ZeroMQ's queue into the dead link's socket)
    out = subprocess.run(["ip", "netns", "exec", node2.ns, "ss", "-K", "-t", "-n", "dst",
                          cluster.nodes[0].address], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    assert out.count(cluster.nodes[0].address) >= 1, f"ss -K killed no connection: {out!r}"
    node2.link(up=True)
    up = time.monotonic()
    r = read_json(proc, timeout=LIVENESS * 3)
    elapsed = time.monotonic() - up
    print(f"death report lost in a reset ({out.count(cluster.nodes[0].address)} connections killed): "
          f"{r['error']} {r['message']!r} {elapsed:.2f} s after the link came back (limit {LIVENESS} s)")
    assert r["error"] == "WorkerDiedError" and "on node 2" in r["message"], r
    assert elapsed < LIVENESS, elapsed
    assert wait_exit([proc, *followers], 30) == [0, 0, 0]


def test_link_cut_shorter_than_the_limit_loses_nothing(cluster):
    """Node 2's link is down for 1 s (the limit is 3 s) while checksummed calls
    stream, 8 in flight: every call is answered right, none fails, and at least
    one was handed over before the cut and answered only after the link came
    back, so calls did cross the cut. The link goes down once the driver says its
    calls stream (8 answered). Sabotage: make ``Membership._check_liveness``
    give a node ``liveness_s / 4`` → fails with the driver's real error
    ("NodeLostError: node 2 (node2) lost: no heartbeat for 0.9 s"; the old driver
    died without output)."""
    followers = start_followers(cluster)
    proc = driver(cluster, "blip")
    assert read_json(proc)["ready"]
    assert read_json(proc, timeout=30)["streaming"]
    down = time.monotonic()
    cluster.nodes[2].link(up=False)
    time.sleep(LIVENESS / 3)  # the cut under test: 1 s down, the limit is 3 s
    cluster.nodes[2].link(up=True)
    up = time.monotonic()
    r = read_json(proc, timeout=60)
    across = [(s, a) for s, a in zip(r["sent"], r["answered"]) if s < down and a is not None and a > up]
    print(f"link cut for {LIVENESS / 3:.1f} s: {r['calls']} calls, {r['bad']} bad, {len(across)} across "
          f"the cut (the longest answered {max((a - s for s, a in across), default=0):.2f} s after it "
          "was sent)")
    assert r["error"] is None, r["error"]
    assert r["bad"] == 0 and r["calls"] > 10 and None not in r["answered"], (r["calls"], r["bad"])
    assert across, "no call was in flight across the cut"
    assert wait_exit([proc, *followers], 30) == [0, 0, 0]


@pytest.mark.parametrize("scenario", ["hold", "hold_busy"])
def test_leader_sigkill_leaves_no_process_and_no_shared_memory(cluster, scenario):
    """Every follower process and worker is gone within the liveness limit + 1.5 s
    of the leader's SIGKILL, idle workers or workers inside a long call
    (``hold_busy``). Sabotage: give the workers the 2 s stop grace after a lost
    leader (``self._stop_grace = 2.0`` in ``NodeAgent.run``): ``hold_busy`` takes
    4.9 s. (Polling only until the next heartbeat in ``NodeAgent._serve`` makes
    the check up to ``liveness_s / 5`` late: 2 s at the default 10 s, too little
    at 3 s for this test to tell.)"""
    followers = start_followers(cluster)
    proc = driver(cluster, scenario)
    assert read_json(proc)["ready"]
    assert all(len(n.pids()) == 3 for n in cluster.nodes[1:])  # agent + 2 workers
    t0 = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    codes = wait_exit(followers, LIVENESS * 2 + 5)
    assert codes == [1, 1]
    deadline = time.monotonic() + 5
    while any(n.pids() or n.shm_segments() for n in cluster.nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    print(f"leader SIGKILL ({scenario}): every node clean after {elapsed:.2f} s (limit {LIVENESS} s)")
    for node in cluster.nodes:
        assert node.pids() == [] and node.shm_segments() == [], node.name
    assert elapsed < LIVENESS + CLEAN_SLACK_S


def test_follower_with_a_full_ring_ends_when_its_leader_dies(cluster):
    """Node 1's workers hang and the leader sends until node 1 takes no more
    (ring and read-ahead full), then is SIGKILLed: node 1's agent, workers and
    segments are gone within the liveness limit + 1.5 s. Sabotage: in
    ``NodeAgent._read_ahead`` count a readable socket with a full backlog as the
    leader alive (``self._last_leader = time.monotonic()``): node 1 never ends."""
    followers = start_followers(cluster)
    proc = driver(cluster, "full_ring")
    r = read_json(proc, timeout=180)
    assert r["ready"] and r["sent"] > 1024, r
    t0 = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    node1 = cluster.nodes[1]
    deadline = time.monotonic() + LIVENESS + 5
    while (node1.pids() or node1.shm_segments()) and time.monotonic() < deadline:
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    print(f"leader SIGKILL with node 1's ring full ({r['sent']} calls sent): node 1 clean after "
          f"{elapsed:.2f} s (limit {LIVENESS} s)")
    assert node1.pids() == [] and node1.shm_segments() == []
    assert elapsed < LIVENESS + CLEAN_SLACK_S
    assert wait_exit(followers, 10) == [1, 1]


RESETS = {  # scenario: the driver's calls, and which of node 2's connections are reset
    "calls": ("reset", ("dport", "=", ":29650")),  # 50 kB calls; the call stream (XPUB)
    "calls_over_1MiB": ("reset_big", ("dport", "=", ":29650")),  # 1.5 MB calls
    "replies": ("reset_replies", ()),  # 500 kB calls answered with 500 kB; every connection
}


@pytest.mark.parametrize("case", list(RESETS))
def test_calls_lost_in_a_reset_connection_are_sent_again(cluster, case):
    """Node 2's connections to the leader are reset (``ss -K``) five times while
    checksummed calls without a timeout stream to it, 16 in flight: ZeroMQ
    reconnects and drops what the connections held. ``calls``: its call stream
    (the XPUB port) is reset. Heartbeats carry the last call number, the agent
    asks for the missing calls, the leader sends them again from the calls it
    keeps. ``calls_over_1MiB``: the same with calls of 1.5 MB, which the leader
    once did not keep. ``replies``: every connection of node 2 is reset, its
    workers' reply connections too, while the calls are answered with 500 kB;
    each worker sends again the replies the leader has not taken, and the leader
    drops those it has. Every call is answered, right, in order, and none waits
    more than the liveness limit; the leader did send calls again (for
    ``replies``: dropped copies of replies it had, so the workers sent again).
    Sabotage: ``DataPath.resend`` returns None (the minimum: the node is
    failed): ``NodeLostError``; heartbeats without the number too (``["hb"]`` in
    ``Membership._step``): the driver hangs; keep calls up to 1 MiB only (as before)
    → ``calls_over_1MiB`` fails with ``NodeLostError`` ("missed calls"); send no
    reply again (``ReplySender._send_again`` returns at once) → ``replies``
    fails: no copy dropped, and mostly before that the executor's protocol error
    (a reply overtaken by a later one, after the 3 s grace)."""
    scenario, match = RESETS[case]
    followers = start_followers(cluster)
    proc = driver(cluster, scenario)
    assert read_json(proc)["ready"]
    leader_ip, node2 = cluster.nodes[0].address, cluster.nodes[2]
    killed = 0
    for _ in range(5):
        time.sleep(0.5)  # the spacing of the resets (each meets the calls streaming), not a wait
        out = subprocess.run(["ip", "netns", "exec", node2.ns, "ss", "-K", "-t", "-n", "dst", leader_ip,
                              *match], capture_output=True, text=True, timeout=10, check=True).stdout
        killed += sum(leader_ip in line for line in out.splitlines())
    r = read_json(proc, timeout=60)
    print(f"5 resets of node 2's connections ({case}, {killed} killed): {r['calls']} calls, {r['bad']} "
          f"bad, {r['error']}, longest wait {r['longest']:.2f} s (limit {LIVENESS} s); sent again: "
          f"{r['calls_again']} calls; copies of replies dropped: {r['replies_again']}")
    assert not r["hung"], r
    assert r["error"] is None and r["bad"] == 0 and r["calls"] > 100, r
    assert r["longest"] < LIVENESS, r
    assert killed >= (5 if match else 20), killed  # the agent's 2 and its 2 workers' connections
    assert r["replies_again"] > 0 if case == "replies" else r["calls_again"] > 0, r  # resets met calls
    assert wait_exit([proc, *followers], 30) == [0, 0, 0]  # a clean end, its bye heard after the resets


def test_compose_commands_run_the_demo_across_three_nodes(cluster):
    """The whole compose topology, for real: the leader service's command (the demo
    driver) and the two follower services, each in its own namespaces."""
    pytest.importorskip("torch")
    followers = start_followers(cluster)
    argv, env = compose.service("leader")
    proc = cluster.nodes[0].start([*argv, "--steps", "20"], env=dict(env, PYTHONPATH=TEST_PATH),
                                  stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "cluster of 6 ranks ready" in out and "matches the reference" in out and "yes" in out
    assert wait_exit(followers, 30) == [0, 0]
    for node in cluster.nodes:
        assert node.shm_segments() == [] and node.pids() == []


def test_a_cluster_whose_first_node_fails_to_close_still_closes_the_others(monkeypatch):
    """The harness's own teardown: listing node 0's processes times out (``ip``
    slow or stuck) as the cluster closes. The error is raised, and every other
    node is still ended and deleted, node 0's namespace too. Before, the loop
    stopped at node 0: nodes 1 and 2 kept their sentinel processes, namespaces
    and /etc/netns folders, and the switch its namespace. (``_ip`` is wrapped to
    time out for that one command; every namespace is real.) Sabotage: the old
    loop in ``NetnsCluster.close`` (no ``run_every``) -> nodes left."""
    import zbus.netns

    real = zbus.netns._ip
    c = NetnsCluster(3)
    c.__enter__()
    names = [n.ns for n in c.nodes] + [c.switch]

    def slow_pids_of_node_0(*args, **kwargs):
        if args[:2] == ("netns", "pids") and args[2] == c.nodes[0].ns:
            raise subprocess.TimeoutExpired(["ip", *args], 10)
        return real(*args, **kwargs)

    monkeypatch.setattr(zbus.netns, "_ip", slow_pids_of_node_0)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            c.close()
        listed = real("netns", "list").stdout
        assert [n for n in names if n in listed] == [], listed
        assert [n.sentinel.pid for n in c.nodes if n.sentinel.poll() is None] == []
        assert [n.ns for n in c.nodes if os.path.exists(f"/etc/netns/{n.ns}")] == []
    finally:
        monkeypatch.setattr(zbus.netns, "_ip", real)
        c.close()
