"""Forming a multi-node cluster: settings, the join handshake and liveness.

The leader (the process that owns the :class:`zbus.Executor`) binds two TCP ports
on its address: ``master_port`` (XPUB: RPC broadcasts, heartbeats and per-node
control, leader -> nodes) and ``master_port + 1`` (PULL: joins, heartbeats and
every remote rank's replies, nodes -> leader). Followers open every connection.

Topics on the XPUB side: ``R`` the RPC stream (relayed verbatim into each node's
ring), ``H`` leader heartbeats and the final ``bye``, ``N<node id>`` control for
one node (welcome or reject). Messages on the PULL side are codec-encoded lists:
``["join", node_id, info]``, ``["hb", node_rank]``, ``["died", node_rank, rank,
exitcode]``, or a worker reply ``[rank, seq, status, value]``.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import psutil
import zmq

from . import codec
from .errors import CodecError, NodeLostError, RingClosed, SendTimeout, WorkerDiedError, ZbusError
from .queues import Broadcaster, bind, deadline_of, remaining, send_frames

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
TOPIC_RPC, TOPIC_HEARTBEAT = b"R", b"H"
DEFAULT_MASTER_PORT = 29650


def node_topic(node_id: str) -> bytes:
    return b"N" + node_id.encode()


def new_node_id() -> str:
    return secrets.token_hex(8)


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True)
class ClusterSettings:
    """Where the leader is and how big the cluster is. Each field comes from the
    argument, else ``ZBUS_*``, else Kubernetes LeaderWorkerSet's ``LWS_*``."""

    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    liveness_s: float

    @classmethod
    def resolve(cls, nnodes: int | None = None, nproc_per_node: int | None = None,
                master_addr: str | None = None, master_port: int | None = None,
                liveness_s: float | None = None) -> ClusterSettings:
        return cls(
            nnodes=int(nnodes or _env("ZBUS_NNODES", "LWS_GROUP_SIZE") or 1),
            nproc_per_node=int(nproc_per_node or _env("ZBUS_NPROC_PER_NODE") or 1),
            master_addr=master_addr or _env("ZBUS_MASTER_ADDR", "LWS_LEADER_ADDRESS") or "127.0.0.1",
            master_port=int(master_port or _env("ZBUS_MASTER_PORT") or DEFAULT_MASTER_PORT),
            liveness_s=float(liveness_s or _env("ZBUS_LIVENESS_S") or 10.0),
        )

    @property
    def heartbeat_s(self) -> float:
        return max(0.05, self.liveness_s / 5)


def touch_health() -> None:
    """Mark this node healthy: ``ZBUS_HEALTH_FILE``, when set, gets a fresh mtime at
    every heartbeat (container health checks read it; see nodes/healthy.sh)."""
    path = os.environ.get("ZBUS_HEALTH_FILE")
    if path:
        try:
            with open(path, "a"):
                os.utime(path)
        except OSError as e:
            log.warning("cannot touch health file %s: %s", path, e)


def port_range() -> tuple[int, int] | None:
    """``ZBUS_PORT_RANGE="lo-hi"``: where zbus binds ports it picks itself."""
    text = os.environ.get("ZBUS_PORT_RANGE")
    if not text:
        return None
    lo, _, hi = text.partition("-")
    return int(lo), int(hi)


