"""The nodes of a cluster, as the leader sees them: formation, liveness, status.

Formation: a follower sends ``join`` until welcomed. The leader welcomes it (on
``N<node id>``) once that subscription shows on the XPUB socket, then probes it on
``R<session>P`` and ``HP`` until it answers ``subscribed``: only then does the node
count as joined, so it cannot miss an RPC. (A SUB socket re-sends its subscriptions in
no set order, so the order they were made in proves nothing.) Liveness:
heartbeats both ways; a joined node silent for ``liveness_s`` fails the executor
(:class:`zbus.errors.NodeLostError`).

All of it runs on the leader's own I/O thread (:meth:`Membership.start`), never on
a caller's: the heartbeats sent, the liveness check, welcomes, probes, status
answers, and the nodes' control messages. Only a node's heartbeat is filed by
whichever thread reads the PULL socket (:class:`zbus.datapath.DataPath`), a
caller waiting for its replies included, so no reply wait starves it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from . import codec, protocol
from .cluster import (
    STATUS_TOPIC,
    ClusterSettings,
    any_rank,
    node_topic,
    probe_topics,
    touch_health,
)
from .config import DEFAULT_MAX_MESSAGE, MIN_SIZE_LIMIT
from .datapath import DataPath
from .errors import CodecError, ExecutorFailedError, NodeLostError, WorkerDiedError, ZbusError, brief, said
from .failure import Failure
from .metrics import Metrics

log = logging.getLogger(__name__)

# A member's messages name its leader's session: an orphan of a leader that died
# (its node may not have noticed yet) reaches one restarted at the same address.
MEMBER_KINDS = ("hb", "died", "leaving", "gap")
MAX_PENDING_JOINS = 256  # joins waiting for their node's subscription
MAX_NODE_TOPICS = 4096  # node topics subscribed while the cluster forms
# A node's ask for lost calls is answered at most this often (its agent asks every
# 0.5 s): each answer scans the kept calls and may wait for the node's queue, and
# what the asks of a node that reads none of them queue stays there.
GAP_EVERY_S = 0.25
# The types of the join fields a node sends (``NodeAgent._join``); node_rank may be None.
JOIN_TYPES = {"version": int, "nproc": int, "host": str, "address": str, "node_rank": int, "pid": int,
              "max_message": int}


JOIN_TEXT_MAX = 255  # a host name's most (DNS: 253), and an address's


def _join_types(info: dict) -> bool:
    """Whether the fields a join has are of the types a node sends (missing ones
    are refused later, loudly, by ``Membership._check_join``)."""
    return all(_join_field_ok(k, info[k], t) for k, t in JOIN_TYPES.items() if k in info)


def _join_field_ok(key: str, value: Any, kind: type) -> bool:
    """Its type; a text short and printable (the host and address go into log
    lines, errors and ``zbus status``); a message limit one a node can have."""
    if key == "node_rank" and value is None:  # any free rank
        return True
    if key == "max_message":  # (no node's is less: ``size_setting``)
        return type(value) is int and value >= MIN_SIZE_LIMIT
    return type(value) is kind and (kind is not str or len(value) <= JOIN_TEXT_MAX and value.isprintable())


@dataclass
class NodeInfo:
    node_rank: int
    node_id: str
    host: str
    address: str
    nproc: int
    pid: int
    last_seen: float
    core: str = "unknown"  # its ring's core, as the node said (zbus.ring.CORE)
    max_message: int = DEFAULT_MAX_MESSAGE  # its ZBUS_MAX_MESSAGE, as it said (else the default)




_NODE_ID = re.compile(r"[0-9a-f]{16}")


def node_id_ok(node_id: Any) -> bool:
    """Whether ``node_id`` may be a node's id, on whose topic the leader answers: an
    agent's, 16 hex digits. A topic is a prefix: an id made of a member's and a
    suffix would have what the leader says to it reach that member too ("R", "R*":
    as a call; more hex digits: its welcome, heartbeats and calls sent again,
    filling the member's backlog); ids of one length are prefixes of none."""
    return type(node_id) is str and _NODE_ID.fullmatch(node_id) is not None

class Membership:
    """Which nodes belong to the cluster and whether they live: admits them while
    the cluster forms, heartbeats, fails the executor when one is lost, answers
    ``zbus status``. Its I/O thread also gives the data path its turn on the PULL
    socket while no caller reads it, so the nodes are heard while the driver is
    idle."""

    def __init__(self, settings: ClusterSettings, path: DataPath, failure: Failure, metrics: Metrics,
                 reply_address: str, status: Callable[[], dict] | None = None):
        self.settings = settings
        self.path = path
        self.failure = failure
        self.metrics = metrics
        self.cond = path.cond  # shared with the receivers: a failure wakes every wait at once
        self.nodes: dict[int, NodeInfo] = {}
        self.formed = settings.nnodes <= 1
        self._reply_address = reply_address
        self._joins: dict[str, dict] = {}
        self._subscribed: dict[bytes, None] = {}  # node topics subscribed, oldest first
        self._probing: dict[str, NodeInfo] = {}
        self._gap_answered: dict[int, float] = {}  # node rank: when its last ask for lost calls was
        self._dropped_ids: dict[str, None] = {}  # dropped while probed (the latest, in order)
        self._welcome_spec: dict = {}
        self.session = path.session
        self._probe_topics = probe_topics(self.session)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status = status

    # --- joining -------------------------------------------------------------------

    def admit(self, spec: dict, torch_port: int, timeout: float, extra_env: dict | None = None,
              on_join: Callable[[int, int], None] | None = None) -> None:
        """Start the I/O thread, which admits the nodes, and wait until all joined.

        Heartbeats flow both ways from the first join on, and replies (READY)
        from nodes that joined early are kept. A node refused for a reason that
        a retry cannot mend (protocol version, worker count, node rank) fails
        start-up at once, naming the node; a timeout names the missing ranks."""
        self._welcome_spec = {"spec": spec, "torch_port": torch_port, "env": dict(extra_env or {})}
        self.start()
        want = self.settings.nnodes - 1
        deadline = time.monotonic() + timeout
        last_log = time.monotonic()
        seen = -1
        while True:
            with self.cond:
                self.failure.raise_if_failed()  # (first: a node refused while on_join ran)
                if len(self.nodes) >= want:
                    self.formed = True
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.settings.nnodes)) - set(self.nodes))
                    raise TimeoutError(f"{len(self.nodes)}/{want} follower nodes joined within "
                                       f"{timeout} s; missing node ranks: {missing}")
                if on_join is None or len(self.nodes) == seen:
                    self.cond.wait(min(left, 1.0))
                    if time.monotonic() - last_log >= 2:
                        last_log = time.monotonic()
                        log.info("%d/%d nodes joined: %s", len(self.nodes) + 1, self.settings.nnodes,
                                 self.describe_nodes())
                    continue
                seen = len(self.nodes)
            # (the lock let go: the I/O thread admits nodes and files replies under it)
            on_join(seen + 1, want + 1)
        if on_join is not None:
            on_join(want + 1, want + 1)
            self.failure.raise_if_failed()
        log.info("%d/%d nodes joined: %s", want + 1, want + 1, self.describe_nodes())

    def describe_nodes(self) -> str:
        return ", ".join(f"{n.node_rank}:{n.host}" for n in sorted(self.nodes.values(),
                                                                   key=lambda n: n.node_rank)) or "-"

    def _on_subscription(self, topic: bytes, on: bool) -> None:
        """A node topic subscribed (``on``) or cancelled (its peer left, say). At
        the limit, a flood of topics from peers that never join forgets the oldest
        that no join waits for: a real node joins within 2 s of subscribing."""
        log.debug("subscription %r %s", topic, "on" if on else "off")
        if not on:
            self._subscribed.pop(topic, None)
            return
        if topic not in self._subscribed and len(self._subscribed) >= MAX_NODE_TOPICS:
            waited = {node_topic(n) for n in self._joins}
            old = next((t for t in self._subscribed if t not in waited), None)
            self.metrics.dropped(reason="subscription-flood")
            if old is None:
                return
            del self._subscribed[old]
        self._subscribed[topic] = None
        self._welcome_ready()

    def _on_join(self, node_id: Any, info: Any) -> None:
        if not node_id_ok(node_id) or not isinstance(info, dict):
            self.path.drop("a malformed join request", "bad-join")
            return
        if node_id in self._probing or any(n.node_id == node_id for n in self.nodes.values()):
            return  # a repeated join of a node already welcomed
        log.debug("join from %s (%s)", info.get("host"), node_id)
        if self.formed:
            self._refuse_late(node_id, info)
            return
        if len(self._joins) >= MAX_PENDING_JOINS and node_id not in self._joins:
            # A flood of joins from nodes that never subscribe: forget the oldest. A real
            # node is welcomed as soon as a join and its subscription are both here,
            # and it sends its join again every 2 s.
            self._joins.pop(next(iter(self._joins)))
            self.metrics.dropped(reason="join-flood")
        if not _join_types(info):  # no value == cannot judge may wait in _joins
            self.path.drop(f"a join with fields of the wrong types: {brief(info)}", "bad-join")
            return
        self._joins[node_id] = info
        self._welcome_ready()

    def _refuse_late(self, node_id: str, info: dict) -> None:
        """A join once the cluster formed: refused, failing nothing."""
        self.path.drop(f"a join from {brief(info.get('host', '?'))}: the cluster is formed", "late-join")
        # never waits for room: a joiner that reads nothing would hold this thread up
        self.path.send_control(node_topic(node_id), ["reject", "the cluster is already formed"],
                               timeout=1.0, wait=False)

    def _welcome_ready(self) -> None:
        """Welcome the joins whose node topic subscription has arrived (the welcome
        goes on that topic); probes then check the node's other subscriptions. A
        join for a rank that a node still being probed holds waits: that node may
        have died (then it expires) or may answer (then this join is refused, as
        late once the cluster formed)."""
        for node_id in [n for n in self._joins if node_topic(n) in self._subscribed]:
            if self.formed:
                self._refuse_late(node_id, self._joins.pop(node_id))
            elif not self._held_by_probing(self._joins[node_id].get("node_rank")):
                self._welcome(node_id, self._joins.pop(node_id))

    def _held_by_probing(self, rank: Any) -> bool:
        probing = {n.node_rank for n in self._probing.values()}
        if any_rank(rank):  # any free rank: wait only if the probed nodes hold the last ones
            taken = probing | set(self.nodes)
            return bool(probing) and all(r in taken for r in range(1, self.settings.nnodes))
        return type(rank) is int and rank in probing

    def _expire_probing(self, now: float) -> None:
        """Drop the nodes welcomed a liveness limit ago that never answered the
        probes (stopped or crashed while joining), so their ranks are free again.
        One that still runs is told, and leaves."""
        for node_id, node in list(self._probing.items()):
            if now - node.last_seen > self.settings.liveness_s:
                del self._probing[node_id]
                self._dropped_ids[node_id] = None
                while len(self._dropped_ids) > MAX_PENDING_JOINS:
                    self._dropped_ids.pop(next(iter(self._dropped_ids)))
                log.warning("node %s (rank %d) never answered the probes within %.1f s: dropped",
                            node.host, node.node_rank, self.settings.liveness_s)
                self.path.send_control(node_topic(node_id), ["dropped", "no answer to the probes in time"],
                                       0.1)
        self._welcome_ready()

    def _welcome(self, node_id: str, info: dict) -> None:
        s = self.settings
        try:
            node_rank = self._check_join(info)
            welcome = ["welcome", {
                "node_rank": node_rank, "nnodes": s.nnodes, "nproc_per_node": s.nproc_per_node,
                "master_addr": s.master_addr, "liveness_s": s.liveness_s,
                "reply_address": self._reply_address, "max_reply": self.path.max_reply,
                "session": self.session, **self._welcome_spec}]
            size = codec.nbytes(codec.encode(welcome))
            limit = info.get("max_message", DEFAULT_MAX_MESSAGE)
            if size > limit:  # (its socket would drop it at each try, and the node join again)
                raise CodecError(f"the welcome, with the worker's arguments, takes {size} bytes, over "
                                 f"the {limit} that the node takes (its ZBUS_MAX_MESSAGE)")
        except ZbusError as e:
            log.error("refused node %s: %s", info.get("host", "?"), e)
            self.path.send_control(node_topic(node_id), ["reject", str(e)], timeout=1.0)
            self.failure.fail(ExecutorFailedError(f"node {info.get('host', '?')} refused: {e}"))
            return
        node = NodeInfo(node_rank, node_id, info["host"], info["address"], info["nproc"], info["pid"],
                        time.monotonic(), str(info.get("core", "unknown"))[:16],
                        info.get("max_message", DEFAULT_MAX_MESSAGE))
        self.path.open_receivers(node_rank)
        sent = self.path.send_control(node_topic(node_id), welcome, timeout=1.0, wait=False)
        # (never waits for room: a joiner that reads nothing would hold up this thread,
        # and the XPUB's lock, which the welcome may be sent under; it joins again in 2 s)
        if sent:
            self._probing[node_id] = node
        else:  # its next join tries again
            log.warning("welcome to %s not sent: retrying on its next join", node.host)

    def _on_refused(self, node_id: Any, reason: Any) -> None:
        """A welcomed node would not start the workers (see zbus.agent)."""
        node = self._probing.get(node_id) if type(node_id) is str else None
        if node is None:
            self.metrics.dropped(reason="stray-refused")
            return
        self.failure.fail(ExecutorFailedError(f"node {node.node_rank} ({node.host}) refused to start the "
                                              f"workers: {said(reason)}"))

    def _on_subscribed(self, node_id: Any) -> None:
        node = self._probing.pop(node_id, None) if node_id_ok(node_id) else None
        if node is None:
            if node_id in self._dropped_ids:
                # welcomed once, dropped since (the notice may have found it unable to
                # hear): it must not take itself for a member, so it is told again. Only
                # these: a topic is a prefix, so an id made up (a member's id + "R*")
                # would reach a member as a malformed call.
                self.path.send_control(node_topic(node_id), ["dropped", "not a member: dropped while "
                                                             "joining"], timeout=0.1, wait=False)
            return
        node.last_seen = time.monotonic()
        with self.cond:
            self.nodes[node.node_rank] = node
            # formed with the last node (not once admit's thread, maybe in a slow
            # on_join, sees it): a join from now on is refused as late, and fails nothing
            self.formed = len(self.nodes) >= self.settings.nnodes - 1
            self.cond.notify_all()
        log.info("node %d joined: %s (%s)", node.node_rank, node.host, node.address)
        self._welcome_ready()  # a join that waited for this rank is refused now

    def _probe(self) -> None:
        for node_id in self._probing:
            for topic in self._probe_topics:
                self.path.send_control(topic, ["probe", node_id], timeout=0.1)

    def _check_join(self, info: Any) -> int:
        s = self.settings
        if not isinstance(info, dict) or not all(k in info for k in ("version", "nproc", "host",
                                                                       "address", "node_rank", "pid")):
            raise ZbusError(f"malformed join request: {brief(info)}")
        host = info["host"]
        if info["version"] != protocol.PROTOCOL_VERSION:
            raise ZbusError(f"node {host} speaks protocol {info['version']}, "
                            f"the leader {protocol.PROTOCOL_VERSION}")
        if info["nproc"] != s.nproc_per_node:
            raise ZbusError(f"node {host} has {info['nproc']} workers but every node needs "
                            f"{s.nproc_per_node} (world size {s.nnodes * s.nproc_per_node})")
        rank = info["node_rank"]
        taken = {n.node_rank: n for n in (*self.nodes.values(), *self._probing.values())}
        if any_rank(rank):
            free = [r for r in range(1, s.nnodes) if r not in taken]
            if not free:
                raise ZbusError(f"node {host}: the cluster of {s.nnodes} nodes is complete")
            return free[0]
        if type(rank) is not int or not 1 <= rank < s.nnodes:
            raise ZbusError(f"node {host} asks for node rank {rank}; valid: 1..{s.nnodes - 1} "
                            "(0 is the leader)")
        if rank in taken:
            raise ZbusError(f"node {host} asks for node rank {rank}, already taken by "
                            f"{taken[rank].host}")
        return rank


    # --- the I/O thread ----------------------------------------------------------

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="zbus-leader-io", daemon=True)
        thread.start()
        self._thread = thread  # (only once started: stop() joins it)

    def stop(self) -> None:
        """End the I/O thread (it wakes every 50 ms at most)."""
        self._stop.set()
        self.path.wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        """The I/O thread: heartbeats and liveness, subscriptions while the cluster
        forms (the XPUB socket is then only ours), the messages a caller left to
        it, and the PULL socket whenever no caller has wanted it for a while."""
        next_hb, told = 0.0, False  # told: the nodes were sent ``failed``
        while not self._stop.is_set():
            try:
                next_hb, told = self._step(next_hb, told)
            except zmq.ZMQError as e:
                if not self._stop.is_set():
                    self.failure.fail(ExecutorFailedError(f"leader I/O failed: {e}"))
                return
            except Exception as e:  # noqa: BLE001 - nothing a peer sends may stop heartbeats
                self.path.drop(f"a message that broke the I/O loop: {type(e).__name__}: {brief(str(e))}",
                               "io-loop")
                self._stop.wait(0.05)  # no busy loop if it happens again at once

    def _step(self, next_hb: float, told: bool) -> tuple[float, bool]:
        """One turn of the I/O loop; the time of the next heartbeat, and whether the
        nodes were told of the failure (at once, not at the next heartbeat)."""
        s = self.settings
        now = time.monotonic()
        error = self.failure.error
        if now >= next_hb or (error is not None and not told):
            # a failed executor says so instead of heartbeating: its nodes free their GPUs
            hb = ["hb", self.path.sent_seq, self.session] if error is None \
                else ["failed", self.session, brief(str(error))]
            ids = self.node_ids()
            if self.path.send_beat(hb, ids, timeout=s.heartbeat_s / 2):
                told = error is not None
            else:
                log.warning("heartbeat not sent: a node is not taking messages")
            next_hb = time.monotonic() + s.heartbeat_s
            self._check_liveness(time.monotonic())
            self.path.calls.forget(list(self.nodes))  # what the nodes' heartbeats said they have
            if not self.formed:
                self._expire_probing(time.monotonic())
            touch_health()
        wait_ms = min(50, int(max(0.0, next_hb - time.monotonic()) * 1000) + 1)
        self._read_subscriptions()
        if not self.formed:
            self._probe()
        self.path.handle_control()
        self.path.read_unless_callers(wait_ms)
        return next_hb, told

    def _read_subscriptions(self) -> None:
        """Take the XPUB socket's subscription notices (a node topic means a node
        can be welcomed). Read even once formed, so strangers cannot pile them up.
        Non-blocking: other threads send on this socket under the same lock."""
        if not self.path.xpub_lock.acquire(timeout=0.01):
            return
        try:
            for _ in range(1000):
                if not self.path.bcast.xpub.poll(0, zmq.POLLIN):
                    break
                msg = self.path.bcast.xpub.recv()
                topic = msg[1:]
                if msg[:1] in (b"\x00", b"\x01") and not self.formed and topic[:1] == b"N" \
                        and len(topic) <= 33:
                    self._on_subscription(topic, msg[:1] == b"\x01")
        finally:
            self.path.xpub_lock.release()


    # --- the nodes' messages -----------------------------------------------------

    def handle(self, msg: list) -> None:
        """A node's message that is no reply: a heartbeat (from the thread that read
        it), else on the I/O thread."""
        kind = msg[0]
        if kind in MEMBER_KINDS:  # [kind, node rank, session, ...]
            if len(msg) < 3 or msg[2] != self.session:  # (plain data: != can judge)
                self.path.drop(f"a {kind} message of another leader's node (a leader before this one "
                               "at its address?)", "other-session")
                return
            del msg[2]
        if kind == "hb" and len(msg) in (2, 3):  # from a node still being probed: nothing to do
            node = self.nodes.get(msg[1]) if type(msg[1]) is int else None
            if node is not None:
                node.last_seen = time.monotonic()
                self.metrics.heartbeat(node.node_rank)
                if len(msg) == 3:  # and the last call its agent relayed
                    self.path.calls.has(node.node_rank, msg[2])
        elif kind == "died" and len(msg) == 4 and type(msg[1]) is type(msg[2]) is int \
                and type(msg[3]) in (int, type(None)) and msg[1] in self.nodes:
            node = self.nodes[msg[1]]
            self.failure.fail(WorkerDiedError(msg[2], msg[3], f"on node {node.node_rank} ({node.host})"))
        elif kind == "leaving" and len(msg) == 3 and type(msg[1]) is int and msg[1] in self.nodes:
            node = self.nodes[msg[1]]  # its agent gave up, and says why
            self.failure.fail(NodeLostError(node.node_rank, node.host, f"it left: {said(msg[2])}"))
        elif kind == "join" and len(msg) == 3:
            self._on_join(msg[1], msg[2])
        elif kind == "subscribed" and len(msg) == 2 and type(msg[1]) is str:
            self._on_subscribed(msg[1])
        elif kind == "gap" and len(msg) == 4 and type(msg[1]) is int and msg[1] in self.nodes:
            node = self.nodes[msg[1]]  # its agent saw calls go missing (a reset connection)
            now = time.monotonic()
            if now < self._gap_answered.get(node.node_rank, -GAP_EVERY_S) + GAP_EVERY_S:
                self.path.drop(f"node {node.node_rank} asked for lost calls again within {GAP_EVERY_S} s",
                               "gap-too-soon")
                return
            self._gap_answered[node.node_rank] = now
            sent = self.path.resend(node.node_id, node.node_rank, msg[2])
            if sent is None:
                self.failure.fail(NodeLostError(node.node_rank, node.host,
                                                f"missed calls {brief(msg[2])} to {brief(msg[3])}"))
            else:  # (those its full queue had no room for go when it asks again)
                log.log(logging.WARNING if sent else logging.DEBUG, "node %d (%s) missed calls %s to %s: "
                        "%d sent again", node.node_rank, node.host, brief(msg[2]), brief(msg[3]), sent)
        elif kind == "refused" and len(msg) == 3:
            self._on_refused(msg[1], msg[2])
        elif kind == "status" and len(msg) == 2:
            self._answer_status(msg[1])
        else:
            self.path.drop(f"an unknown control message {brief(kind)}", "unknown-kind")

    def probing_rank(self, node_id: str) -> int | None:
        """The node rank of node ``node_id`` while it is probed, else None."""
        node = self._probing.get(node_id)
        return None if node is None else node.node_rank

    def _check_liveness(self, now: float) -> None:
        for node in self.nodes.values():
            if now - node.last_seen > self.settings.liveness_s:
                self.failure.fail(NodeLostError(
                    node.node_rank, node.host, f"no heartbeat for {now - node.last_seen:.1f} s"))
                return

    def _answer_status(self, token: Any) -> None:
        if type(token) is not str or not 0 < len(token) <= 64 or self._status is None:
            self.metrics.dropped(reason="bad-status")
            return
        # never waits for room: a requester that does not read would hold this thread up
        self.path.send_control(STATUS_TOPIC + token.encode(), ["status", self._status()], timeout=1.0,
                               wait=False)

    def announce_stop(self) -> None:
        """Tell the agents that their workers are about to be stopped, so they do
        not report the exits as failures."""
        self.path.tell_nodes(["stopping", self.session], self.node_ids(), timeout=1.0)

    def say_bye(self) -> bool:
        """Tell the nodes the cluster is done (they stop their workers and exit 0);
        whether it went to any node. Said as soon as the last call (STOP) is out, so a
        leader killed while its own workers stop leaves no node waiting for it."""
        try:
            return self.path.tell_nodes(["bye", self.session], self.node_ids(), timeout=1.0)
        except zmq.ZMQError:
            return False

    def node_ids(self) -> list[str]:
        return [node.node_id for node in list(self.nodes.values())]

    def reject_joining(self) -> None:
        """The leader stops before the cluster formed: tell the followers still
        joining, which would otherwise wait out their join timeout."""
        try:
            if not self.formed:
                waited = [node_topic(n) for n in self._joins]  # those of real joiners first
                for topic in list(dict.fromkeys([*(t for t in waited if t in self._subscribed),
                                                 *self._subscribed]))[:64]:
                    self.path.send_control(topic, ["reject", "the leader stopped before the cluster formed"],
                                           0.2)
        except zmq.ZMQError:
            pass
