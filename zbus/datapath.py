"""The leader's data path: calls out to the nodes, replies back from them.

Calls go out on the XPUB socket (topic ``R<session>``; ``N<node id>R`` when a node
lost some and asks for them again), each copy kept in :class:`SentCalls` until every
node has it. Every remote rank's reply comes back on the PULL socket, into that
rank's :class:`RemoteReceiver`. The PULL socket also carries the nodes' control
messages, which :class:`zbus.membership.Membership` handles.

The PULL socket is read under ``pull_lock`` by one thread at a time: by a caller
waiting for replies (:meth:`DataPath.try_read_replies`), else by the I/O thread
(:meth:`DataPath.read_unless_callers`). The reader files replies and heartbeats
at once and leaves every other message to the I/O thread
(:meth:`DataPath.handle_control`), which handles it with the socket released (so
failures and admissions are handled in one place, and never keep a caller off
the socket). The XPUB socket is shared under ``xpub_lock``.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from typing import Any, Callable

import msgpack
import zmq

from . import codec, protocol
from .cluster import TOPIC_HEARTBEAT, TOPIC_RPC, ClusterSettings, any_rank, node_topic, rpc_topic
from .curve import LeaderCurve
from .errors import CodecError, RingClosed, brief
from .metrics import Metrics
from .queues import Broadcaster, deadline_of, given_again, remaining, send_frames, send_message, sent_now
from .shm import core

# The compiled reader of the PULL socket (zbus._core.take_message), if the core is built and
# finds pyzmq's libzmq: it takes a message whole with no Python step between its frames.
_core = core if core is not None and core.relay_ready() else None

log = logging.getLogger(__name__)

# A message that is not a reply (a join, heartbeat, report, status request: each well
# under 2 KiB) is dropped if it is bigger than this, or would decode into more (as
# codec.object_bytes estimates): so the joins kept and the control backlog are
# bounded in what they hold, not only in what arrived.
MAX_CONTROL_MESSAGE = 64 * 2**10

PUMP_SLICE_S = 0.02  # a waiting caller reads the PULL socket in slices this long
READ_PASS_S = 0.05  # and takes what it has for this long at most
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
# Frames a message on the PULL socket may have: a reply's header and one frame for
# each tensor or array, and each bytes of 16 KiB or more (a local rank's reply may
# have the codec's 2**20). ZeroMQ bounds each frame's size, not their number: a
# peer's one message of millions of empty frames (2 bytes each on the wire) made a
# Python object of each, the reader holding the socket till the end. The frames
# past this are read and let go, the pass's time bounding each turn.
MAX_FRAMES = 1 << 16
TELL_RETRY_S = 0.01  # how often tell_nodes tries again the nodes that had no room
MAX_CONTROL_BYTES = 64 * 2**20  # and the bytes they hold (MAX_CONTROL_MESSAGE); more are dropped
RESEND_BYTES = 512 * 2**20  # copies of the calls a node may lack; past this the oldest go
RESEND_WAIT_S = 0.02  # a node's queue full this long: the rest waits for its next ask (every 0.5 s)


_INT_WIDTHS = {0xcc: (1, False), 0xcd: (2, False), 0xce: (4, False), 0xcf: (8, False),
               0xd0: (1, True), 0xd1: (2, True), 0xd2: (4, True), 0xd3: (8, True)}  # msgpack's ints


def _reply_head(frame: Any) -> tuple[bytes, list] | None:
    """``(session, [rank, seq, status])`` if ``frame`` starts as a remote worker's
    reply does (msgpack's array of 5, as msgpack writes it, the session its leader's
    welcome named as a str of at most 31 bytes, its bytes returned as packed, then
    three ints), else None. Reads its first 60 bytes at most, builds nothing else:
    every reply passes here."""
    head = bytes(memoryview(frame)[:60])
    if len(head) < 2 or head[0] != 0x95 or not 0xa0 <= head[1] <= 0xbf:
        return None
    ints, pos = [], 2 + (head[1] & 0x1f)
    for _ in range(3):
        b = head[pos] if pos < len(head) else -1
        if 0 <= b < 0x80 or b >= 0xe0:  # a fixint, positive or negative
            ints.append(b if b < 0x80 else b - 0x100)
            pos += 1
        elif b in _INT_WIDTHS:
            width, signed = _INT_WIDTHS[b]
            if pos + 1 + width > len(head):
                return None
            ints.append(int.from_bytes(head[pos + 1:pos + 1 + width], "big", signed=signed))
            pos += 1 + width
        else:
            return None
    return head[1:2 + (head[1] & 0x1f)], ints


def _too_big(size: int, limit: int) -> codec.ExceptionInfo:
    """What a reply over the largest the leader takes becomes (its frames are not
    kept): its call fails naming the setting."""
    return codec.ExceptionInfo("zbus.errors.CodecError", f"cannot decode the reply: a reply of {size} "
                               f"bytes exceeds ZBUS_MAX_REPLY ({limit} bytes)")


class Undecoded:
    """A reply's frames, decoded by the caller that takes the reply: not by the
    thread reading the socket, which files every rank's replies and the nodes'
    heartbeats (a header may take seconds to check), nor before its rank and call
    number are known to be expected."""

    __slots__ = ("frames",)

    def __init__(self, frames: list) -> None:
        self.frames = frames


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
                 grace: float = 10.0, next_seq: Callable[[], int] | None = None,
                 answered: Callable[[], int] | None = None, max_reply: int | None = None):
        self.rank = rank
        self._cond = cond
        self._try_read = try_read  # reads the socket here; False if another thread reads it
        self._grace = grace
        self._next_seq = next_seq  # the highest call number a reply may answer now
        self._answered = answered  # every call up to this number has all its replies
        self._max_reply = max_reply  # the bytes a reply's frames may hold (decoding refuses more)
        self._replies: dict[int, Any] = {}  # call number: reply
        self._taken = protocol.READY - 1  # the last call number taken
        self._overtaken: float | None = None  # since when the wanted reply is overtaken
        self._given: Any = None  # the reply given last, until the caller took it
        self._aborted = False
        self.again = 0  # replies dropped as copies

    def expects(self, seq: Any) -> bool:  # called with the condition held
        """Whether a reply to call ``seq`` can be a real one, or a copy of one: READY,
        a call sent and not yet answered, or one whose reply this rank gave (a
        copy). A copy is counted and not kept (:meth:`put`), nor is a reply to a
        call answered without this rank (it was not asked), so what is kept is
        bounded by the calls in flight, whatever a peer sends."""
        if type(seq) is not int:
            return False
        if seq == protocol.READY or 0 < seq <= self._taken:
            return True
        answered = self._answered() if self._answered is not None else 0
        return answered < seq <= (self._next_seq() if self._next_seq is not None else seq)

    def put(self, reply: Any) -> None:  # called with the condition held
        seq = reply[1]
        if seq <= self._taken or seq in self._replies:
            self.again += 1
            return
        self._drop_answered()
        self._replies[seq] = reply

    def _drop_answered(self) -> None:
        """Drop the replies kept for calls answered since (without this rank: it was
        not asked), which no one takes."""
        if self._answered is not None and self._replies:
            answered = self._answered()
            for stale in [s for s in self._replies if 0 < s <= answered]:
                del self._replies[stale]

    def _take(self, want: int | None) -> Any:
        """The reply for ``want`` (any: the earliest), or None (condition held)."""
        if want is not None and want in self._replies:
            seq = want
        else:
            self._drop_answered()
            if not self._replies:
                return None
            seq = min(self._replies)
            if want is not None and seq > want:  # overtaken: sent again, or never
                now = time.monotonic()
                self._overtaken = self._overtaken or now
                if now - self._overtaken < self._grace:
                    return None
        self._overtaken = None
        self._taken = max(self._taken, seq)
        # kept until the caller took it (no call between: a Ctrl-C cannot land there)
        self._given = reply = self._replies[seq]
        del self._replies[seq]
        return reply

    def _ready(self, want: int | None) -> bool:
        return want in self._replies or given_again(self._given, want) if want is not None \
            else bool(self._replies)

    def poll(self, want: int | None = None) -> bool:
        if not self._ready(want):
            self._try_read(0.0)
        return self._ready(want)

    def get(self, timeout: float | None = None, cancel: Any = None, want: int | None = None) -> Any:
        deadline = deadline_of(timeout)
        while True:
            with self._cond:
                reply = self._given if given_again(self._given, want) else self._take(want)
                if reply is None and self._aborted:
                    raise RingClosed(f"replies of rank {self.rank} aborted")
            if reply is not None:
                # (decoded with the condition let go: every reader files under it)
                self._given = reply = self._decoded(reply)
                return reply
            left = PUMP_SLICE_S if deadline is None else min(PUMP_SLICE_S, remaining(deadline, "reply"))
            if not self._try_read(left):  # another thread reads the socket: it files our reply
                with self._cond:
                    if not self._ready(want) and not self._aborted:
                        self._cond.wait(left)

    def taken(self) -> None:
        """The caller keeps the reply given last: it is not given again. (Until then
        it is, while the caller wants its call: a Ctrl-C in its decoding, or before
        the caller kept it, loses no reply.)"""
        self._given = None

    def _decoded(self, reply: list) -> list:
        """The reply with its value decoded (by this caller, no lock held); one that
        cannot be is the error of its call."""
        if type(reply[3]) is not Undecoded:
            return reply
        try:
            # (the list its head began, less the session)
            return codec.decode(reply[3].frames, self._max_reply)[1:]
        except CodecError as e:  # (a type the driver never registered, say): the caller learns why
            info = codec.ExceptionInfo("zbus.errors.CodecError", f"cannot decode the reply: {e}")
            return [reply[0], reply[1], protocol.RAISED, info]

    def abort(self) -> None:
        """Wake the waiting caller, and every later one: they raise RingClosed. (Nothing
        to close: the socket is the leader's.)"""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()



_recv = zmq.backend.Socket.recv  # (compiled, unlike zmq.Socket.recv: no Python step inside)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # (ints: an enum's ``&`` is a Python function)
_RCVMORE, _NOBLOCK = int(zmq.RCVMORE), int(zmq.NOBLOCK)


def _rest_of(sock: zmq.Socket, frames: list) -> bool:
    """Take the rest of a message whose first frames are ``frames``, up to
    MAX_FRAMES: whether that is all of it (False: the rest is left on the socket).
    ZeroMQ holds a message whole before any of it can be taken: this never waits."""
    while frames[-1].more:
        if len(frames) >= MAX_FRAMES:
            return False
        frames.append(_recv(sock, _NOBLOCK, False))
    return True


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
        bytes are kept as they are), and forget what ``node_ranks`` all have. A call
        over the limit is not copied: it and every call before it are forgotten."""
        size = codec.nbytes(frames)
        kept = [f if type(f) is bytes else bytes(f) for f in frames] if size <= self._limit else None
        with self._lock:
            if self._kept and self._kept[-1][0] == seq:  # (recorded twice: a Ctrl-C as it was)
                return
            if kept is None:  # (a gap across it fails its node, as when its copy is dropped)
                self._kept.clear()
                self._bytes, self.last = 0, seq
                return
            self._kept.append((seq, kept, size))
            self._bytes += size
            self.last = seq
            self._forget(node_ranks)

    def had(self, node_rank: int) -> int:
        """The last call node ``node_rank`` is known to have relayed (0: none)."""
        return self._have.get(node_rank, 0)

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


class DataPath:
    """The leader's two sockets as the calls and replies use them: calls published
    to the nodes and sent again to one that lost some, the PULL socket read by a
    waiting caller or the I/O thread, replies filed into per-rank receivers, and
    the nodes' other messages handed to the control handler (see the module's
    docstring for who reads the PULL socket)."""

    def __init__(self, settings: ClusterSettings, bcast: Broadcaster, pull: zmq.Socket,
                 curve: LeaderCurve | None, metrics: Metrics, max_reply: int):
        self.settings = settings
        self.bcast = bcast
        self.pull = pull
        self.curve = curve
        self.metrics = metrics
        self.max_reply = max_reply
        # this leader's own: its welcome names it, its calls go on rpc_topic(session) and
        # its heartbeats name it, so a node that joined a leader which died hears none
        # of a new one's calls at the same address, and takes it for a stranger
        self.session = secrets.token_hex(8)
        self._reply_tag = msgpack.packb(self.session)  # how a reply names it (see _reply_head)
        self.rpc_topic = rpc_topic(self.session)
        self.xpub_lock = threading.RLock()  # the I/O thread sends welcomes while reading it
        self.pull_lock = threading.Lock()
        # one condition for replies filed, nodes joined and a failure: every wait wakes on it
        self.cond = threading.Condition()
        self.wake = threading.Event()  # the I/O thread has work: a control message, a failure
        self.receivers: dict[int, RemoteReceiver] = {}
        self.calls = SentCalls()  # copies of the calls a node may lack
        self.calls_again = 0  # calls sent again to a node that lost them
        self.answered = 0  # every call up to this number has all its replies (the executor's)
        self._caller_seen = 0.0  # when a caller last wanted the PULL socket
        self._control: collections.deque = collections.deque()  # read from PULL, for the I/O thread
        # bytes (codec.object_bytes) of the messages put in _control (by the reader) and
        # taken out (by the I/O thread): each counter has one writer, so no lock is needed
        self._control_in = self._control_out = 0
        self._msg_bytes = 0  # what the message _checked_message returned last holds, if no reply
        self._pull_closed = False
        self._pull_handle = pull.underlying  # libzmq's socket, for the compiled reader
        self._read_one = self._read_one_core if _core is not None else self._read_one_py
        self._rest_left = False  # the socket holds the rest of a message of too many frames
        self._last_drop_log, self._drops_logged = 0.0, 0
        self._on_control: Callable[[list], None] = self._no_control
        self._probing_rank: Callable[[str], int | None] = lambda _node_id: None

    def route_control(self, on_control: Callable[[list], None],
                      probing_rank: Callable[[str], int | None]) -> None:
        """Hand the nodes' messages that are no reply to ``on_control``; ``probing_rank``
        names the node rank of a node still being probed (keys may speak only for
        their own node: :meth:`_sent_by_owner`)."""
        self._on_control, self._probing_rank = on_control, probing_rank

    def _no_control(self, msg: list) -> None:
        self.drop(f"an unknown control message {brief(msg[0])}", "unknown-kind")

    # --- calls out ---------------------------------------------------------------

    def try_publish_to_nodes(self, frames: list, timeout: float) -> bool:
        """Send a call to the nodes only (after a failure the local ring is aborted)
        within ``timeout`` seconds: whether it was queued (False: the XPUB socket
        stayed busy, or a node full)."""
        try:
            send_frames(self.bcast.xpub, self.bcast.wire(self.rpc_topic, frames), deadline_of(timeout),
                        "broadcast to nodes", lock=self.xpub_lock)
            return True
        except TimeoutError:
            return False

    def sent(self, seq: int, frames: list, node_ranks: list[int]) -> None:
        """Call ``seq`` was queued for the nodes ``node_ranks`` (the executor's sending
        thread): keep a copy to send again to a node whose connection lost it
        (:class:`SentCalls`)."""
        self.calls.add(seq, frames, node_ranks)

    @property
    def sent_seq(self) -> int:
        """The last call number queued for the nodes."""
        return self.calls.last

    def _answered_seq(self) -> int:
        return self.answered

    def _next_seq(self) -> int:
        """The highest call number a reply may answer: those sent, and the one being
        sent (its replies may come before ``sent`` records it)."""
        return self.sent_seq + 1

    def resend(self, node_id: str, node_rank: int, first: Any) -> int | None:
        """Send calls ``first``..last again to node ``node_id`` alone, on its node
        topic: how many went (fewer when its queue stayed full: the node asks again
        for the rest, and gives up after its own limit), or None if they are no
        longer all kept (the node cannot be made whole). Those the node is known to
        have since it asked (its ask waited behind its heartbeat, say) are not sent."""
        if type(first) is int and 0 < first <= self.calls.had(node_rank):
            first = self.calls.had(node_rank) + 1
            if first > self.calls.last:
                return 0
        calls = self.calls.since(first)
        if calls is None:
            return None
        topic, deadline, sent = node_topic(node_id) + TOPIC_RPC, deadline_of(RESEND_WAIT_S), 0
        for frames in calls:
            try:
                send_frames(self.bcast.xpub, self.bcast.wire(topic, frames), deadline, "send calls again",
                            lock=self.xpub_lock)
            except TimeoutError:
                break
            sent += 1
        self.calls_again += sent
        return sent

    def send_control(self, topic: bytes, obj: Any, timeout: float = 5.0, wait: bool = True) -> bool:
        """Send a control message to the nodes; False if the XPUB socket stayed busy
        or a subscriber full for ``timeout`` (``wait=False``: full now)."""
        if wait:
            return send_message(self.bcast.xpub, obj, timeout, "control send", topic, self.xpub_lock)
        return self._send_now([topic], obj, timeout)

    def send_beat(self, obj: Any, node_ids: list[str], timeout: float) -> bool:
        """Send a heartbeat (or ``failed``) to the nodes without waiting on any: one
        broadcast, or, while some node's queue is full (a stalled node, which makes
        every broadcast wait), a copy on each node's own topic that has room, so the
        other nodes still hear the leader. False if none went out, or the socket
        stayed busy for ``timeout``."""
        return self._send_now([TOPIC_HEARTBEAT], obj, timeout, [node_topic(n) for n in node_ids])

    def tell_nodes(self, obj: Any, node_ids: list[str], timeout: float, cancel: Any = None) -> bool:
        """Send a control message that every node must hear (``stopping``, ``bye``,
        ``coming``) within ``timeout``: one broadcast, or, while some node's queue
        is full (a stalled node, on which a broadcast would wait out the timeout),
        a copy on each node's own topic as soon as that node has room; no longer
        once ``cancel`` (an Event) is set. Whether it went to any node (then it is
        worth lingering on close to let it out)."""
        frames, deadline = codec.encode(obj), deadline_of(timeout)
        left, went = [TOPIC_HEARTBEAT], False
        while cancel is None or not cancel.is_set():  # (or the deadline)
            if not self.xpub_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return went
            try:
                before = len(left)
                left = [t for t in left if not sent_now(self.bcast.xpub, [t, *frames], "control send")]
                went |= len(left) < before
            finally:
                self.xpub_lock.release()
            if not left or time.monotonic() >= deadline:
                return went
            if left == [TOPIC_HEARTBEAT]:  # no copy went yet: one per node from now on
                left = [node_topic(n) for n in node_ids]
            time.sleep(TELL_RETRY_S)
        return went

    def _send_now(self, topics: list[bytes], obj: Any, timeout: float,
                  instead: list[bytes] | None = None) -> bool:
        """Send ``obj`` on ``topics`` where every subscriber has room now (the socket
        taken within ``timeout``); if it went on none of them, on each of ``instead``
        that has room. Whether it went anywhere. Never waits on a subscriber."""
        frames = codec.encode(obj)
        if not self.xpub_lock.acquire(timeout=timeout):
            return False
        try:
            sent = [sent_now(self.bcast.xpub, [t, *frames], "control send") for t in topics]
            if not any(sent) and instead:
                sent = [sent_now(self.bcast.xpub, [t, *frames], "control send") for t in instead]
            return any(sent)
        finally:
            self.xpub_lock.release()

    # --- replies in --------------------------------------------------------------

    def open_receivers(self, node_rank: int) -> None:
        """Keep the replies of the ranks of node ``node_rank`` from now on (it was
        welcomed: its workers' READY may come before it counts as joined)."""
        s = self.settings
        for local in range(s.nproc_per_node):
            rank = node_rank * s.nproc_per_node + local
            self.receivers[rank] = RemoteReceiver(rank, self.cond, self.try_read_replies, s.liveness_s,
                                                  self._next_seq, self._answered_seq, self.max_reply)

    @property
    def replies_again(self) -> int:
        """Copies of replies dropped: a worker sent again what it kept when its
        connection dropped, and some of it had arrived."""
        return sum(r.again for r in list(self.receivers.values()))

    def abort_receivers(self) -> None:
        for r in list(self.receivers.values()):  # the I/O thread may be adding one
            r.abort()

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
        except (zmq.ZMQError, OSError):
            pass  # the socket is closing: the receivers are aborted with it
        finally:
            self.pull_lock.release()
        return True

    def _read_pull(self, timeout_ms: int) -> None:
        """Take what the PULL socket has (waiting up to ``timeout_ms`` for the first
        message), at most 256 messages or READ_PASS_S, so the I/O thread's timers
        and a caller's deadline go on under a flood. Replies and heartbeats are
        filed here; the rest is left to the I/O thread, which handles it with the
        socket released (a handler may wait for the XPUB socket, or run failure
        callbacks)."""
        if self._pull_closed:
            return
        if not (_core.wait_message(self._pull_handle, timeout_ms / 1000) if _core is not None
                else self.pull.poll(timeout_ms, zmq.POLLIN)):
            return
        end = time.monotonic() + READ_PASS_S
        for _ in range(256):
            if self._rest_left and not self._let_rest_go(end):
                return
            if not self._read_one() or time.monotonic() > end:
                break

    def _let_rest_go(self, end: float) -> bool:
        """Read and let go the frames left of a message of too many, until ``end``:
        whether they are all gone. (The socket says whether it is in a message: a
        Ctrl-C that took a frame's return leaves no doubt here.)"""
        while self.pull.getsockopt(_RCVMORE):
            if time.monotonic() > end:
                return False
            for _ in range(4096):
                if not _recv(self.pull, _NOBLOCK, False).more:
                    break
        self._rest_left = False
        return True

    def _read_one_core(self) -> bool:
        """Take the next message off the PULL socket and file it; False if none is
        there. The compiled core takes it whole and puts it in ``got`` before any
        Python step runs: a KeyboardInterrupt or SystemExit (a signal's handler, in a
        caller's thread) lets it be filed first (where it was not yet), then goes on."""
        got: list = []
        filed = [False]
        try:
            if not _core.take_message(self._pull_handle, MAX_FRAMES, self.curve is not None, got):
                return False
            self._file_taken(got[0], filed)
        except BaseException as e:
            if isinstance(e, Exception) or filed[0] or not got:
                raise
            self._file_taken(got[0], filed)
            raise
        return True

    def _file_taken(self, taken: tuple, filed: list) -> None:
        frames, whole, user_id = taken
        self._rest_left = not whole
        self._file(frames, user_id, filed)

    def _read_one_py(self) -> bool:
        """The twin of :meth:`_read_one_core` in Python. Once its first frame is taken
        the message is nowhere else: a KeyboardInterrupt or SystemExit lets it be taken
        whole and filed first, then goes on. (pyzmq runs a signal's handler inside its
        receive and drops the frame it took if the handler raises: that loss only the
        compiled reader avoids.)"""
        if not self.pull.getsockopt(_EVENTS) & _POLLIN:  # (no exception to build when empty)
            return False
        try:
            frames = [_recv(self.pull, _NOBLOCK, False)]
        except zmq.Again:
            return False
        filed = [False]
        try:
            self._rest_left = not _rest_of(self.pull, frames)
            self._file_frames(frames, filed)
        except BaseException as e:
            if isinstance(e, Exception) or filed[0]:
                raise
            self._rest_left = not _rest_of(self.pull, frames)
            self._file_frames(frames, filed)
            raise
        return True

    def _file_frames(self, frames: list, filed: list) -> None:
        user_id = frames[0].get("User-Id") if self.curve is not None else None
        self._file([f.buffer for f in frames], user_id, filed)

    def _file(self, frames: list, user_id: str | None, filed: list) -> None:
        """Check a message's frames (buffers; ``user_id``: the CURVE key that sent it)
        and file what they hold: a reply or heartbeat at once, another control message
        for the I/O thread; ``filed`` is set once done."""
        msg = self._checked_message(frames, user_id)
        if msg is None:
            filed[0] = True
            return
        kind = msg[0]
        if type(kind) is int or (type(kind) is str and kind == "hb"):
            self._dispatch_safely(msg)
        elif len(self._control) >= MAX_CONTROL_BACKLOG \
                or self._control_in - self._control_out + self._msg_bytes > MAX_CONTROL_BYTES:
            self.drop("a control message: too many are waiting", "backlog")
        else:
            self._control.append((msg, self._msg_bytes))
            self._control_in += self._msg_bytes
            self.wake.set()
        filed[0] = True


    def read_unless_callers(self, wait_ms: int) -> None:
        """The I/O thread's turn on the PULL socket: read it for up to ``wait_ms``
        unless a caller wanted it lately (then wait for control messages instead)."""
        if time.monotonic() - self._caller_seen < CALLERS_QUIET_S:
            self.wake.wait(wait_ms / 1000)  # callers read the socket
        elif self.pull_lock.acquire(timeout=wait_ms / 1000):
            try:
                self._read_pull(wait_ms)
            finally:
                self.pull_lock.release()
            with self.cond:
                self.cond.notify_all()  # a caller that waited for the socket may take it

    def handle_control(self) -> None:
        """Handle the control messages a reader left (the I/O thread), at most 256:
        bounded, as the reading is."""
        self.wake.clear()
        for _ in range(min(len(self._control), 256)):
            msg, size = self._control.popleft()
            self._control_out += size
            self._dispatch_safely(msg)

    def _dispatch_safely(self, msg: list) -> None:
        try:
            self._dispatch(msg)
        except Exception as e:  # noqa: BLE001 - a bad message must not stop the reader
            self.drop(f"a message that broke its handler: {type(e).__name__}: {brief(str(e))}", "handler")

    def _dispatch(self, msg: list) -> None:
        if type(msg[0]) is int:
            self._file_reply(msg)
        else:
            self._on_control(msg)

    def _file_reply(self, msg: list) -> None:
        rank = msg[0]
        receiver = self.receivers.get(rank)
        if receiver is None or len(msg) != 4:
            self.drop(f"a reply for unknown rank {rank!r}", "unknown-rank")
            return
        if type(msg[1]) is not int or type(msg[2]) is not int:  # (an array's == has no truth value)
            self.drop(f"a reply of rank {rank} without a call number or an int status", "shape")
            return
        with self.cond:
            if not receiver.expects(msg[1]):
                self.drop(f"a reply of rank {rank} to call {brief(msg[1])}, which it cannot answer now",
                          "unexpected-reply")
                return
            receiver.put(msg)
            self.cond.notify_all()
        self.calls.has(rank // self.settings.nproc_per_node, msg[1])  # its node had the call

    def _checked_message(self, frames: list, user_id: str | None) -> Any:
        """The message of ``frames``, checked (None: dropped, and counted)."""
        try:
            tagged = _reply_head(frames[0])
            if tagged is not None and tagged[0] != self._reply_tag:
                self.drop("a reply that names another leader's session (of a leader before this one "
                          "at its address?)", "other-session")
                return None
            head = None if tagged is None else tagged[1]
            size = sum(f.nbytes for f in frames)
            if self._rest_left:  # (its frames past MAX_FRAMES are let go)
                if head is None:
                    self.drop(f"a message of over {MAX_FRAMES} frames", "too-many-frames")
                    return None
                msg = [head[0], head[1], protocol.RAISED, codec.ExceptionInfo(
                    "zbus.errors.CodecError", f"cannot decode the reply: it has over {MAX_FRAMES} frames "
                    "(one for each tensor or array, and each bytes of 16 KiB or more)")]
            elif head is not None and size <= self.max_reply:  # a reply: checked, filed, decoded by its taker
                msg = [*head, Undecoded(frames)]
            elif head is not None:  # (its frames, each within the limit, are not kept)
                msg = [head[0], head[1], protocol.RAISED, _too_big(size, self.max_reply)]
            else:
                if size > MAX_CONTROL_MESSAGE:
                    self.drop(f"a message of {size} bytes that is no reply (others are at most "
                              f"{MAX_CONTROL_MESSAGE})", "too-big")
                    return None
                # What it would build, estimated before msgpack builds it: a header of
                # 64 KiB can make millions of empty lists (tens of ms a message).
                self._msg_bytes = size + codec.object_bytes(frames[0], MAX_CONTROL_MESSAGE - size)
                if self._msg_bytes > MAX_CONTROL_MESSAGE:
                    self.drop(f"a message that would decode into more than {MAX_CONTROL_MESSAGE} bytes",
                              "too-big")
                    return None
                # (plain: no node's control message holds a tensor, array or registered
                # type, and none may make this thread load torch or build one)
                msg = codec.decode(frames, self.max_reply, plain=True)
                if type(msg) is list and msg and type(msg[0]) is int:  # a reply that names no session
                    self.drop(f"a reply of rank {brief(msg[0])} that names no session", "other-session")
                    return None
                if type(msg) is list and msg and msg[0] == self.session:  # (plain data: == can judge)
                    self.drop(f"a reply of the wrong shape: {brief(msg)}", "shape")
                    return None
        except CodecError as e:
            self.drop(f"a malformed message from the network: {e}", "undecodable")
            return None
        if type(msg) is not list or not msg:
            self.drop(f"a message of the wrong shape: {brief(msg)}", "shape")
            return None
        if self.curve is not None and not self._sent_by_owner(msg, self.curve.rank_of(user_id)):
            self.drop(f"a {brief(msg[0])} message for a node rank not of the key that sent it",
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
            return True  # dropped by the control handler
        if kind in ("hb", "gap", "leaving"):
            return len(msg) > 1 and type(msg[1]) is int and msg[1] == node_rank
        if kind == "died":
            return len(msg) > 3 and type(msg[1]) is type(msg[3]) is int and msg[1] == node_rank \
                and msg[3] in ranks
        if kind == "join" and len(msg) == 3 and isinstance(msg[2], dict):
            if any_rank(msg[2].get("node_rank")):
                msg[2]["node_rank"] = node_rank  # the key decides which free rank it takes
            return type(msg[2]["node_rank"]) is int and msg[2]["node_rank"] == node_rank
        if kind in ("subscribed", "refused") and len(msg) > 1 and type(msg[1]) is str:
            probed = self._probing_rank(msg[1])
            return probed is None or probed == node_rank
        return True  # status (any listed key may ask) and what the handler drops

    def drop(self, what: str, reason: str) -> None:
        """Count a dropped message under ``reason`` (see :attr:`dropped_by`); log it,
        at most once a second under a flood."""
        self.metrics.dropped(reason=reason)
        now = time.monotonic()
        if now - self._last_drop_log >= 1.0:
            since = self.metrics.dropped_frames - self._drops_logged
            log.warning("dropped %s%s", what, f" (and {since - 1} more since the last report)"
                        if since > 1 else "")
            self._last_drop_log, self._drops_logged = now, self.metrics.dropped_frames

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
        ``subscription-flood`` (over 4096 node topics while forming: the oldest no
        join waits for is forgotten),
        ``late-join`` (a join once the cluster formed: refused), ``stray-refused``,
        ``other-session`` (a member's message naming another leader's session),
        ``bad-status``, ``not-owner`` (a key speaking for another node),
        ``handler`` / ``io-loop`` (a message that broke its handler),
        ``backlog`` (too many control messages waiting), ``gap-too-soon`` (a node's
        ask for lost calls within ``GAP_EVERY_S`` of its last), ``too-many-frames``
        (a message of more than ``MAX_FRAMES`` that is no reply)."""
        return self.metrics.drops()

    def close(self, linger_s: float) -> None:
        """Wake every waiting caller (RingClosed), close the PULL socket once no caller
        reads it, and the XPUB once no thread sends on it; ``linger_s`` lets queued
        messages out."""
        self.abort_receivers()
        locked = self.pull_lock.acquire(timeout=1.0)  # a caller leaves it within a slice
        self._pull_closed = True
        self.pull.close(linger=0)
        if locked:
            self.pull_lock.release()
        # (a ZeroMQ socket closed while another thread sends on it can crash libzmq)
        locked = self.xpub_lock.acquire(timeout=1.0)  # a sender lets go within a slice
        try:
            self.bcast.close(linger_s=linger_s)
        finally:
            if locked:
                self.xpub_lock.release()
