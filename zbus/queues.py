"""Message queues on top of the ring and ZeroMQ, all with one interface.

- :class:`Broadcaster`: one message to every local reader (shared-memory ring) and
  every remote subscriber (ZeroMQ XPUB), encoded once.
- Response queues carry each worker's answer to the one reader that wants it:
  :class:`ShmSender`/:class:`ShmReceiver` within a machine, :class:`ZmqSender`
  (PUSH) / :class:`ZmqReceiver` (PULL) across machines. ``put(obj, timeout)`` and
  ``get(timeout)`` behave the same on both.

No send is silent about failure: nothing is dropped at a high-water mark (XPUB runs
with ``XPUB_NODROP``), a peer that does not take a message within the timeout
raises :class:`TimeoutError`. A send never aliases the caller's memory after it
returns or raises: ZeroMQ gets its own copy of every frame, and the ring copies what
it keeps, so no send waits past its deadline for a peer to read.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import zmq

from . import codec, protocol
from .config import RingGeometry, WaitPolicy
from .errors import Cancelled, CodecError, SendTimeout, ZbusError
from .ring import RingHandle, RingReader, RingWriter, deadline_of

WAIT_SLICE_S = 0.1  # a blocked send or lock wait checks its cancel event this often
LOCK_TURN_S = 0.02  # a send waiting on a full peer lets other threads have the socket this often
LOCK_PAUSE_S = 0.001  # ... for this long


def remaining(deadline: float | None, what: str) -> float | None:
    """Seconds left before ``deadline`` (None: no limit); TimeoutError once past."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what} timed out")
    return left


def bind(sock: zmq.Socket, host: str, port: int = 0, port_range: tuple[int, int] | None = None) -> int:
    """Bind ``sock`` on ``host`` (never a wildcard unless asked) and return the
    port the kernel gave: port 0 or one from ``port_range``. No probe-then-bind.
    A port that cannot be had is a ZbusError naming it (ZeroMQ's own error is no
    OSError: a driver or the CLI would show a traceback of the socket's internals)."""
    if ":" in host:  # an IPv6 address: ZeroMQ refuses it unless told
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if port:
            sock.bind(f"tcp://{bracket(host)}:{port}")
            return port
        if port_range:
            return sock.bind_to_random_port(f"tcp://{bracket(host)}", port_range[0], port_range[1] + 1,
                                            max_tries=4 * (port_range[1] - port_range[0] + 1))
        sock.bind(f"tcp://{bracket(host)}:*")
    except (zmq.ZMQError, zmq.ZMQBindError) as e:  # (the second: each port of the range tried)
        where = f"port {port}" if port else f"a port in {port_range[0]}-{port_range[1]}" if port_range \
            else "a free port"
        errno = getattr(e, "errno", zmq.EADDRINUSE)
        taken = " (another leader, or another program, holds it)" if errno == zmq.EADDRINUSE else ""
        raise ZbusError(f"cannot listen on {where} of {host}: {zmq.strerror(errno)}{taken}") from e
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


