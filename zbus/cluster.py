"""A multi-node cluster's settings, wire topics and helpers, shared by the leader
(:mod:`zbus.leader`) and the followers' agents (:mod:`zbus.agent`).

The leader (the process that owns the :class:`zbus.Executor`) binds two TCP ports
on its address: ``master_port`` (XPUB: RPC broadcasts, heartbeats and per-node
control, leader -> nodes) and ``master_port + 1`` (PULL: joins, heartbeats and
every remote rank's replies, nodes -> leader). Followers open every connection.

Topics on the XPUB side: ``R<session>`` the RPC stream of the leader whose welcome
named that session (relayed verbatim into each node's ring), ``H`` leader
heartbeats ``["hb", last call number sent, session]`` (``failed`` instead once the
executor failed), ``stopping`` and the final ``bye``, ``N<node id>`` control for one
node (welcome, reject, or dropped: welcomed, then silent too long), ``N<node id>R``
calls sent again to a node that lost them, ``R<session>P``/``HP`` probes. Messages
on the PULL side are codec-encoded lists: ``["join", node_id, info]``,
``["subscribed", node_id]``, ``["refused", node_id, reason]``, ``["status",
token]``, a member's ``["hb", node_rank, session, last call relayed]``, ``["died",
node_rank, session, rank, exitcode]``, ``["gap", node_rank, session, expected_seq,
got_seq]`` and ``["leaving", node_rank, session, reason]`` (the session its welcome
named: another leader's is dropped), or a remote worker's reply ``[session,
rank, seq, status, value]`` (the same).

Joining: a follower subscribes to ``H`` and its own ``N<id>``, then sends ``join``
until welcomed, and then to ``R<session>``; the leader's side is
:class:`zbus.membership.Membership`.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

import zmq

from . import codec
from .config import size_setting
from .errors import CodecError, SettingError, ZbusError
from .queues import bracket, send_message

log = logging.getLogger(__name__)

TOPIC_RPC, TOPIC_HEARTBEAT = b"R", b"H"
MAX_REPLY_DEFAULT = 256 * 2**20
STATUS_TOPIC = b"S"  # + the asker's token: answers to ``zbus status``
STATUS_MAX = 16 * 2**20  # the largest answer ``zbus status`` reads (4096 nodes take about 1 MiB)
STATUS_FRAMES = 16  # and its frames at most (an answer is its topic and a frame or two)
DEFAULT_MASTER_PORT = 29650
LIVENESS_RANGE_S = (0.5, 600.0)  # a leader's liveness limit, which a welcome tells its nodes
# A call of COMING_BYTES or more is announced to the nodes first ("coming"): ZeroMQ hands
# on no part of a message before all of it, so the heartbeats queued behind it are heard
# only once it is in, and its node gives the leader its liveness limit and as long again
# as the call takes at SLOWEST_LINK_BYTES_S.
COMING_BYTES = 1 << 20
SLOWEST_LINK_BYTES_S = 10 * 10**6


def max_reply() -> int:
    """The largest message the leader's PULL socket takes (``ZBUS_MAX_REPLY``, default
    256 MiB, never above ``ZBUS_MAX_MESSAGE``): ZeroMQ drops the connection of a peer
    that sends a bigger frame before allocating it, and a message whose frames add
    up to more is dropped (a reply's caller gets a CodecError). The welcome tells
    the nodes, whose workers answer a call with that error rather than send a
    bigger reply. Bigger values belong in shared storage, not on the leader's socket."""
    return min(size_setting("ZBUS_MAX_REPLY", MAX_REPLY_DEFAULT), codec.MAX_MESSAGE)


def any_rank(rank: Any) -> bool:
    """Whether a join's ``node_rank`` asks for any free rank (None or -1); False for
    what is no int, a numpy array say, where ``in (None, -1)`` would raise."""
    return rank is None or (type(rank) is int and rank == -1)


def node_topic(node_id: str) -> bytes:
    return b"N" + node_id.encode()


def rpc_topic(session: str) -> bytes:
    """The topic of the calls of the leader whose session this is. A node hears only
    its own leader's calls: ZeroMQ reconnects it to whatever leader binds the same
    address (one restarted there), whose calls could come before the heartbeat
    that shows it a stranger."""
    return TOPIC_RPC + session.encode()


def probe_topics(session: str) -> tuple[bytes, bytes]:
    """Probes travel on topics that the RPC and heartbeat subscriptions match (prefix),
    so a node's answer proves both subscriptions are in place at the leader."""
    return rpc_topic(session) + b"P", TOPIC_HEARTBEAT + b"P"


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


def typed_setting(kind: type, field: str, arg: Any, default: Any, *names: str) -> Any:
    """``_pick``'s value as ``kind`` (None stays None); else a SettingError naming
    the argument or variable it came from."""
    value = _pick(arg, default, *names)
    try:
        return None if value is None else kind(value)
    except (TypeError, ValueError):
        where = field if arg is not None else next(n for n in names if _env(n) is not None)
        raise SettingError(f"{where}={value!r}: expected {'a whole number' if kind is int else 'a number'}"
                           ) from None


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
            nnodes=typed_setting(int, "nnodes", nnodes, 1, "ZBUS_NNODES", "LWS_GROUP_SIZE"),
            nproc_per_node=typed_setting(int, "nproc_per_node", nproc_per_node, 1, "ZBUS_NPROC_PER_NODE"),
            master_addr=str(_pick(master_addr, "127.0.0.1", "ZBUS_MASTER_ADDR", "LWS_LEADER_ADDRESS")),
            master_port=typed_setting(int, "master_port", master_port, DEFAULT_MASTER_PORT,
                                      "ZBUS_MASTER_PORT"),
            liveness_s=typed_setting(float, "liveness_s", liveness_s, 10.0, "ZBUS_LIVENESS_S"),
        )
        s._check()
        return s

    def _check(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise SettingError(f"nnodes ({self.nnodes}) and nproc_per_node ({self.nproc_per_node}) "
                               "must be at least 1")
        if not self.master_addr:
            raise SettingError("master_addr is empty")
        if not 1 <= self.master_port <= 65534:  # the leader binds master_port and master_port + 1
            raise SettingError(f"master_port {self.master_port} outside 1..65534: followers find the "
                               "leader by this port, so it cannot be 0 (chosen at random)")
        lo, hi = LIVENESS_RANGE_S
        if not lo <= self.liveness_s <= hi:  # (what every follower takes: else none would join)
            raise SettingError(f"liveness_s {self.liveness_s} outside {lo}..{hi} s")

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
    try:
        ports = int(lo), int(hi)
    except ValueError:
        ports = (0, 0)
    if not 1 <= ports[0] <= ports[1] <= 65535:  # (0 would bind anywhere, past the firewall's rule)
        raise SettingError(f"ZBUS_PORT_RANGE={text!r}: expected lo-hi, 1 <= lo <= hi <= 65535")
    return ports


def resolve_ip(host: str) -> str:
    """An IP address for ``host`` (ZeroMQ binds to addresses, not host names)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise ZbusError(f"cannot resolve {host!r}: {e}") from e
    except UnicodeError as e:  # (an empty label, or one too long: no retry makes it resolve)
        raise SettingError(f"{host!r} is no host name: {e}") from e


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


def _frames_at_most(sock: zmq.Socket, limit: int, deadline: float) -> list:
    """The frames of the message waiting on ``sock``, or none if it has more than
    ``limit``: the rest is read and let go until ``deadline``. ZeroMQ bounds a
    frame's size, not their number: a peer's message of millions of empty frames (2
    bytes each on the wire) was a bytes object each here, all kept at once."""
    frames = [sock.recv()]
    while (more := sock.getsockopt(zmq.RCVMORE)) and time.monotonic() < deadline:
        frame = sock.recv()
        if len(frames) <= limit:
            frames.append(frame)
    return frames if not more and len(frames) <= limit else []  # (the deadline cut it short: none)


def query_status(master_addr: str, master_port: int, timeout: float = 10.0, curve: Any = None) -> dict:
    """Ask a running leader for its status (``zbus status``): subscribe to an
    answer topic of our own, then ask on the leader's PULL port until it answers;
    with ``curve`` (a :class:`zbus.curve.NodeCurve`) as that node, to a keyed leader."""
    token = secrets.token_hex(8)
    ip = resolve_ip(master_addr)
    ctx = zmq.Context()
    try:
        sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
        for sock in (sub, push):
            if curve is not None:
                curve.client(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, ":" in ip)
        sub.setsockopt(zmq.SUBSCRIBE, STATUS_TOPIC + token.encode())
        sub.setsockopt(zmq.MAXMSGSIZE, STATUS_MAX)
        sub.connect(f"tcp://{bracket(ip)}:{master_port}")
        push.connect(f"tcp://{bracket(ip)}:{master_port + 1}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            send_message(push, ["status", token], 0.5, "status")
            if sub.poll(500, zmq.POLLIN):
                frames = _frames_at_most(sub, STATUS_FRAMES, deadline)
                try:  # (plain: the answer holds no tensor, array or registered type, nor loads one)
                    msg = codec.decode(frames[1:], STATUS_MAX, plain=True) if frames[1:] else None
                except CodecError:
                    continue
                if type(msg) is list and len(msg) == 2 and msg[0] == "status" and type(msg[1]) is dict:
                    return msg[1]
        raise TimeoutError(f"no leader answered at {master_addr}:{master_port} within {timeout} s")
    finally:
        ctx.destroy(linger=0)