def resolve_ip(host: str) -> str:
    """An IP address for ``host`` (ZeroMQ binds to addresses, not host names)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise ZbusError(f"cannot resolve {host!r}: {e}") from e


def route_to(master_ip: str) -> tuple[str, str | None]:
    """The local address (and its interface name) that routes to ``master_ip``:
    a connected UDP socket sends nothing but makes the kernel pick the route."""
    family = socket.AF_INET6 if ":" in master_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master_ip, 9))
        local = s.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addrs):
            return local, name
    return local, None


@dataclass
class NodeInfo:
    node_rank: int
    node_id: str
    host: str
    address: str
    nproc: int
    pid: int
    last_seen: float


class RemoteReceiver:
    """Replies of one remote rank, filled by the leader's I/O thread; the same
    ``get``/``poll`` interface as the shared-memory response queue."""

    def __init__(self, rank: int, cond: threading.Condition):
        self.rank = rank
        self._cond = cond
        self._queue: collections.deque = collections.deque()
        self._aborted = False

    def put(self, reply: Any) -> None:  # called with the condition held
        self._queue.append(reply)

    def poll(self) -> bool:
        return bool(self._queue)

    def get(self, timeout: float | None = None, cancel: Any = None) -> Any:
        deadline = deadline_of(timeout)
        with self._cond:
            while not self._queue:
                if self._aborted:
                    raise RingClosed(f"replies of rank {self.rank} aborted")
                self._cond.wait(0.5 if deadline is None else min(0.5, remaining(deadline, "reply")))
            return self._queue.popleft()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def close(self) -> None:
        self.abort()


class Leader:
    """The leader's side of the cluster: binds the two ports, admits nodes, relays
    heartbeats, and routes remote replies to per-rank receivers. One I/O thread
    owns the PULL socket; the XPUB socket is shared under a lock."""

    def __init__(self, settings: ClusterSettings, broadcaster_factory: Callable[..., Broadcaster],
                 on_failure: Callable[[Exception], None]):
        self.settings = settings
        self.ctx = zmq.Context()
        self.bind_ip = resolve_ip(settings.master_addr)
        self.bcast = broadcaster_factory(host=self.bind_ip, port=settings.master_port, ctx=self.ctx)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE)
        bind(self.pull, self.bind_ip, settings.master_port + 1)
        self.xpub_lock = threading.Lock()
        self.nodes: dict[int, NodeInfo] = {}
        self.cond = threading.Condition()
        self.receivers: dict[int, RemoteReceiver] = {}
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        log.warning("zbus leader on %s:%d-%d: links are not authenticated (no CurveZMQ keys)",
                    self.bind_ip, settings.master_port, settings.master_port + 1)

    # --- joining -------------------------------------------------------------------

    def admit(self, spec: dict, torch_port: int, timeout: float) -> None:
        """Wait until every follower node joined and got its welcome."""
        s = self.settings
        want = s.nnodes - 1
        deadline = deadline_of(timeout)
        pending_subs: set[bytes] = set()
        joins: dict[str, tuple[dict, float]] = {}
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self.bcast.xpub, zmq.POLLIN)
        last_log = 0.0
        while len(self.nodes) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, s.nnodes)) - set(self.nodes))
                raise TimeoutError(f"{len(self.nodes)}/{want} follower nodes joined within {timeout} s; "
                                   f"missing node ranks: {missing}")
            events = dict(poller.poll(min(500, int(left * 1000) + 1)))
            if self.bcast.xpub in events:
                msg = self.bcast.xpub.recv()
                if msg[:1] == b"\x01":
                    pending_subs.add(msg[1:])
            if self.pull in events:
                msg = self._recv_control()
                if msg is not None and msg[0] == "join":
                    joins[msg[1]] = (msg[2], time.monotonic())
            for node_id, (info, _) in list(joins.items()):
                if node_topic(node_id) in pending_subs:
                    del joins[node_id]
                    self._welcome(node_id, info, spec, torch_port)
            if time.monotonic() - last_log > 2:
                last_log = time.monotonic()
                log.info("%d/%d nodes joined: %s", len(self.nodes) + 1, s.nnodes,
                         ", ".join(f"{n.node_rank}:{n.host}" for n in self.nodes.values()) or "-")
        log.info("%d/%d nodes joined", s.nnodes, s.nnodes)

    def _welcome(self, node_id: str, info: Any, spec: dict, torch_port: int) -> None:
        s = self.settings
        try:
            node_rank = self._check_join(info)
        except ZbusError as e:
            log.error("refused node %s: %s", info.get("host") if isinstance(info, dict) else "?", e)
            self._send(node_topic(node_id), ["reject", str(e)])
            return
        self.nodes[node_rank] = NodeInfo(node_rank, node_id, info["host"], info["address"],
                                         info["nproc"], info["pid"], time.monotonic())
        for local in range(s.nproc_per_node):
            rank = node_rank * s.nproc_per_node + local
            self.receivers[rank] = RemoteReceiver(rank, self.cond)
        self._send(node_topic(node_id), ["welcome", {
            "node_rank": node_rank, "nnodes": s.nnodes, "nproc_per_node": s.nproc_per_node,
            "spec": spec, "master_addr": s.master_addr, "torch_port": torch_port,
            "reply_address": f"tcp://{_bracket(self.bind_ip)}:{s.master_port + 1}",
            "liveness_s": s.liveness_s}])
        log.info("node %d joined: %s (%s)", node_rank, info["host"], info["address"])

    def _check_join(self, info: Any) -> int:
        s = self.settings
        if not isinstance(info, dict) or not all(k in info for k in ("version", "nproc", "host",
                                                                       "address", "node_rank", "pid")):
            raise ZbusError(f"malformed join request: {str(info)[:200]}")
        host = info["host"]
        if info["version"] != PROTOCOL_VERSION:
            raise ZbusError(f"node {host} speaks protocol {info['version']}, the leader {PROTOCOL_VERSION}")
        if info["nproc"] != s.nproc_per_node:
            raise ZbusError(f"node {host} has {info['nproc']} workers but every node needs "
                            f"{s.nproc_per_node} (world size {s.nnodes * s.nproc_per_node})")
        rank = info["node_rank"]
        if rank in (None, -1):
            free = [r for r in range(1, s.nnodes) if r not in self.nodes]
            if not free:
                raise ZbusError(f"node {host}: the cluster of {s.nnodes} nodes is complete")
            return free[0]
        if type(rank) is not int or not 1 <= rank < s.nnodes:
            raise ZbusError(f"node {host} asks for node rank {rank}; valid: 1..{s.nnodes - 1} "
                            "(0 is the leader)")
        if rank in self.nodes:
            raise ZbusError(f"node {host} asks for node rank {rank}, already taken by "
                            f"{self.nodes[rank].host}")
        return rank

    # --- running -------------------------------------------------------------------

    def start(self) -> None:
        now = time.monotonic()
        for n in self.nodes.values():
            n.last_seen = now
        self._thread = threading.Thread(target=self._run, name="zbus-leader-io", daemon=True)
        self._thread.start()

    def _send(self, topic: bytes, obj: Any, timeout: float = 5.0) -> bool:
        """Send a control message; False if the XPUB socket stayed busy (an RPC
        blocked on a full node) or full for ``timeout``."""
        if not self.xpub_lock.acquire(timeout=timeout):
            return False
        try:
            send_frames(self.bcast.xpub, [topic, *codec.encode(obj)], deadline_of(timeout), "control send")
            return True
        except TimeoutError:
            return False
        finally:
            self.xpub_lock.release()

    def publish(self, frames: list, deadline: float | None, on_full: Callable[[], None] | None = None,
                cancel: threading.Event | None = None) -> None:
        """Send one RPC to every node (one copy each) and the local ring. Either
        every rank gets it or none (:class:`SendTimeout` says which): the ring is
        made ready first, and once the nodes have the message, so does the ring."""
        ring = self.bcast.ring
        if ring is not None:
            try:
                ring.flush(deadline, cancel, on_full)
            except TimeoutError as e:
                raise SendTimeout(str(e), queued=False) from None
        with self.xpub_lock:
            send_frames(self.bcast.xpub, [TOPIC_RPC, *frames], deadline, "broadcast to nodes", cancel)
        if ring is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ring.send(frames, left, cancel, on_full)
            except SendTimeout as e:
                raise SendTimeout(str(e), queued=True) from None

    def _recv_control(self) -> Any:
        try:
            frames = [f.buffer for f in self.pull.recv_multipart(copy=False)]
            msg = codec.decode(frames)
        except (CodecError, zmq.ZMQError) as e:
            self.dropped += 1
            log.warning("dropped a malformed message from the network: %s", e)
            return None
        if type(msg) is not list or not msg:
            self.dropped += 1
            log.warning("dropped a message of the wrong shape: %s", str(msg)[:100])
            return None
        return msg

    def _run(self) -> None:
        s = self.settings
        next_hb = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_hb:
                    if not self._send(TOPIC_HEARTBEAT, ["hb"], timeout=s.heartbeat_s / 2):
                        log.warning("heartbeat not sent: a node is not taking messages")
                    next_hb = time.monotonic() + s.heartbeat_s
                    self._check_liveness(time.monotonic())
                    touch_health()
                if self.pull.poll(int(max(0.0, next_hb - time.monotonic()) * 1000) + 1, zmq.POLLIN):
                    while self.pull.poll(0, zmq.POLLIN):
                        self._dispatch(self._recv_control())
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                self._on_failure(ZbusError(f"leader I/O failed: {e}"))

    def _dispatch(self, msg: Any) -> None:
        if msg is None:
            return
        kind = msg[0]
        if type(kind) is int:
            receiver = self.receivers.get(kind)
            if receiver is None or len(msg) != 4:
                self.dropped += 1
                log.warning("dropped a reply for unknown rank %r", kind)
                return
            with self.cond:
                receiver.put(msg)
                self.cond.notify_all()
        elif kind == "hb" and len(msg) == 2 and msg[1] in self.nodes:
            self.nodes[msg[1]].last_seen = time.monotonic()
        elif kind == "died" and len(msg) == 4 and msg[1] in self.nodes:
            node = self.nodes[msg[1]]
            self._on_failure(WorkerDiedError(msg[2], msg[3], f"on node {node.node_rank} ({node.host})"))
        elif kind == "join":
            info = msg[2] if len(msg) > 2 and isinstance(msg[2], dict) else {}
            if not any(n.node_id == msg[1] for n in self.nodes.values()):
                log.error("refused late join from %s: the cluster is formed", info.get("host", "?"))
        else:
            self.dropped += 1
            log.warning("dropped an unknown control message %r", str(kind)[:50])

    def _check_liveness(self, now: float) -> None:
        for node in self.nodes.values():
            if now - node.last_seen > self.settings.liveness_s:
                self._on_failure(NodeLostError(
                    node.node_rank, node.host, f"no heartbeat for {now - node.last_seen:.1f} s"))
                return

    def publish_remote(self, frames: list, deadline: float | None) -> None:
        """Send to the nodes only (the local ring may be aborted after a failure)."""
        if self.xpub_lock.acquire(timeout=max(0.0, deadline - time.monotonic()) if deadline else -1):
            try:
                send_frames(self.bcast.xpub, [TOPIC_RPC, *frames], deadline, "broadcast to nodes")
            finally:
                self.xpub_lock.release()

    def announce_stop(self) -> None:
        """Tell the agents that their workers are about to be stopped, so they do
        not report the exits as failures."""
        self._send(TOPIC_HEARTBEAT, ["stopping"], timeout=1.0)

    def abort_receivers(self) -> None:
        for r in self.receivers.values():
            r.abort()

    def close(self) -> None:
        """Say bye to the nodes (best effort, bounded) and close everything."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            bye = self._send(TOPIC_HEARTBEAT, ["bye"], timeout=1.0)
        except zmq.ZMQError:
            bye = False
        self.abort_receivers()
        self.pull.close(linger=0)
        self.bcast.close(linger_s=1.0 if bye else 0.0)
        self.ctx.term()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host