def bracket(host: str) -> str:
    """``host`` as a ZeroMQ or URL address takes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


_send = zmq.backend.Socket.send  # (compiled, unlike zmq.Socket.send: see send_frames)
# The flags as plain ints: pyzmq's are enum members, whose ``|`` is a Python function
# (a step where a signal's handler may run, see send_frames) and costs a microsecond.
_MORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket, frames: Sequence[Any], deadline: float | None, what: str,
                cancel: Any = None, lock: Any = None, on_queued: Callable[[], None] | None = None) -> None:
    """Send a multipart message, each frame copied once into ZeroMQ's own memory:
    the caller may change its buffers as soon as this returns, however long the
    message then waits for a slow peer.

    Only the first frame can wait (ZeroMQ takes the rest of a message once it took
    its first part): until ``deadline``, then :class:`SendTimeout` with
    ``queued=False`` (nothing was sent), or until ``cancel`` is set
    (:class:`Cancelled`). The wait sleeps in ZeroMQ, woken when the peer makes
    room: an XPUB socket reports itself writable even at its high-water mark, so
    polling it would spin. ``lock``, when given, serialises the socket with other
    threads: taken by ``deadline``, and let go between the waits of the first
    frame, while nothing of the message is queued, so that a full peer does not
    hold up another thread's sends (the heartbeats).

    Once ZeroMQ took the first part, the message is finished even when an
    exception (Ctrl-C, a signal handler's) cuts the loop short: the socket's next
    message would be glued onto the part sent. Python runs a signal's handler as
    a compiled call returns or at the loop's end, never between ``began`` and the
    send (pyzmq's own ``send``, a Python function, would add its entry), so the
    part in hand counts as sent, exactly. (The one window left: a handler run in
    the few steps after a first part that had to wait was taken.) ``on_queued``
    runs once the whole message is queued, before such an exception goes on (in
    its own first step included: it may then run twice). The lock is let go
    inline: a method's first step, where a signal's handler may run, would keep it.
    """
    turn = _Turn(lock, deadline, what, cancel)
    try:
        turn.take()
        if cancel is not None and cancel.is_set():  # (a failure while this waited: nothing goes after it)
            raise Cancelled(f"{what} cancelled")
        last, i, began, whole = len(frames) - 1, 0, False, False
        try:
            for i, frame in enumerate(frames):
                flags = _MORE if i < last else 0
                began = True
                try:
                    _send(sock, frame, flags | _NOBLOCK, True)
                except zmq.Again:
                    began = i > 0
                    _send_waiting(sock, frame, flags, deadline, what, cancel, turn if i == 0 else None)
                    began = True
            whole = True
            if on_queued is not None:
                on_queued()
        except BaseException as e:
            if began and not isinstance(e, zmq.ZMQError) and not (whole and isinstance(e, Exception)):
                _finish(sock, frames, i + 1, on_queued)  # (whole: it sends nothing more)
            raise
    finally:
        if turn.held:
            turn.held = False
            turn.lock.release()


def _finish(sock: zmq.Socket, frames: Sequence[Any], start: int,
            on_queued: Callable[[], None] | None) -> None:
    """Send the rest of a message whose first part ZeroMQ took (it takes the rest
    at once, whatever its high-water mark)."""
    last = len(frames) - 1
    try:
        for i in range(start, last + 1):
            _send(sock, frames[i], (_MORE if i < last else 0) | _NOBLOCK, True)
    except zmq.ZMQError:
        return  # the socket is closing: it sends nothing more
    if on_queued is not None:
        on_queued()


def sent_now(sock: zmq.Socket, frames: Sequence[Any], what: str) -> bool:
    """Send ``frames`` if every subscriber they go to has room now: whether they
    went (False: nothing was sent, a queue is full)."""
    try:
        send_frames(sock, frames, time.monotonic(), what)
    except TimeoutError:
        return False
    return True


def send_message(sock: zmq.Socket, obj: Any, timeout: float, what: str,
                 topic: bytes | None = None, lock: Any = None) -> bool:
    """Encode ``obj`` and send it (after ``topic``, if given) within ``timeout``
    seconds: a control message, small and never urgent. Whether it was sent (False:
    the peer took nothing in time)."""
    frames = codec.encode(obj)
    try:
        send_frames(sock, frames if topic is None else [topic, *frames], deadline_of(timeout), what,
                    lock=lock)
    except TimeoutError:
        return False
    return True


def _send_waiting(sock: zmq.Socket, frame: Any, flags: int, deadline: float | None, what: str,
                  cancel: Any, turn: _Turn | None) -> None:
    """Send one frame that ZeroMQ did not take at once: blocking sends of at most
    ``WAIT_SLICE_S`` each (``LOCK_TURN_S`` while another thread may want the
    socket: ``turn``), checking the deadline and ``cancel`` between them."""
    shared = turn is not None and turn.lock is not None
    try:
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"{what} cancelled")
            left = LOCK_TURN_S if shared else WAIT_SLICE_S
            left = left if deadline is None else min(left, deadline - time.monotonic())
            if left <= 0:
                raise SendTimeout(f"{what} timed out", queued=False)
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(left * 1000)))
            try:
                _send(sock, frame, flags, True)
                return
            except zmq.Again:
                if shared:  # the socket as the others expect it, before they may take it
                    sock.setsockopt(zmq.SNDTIMEO, -1)
                    turn.let_others()
    finally:
        if not shared or turn.held:  # (not taken back: another thread's socket now)
            sock.setsockopt(zmq.SNDTIMEO, -1)


class _Turn:
    """A thread's hold on ``lock`` (or on nothing) for one send: taken by the
    deadline, let go for a moment between waits; its sender releases it at the
    end, and never when not held."""

    def __init__(self, lock: Any, deadline: float | None, what: str, cancel: Any) -> None:
        self.lock, self.deadline, self.what, self.cancel = lock, deadline, what, cancel
        self.held = False

    def take(self) -> None:
        if self.lock is not None:
            acquire(self.lock, self.deadline, self.what, self.cancel)
            self.held = True

    def let_others(self) -> None:
        """Release, pause (a lock is not fair: without the pause this thread would
        take it straight back from a waiting one), and take it again by the deadline."""
        self.held = False
        self.lock.release()
        time.sleep(LOCK_PAUSE_S)
        self.take()


def acquire(lock: Any, deadline: float | None, what: str, cancel: Any = None) -> None:
    """Take ``lock`` by ``deadline`` (else :class:`SendTimeout`, ``queued=False``),
    giving up when ``cancel`` is set (:class:`Cancelled`)."""
    while True:
        left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
        if lock.acquire(timeout=max(0.0, left)):
            return
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"{what} cancelled")
        if left <= 0:
            raise SendTimeout(f"{what} timed out waiting for the socket", queued=False)


def recv_frames(sock: zmq.Socket, deadline: float | None, what: str, cancel: Any = None) -> list[memoryview]:
    while not sock.poll(_poll_ms(deadline, what), zmq.POLLIN):
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"{what} cancelled")
    return [f.buffer for f in sock.recv_multipart(copy=False)]


def _poll_ms(deadline: float | None, what: str) -> int:
    left = remaining(deadline, what)
    return 500 if left is None else max(0, min(500, int(left * 1000) + 1))


class Broadcaster:
    """Publish each message once to ``n_local`` ring readers and to the remote
    subscribers of an XPUB socket (if ``host`` is given)."""

    def __init__(self, n_local: int, host: str | None = None, port: int = 0,
                 port_range: tuple[int, int] | None = None, ctx: zmq.Context | None = None,
                 ring: RingWriter | None = None,
                 configure: Callable[[zmq.Socket], None] | None = None,
                 policy: WaitPolicy | None = None):
        if ring is None and n_local:
            ring = RingWriter.create(n_local, RingGeometry.from_env(calls=True), policy)
        self.ring = ring
        self.xpub: zmq.Socket | None = None
        self.in_parts = False  # large frames cut in parts on the XPUB socket (a keyed one)
        self.port = 0
        self.subscribers: list[bytes] = []
        if host is not None:
            try:
                self._open_xpub(ctx or zmq.Context.instance(), host, port, port_range, configure)
            except BaseException:  # a port in use, say: leave no ring (nor socket) behind
                self.close()
                raise

    def _open_xpub(self, ctx: zmq.Context, host: str, port: int, port_range: tuple[int, int] | None,
                   configure: Callable[[zmq.Socket], None] | None) -> None:
        self.xpub = ctx.socket(zmq.XPUB)
        self.xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.xpub.setsockopt(zmq.XPUB_NODROP, 1)
        self.xpub.setsockopt(zmq.SNDHWM, 64)
        self.xpub.setsockopt(zmq.LINGER, 0)
        self.xpub.setsockopt(zmq.MAXMSGSIZE, 4096)  # it only receives subscriptions (and a handshake)
        if configure is not None:  # e.g. CurveZMQ keys, which must precede bind
            configure(self.xpub)
        self.in_parts = bool(self.xpub.getsockopt(zmq.CURVE_SERVER))
        self.port = bind(self.xpub, host, port, port_range)

    @property
    def handle(self) -> RingHandle | None:
        return self.ring.handle if self.ring else None

    def wait_until_ready(self, n_subscribers: int, timeout: float) -> list[bytes]:
        """Wait until ``n_subscribers`` subscriptions arrived; return their topics."""
        deadline = deadline_of(timeout)
        while len(self.subscribers) < n_subscribers:
            if self.xpub is None:
                raise ZbusError("this broadcaster has no remote side")
            if self.xpub.poll(_poll_ms(deadline, f"waiting for {n_subscribers} subscribers "
                                                  f"({len(self.subscribers)} arrived)"), zmq.POLLIN):
                msg = self.xpub.recv()
                if msg[:1] == b"\x01":
                    self.subscribers.append(msg[1:])
        return self.subscribers

    def publish(self, obj: Any, timeout: float | None = None, topic: bytes = b"") -> None:
        self.publish_frames(codec.encode(obj), timeout, topic)

    def publish_frames(self, frames: Sequence[Any], timeout: float | None = None, topic: bytes = b"",
                       on_full: Callable[[], None] | None = None, cancel: Any = None,
                       lock: Any = None, on_queued: Callable[[], None] | None = None) -> None:
        """Send one message to every remote subscriber and every ring reader, or to
        none: :class:`SendTimeout` says which (``queued``). The ring is made ready
        first (a message an earlier timeout cut short is finished); once the remote
        copy is queued, the ring gets it too. Every step, taking ``lock`` included,
        ends by ``timeout``, and both the XPUB and the ring copy what they keep, so
        the caller may change its buffers once this returns or raises. ``lock``
        serialises the XPUB socket with other threads and is held only while
        queueing. ``on_full`` runs while the ring is full (see :meth:`RingWriter.send`);
        ``on_queued`` once the remote copy is queued (ZeroMQ may still be sending it)."""
        deadline = deadline_of(timeout)
        ring = self.ring
        if ring is not None:
            try:
                ring.flush(deadline, cancel, on_full)
            except TimeoutError as e:
                raise SendTimeout(str(e), queued=False) from None
        if self.xpub is not None:
            send_frames(self.xpub, self.wire(topic, frames), deadline, "broadcast to remote nodes",
                        cancel, lock, on_queued)
        if ring is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ring.send(frames, left, cancel, on_full)
            except SendTimeout as e:
                raise SendTimeout(str(e), queued=True) from None

    def wire(self, topic: bytes, frames: Sequence[Any]) -> list:
        """A call as the XPUB socket sends it: on a keyed link, its large frames in
        parts (see :func:`zbus.protocol.in_parts`)."""
        if self.in_parts:
            counts, parts = protocol.in_parts(list(frames))
            if counts:
                return [topic + protocol.PARTS, counts, *parts]
        return [topic, *frames]

    def close(self, linger_s: float = 0.0) -> None:
        """Close the ring and the XPUB socket; ``linger_s`` lets queued messages out."""
        if self.ring is not None:
            self.ring.close()
        if self.xpub is not None:
            self.xpub.close(linger=int(linger_s * 1000))


def checked_size(frames: Sequence[Any], limit: int | None, whose: str) -> int:
    """The bytes of a message to send; CodecError if over ``limit``, which ``whose``
    reader takes (it would read it whole, or drop it with its connection, then refuse it)."""
    size = codec.nbytes(frames)
    if limit is not None and size > limit:
        raise CodecError(f"a message of {size} bytes is over the {limit} bytes {whose}")
    return size


class ShmSender:
    """Writing end of a single-reader shared-memory response queue."""

    def __init__(self, handle: RingHandle | dict, policy: WaitPolicy | None = None):
        self.ring = RingWriter.attach(handle, policy)

    def put(self, obj: Any, timeout: float | None = None) -> None:
        """Send one message; CodecError, sending nothing, if it is over
        ``ZBUS_MAX_MESSAGE``, which this node's driver shares (it would read it
        whole, then refuse it)."""
        frames = codec.encode(obj)
        checked_size(frames, codec.MAX_MESSAGE, "the driver takes (ZBUS_MAX_MESSAGE)")
        self.ring.send(frames, timeout)

    def close(self) -> None:
        self.ring.close(unlink=False)


def given_again(given: Any, want: int | None) -> bool:
    """Whether ``given``, a reply given and not yet taken, is the one for call ``want``."""
    return type(given) is list and len(given) == 4 and type(given[1]) is int and given[1] == want


class ShmReceiver:
    """Reading end of a single-reader shared-memory response queue."""

    def __init__(self, ring: RingReader):
        self.ring = ring
        self._frames: list | None = None  # a reply read, until it is decoded
        self._given: Any = None  # the reply given last, until the caller took it

    def get(self, timeout: float | None = None, cancel: Any = None, want: int | None = None) -> Any:
        """The next reply (a ring loses nothing and keeps order). A reply is kept
        from its reading until the caller says it took it (:meth:`taken`), and given
        again while ``want`` names its call: a Ctrl-C that lands in its decoding, or
        before the caller kept it, loses no reply."""
        if given_again(self._given, want):
            return self._given
        if self._frames is None:
            self._frames = self.ring.recv(timeout, cancel)
        try:
            reply = codec.decode(self._frames)
        except CodecError:
            self._frames = None  # (its call gets the error)
            raise
        self._given, self._frames = reply, None
        return reply

    def taken(self) -> None:
        """The caller keeps the reply given last: it is not given again."""
        self._given = None

    def poll(self, want: int | None = None) -> bool:
        return given_again(self._given, want) or self._frames is not None or self.ring.poll()

    def abort(self) -> None:
        self.ring.abort()

    def close(self) -> None:
        self.ring.close()


class ZmqSender:
    """PUSH side of a remote response queue: connects to the reader's address."""

    def __init__(self, address: str, ctx: zmq.Context | None = None, hwm: int = 64,
                 configure: Callable[[zmq.Socket], None] | None = None, max_bytes: int | None = None):
        self.max_bytes = max_bytes  # the reader's limit (None: none known)
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        if configure is not None:  # e.g. CurveZMQ keys, which must precede connect
            configure(self.sock)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        if "[" in address:  # tcp://[v6 address]:port
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(address)

    def put(self, obj: Any, timeout: float | None = None) -> None:
        self.put_frames(codec.encode(obj), timeout)

    def put_frames(self, frames: Sequence[Any], timeout: float | None = None, cancel: Any = None) -> int:
        """Send one message; its size. CodecError, sending nothing, if it is over the
        reader's limit (the reader would drop it, with the connection if one frame is
        over); Cancelled once ``cancel`` (an Event) is set while it waits."""
        size = checked_size(frames, self.max_bytes, "the leader takes (ZBUS_MAX_REPLY on the leader)")
        send_frames(self.sock, frames, deadline_of(timeout), "response send", cancel)
        return size

    def close(self, linger_s: float = 1.0) -> None:
        """Close, giving queued replies ``linger_s`` to leave."""
        self.sock.close(linger=int(linger_s * 1000))


# Copies of the replies the driver may lack; past this the oldest go. A reply bigger
# than this is not kept: copying it would drop every other (and cost its size again).
KEEP_REPLY_BYTES = 512 * 2**20


def _with_heartbeats(configure: Callable[[zmq.Socket], None] | None,
                     heartbeat_s: float) -> Callable[[zmq.Socket], None]:
    """``configure``, then ZeroMQ's own heartbeats every ``heartbeat_s``: a link idle
    between calls stays open through a firewall or NAT that forgets idle flows, and
    one that dies without a word (no reset) is dropped after three missed beats,
    which sends the kept replies again, where TCP alone retries for 15 minutes."""
    ms = max(1, int(heartbeat_s * 1000))

    def configured(sock: zmq.Socket) -> None:
        if configure is not None:
            configure(sock)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ms)
    return configured


