"""Forming a multi-node cluster: settings, the join handshake and liveness.

The leader (the process that owns the :class:`zbus.Executor`) binds two TCP ports
on its address: ``master_port`` (XPUB: RPC broadcasts, heartbeats and per-node
control, leader -> nodes) and ``master_port + 1`` (PULL: joins, heartbeats and
every remote rank's replies, nodes -> leader). Followers open every connection.

Topics on the XPUB side: ``R`` the RPC stream (relayed verbatim into each node's
ring), ``H`` leader heartbeats ``["hb", last call number sent]`` (``failed``
instead once the executor failed), ``stopping`` and the final ``bye``,
``N<node id>`` control for one node (welcome, reject, or dropped: welcomed, then
silent too long), ``N<node id>R`` calls sent again to a node that lost them,
``RP``/``HP`` probes. Messages on the PULL side are codec-encoded lists:
``["join", node_id, info]``, ``["subscribed", node_id]``, ``["hb", node_rank,
last call relayed]``, ``["died", node_rank, rank, exitcode]``, ``["gap",
node_rank, expected_seq, got_seq]``, ``["refused", node_id, reason]``,
``["status", token]``, or a worker reply ``[rank, seq, status, value]``.

Joining: a follower subscribes to ``R``, ``H`` and its own ``N<id>``, then sends
``join`` until welcomed. The leader welcomes it (on ``N<id>``) once that
subscription shows on the XPUB socket, then probes it on ``RP`` and ``HP`` until
it answers ``subscribed``: only then does the node count as joined, so it cannot
miss an RPC. (A SUB socket re-sends its subscriptions in no set order, so the
order they were made in proves nothing.)
"""

from __future__ import annotations

import collections
import logging
import os
import reprlib
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from . import codec, protocol
from .curve import LeaderCurve, describe
from .errors import (
    CodecError,
    ExecutorFailedError,
    NodeLostError,
    RingClosed,
    WorkerDiedError,
    ZbusError,
)
from .failure import Failure
from .metrics import Metrics
from .queues import Broadcaster, bind, bracket, deadline_of, remaining, send_frames, send_message

log = logging.getLogger(__name__)

TOPIC_RPC, TOPIC_HEARTBEAT = b"R", b"H"
# Probes travel on topics that the RPC and heartbeat subscriptions match (prefix),
# so a node's answer proves both subscriptions are in place at the leader.
PROBE_TOPICS = (TOPIC_RPC + b"P", TOPIC_HEARTBEAT + b"P")
MAX_PENDING_JOINS = 256  # joins waiting for their node's subscription
# A message that is not a reply (a join, heartbeat, report, status request: each well
# under 2 KiB) is dropped if it is bigger than this, or would decode into more (as
# codec.object_bytes estimates): so the joins kept and the control backlog are
# bounded in what they hold, not only in what arrived.
MAX_CONTROL_MESSAGE = 64 * 2**10
MAX_REPLY_DEFAULT = 256 * 2**20
STATUS_TOPIC = b"S"  # + the asker's token: answers to ``zbus status``
DEFAULT_MASTER_PORT = 29650


def max_reply() -> int:
    """The largest message the leader's PULL socket takes (``ZBUS_MAX_REPLY``, default
    256 MiB, never above ``ZBUS_MAX_MESSAGE``): ZeroMQ drops the connection of a peer
    that sends a bigger frame before allocating it, and a message whose frames add
    up to more is dropped (a reply's caller gets a CodecError). The welcome tells
    the nodes, whose workers answer a call with that error rather than send a
    bigger reply. Bigger values belong in shared storage, not on the leader's socket."""
    value = os.environ.get("ZBUS_MAX_REPLY")
    limit = int(value) if value else MAX_REPLY_DEFAULT
    if limit <= 0:
        raise ValueError(f"ZBUS_MAX_REPLY must be positive, got {value!r}")
    return min(limit, codec.MAX_MESSAGE)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def brief(obj: Any) -> str:
    """A short repr of a value from the network for a log line: bounded in depth and
    length (``str`` of a deeply nested value recurses without bound)."""
    try:
        return _REPR.repr(obj)
    except Exception as e:  # noqa: BLE001 - a dataclass whose repr raises, say
        return f"<{type(obj).__name__}: repr failed: {type(e).__name__}>"


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


def _pick(arg: Any, default: Any, *names: str) -> Any:
    """The argument if given (not None), else the first set variable, else ``default``."""
    if arg is not None:
        return arg
    value = _env(*names)
    return default if value is None else value


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
        """Only None means "not given": an explicit 0 or "" is checked, never replaced
        by a default. ``master_port`` 0 is refused: the followers must know it."""
        s = cls(
            nnodes=int(_pick(nnodes, 1, "ZBUS_NNODES", "LWS_GROUP_SIZE")),
            nproc_per_node=int(_pick(nproc_per_node, 1, "ZBUS_NPROC_PER_NODE")),
            master_addr=str(_pick(master_addr, "127.0.0.1", "ZBUS_MASTER_ADDR", "LWS_LEADER_ADDRESS")),
            master_port=int(_pick(master_port, DEFAULT_MASTER_PORT, "ZBUS_MASTER_PORT")),
            liveness_s=float(_pick(liveness_s, 10.0, "ZBUS_LIVENESS_S")),
        )
        s._check()
        return s

    def _check(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(f"nnodes ({self.nnodes}) and nproc_per_node ({self.nproc_per_node}) "
                             "must be at least 1")
        if not self.master_addr:
            raise ValueError("master_addr is empty")
        if not 1 <= self.master_port <= 65534:  # the leader binds master_port and master_port + 1
            raise ValueError(f"master_port {self.master_port} outside 1..65534: followers find the "
                             "leader by this port, so it cannot be 0 (chosen at random)")
        if not self.liveness_s > 0:
            raise ValueError(f"liveness_s {self.liveness_s} must be positive")

    @property
    def heartbeat_s(self) -> float:
        return heartbeat_interval(self.liveness_s)


def heartbeat_interval(liveness_s: float) -> float:
    """How often the leader and each agent heartbeat: five beats to a liveness limit."""
    return max(0.05, liveness_s / 5)


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


_INT_TYPES = frozenset([*range(0x00, 0x80), *range(0xcc, 0xd4), *range(0xe0, 0x100)])


def _reply_head(frame: Any) -> list | None:
    """``[rank, seq]`` if ``frame`` starts as a reply does (an array of 4, then two
    ints), else None. Reads its first 24 bytes at most, builds nothing else."""
    import msgpack

    head = bytes(memoryview(frame)[:24])
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(head)
    try:
        if unpacker.read_array_header() != 4:
            return None
        rank_seq = []
        for _ in range(2):
            if head[unpacker.tell()] not in _INT_TYPES:
                return None
            rank_seq.append(unpacker.unpack())
    except Exception:  # noqa: BLE001 - not even the envelope: plain garbage
        return None
    return rank_seq


def _undecodable_reply(frames: list, error: Exception) -> list | None:
    """A worker's reply whose value cannot be decoded here (a type the driver
    never registered, say) becomes an error reply for that call, so the caller
    learns why instead of waiting; anything else is None (dropped). Only the
    head is read: the rest is what the codec refused, maybe for what it would build."""
    head = _reply_head(frames[0]) if frames else None
    if head is None:
        return None
    info = codec.ExceptionInfo("zbus.errors.CodecError", f"cannot decode the reply: {error}")
    return [*head, protocol.RAISED, info]


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for bind(0) and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _pair_free(host: str, port: int) -> bool:
    with socket.socket() as a, socket.socket() as b:
        try:
            a.bind((host, port))
            b.bind((host, port + 1))
        except OSError:
            return False
    return True


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 free on ``host`` now: for a leader on a machine of
    its own (the local demo, tests). A cluster across hosts uses a fixed port.

    The pair is released until the leader binds it, so it is chosen outside the
    kernel's ephemeral range: no bind(0) or outgoing connection takes it meanwhile."""
    lo, hi = _ephemeral_range()
    spans = [(s, e) for s, e in ((10000, lo - 2), (hi + 1, 65534)) if e - s > 1000]
    rng = secrets.SystemRandom()
    for _ in range(200 if spans else 0):
        start, end = rng.choice(spans)
        port = rng.randint(start, end)
        if _pair_free(host, port):
            return port
    for _ in range(50):  # no room outside the ephemeral range: a port the kernel gives
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
        if port < 65535 and _pair_free(host, port):
            return port
    raise OSError(f"no two consecutive free ports on {host}")


def route_to(master_ip: str) -> tuple[str, str | None]:
    """The local address (and its interface name) that routes to ``master_ip``:
    a connected UDP socket sends nothing but makes the kernel pick the route."""
    import psutil

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
    """Replies of one remote rank, by call number; the same ``get``/``poll``
    interface as the shared-memory response queue, told the call the caller
    wants (``want``). A thread waiting here reads the leader's PULL socket itself
    when no other thread is (``try_read``), so a reply reaches it with no hand-over
    between threads; else the reading thread files replies here.

    A reply may come twice, or after later ones: its worker sends again what it
    kept when its connection drops (:class:`zbus.queues.ReplySender`). A copy of
    a reply here or taken is dropped (counted in ``again``); ``get`` waits for
    the reply it wants. If later replies came and that one does not within
    ``grace`` seconds, the earliest is returned, and the caller's check fails on
    it (a reply that will never come) instead of waiting for ever."""

    def __init__(self, rank: int, cond: threading.Condition, try_read: Callable[[float], bool],
                 grace: float = 10.0, next_seq: Callable[[], int] | None = None):
        self.rank = rank
        self._cond = cond
        self._try_read = try_read  # reads the socket here; False if another thread reads it
        self._grace = grace
        self._next_seq = next_seq  # the highest call number a reply may answer now
        self._replies: dict[int, Any] = {}  # call number: reply
        self._taken = protocol.READY - 1  # the last call number taken
        self._overtaken: float | None = None  # since when the wanted reply is overtaken
        self._aborted = False
        self.again = 0  # replies dropped as copies

    def expects(self, seq: Any) -> bool:  # called with the condition held
        """Whether a reply to call ``seq`` can be a real one, or a copy of one: READY,
        or a call already sent. A copy is counted and not kept (:meth:`put`), so
        what is kept is bounded by the calls in flight, whatever a peer sends."""
        if type(seq) is not int:
            return False
        return seq == protocol.READY or 0 < seq <= (
            self._next_seq() if self._next_seq is not None else seq)

    def put(self, reply: Any) -> None:  # called with the condition held
        seq = reply[1]
        if seq <= self._taken or seq in self._replies:
            self.again += 1
        else:
            self._replies[seq] = reply

    def _take(self, want: int | None) -> Any:
        """The reply for ``want`` (any: the earliest), or None (condition held)."""
        if want is not None and want in self._replies:
            seq = want
        elif not self._replies:
            return None
        else:
            seq = min(self._replies)
            if want is not None and seq > want:  # overtaken: sent again, or never
                now = time.monotonic()
                self._overtaken = self._overtaken or now
                if now - self._overtaken < self._grace:
                    return None
        self._overtaken = None
        self._taken = max(self._taken, seq)
        return self._replies.pop(seq)

    def _ready(self, want: int | None) -> bool:
        return want in self._replies if want is not None else bool(self._replies)

    def poll(self, want: int | None = None) -> bool:
        if not self._ready(want):
            self._try_read(0.0)
        return self._ready(want)

    def get(self, timeout: float | None = None, cancel: Any = None, want: int | None = None) -> Any:
        deadline = deadline_of(timeout)
        while True:
            with self._cond:
                reply = self._take(want)
                if reply is not None:
                    return reply
                if self._aborted:
                    raise RingClosed(f"replies of rank {self.rank} aborted")
            left = PUMP_SLICE_S if deadline is None else min(PUMP_SLICE_S, remaining(deadline, "reply"))
            if not self._try_read(left):  # another thread reads the socket: it files our reply
                with self._cond:
                    if not self._ready(want) and not self._aborted:
                        self._cond.wait(left)

    def abort(self) -> None:
        """Wake the waiting caller, and every later one: they raise RingClosed. (Nothing
        to close: the socket is the leader's.)"""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


PUMP_SLICE_S = 0.02  # a waiting caller reads the PULL socket in slices this long
CALLERS_QUIET_S = 0.1  # the I/O thread reads the PULL socket once callers left it this long
MAX_CONTROL_BACKLOG = 4096  # control messages read but not yet handled; more are dropped
# Messages ZeroMQ queues on the PULL socket for each connection (each worker and
# each agent has its own, so the world size does not enter) before this process reads
# them: a flooding peer waits on its own sends after these, and a busy leader holds at
# most this many messages (and one being received) per connection. Real traffic does
# not wait on it: a rank sends one reply per call and the leader reads all the time;
# a worker queues 64 more replies on its own side first. 16 keeps small messages near
# ZeroMQ's full rate (measured on loopback: 375,000/s per connection; 1: 85,000/s).
PULL_RCVHWM = 16
MAX_CONTROL_BYTES = 64 * 2**20  # and the bytes they hold (MAX_CONTROL_MESSAGE); more are dropped
RESEND_BYTES = 512 * 2**20  # copies of the calls a node may lack; past this the oldest go


class SentCalls:
    """Copies of the calls queued for the nodes, kept until every node is known to
    have them: a reset connection loses what it held without a word, and a node
    that finds a gap asks for those calls again. A node has a call once one of
    its workers answered it or a later one, or its agent's heartbeat names it or
    a later one. Copies beyond ``limit`` bytes are dropped, oldest first: a gap
    across one of those fails its node. The executor's sending thread adds;
    whoever reads the nodes' messages records what they have."""

    def __init__(self, limit: int = RESEND_BYTES):
        self._limit = limit
        self._lock = threading.Lock()
        self._kept: collections.deque = collections.deque()  # (seq, frames, bytes)
        self._bytes = 0
        self._have: dict[int, int] = {}  # node rank: the last call it is known to have relayed
        self.last = 0  # the last call number queued for the nodes

    def add(self, seq: int, frames: list, node_ranks: list[int]) -> None:
        """Keep a copy of call ``seq`` (the caller may reuse its buffers; immutable
        bytes are kept as they are), and forget what ``node_ranks`` all have."""
        kept = [f if type(f) is bytes else bytes(f) for f in frames]
        size = sum(len(f) for f in kept)
        with self._lock:
            self._kept.append((seq, kept, size))
            self._bytes += size
            self.last = seq
            self._forget(node_ranks)

    def has(self, node_rank: int, seq: Any) -> None:
        """Node ``node_rank`` has relayed call ``seq`` and every call before it (no
        further than the calls sent: a peer cannot make the leader forget more)."""
        if type(seq) is int and seq > self._have.get(node_rank, 0):
            self._have[node_rank] = min(seq, self.last)

    def forget(self, node_ranks: list[int]) -> None:
        """Drop the copies of the calls the nodes ``node_ranks`` all have."""
        with self._lock:
            self._forget(node_ranks)

    def _forget(self, node_ranks: list[int]) -> None:  # the lock held
        have = min((self._have.get(r, 0) for r in node_ranks), default=self.last)
        while self._kept and (self._kept[0][0] <= have or self._bytes > self._limit):
            self._bytes -= self._kept.popleft()[2]

    def since(self, first: Any) -> list[list] | None:
        """The frames of calls ``first``..last, or None unless every one is kept."""
        with self._lock:
            calls = [c for c in self._kept if type(first) is int and c[0] >= first]
            last = self.last
        if not calls or calls[0][0] != first or calls[-1][0] != last:
            return None
        return [frames for _, frames, _ in calls]


class Leader:
    """The leader's side of the cluster: binds the two ports, admits nodes, relays
    heartbeats, and routes remote replies to per-rank receivers.

    The PULL socket is read under ``pull_lock`` by one thread at a time: by a
    caller waiting for replies (:meth:`try_read_replies`), else by the I/O thread. The reader
    files replies and heartbeats at once and leaves every other message to the
    I/O thread, which handles it with the socket released (so failures and
    admissions are handled in one place, and never keep a caller off the
    socket). The XPUB socket is shared under ``xpub_lock``."""

    def __init__(self, settings: ClusterSettings, broadcaster_factory: Callable[..., Broadcaster],
                 failure: Failure | None = None, curve_dir: str | None = None,
                 metrics: Metrics | None = None, status: Callable[[], dict] | None = None,
                 secret: bytes | None = None, insecure: bool = False):
        self.settings = settings
        self.ctx = zmq.Context()
        self.curve: LeaderCurve | None = None
        try:
            self.bind_ip = resolve_ip(settings.master_addr)
            check_exposure(self.bind_ip, bool(secret or curve_dir), insecure)
            if secret:
                self.curve = LeaderCurve.from_secret(self.ctx, secret, settings.nnodes)
            elif curve_dir:
                self.curve = LeaderCurve.from_dir(self.ctx, curve_dir)
            configure = self.curve.server if self.curve else None
            self.bcast = broadcaster_factory(host=self.bind_ip, port=settings.master_port, ctx=self.ctx,
                                             configure=configure)
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            self.max_reply = max_reply()
            self.pull.setsockopt(zmq.MAXMSGSIZE, self.max_reply)
            self.pull.setsockopt(zmq.RCVHWM, PULL_RCVHWM)  # ZeroMQ's default: 1000
            if configure is not None:
                configure(self.pull)
            bind(self.pull, self.bind_ip, settings.master_port + 1)
        except BaseException:  # a port in use, bad keys: leave no thread, socket or ring behind
            if getattr(self, "bcast", None) is not None:
                self.bcast.close()
            if self.curve is not None:
                self.curve.close()
            self.ctx.destroy(linger=0)
            raise
        self.xpub_lock = threading.RLock()  # the I/O thread sends welcomes while reading it
        self.pull_lock = threading.Lock()
        self._caller_seen = 0.0  # when a caller last wanted the PULL socket
        self._control: collections.deque = collections.deque()  # read from PULL, for the I/O thread
        # bytes (codec.object_bytes) of the messages put in _control (by the reader) and
        # taken out (by the I/O thread): each counter has one writer, so no lock is needed
        self._control_in = self._control_out = 0
        self._msg_bytes = 0  # what the message _recv_control returned last holds, if no reply
        self._wake = threading.Event()
        self._pull_closed = False
        self.nodes: dict[int, NodeInfo] = {}
        self.cond = threading.Condition()
        self.receivers: dict[int, RemoteReceiver] = {}
        # the executor's own (one failure state: see zbus.failure); a leader alone makes one
        self.failure = failure if failure is not None else Failure()
        self.calls = SentCalls()  # copies of the calls a node may lack
        self.calls_again = 0  # calls sent again to a node that lost them
        self.formed = settings.nnodes <= 1
        self._joins: dict[str, dict] = {}
        self._subscribed: set[bytes] = set()
        self._probing: dict[str, NodeInfo] = {}
        self._welcome_spec: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.metrics = metrics or Metrics()
        self._last_drop_log, self._drops_logged = 0.0, 0
        self._status = status
        self.failure.on_failure(self._on_failure)
        (log.info if self.curve else log.warning)(
            "zbus leader on %s:%d-%d: links are %s", self.bind_ip, settings.master_port,
            settings.master_port + 1, describe(self.curve))

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
        with self.cond:
            while len(self.nodes) < want:
                if on_join is not None and len(self.nodes) != seen:
                    seen = len(self.nodes)
                    on_join(seen + 1, want + 1)
                self.failure.raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.settings.nnodes)) - set(self.nodes))
                    raise TimeoutError(f"{len(self.nodes)}/{want} follower nodes joined within "
                                       f"{timeout} s; missing node ranks: {missing}")
                self.cond.wait(min(left, 1.0))
                if time.monotonic() - last_log >= 2:
                    last_log = time.monotonic()
                    log.info("%d/%d nodes joined: %s", len(self.nodes) + 1, self.settings.nnodes,
                             self.describe_nodes())
            self.formed = True
        if on_join is not None:
            on_join(want + 1, want + 1)
        log.info("%d/%d nodes joined: %s", want + 1, want + 1, self.describe_nodes())

    def describe_nodes(self) -> str:
        return ", ".join(f"{n.node_rank}:{n.host}" for n in sorted(self.nodes.values(),
                                                                   key=lambda n: n.node_rank)) or "-"

    def _on_subscription(self, topic: bytes) -> None:
        log.debug("subscription %r", topic)
        self._subscribed.add(topic)
        self._welcome_ready()

    def _on_join(self, node_id: Any, info: Any) -> None:
        if type(node_id) is not str or not isinstance(info, dict):
            self._drop("a malformed join request", "bad-join")
            return
        if node_id in self._probing or any(n.node_id == node_id for n in self.nodes.values()):
            return  # a repeated join of a node already welcomed
        log.debug("join from %s (%s)", info.get("host"), node_id)
        if self.formed:
            log.error("refused a join from %s: the cluster is formed", info.get("host", "?"))
            self._send_control(node_topic(node_id), ["reject", "the cluster is already formed"], timeout=1.0)
            return
        if len(self._joins) >= MAX_PENDING_JOINS and node_id not in self._joins:
            # A flood of joins from nodes that never subscribe: forget the oldest. A real
            # node is welcomed as soon as a join and its subscription are both here,
            # and it sends its join again every 2 s.
            self._joins.pop(next(iter(self._joins)))
            self.metrics.dropped(reason="join-flood")
        self._joins[node_id] = info
        self._welcome_ready()

    def _welcome_ready(self) -> None:
        """Welcome the joins whose node topic subscription has arrived (the welcome
        goes on that topic); probes then check the node's other subscriptions. A
        join for a rank that a node still being probed holds waits: that node may
        have died (then it expires) or may answer (then this join is refused)."""
        for node_id in [n for n in self._joins if node_topic(n) in self._subscribed]:
            if not self._held_by_probing(self._joins[node_id].get("node_rank")):
                self._welcome(node_id, self._joins.pop(node_id))

    def _held_by_probing(self, rank: Any) -> bool:
        probing = {n.node_rank for n in self._probing.values()}
        if rank in (None, -1):  # any free rank: wait only if the probed nodes hold the last ones
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
                log.warning("node %s (rank %d) never answered the probes within %.1f s: dropped",
                            node.host, node.node_rank, self.settings.liveness_s)
                self._send_control(node_topic(node_id), ["dropped", "no answer to the probes in time"], 0.1)
        self._welcome_ready()

    def _welcome(self, node_id: str, info: dict) -> None:
        s = self.settings
        try:
            node_rank = self._check_join(info)
        except ZbusError as e:
            log.error("refused node %s: %s", info.get("host", "?"), e)
            self._send_control(node_topic(node_id), ["reject", str(e)], timeout=1.0)
            self.failure.fail(ExecutorFailedError(f"node {info.get('host', '?')} refused: {e}"))
            return
        node = NodeInfo(node_rank, node_id, info["host"], info["address"], info["nproc"], info["pid"],
                        time.monotonic())
        for local in range(s.nproc_per_node):
            rank = node_rank * s.nproc_per_node + local
            self.receivers[rank] = RemoteReceiver(rank, self.cond, self.try_read_replies, s.liveness_s,
                                               self._next_seq)
        sent = self._send_control(node_topic(node_id), ["welcome", {
            "node_rank": node_rank, "nnodes": s.nnodes, "nproc_per_node": s.nproc_per_node,
            "master_addr": s.master_addr, "liveness_s": s.liveness_s,
            "reply_address": f"tcp://{bracket(self.bind_ip)}:{s.master_port + 1}",
            "max_reply": self.max_reply, **self._welcome_spec}])
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
                                       f"workers: {brief(reason)}"))

    def _on_subscribed(self, node_id: Any) -> None:
        node = self._probing.pop(node_id, None)
        if node is None:
            return
        node.last_seen = time.monotonic()
        with self.cond:
            self.nodes[node.node_rank] = node
            self.cond.notify_all()
        log.info("node %d joined: %s (%s)", node.node_rank, node.host, node.address)
        self._welcome_ready()  # a join that waited for this rank is refused now

    def _probe(self) -> None:
        for node_id in self._probing:
            for topic in PROBE_TOPICS:
                self._send_control(topic, ["probe", node_id], timeout=0.1)

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
        if rank in (None, -1):
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

    # --- running -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="zbus-leader-io", daemon=True)
        self._thread.start()

    def _send_control(self, topic: bytes, obj: Any, timeout: float = 5.0) -> bool:
        """Send a control message to the nodes; False if the XPUB socket stayed busy
        (an RPC blocked on a full node) or full for ``timeout``."""
        if not self.xpub_lock.acquire(timeout=timeout):
            return False
        try:
            return send_message(self.bcast.xpub, obj, timeout, "control send", topic)
        finally:
            self.xpub_lock.release()

    def _recv_control(self) -> Any:
        try:
            raw = self.pull.recv_multipart(copy=False)
            frames = [f.buffer for f in raw]
            size = sum(f.nbytes for f in frames)
            if size > MAX_CONTROL_MESSAGE and _reply_head(frames[0]) is None:
                self._drop(f"a message of {size} bytes that is no reply (others are at most "
                           f"{MAX_CONTROL_MESSAGE})", "too-big")
                return None
            msg = codec.decode(frames, self.max_reply)
        except CodecError as e:
            reply = _undecodable_reply(frames, e)
            if reply is None:
                self._drop(f"a malformed message from the network: {e}", "undecodable")
            return reply
        except zmq.ZMQError as e:
            self._drop(f"a message that could not be read: {e}", "unreadable")
            return None
        if type(msg) is not list or not msg:
            self._drop(f"a message of the wrong shape: {brief(msg)}", "shape")
            return None
        if type(msg[0]) is not int:  # not a reply: what it holds once decoded
            self._msg_bytes = size + codec.object_bytes(frames[0])
            if self._msg_bytes > MAX_CONTROL_MESSAGE:
                self._drop(f"a {brief(msg[0])} message that decodes into about {self._msg_bytes} "
                           f"bytes (at most {MAX_CONTROL_MESSAGE})", "too-big")
                return None
        if self.curve is not None and not self._sent_by_owner(msg, self.curve.rank_of(raw[0].get("User-Id"))):
            self._drop(f"a {brief(msg[0])} message for a node rank not of the key that sent it",
                       "not-owner")
            return None
        return msg

    def _sent_by_owner(self, msg: list, node_rank: int | None) -> bool:
        """Whether the node key of ``node_rank`` may send ``msg``: each key speaks only
        for its own node rank and that node's worker ranks (see zbus.curve)."""
        n, kind = self.settings.nproc_per_node, msg[0]
        ranks = range(node_rank * n, (node_rank + 1) * n) if node_rank else range(0)
        if type(kind) is int:  # a worker's reply
            return kind in ranks
        if type(kind) is not str:
            return True  # dropped by _dispatch
        if kind in ("hb", "gap"):
            return len(msg) > 1 and type(msg[1]) is int and msg[1] == node_rank
        if kind == "died":
            return len(msg) > 2 and type(msg[1]) is type(msg[2]) is int and msg[1] == node_rank \
                and msg[2] in ranks
        if kind == "join" and len(msg) == 3 and isinstance(msg[2], dict):
            if msg[2].get("node_rank") in (None, -1):
                msg[2]["node_rank"] = node_rank  # the key decides which free rank it takes
            return type(msg[2]["node_rank"]) is int and msg[2]["node_rank"] == node_rank
        if kind in ("subscribed", "refused") and len(msg) > 1 and type(msg[1]) is str:
            node = self._probing.get(msg[1])
            return node is None or node.node_rank == node_rank
        return True  # status (any listed key may ask) and what _dispatch drops

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
                self._drop(f"a message that broke the I/O loop: {type(e).__name__}: {brief(str(e))}",
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
            hb = ["hb", self.sent_seq] if error is None else ["failed", brief(str(error))]
            if self._send_control(TOPIC_HEARTBEAT, hb, timeout=s.heartbeat_s / 2):
                told = error is not None
            else:
                log.warning("heartbeat not sent: a node is not taking messages")
            next_hb = time.monotonic() + s.heartbeat_s
            self._check_liveness(time.monotonic())
            self.calls.forget(list(self.nodes))  # what the nodes' heartbeats said they have
            if not self.formed:
                self._expire_probing(time.monotonic())
            touch_health()
        wait_ms = min(50, int(max(0.0, next_hb - time.monotonic()) * 1000) + 1)
        self._read_subscriptions()
        if not self.formed:
            self._probe()
        self._wake.clear()
        for _ in range(min(len(self._control), 256)):  # bounded, as the reading is
            msg, size = self._control.popleft()
            self._control_out += size
            self._dispatch_safely(msg)
        if time.monotonic() - self._caller_seen < CALLERS_QUIET_S:
            self._wake.wait(wait_ms / 1000)  # callers read the socket
        elif self.pull_lock.acquire(timeout=wait_ms / 1000):
            try:
                self._read_pull(wait_ms)
            finally:
                self.pull_lock.release()
            with self.cond:
                self.cond.notify_all()  # a caller that waited for the socket may take it
        return next_hb, told

    def try_read_replies(self, timeout: float) -> bool:
        """Read the PULL socket in this thread for up to ``timeout`` seconds (until
        something arrives) unless another thread is reading it: whether this one
        did (False: the reading thread files the replies; wait on ``cond``)."""
        self._caller_seen = time.monotonic()
        if not self.pull_lock.acquire(blocking=False):
            return False
        try:
            if not self._pull_closed:
                self._read_pull(int(timeout * 1000))
        except zmq.ZMQError:
            pass  # the socket is closing: the receivers are aborted with it
        finally:
            self.pull_lock.release()
        return True

    def _read_pull(self, timeout_ms: int) -> None:
        """Take what the PULL socket has (waiting up to ``timeout_ms`` for the first
        message), at most 256 messages, so the I/O thread's timers go on under a
        flood. Replies and heartbeats are filed here; the rest is left to the I/O
        thread, which handles it with the socket released (a handler may wait
        for the XPUB socket, or run failure callbacks)."""
        if not self.pull.poll(timeout_ms, zmq.POLLIN):
            return
        for _ in range(256):
            if not self.pull.poll(0, zmq.POLLIN):
                break
            msg = self._recv_control()
            if msg is None:
                continue
            kind = msg[0]
            if type(kind) is int or (type(kind) is str and kind == "hb"):
                self._dispatch_safely(msg)
            elif len(self._control) >= MAX_CONTROL_BACKLOG \
                    or self._control_in - self._control_out + self._msg_bytes > MAX_CONTROL_BYTES:
                self._drop("a control message: too many are waiting", "backlog")
            else:
                self._control.append((msg, self._msg_bytes))
                self._control_in += self._msg_bytes
                self._wake.set()

    def _dispatch_safely(self, msg: Any) -> None:
        try:
            self._dispatch(msg)
        except Exception as e:  # noqa: BLE001 - a bad message must not stop the reader
            self._drop(f"a message that broke its handler: {type(e).__name__}: {brief(str(e))}", "handler")

    def _read_subscriptions(self) -> None:
        """Take the XPUB socket's subscription notices (a node topic means a node
        can be welcomed). Read even once formed, so strangers cannot pile them up.
        Non-blocking: other threads send on this socket under the same lock."""
        if not self.xpub_lock.acquire(timeout=0.01):
            return
        try:
            for _ in range(1000):
                if not self.bcast.xpub.poll(0, zmq.POLLIN):
                    break
                msg = self.bcast.xpub.recv()
                if msg[:1] != b"\x01":
                    continue
                topic = msg[1:]
                if not self.formed and topic[:1] == b"N" and len(topic) <= 33 \
                        and len(self._subscribed) < 4096:
                    self._on_subscription(topic)
        finally:
            self.xpub_lock.release()

    def _dispatch(self, msg: Any) -> None:
        if msg is None:
            return
        kind = msg[0]
        if type(kind) is int:
            receiver = self.receivers.get(kind)
            if receiver is None or len(msg) != 4:
                self._drop(f"a reply for unknown rank {kind!r}", "unknown-rank")
                return
            if type(msg[1]) is not int:
                self._drop(f"a reply of rank {kind} without a call number", "shape")
                return
            with self.cond:
                if not receiver.expects(msg[1]):
                    self._drop(f"a reply of rank {kind} to call {brief(msg[1])}, which it cannot answer now",
                               "unexpected-reply")
                    return
                receiver.put(msg)
                self.cond.notify_all()
            self.calls.has(kind // self.settings.nproc_per_node, msg[1])  # its node had the call
        elif kind == "hb" and len(msg) in (2, 3):  # from a node still being probed: nothing to do
            node = self.nodes.get(msg[1]) if type(msg[1]) is int else None
            if node is not None:
                node.last_seen = time.monotonic()
                self.metrics.heartbeat(node.node_rank)
                if len(msg) == 3:  # and the last call its agent relayed
                    self.calls.has(node.node_rank, msg[2])
        elif kind == "died" and len(msg) == 4 and type(msg[1]) is type(msg[2]) is int \
                and type(msg[3]) in (int, type(None)) and msg[1] in self.nodes:
            node = self.nodes[msg[1]]
            self.failure.fail(WorkerDiedError(msg[2], msg[3], f"on node {node.node_rank} ({node.host})"))
        elif kind == "join" and len(msg) == 3:
            self._on_join(msg[1], msg[2])
        elif kind == "subscribed" and len(msg) == 2 and type(msg[1]) is str:
            self._on_subscribed(msg[1])
        elif kind == "gap" and len(msg) == 4 and type(msg[1]) is int and msg[1] in self.nodes:
            node = self.nodes[msg[1]]  # its agent saw calls go missing (a reset connection)
            if self._resend(node, msg[2]):
                log.warning("node %d (%s) missed calls %s to %s: sent again", node.node_rank, node.host,
                            brief(msg[2]), brief(msg[3]))
            else:
                self.failure.fail(NodeLostError(node.node_rank, node.host,
                                         f"missed calls {brief(msg[2])} to {brief(msg[3])}"))
        elif kind == "refused" and len(msg) == 3:
            self._on_refused(msg[1], msg[2])
        elif kind == "status" and len(msg) == 2:
            self._answer_status(msg[1])
        else:
            self._drop(f"an unknown control message {brief(kind)}", "unknown-kind")

    def _next_seq(self) -> int:
        """The highest call number a reply may answer: those sent, and the one being
        sent (its replies may come before ``sent`` records it)."""
        return self.sent_seq + 1

    def _drop(self, what: str, reason: str) -> None:
        """Count a dropped message under ``reason`` (see :attr:`dropped_by`); log it,
        at most once a second under a flood."""
        self.metrics.dropped(reason=reason)
        now = time.monotonic()
        if now - self._last_drop_log >= 1.0:
            since = self.metrics.dropped_frames - self._drops_logged
            log.warning("dropped %s%s", what, f" (and {since - 1} more since the last report)"
                        if since > 1 else "")
            self._last_drop_log, self._drops_logged = now, self.metrics.dropped_frames

    def _check_liveness(self, now: float) -> None:
        for node in self.nodes.values():
            if now - node.last_seen > self.settings.liveness_s:
                self.failure.fail(NodeLostError(
                    node.node_rank, node.host, f"no heartbeat for {now - node.last_seen:.1f} s"))
                return

    def sent(self, seq: int, frames: list) -> None:
        """Call ``seq`` was queued for the nodes (the executor's sending thread): keep
        a copy to send again to a node whose connection lost it (:class:`SentCalls`)."""
        self.calls.add(seq, frames, list(self.nodes))

    @property
    def sent_seq(self) -> int:
        """The last call number queued for the nodes."""
        return self.calls.last

    def _resend(self, node: NodeInfo, first: Any) -> bool:
        """Send calls ``first``..last again to ``node`` alone, on its node topic;
        False if they are no longer all kept or could not be sent."""
        calls = self.calls.since(first)
        if calls is None:
            return False
        topic = node_topic(node.node_id) + TOPIC_RPC
        for frames in calls:
            if not self.xpub_lock.acquire(timeout=1.0):
                return False
            try:
                send_frames(self.bcast.xpub, self.bcast.wire(topic, frames), deadline_of(1.0),
                            "send calls again")
            except TimeoutError:
                return False
            finally:
                self.xpub_lock.release()
        self.calls_again += len(calls)
        return True

    def try_publish_to_nodes(self, frames: list, timeout: float) -> bool:
        """Send a call to the nodes only (after a failure the local ring is aborted)
        within ``timeout`` seconds: whether it was queued (False: the XPUB socket
        stayed busy, or a node full)."""
        if not self.xpub_lock.acquire(timeout=timeout):
            return False
        try:
            send_frames(self.bcast.xpub, self.bcast.wire(TOPIC_RPC, frames), deadline_of(timeout),
                        "broadcast to nodes")
            return True
        except TimeoutError:
            return False
        finally:
            self.xpub_lock.release()

    @property
    def replies_again(self) -> int:
        """Copies of replies dropped: a worker sent again what it kept when its
        connection dropped, and some of it had arrived."""
        return sum(r.again for r in list(self.receivers.values()))

    @property
    def dropped(self) -> int:
        """Messages from the network dropped as malformed or unexpected."""
        return self.metrics.dropped_frames

    @property
    def dropped_by(self) -> dict[str, int]:
        """:attr:`dropped` by reason: ``undecodable`` (the codec refused it: garbage,
        truncated, too deep, a frame used twice, data that does not match its
        declared shape), ``shape`` (not a non-empty list), ``unknown-rank`` (a reply
        for no remote rank), ``unknown-kind``, ``bad-join``, ``join-flood``,
        ``stray-refused``, ``bad-status``, ``not-owner`` (a key speaking for another
        node), ``handler`` / ``io-loop`` (a message that broke its handler),
        ``backlog`` (too many control messages waiting), ``unreadable``."""
        return self.metrics.drops()

    def _answer_status(self, token: Any) -> None:
        if type(token) is not str or not 0 < len(token) <= 64 or self._status is None:
            self.metrics.dropped(reason="bad-status")
            return
        self._send_control(STATUS_TOPIC + token.encode(), ["status", self._status()], timeout=1.0)

    def announce_stop(self) -> None:
        """Tell the agents that their workers are about to be stopped, so they do
        not report the exits as failures."""
        self._send_control(TOPIC_HEARTBEAT, ["stopping"], timeout=1.0)

    def say_bye(self) -> bool:
        """Tell the nodes the cluster is done (they stop their workers and exit 0);
        whether it was sent. Said as soon as the last call (STOP) is out, so a
        leader killed while its own workers stop leaves no node waiting for it."""
        try:
            return self._send_control(TOPIC_HEARTBEAT, ["bye"], timeout=1.0)
        except zmq.ZMQError:
            return False

    def abort_receivers(self) -> None:
        for r in list(self.receivers.values()):  # the I/O thread may be adding one
            r.abort()

    def _on_failure(self, _error: Exception) -> None:
        """Failed (here or in the executor: a local worker died, say): stop waiting
        for nodes and for replies."""
        with self.cond:
            self.cond.notify_all()
        self._wake.set()  # the I/O thread tells the nodes
        self.abort_receivers()

    def close(self) -> None:
        """Say bye to the nodes (best effort, bounded) and close everything."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)  # it wakes every 50 ms at most
        try:
            if not self.formed:  # followers still joining would otherwise wait out their timeout
                for topic in list(self._subscribed)[:64]:
                    self._send_control(topic, ["reject", "the leader stopped before the cluster formed"], 0.2)
        except zmq.ZMQError:
            pass
        bye = self.say_bye()
        self.abort_receivers()
        locked = self.pull_lock.acquire(timeout=1.0)  # a caller leaves it within a slice
        self._pull_closed = True
        self.pull.close(linger=0)
        if locked:
            self.pull_lock.release()
        self.bcast.close(linger_s=1.0 if bye else 0.0)
        if self.curve is not None:
            self.curve.close()
        self.ctx.term()


def check_exposure(bind_ip: str, keyed: bool, insecure: bool) -> None:
    """A leader without keys on an address other hosts reach lets anyone join as a
    node or pose as one: refuse it unless asked for (``insecure``)."""
    import ipaddress

    if keyed or ipaddress.ip_address(bind_ip.split("%")[0]).is_loopback:
        return
    if not insecure:
        raise ZbusError(f"refusing to lead nodes on {bind_ip} without keys: set ZBUS_SECRET (or "
                        "curve_dir=) to authenticate them, or ZBUS_INSECURE=1 / insecure=True to run "
                        "without (see docs/security.md)")
    log.warning("insecure: leading nodes on %s without keys: anyone who reaches its ports can join as "
                "a node, read every call and forge replies, and anyone posing as this leader can "
                "start the allowed worker classes on the followers", bind_ip)


def query_status(master_addr: str, master_port: int, timeout: float = 10.0,
                 curve_dir: str | None = None, secret: bytes | None = None) -> dict:
    """Ask a running leader for its status (``zbus status``): subscribe to an
    answer topic of our own, then ask on the leader's PULL port until it answers."""
    from .curve import NodeCurve

    token = secrets.token_hex(8)
    ip = resolve_ip(master_addr)
    ctx = zmq.Context()
    try:
        sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
        for sock in (sub, push):
            if secret:  # any node key may ask: rank 1's
                NodeCurve.from_secret(secret, 1).client(sock)
            elif curve_dir:
                NodeCurve.from_dir(curve_dir).client(sock)
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, STATUS_TOPIC + token.encode())
        sub.connect(f"tcp://{bracket(ip)}:{master_port}")
        push.connect(f"tcp://{bracket(ip)}:{master_port + 1}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            send_message(push, ["status", token], 0.5, "status")
            if sub.poll(500, zmq.POLLIN):
                _, *frames = sub.recv_multipart()
                msg = codec.decode(frames)
                if type(msg) is list and len(msg) == 2 and msg[0] == "status":
                    return msg[1]
        raise TimeoutError(f"no leader answered at {master_addr}:{master_port} within {timeout} s")
    finally:
        ctx.destroy(linger=0)