class ReplySender(ZmqSender):
    """PUSH side of a remote rank's replies, which no reset connection loses.

    ZeroMQ reconnects by itself, but what the old connection held (the message
    being written, the kernel's buffers at both ends) is gone without a word, and
    its caller would wait for ever. So a copy of each call's reply is kept until
    the driver has it (:meth:`ack`: every call up to a number has all its
    replies, which each call's envelope tells), and a monitor thread sends every
    kept reply again as soon as the connection drops: they wait in ZeroMQ's queue
    and go out on the next connection. The leader drops the copies it already
    has and puts late ones back in order (:class:`zbus.datapath.RemoteReceiver`).
    Copies beyond ``KEEP_REPLY_BYTES`` are dropped, oldest first."""

    def __init__(self, address: str, ctx: zmq.Context | None = None, hwm: int = 64,
                 configure: Callable[[zmq.Socket], None] | None = None, max_bytes: int | None = None,
                 session: str | None = None, heartbeat_s: float | None = None):
        self._session = session  # the leader's, which each reply names (see zbus.datapath)
        if heartbeat_s:
            configure = _with_heartbeats(configure, heartbeat_s)
        # without ``ctx`` a context of its own, which close ends: only a context's end
        # waits for what is queued to leave (ZeroMQ's linger), and a worker then exits
        # with os._exit (a failed start's traceback was lost while its link formed)
        self._own_ctx = zmq.Context() if ctx is None else None
        super().__init__(address, ctx or self._own_ctx, hwm, configure, max_bytes)
        self._lock = threading.Lock()  # the socket: the callers' puts and the monitor's sends
        self._kept: collections.deque = collections.deque()  # (seq, frames, bytes)
        self._kept_bytes = 0
        self._closing = threading.Event()
        self.sent_again = 0  # replies sent again after a dropped connection
        # MONITOR_STOPPED too: ZeroMQ sends it at disable_monitor only if asked for,
        # and it is what ends the monitor thread (else blocked in its receive for good)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED)
        self._thread = threading.Thread(target=self._watch, name="zbus-reply-monitor", daemon=True)
        self._thread.start()

    def put(self, obj: Any, timeout: float | None = None) -> None:
        """Send a reply ``[rank, seq, status, value]`` (as ``[session, rank, seq,
        status, value]`` given the leader's session) and keep a copy of it (a call's,
        ``seq`` > 0, or READY) until :meth:`ack` says the driver has it. A put waiting for room
        when :meth:`close` begins raises Cancelled: close must not close the socket
        under a send."""
        frames = codec.encode(obj if self._session is None else [self._session, *obj])
        seq = obj[1] if type(obj) is list and len(obj) == 4 and type(obj[1]) is int else 0
        with self._lock:
            if self._closing.is_set():  # (the socket is being closed: no thread may use it)
                raise Cancelled("reply sender closed")
            size = self.put_frames(frames, timeout, self._closing)
            # a call's reply, and READY (acked by the first call, which waits for every READY);
            # not one over the limit: its copy would push out every other
            if (0 < seq or seq == protocol.READY) and size <= KEEP_REPLY_BYTES:
                kept = [f if type(f) is bytes else bytes(f) for f in frames]
                self._kept.append((seq, kept, size))
                self._kept_bytes += size
                while self._kept_bytes > KEEP_REPLY_BYTES:
                    self._kept_bytes -= self._kept.popleft()[2]

    def ack(self, answered: int) -> None:
        """The driver has every reply to the calls up to ``answered``: forget them."""
        with self._lock:
            while self._kept and self._kept[0][0] <= answered:
                self._kept_bytes -= self._kept.popleft()[2]

    def _watch(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        try:
            while True:
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event == zmq.EVENT_DISCONNECTED:
                    self._send_again()
        except (zmq.ZMQError, Cancelled):
            return  # closing
        finally:
            self._monitor.close(linger=0)

    def _send_again(self) -> None:
        """The connection dropped: queue every kept reply again (behind what ZeroMQ
        still holds; the leader sorts them out). Our own copies: no release to
        wait for."""
        with self._lock:
            if self._closing.is_set():
                return
            for _, frames, _ in self._kept:
                send_frames(self.sock, frames, None, "reply sent again", self._closing)
            self.sent_again += len(self._kept)

    def close(self, linger_s: float = 1.0) -> None:
        self._closing.set()  # a put or send again waiting for room gives up (within 0.1 s),
        with self._lock_or_not():  # and none starts again: no thread uses the socket
            try:
                self.sock.disable_monitor()  # the monitor thread gets MONITOR_STOPPED and ends
            except zmq.ZMQError:
                pass
        self._thread.join(2.0)  # (without the lock: it may be waiting for it, to return)
        with self._lock_or_not():
            super().close(linger_s)
        if self._own_ctx is not None:  # what is queued leaves, for linger_s at most
            ending = threading.Thread(target=self._own_ctx.term, name="zbus-replies-end", daemon=True)
            ending.start()
            ending.join(linger_s + 1.0)

    @contextlib.contextmanager
    def _lock_or_not(self) -> Iterator[None]:
        """The socket's lock, or after 2 s without it (a send stuck in ZeroMQ)."""
        locked = self._lock.acquire(timeout=2.0)
        try:
            yield
        finally:
            if locked:
                self._lock.release()


class ZmqReceiver:
    """PULL side of a remote response queue: binds, one reader."""

    def __init__(self, host: str, port: int = 0, port_range: tuple[int, int] | None = None,
                 ctx: zmq.Context | None = None, max_bytes: int | None = None):
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        if max_bytes:
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.port = bind(self.sock, host, port, port_range)
        self.max_bytes = max_bytes

    def get(self, timeout: float | None = None, cancel: Any = None) -> Any:
        return codec.decode(recv_frames(self.sock, deadline_of(timeout), "response receive", cancel),
                            self.max_bytes)

    def close(self) -> None:
        self.sock.close(linger=0)
