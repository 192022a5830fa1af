"""Message queues over real ZeroMQ sockets (127.0.0.1 only) and the shm ring.

Every blocking call has a timeout and every socket is closed by the test.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import psutil
import pytest
import torch
import zmq
from conftest import next_line, spawn_python, wait_until, zbus_segments
from peer_procs import digest

from zbus import ZbusError, codec
from zbus.errors import Cancelled, SendTimeout
from zbus.queues import Broadcaster, ReplySender, ZmqReceiver, ZmqSender, bind, deadline_of, send_frames
from zbus.ring import RingReader

pytestmark = pytest.mark.timeout(60)
HOST = "127.0.0.1"
BIG = 256 * 1024  # a frame of its own (codec.OOB_THRESHOLD is 16 KiB)
SMALL_BUF = 16384  # SO_SNDBUF / SO_RCVBUF: a stalled peer's kernel buffers hold little
T = 0.3  # the timeout of the calls that must keep it
SLACK = 0.5  # how late past its timeout a call may return (the sabotaged waits: 5 s or for ever)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # only a safety net: the tests close their sockets themselves


def recv(sock: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        raise TimeoutError(f"nothing received in {timeout} s")
    return sock.recv_multipart()


def sub_socket(ctx: zmq.Context, port: int, topic: bytes = b"", rcvhwm: int | None = None,
               rcvbuf: int | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        s.setsockopt(zmq.RCVHWM, rcvhwm)
    if rcvbuf is not None:
        s.setsockopt(zmq.RCVBUF, rcvbuf)
    s.connect(f"tcp://{HOST}:{port}")
    s.setsockopt(zmq.SUBSCRIBE, topic)
    return s


@pytest.fixture
def peer():
    """Start ZeroMQ readers in processes of their own (tests/peer_procs.py), each
    printing the digest of every message it receives; stall one with
    ``suspend()`` (SIGSTOP). All are killed at the end."""
    procs = []

    def start(kind: str, address: str) -> psutil.Popen:
        p = spawn_python("import peer_procs; peer_procs.main()", kind, address, str(SMALL_BUF),
                         stdout=subprocess.PIPE, bufsize=0)
        procs.append(p)
        return p

    yield start
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()  # a stopped process too
        p.wait(10)
        p.stdout.close()


def read_line(proc: psutil.Popen, timeout: float = 10.0) -> str:
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError(f"nothing from the reader in {timeout} s")
    return proc.stdout.readline().decode().strip()


def stalled_broadcaster(ctx: zmq.Context, peer, n_local: int = 0) -> tuple[Broadcaster, psutil.Popen]:
    """A broadcaster whose one remote subscriber, a process of its own, has
    subscribed and is then stopped (SIGSTOP): a follower that stopped reading.
    High-water mark 4 and small kernel buffers, so a few messages fill them."""
    def small(sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.SNDBUF, SMALL_BUF)

    bc = Broadcaster(n_local, host=HOST, ctx=ctx, configure=small)
    try:
        p = peer("sub", f"tcp://{HOST}:{bc.port}")
        bc.wait_until_ready(1, timeout=10)
        p.suspend()
    except BaseException:
        bc.close()
        raise
    return bc, p


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


# --- response queues -----------------------------------------------------------


def test_a_reply_sender_closes_at_once_and_its_monitor_thread_ends(ctx):
    """A worker's reply sender (the PUSH a remote worker answers on) ends its
    monitor thread at close. Sabotage: leave ``EVENT_MONITOR_STOPPED`` out of the
    monitor's events (as before): ZeroMQ sends no such event, the thread stays
    blocked in its receive, and every close waited 2 s for it (a remote worker
    given 0.2 s to end after a failure was SIGTERMed instead)."""
    rx = ZmqReceiver(HOST, ctx=ctx)
    tx = ReplySender(f"tcp://{HOST}:{rx.port}", ctx=ctx)
    try:
        tx.put([0, 1, 0, "x"], timeout=5)
        assert rx.get(timeout=5) == [0, 1, 0, "x"]
    finally:
        tx.close(linger_s=0)
        rx.close()
    assert not tx._thread.is_alive()


def test_push_pull_round_trip(ctx):
    rx = ZmqReceiver(HOST, ctx=ctx)
    tx = ZmqSender(f"tcp://{HOST}:{rx.port}", ctx=ctx)
    try:
        t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
        big = os.urandom(BIG)
        msgs = [
            (7, t, big),
            {"arr": np.arange(10, dtype=">i4"), "bf": torch.ones(3, dtype=torch.bfloat16)},
            b"small",
            [None, True, 1.5, "s", (b"x" * 100,)],
            torch.tensor(2.5, dtype=torch.float64),
        ]
        for m in msgs:
            tx.put(m, timeout=5)
        out = [rx.get(timeout=5) for _ in msgs]
        assert out[0][0] == 7 and torch.equal(out[0][1], t) and out[0][2] == big
        assert out[1]["arr"].dtype == np.dtype(">i4") and out[1]["arr"].tolist() == list(range(10))
        assert out[1]["bf"].dtype == torch.bfloat16 and torch.equal(out[1]["bf"], torch.ones(3).bfloat16())
        assert out[2:4] == msgs[2:4]
        assert out[4].shape == () and out[4].item() == 2.5
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            rx.get(timeout=0.2)
        assert 0.15 <= time.monotonic() - start < 1.5
    finally:
        tx.close()
        rx.close()


def test_put_times_out_without_a_reader(ctx):
    """PUSH queues up to its high-water mark for a peer that is not there; then put
    raises TimeoutError within its 0.2 s timeout + SLACK, it does not drop.

    The port stays bound (not listening) by a plain socket: a freed port of the
    ephemeral range can be chosen as the source port of ZeroMQ's own reconnect,
    which then connects to itself and swallows the messages."""
    with socket.socket() as nobody:
        nobody.bind((HOST, 0))  # connections are refused, and the port is not free
        tx = ZmqSender(f"tcp://{HOST}:{nobody.getsockname()[1]}", ctx=ctx, hwm=2)
        try:
            for i in range(50):
                start = time.monotonic()
                try:
                    tx.put((i, b"x"), timeout=0.2)
                except TimeoutError:
                    took = time.monotonic() - start
                    assert took <= 0.2 + SLACK, f"put overran its 0.2 s timeout: {took:.3f} s"
                    break
            else:
                pytest.fail("50 puts to nobody with a high-water mark of 2 all succeeded")
            assert i >= 1, "not even one message was queued"
        finally:
            tx.close(linger_s=0)


def test_receiver_max_bytes_refuses_oversize(ctx):
    rx = ZmqReceiver(HOST, ctx=ctx, max_bytes=4096)
    tx = ZmqSender(f"tcp://{HOST}:{rx.port}", ctx=ctx)
    try:
        tx.put(("x" * 100,), timeout=5)
        assert rx.get(timeout=5) == ("x" * 100,)
        tx.put_frames([codec.encode("y" * 2000)[0]] * 3, timeout=5)  # 3 frames, each under the limit
        with pytest.raises(codec.CodecError, match="exceeds the limit of 4096 bytes"):
            rx.get(timeout=5)
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(30)
def test_put_returns_with_the_callers_buffers_free(ctx, peer):
    """``put`` to a reader that stopped reading returns at once, and the caller may
    change its buffers (bytearray, tensor, array; 4 MiB each) right away: the
    reader, once it goes on, gets what they held at the call. The kernel buffers
    hold 64 KiB at most, so nearly all of each message is still with ZeroMQ when
    the buffer changes.

    Sabotage: in ``queues.send_frames`` send frames of 64 KiB or more with
    ``copy=False`` (ZeroMQ reads the caller's memory later): the digests differ.
    With the zero-copy send that waited for ZeroMQ to let go (before this test),
    the first 4 MiB put does not return until the reader goes on, so the test
    times out."""
    p = peer("pull", HOST)
    port = int(read_line(p).split()[1])
    tx = ZmqSender(f"tcp://{HOST}:{port}", ctx=ctx, configure=lambda s: s.setsockopt(zmq.SNDBUF, SMALL_BUF))
    try:
        tx.put("hello", timeout=5)
        assert read_line(p) == digest(codec.encode("hello")), "the reader is not connected"
        p.suspend()
        size = 4 * 2**20
        buf = bytearray(os.urandom(size))
        tensor = torch.arange(size // 4, dtype=torch.int32)
        array = np.arange(size // 8, dtype=np.float64)
        want = []
        for obj, change in [((buf,), lambda: buf.__setitem__(slice(None), bytes(size))),
                            ({"t": tensor}, lambda: tensor.fill_(-1)),
                            ((array,), lambda: array.fill(-1))]:
            frames = codec.encode(obj)
            assert len(frames) > 1, "4 MiB should travel as a frame of its own"
            want.append(digest(frames))
            start = time.monotonic()
            tx.put(obj, timeout=5)
            assert time.monotonic() - start < 1, "put waited for a reader that stopped reading"
            change()  # in place: same memory, new contents
        p.resume()
        assert [read_line(p) for _ in want] == want, "the reader got what the buffers held after put"
    finally:
        tx.close(linger_s=0)


# --- broadcaster -----------------------------------------------------------------


def test_broadcaster_reaches_every_subscriber(ctx):
    bc = Broadcaster(0, host=HOST, ctx=ctx)
    subs = [sub_socket(ctx, bc.port) for _ in range(2)]
    try:
        assert bc.ring is None and bc.handle is None
        assert bc.wait_until_ready(2, timeout=5) == [b"", b""]
        t = torch.randn(5, 3).t()
        bc.publish({"seq": 1, "t": t, "big": (os.urandom(100_000),)}, timeout=5)
        bc.publish("second", timeout=5, topic=b"tp")
        for s in subs:
            frames = recv(s)
            assert frames[0] == b""
            out = codec.decode(frames[1:])
            assert out["seq"] == 1 and torch.equal(out["t"], t) and len(out["big"][0]) == 100_000
            frames = recv(s)
            assert frames[0] == b"tp" and codec.decode(frames[1:]) == "second"
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            bc.wait_until_ready(3, timeout=0.3)
        assert time.monotonic() - start < 2
    finally:
        for s in subs:
            s.close()
        bc.close()


def test_broadcaster_whose_port_is_taken_leaves_no_ring_behind(ctx):
    """Binding after the ring is made: a port in use must not leak the ring's
    segment (a driver that retries on other ports would leak one per try).
    Sabotage: drop the ``close()`` in Broadcaster's failed bind → a segment stays."""
    taken = ctx.socket(zmq.PULL)
    port = taken.bind_to_random_port(f"tcp://{HOST}")
    before = zbus_segments()
    try:
        with pytest.raises(ZbusError, match=f"cannot listen on port {port} of {HOST}: Address already"):
            Broadcaster(2, host=HOST, port=port, ctx=ctx)
        assert zbus_segments() == before
    finally:
        taken.close(linger=0)


def test_a_send_that_loses_the_socket_leaves_it_to_the_new_holder(ctx):
    """A send waiting on a full subscriber lets another thread have the socket
    between its waits; when it cannot take it back by its deadline, it must leave
    the socket alone: the holder set its own send timeout on it. Sabotage: reset
    ``SNDTIMEO`` in ``_send_waiting``'s ``finally`` in every case (as before) → the
    holder's 20 ms becomes -1 under its feet (its next send could wait for ever,
    holding the lock)."""
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.XPUB_NODROP, 1)
    xpub.setsockopt(zmq.SNDHWM, 1)
    xpub.setsockopt(zmq.SNDBUF, SMALL_BUF)
    xpub.setsockopt(zmq.LINGER, 0)
    port = bind(xpub, HOST)
    sub = sub_socket(ctx, port, rcvhwm=1, rcvbuf=SMALL_BUF)  # never reads
    try:
        assert xpub.poll(5000) and xpub.recv() == b"\x01"  # subscribed
        refused = 0
        for _ in range(100_000):  # fill the pipe and the kernel buffers: full for 0.2 s
            try:
                xpub.send(bytes(4096), zmq.NOBLOCK)
                refused = 0
            except zmq.Again:
                refused += 1
                if refused == 4:
                    break
                time.sleep(0.05)  # (ZeroMQ's I/O thread may still move some to the kernel)
        lock, done, seen = threading.Lock(), threading.Event(), {}

        def holder() -> None:
            wait_until(lock.locked, 5, "the sender holding the socket")
            with lock:  # taken while the sender lets go between its waits
                xpub.setsockopt(zmq.SNDTIMEO, 20)
                seen["took"] = True
                done.wait(10)
                seen["sndtimeo"] = xpub.getsockopt(zmq.SNDTIMEO)

        t = threading.Thread(target=holder)
        t.start()
        with pytest.raises(SendTimeout, match="timed out waiting for the socket"):  # (the holder had it)
            send_frames(xpub, [b"x"], deadline_of(0.3), "a test send", lock=lock)
        done.set()
        t.join(10)
        assert seen == {"took": True, "sndtimeo": 20}, seen
    finally:
        sub.close()
        xpub.close()


@pytest.mark.timeout(120)
def test_a_message_ctrl_c_cut_short_is_finished_not_glued_to_the_next(ctx):
    """Ctrl-C (a real signal, whose handler raises) while a part of a call is copied
    into ZeroMQ: the rest of the call follows, and the next message (a heartbeat)
    arrives as a message of its own. Before, the parts left were never sent, and
    the heartbeat was glued onto the call's first parts: one message ``[R, env,
    big, H, hb]``, relayed by a node as a broken call. Sabotage: ``_finish`` not
    called in ``send_frames`` -> that glued message."""
    big = bytes(256 * 2**20)  # copying it takes tens of ms: the signal lands in it
    frames = [b"env", big, b"tail"]
    bc = Broadcaster(0, host=HOST, ctx=ctx)
    sub = sub_socket(ctx, bc.port)
    armed = [False]

    def interrupt(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        bc.wait_until_ready(1, timeout=10)
        cut_short = 0
        for _ in range(5):  # until the signal lands after the first part went (bounded)
            queued, cut = [], False
            armed[0] = True
            timer = threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            try:
                bc.publish_frames(frames, timeout=10, topic=b"R",
                                  on_queued=functools.partial(queued.append, 1))
            except KeyboardInterrupt as e:
                cut = any(f.f_code.co_name == "send_frames" for f, _ in traceback.walk_tb(e.__traceback__))
            finally:
                armed[0] = False
                timer.join()
            bc.publish_frames([b"hb"], timeout=5, topic=b"H")
            got = recv(sub, 10)
            if got[0] == b"R":
                assert [len(f) for f in got] == [1, 3, len(big), 4] and queued == [1]
                cut_short += cut
                got = recv(sub, 10)
            assert got == [b"H", b"hb"]
            if cut_short:
                break
        assert cut_short, "the signal never landed in the call's send: nothing was tested"
    finally:
        signal.signal(signal.SIGUSR1, old)
        sub.close()
        bc.close()


def test_sending_a_message_runs_no_python_step_but_its_own(ctx):
    """Between marking a part begun and handing it to ZeroMQ, ``send_frames`` runs
    no Python function: a signal's handler runs only at such a step (or as a
    compiled call returns), so a part counted as sent was sent. pyzmq's flags are
    enum members, whose ``|`` is a Python function: a Ctrl-C landing there counted
    a part that never went as sent, and the rest of the message was then "finished"
    without its first part. Sabotage: ``zmq.SNDMORE`` / ``zmq.NOBLOCK`` again in
    place of the ints -> enum's ``__or__`` runs inside the send."""
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        port = bind(pull, HOST)
        push.connect(f"tcp://{HOST}:{port}")
        frames = [b"env", b"x" * 10, b"tail"]
        send_frames(push, frames, time.monotonic() + 5, "warm-up")
        called = []

        def profile(frame, event, arg):
            if event == "call":
                called.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")

        sys.setprofile(profile)
        try:
            send_frames(push, frames, time.monotonic() + 5, "a message")
        finally:
            sys.setprofile(None)
        assert called and set(called) <= {"queues.py:send_frames", "queues.py:__init__",
                                           "queues.py:take"}, called
        assert recv(pull) == frames and recv(pull) == frames
    finally:
        push.close(0)
        pull.close(0)


def test_broadcaster_without_remote_side_cannot_wait_for_subscribers():
    bc = Broadcaster(0)
    try:
        with pytest.raises(ZbusError):
            bc.wait_until_ready(1, timeout=0.2)
    finally:
        bc.close()


def _payload(seq: int, big: bytes) -> tuple:
    kind = seq % 4
    if kind == 3:
        return (seq, big)  # 256 KiB, a frame of its own
    if kind == 1:
        return (seq, bytes([seq % 251]) * 60_000)  # a frame of its own too
    return (seq, b"s" * (seq % 50))  # inline


@pytest.mark.timeout(60)
def test_slow_subscriber_makes_publish_time_out_and_nothing_is_dropped(ctx):
    """A subscriber that does not read fills the high-water marks and the TCP
    buffers; publish then raises TimeoutError instead of dropping, and every
    publish, sent or timed out, returns within its 0.2 s timeout + SLACK. After
    the subscriber drains, it has every message publish reported as sent, and
    those whose SendTimeout says ``queued``; in order; never one reported as not
    sent.

    Sabotage: make ``queues.send_frames`` wait until ZeroMQ has released frames of
    64 KiB or more (the zero-copy send before this test): the first publish of a
    256 KiB frame after the buffers fill takes until the subscriber reads, so
    "publish overran its timeout" (or the test times out)."""
    bc = Broadcaster(0, host=HOST, ctx=ctx)
    bc.xpub.setsockopt(zmq.SNDHWM, 4)  # applies to the pipe of the next connection
    bc.xpub.setsockopt(zmq.SNDBUF, SMALL_BUF)
    sub = sub_socket(ctx, bc.port, rcvhwm=4, rcvbuf=SMALL_BUF)
    try:
        bc.wait_until_ready(1, timeout=5)
        big = os.urandom(BIG)
        sent, queued, not_sent = [], [], []
        streak = 0
        for seq in range(3000):
            start = time.monotonic()
            try:
                bc.publish(_payload(seq, big), timeout=0.2)
            except TimeoutError as e:
                assert isinstance(e, SendTimeout)
                (queued if e.queued else not_sent).append(seq)
                streak = 0 if e.queued else streak + 1
            else:
                sent.append(seq)
                streak = 0
            took = time.monotonic() - start
            assert took <= 0.2 + SLACK, f"publish {seq} overran its 0.2 s timeout: {took:.3f} s"
            if streak == 3:
                break
        assert not_sent, f"a subscriber that does not read never blocked publish ({len(sent)} sent)"
        assert len(sent) > 4, "the high-water marks and buffers held almost nothing"

        want = sorted(sent + queued)
        received = []
        while len(received) < len(want):
            try:
                frames = recv(sub, timeout=5)
            except TimeoutError:
                pytest.fail(f"published but never received: {sorted(set(want) - set(received))[:20]}")
            assert frames[0] == b""
            out = codec.decode(frames[1:])
            assert out == _payload(out[0], big), "a message arrived damaged"
            received.append(out[0])
        assert not sub.poll(300, zmq.POLLIN), "a message reported as not sent arrived"
        assert received == want, "messages arrived out of order, twice, or not at all"
        # After draining, publishing works again.
        bc.publish((-1, b"after"), timeout=5)
        assert codec.decode(recv(sub)[1:]) == (-1, b"after")
    finally:
        sub.close()
        bc.close()


SIZES = [0, 1024, 64 * 1024, 2**20, 16 * 2**20]


def _publish_until_full(bc: Broadcaster, size: int, lock=None) -> tuple[int, float]:
    """Publish ``size``-byte payloads with timeout T until one is not taken
    (``queued=False``); each call must end within T + SLACK. Returns how many
    were taken and the longest call."""
    frames = codec.encode((bytes(size),))
    taken, slowest = 0, 0.0
    for _ in range(100_000):
        start = time.monotonic()
        try:
            bc.publish_frames(frames, timeout=T, lock=lock)
        except SendTimeout as e:
            assert not e.queued, "without a ring, a remote send that timed out sent nothing"
            return taken, max(slowest, _within(start, size))
        taken += 1
        slowest = max(slowest, _within(start, size))
    pytest.fail(f"100 000 publishes of {size} B to a stopped subscriber were all taken")


def _within(start: float, size: int) -> float:
    took = time.monotonic() - start
    assert took <= T + SLACK, f"a publish of {size} B with timeout {T} s took {took:.3f} s"
    return took


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"{n}B")
def test_publish_keeps_its_deadline_when_a_subscriber_stops_reading(ctx, peer, size):
    """A remote subscriber that stopped reading (its process SIGSTOPped): every
    ``publish_frames(timeout=T)`` returns within T + SLACK, those ZeroMQ takes
    while nobody reads them included, until the high-water mark makes one time
    out; and so do the next ones.

    Sabotage: make ``queues.send_frames`` send frames of 64 KiB or more zero-copy
    and wait until ZeroMQ releases them (the send before this test): the 64 KiB,
    1 MiB and 16 MiB cases wait on the first message ZeroMQ takes ("a publish ...
    took"), or the test times out."""
    bc, _ = stalled_broadcaster(ctx, peer)
    try:
        taken, slowest = _publish_until_full(bc, size)
        assert taken >= 1, "not even one message was taken before the subscriber's buffers"
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(SendTimeout):
                bc.publish_frames(codec.encode((bytes(size),)), timeout=T)
            slowest = max(slowest, _within(start, size))
        print(f"{size} B: {taken} taken, slowest call {slowest:.3f} s (timeout {T} s)")
    finally:
        bc.close()


@pytest.mark.timeout(30)
def test_publish_keeps_its_deadline_while_a_control_send_holds_the_socket(ctx, peer):
    """The executor publishes under the leader's XPUB lock, which a heartbeat or
    control send holds while it waits on a full node (``DataPath.send_control``: up to its
    own timeout). A publish with timeout T then still returns within T + SLACK, at
    every size, with ``queued=False``.

    Sabotage: take the lock in ``Broadcaster.publish_frames`` without a timeout
    (``with lock:``): each publish waits for the control send's 5 s ("a publish
    ... took")."""
    bc, _ = stalled_broadcaster(ctx, peer)
    lock = threading.RLock()
    held, done = threading.Event(), threading.Event()

    def control_send() -> None:
        with lock:
            held.set()
            with contextlib.suppress(TimeoutError):
                send_frames(bc.xpub, [b"H", *codec.encode(["hb", 1])], deadline_of(5), "control send")
        done.set()

    thread = threading.Thread(target=control_send)
    try:
        _publish_until_full(bc, 1024, lock)  # the node is full: a control send now waits
        thread.start()
        assert held.wait(5)
        slowest = 0.0
        for size in SIZES:
            start = time.monotonic()
            with pytest.raises(SendTimeout) as e:
                bc.publish_frames(codec.encode((bytes(size),)), timeout=T, lock=lock)
            slowest = max(slowest, _within(start, size))
            assert not e.value.queued
        assert not done.is_set(), "the control send let go of the socket before the publishes ended"
        print(f"slowest publish while the lock was held: {slowest:.3f} s (timeout {T} s)")
    finally:
        if thread.ident is not None:
            thread.join(10)
        bc.close()


@pytest.mark.timeout(30)
def test_publish_returns_with_the_callers_buffer_free(ctx, peer):
    """A 16 MiB tensor published to a subscriber that stopped reading: the publish
    succeeds, the tensor is changed right after, twice over, and the subscriber,
    once it goes on, gets what the tensor held at each call.

    Sabotage: in ``queues.send_frames`` send frames of 64 KiB or more with
    ``copy=False`` (ZeroMQ reads the caller's memory later): the digests differ.
    With the zero-copy send that waited for ZeroMQ to let go (before this test),
    the publish does not return while the subscriber is stopped: the test times
    out."""
    bc, p = stalled_broadcaster(ctx, peer)
    try:
        t = torch.arange(4 * 2**20, dtype=torch.int32)  # 16 MiB
        want = []
        for value in (-1, 7):
            frames = codec.encode((t,))
            want.append(digest(frames))
            start = time.monotonic()
            bc.publish_frames(frames, timeout=5)
            assert time.monotonic() - start < 1, "publish waited for a subscriber that stopped reading"
            t.fill_(value)
        p.resume()
        assert [read_line(p) for _ in want] == want, "the subscriber got what the tensor held after publish"
    finally:
        bc.close()


@pytest.mark.timeout(30)
def test_publish_that_times_out_queued_returns_with_the_callers_buffer_free(ctx, peer, monkeypatch):
    """The remote side takes a 16 MiB message, the local ring (8 MiB, its reader
    not reading) cannot: ``SendTimeout(queued=True)`` within T + SLACK. The
    caller changes the tensor at once; the ring reader, and the remote
    subscriber once it goes on, both get what it held at the call.

    Sabotage: in ``queues.send_frames`` send frames of 64 KiB or more with
    ``copy=False``: the subscriber's digest differs. Or, in ``RingWriter.send``,
    keep the unsent rest without copying it (``self._pending = (rest, left)``):
    the ring reader's digest differs."""
    monkeypatch.setenv("ZBUS_RING", "1Mx8")
    bc, p = stalled_broadcaster(ctx, peer, n_local=1)
    reader = RingReader.attach(bc.handle, 0)
    got: list = []
    thread = threading.Thread(target=lambda: got.append(digest(reader.recv(timeout=20))))
    try:
        t = torch.arange(4 * 2**20, dtype=torch.int32)
        assert t.nbytes > bc.ring.chunk_bytes * bc.ring.n_chunks, "the message should not fit the ring"
        frames = codec.encode((t,))
        want = digest(frames)
        start = time.monotonic()
        with pytest.raises(SendTimeout) as e:
            bc.publish_frames(frames, timeout=T)
        _within(start, t.nbytes)
        assert e.value.queued, "the remote side took it: every rank will get it"
        t.fill_(-1)
        thread.start()  # reads the ring; the rest follows as the writer flushes
        bc.ring.flush(deadline_of(20))
        thread.join(20)
        assert got == [want], "the ring reader got what the tensor held after the call"
        p.resume()
        assert read_line(p) == want, "the subscriber got what the tensor held after the call"
    finally:
        if thread.is_alive():
            thread.join(20)
        reader.close()
        bc.close()


def test_broadcaster_ring_and_remote_together(ctx):
    before = zbus_segments()
    bc = Broadcaster(2, host=HOST, ctx=ctx)
    readers = [RingReader.attach(bc.handle.to_dict(), i) for i in range(2)]
    sub = sub_socket(ctx, bc.port)
    name = bc.handle.name
    try:
        assert os.path.exists(f"/dev/shm/{name}")
        bc.wait_until_ready(1, timeout=5)
        t = torch.randn(256, 256)  # 256 KiB: one ring chunk is 1 MiB by default
        for i in range(3):
            bc.publish((i, t * i, b"z" * 50_000), timeout=5)
        for r in readers:
            for i in range(3):
                seq, got, z = codec.decode(r.recv(timeout=5))
                assert seq == i and torch.equal(got, t * i) and z == b"z" * 50_000
            with pytest.raises(TimeoutError):
                r.recv(timeout=0.1)
        for i in range(3):
            frames = recv(sub)
            seq, got, _ = codec.decode(frames[1:])
            assert seq == i and torch.equal(got, t * i)
    finally:
        sub.close()
        for r in readers:
            r.close()
        bc.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert zbus_segments() - before == set()


def test_ring_only_broadcaster_leaves_no_segment():
    before = zbus_segments()
    bc = Broadcaster(1)
    reader = RingReader.attach(bc.handle, 0)
    try:
        assert bc.xpub is None and bc.port == 0
        assert zbus_segments() - before == {bc.handle.name}
        bc.publish(["hello", torch.arange(5)], timeout=5)
        out = codec.decode(reader.recv(timeout=5))
        assert out[0] == "hello" and torch.equal(out[1], torch.arange(5))
    finally:
        reader.close()
        bc.close()
    assert zbus_segments() - before == set()


# --- bind ------------------------------------------------------------------------


def test_bind_port_zero_returns_the_real_port(ctx):
    s = ctx.socket(zmq.PULL)
    try:
        port = bind(s, HOST, 0)
        assert 0 < port < 65536
        assert s.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://{HOST}:{port}"
        assert listening_addresses(port) == {HOST}, "bound to more than the given address"
    finally:
        s.close(linger=0)


def test_bind_explicit_port(ctx):
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    s = ctx.socket(zmq.PULL)
    try:
        assert bind(s, HOST, port) == port
        assert s.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://{HOST}:{port}"
        assert listening_addresses(port) == {HOST}
    finally:
        s.close(linger=0)


def _os_port_range(width: int = 64) -> tuple[int, int]:
    """A range of ``width`` ports starting at one the OS just gave: no fixed ports
    that another run or program on the machine may hold."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    lo = port if port + width - 1 <= 65535 else port - width + 1
    return lo, lo + width - 1


def test_bind_port_range(ctx):
    lo, hi = _os_port_range()
    socks = [ctx.socket(zmq.PULL) for _ in range(3)]
    try:
        ports = [bind(s, HOST, port_range=(lo, hi)) for s in socks]
        assert len(set(ports)) == 3
        for s, port in zip(socks, ports):
            assert lo <= port <= hi
            assert s.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://{HOST}:{port}"
            assert listening_addresses(port) == {HOST}
        # A range whose only port is taken: an error naming the range, not some other
        # port (before, pyzmq's ZMQBindError, which is no ZMQError, nor an OSError).
        extra = ctx.socket(zmq.PULL)
        socks.append(extra)
        with pytest.raises(ZbusError, match=f"cannot listen on a port in {ports[0]}-{ports[0]} of {HOST}: "
                           "Address already in use"):
            bind(extra, HOST, port_range=(ports[0], ports[0]))
    finally:
        for s in socks:
            s.close(linger=0)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_loopback_queue(ctx):
    rx = ZmqReceiver("::1", ctx=ctx)
    tx = ZmqSender(f"tcp://[::1]:{rx.port}", ctx=ctx)
    try:
        assert rx.sock.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://[::1]:{rx.port}"
        assert listening_addresses(rx.port) == {"::1"}
        tx.put((1, b"v6"), timeout=5)
        assert rx.get(timeout=5) == (1, b"v6")
    finally:
        tx.close()
        rx.close()


def test_a_reply_too_big_to_keep_leaves_the_kept_copies_of_the_others(ctx, monkeypatch):
    """A reply over ``KEEP_REPLY_BYTES`` is not kept: its copy pushed out every older
    copy, then itself, so replies a reset connection lost were lost for good (and
    the copy cost the reply's size again, under the lock). Here the connection drops
    after replies 1, 2 and a big 3: 1 and 2 are sent again on the next one.
    Sabotage: keep every reply, as before -> nothing sent again."""
    from zbus import queues

    monkeypatch.setattr(queues, "KEEP_REPLY_BYTES", 64 * 1024)
    rx = ZmqReceiver(HOST, ctx=ctx)
    port = rx.port
    tx = ReplySender(f"tcp://{HOST}:{port}", ctx=ctx)
    try:
        for seq, value in ((1, b"a"), (2, b"b"), (3, b"c" * 100_000)):
            tx.put([0, seq, 0, value])
        assert [rx.get(timeout=10)[1] for _ in range(3)] == [1, 2, 3]
        rx.close()  # the connection drops; the sender sends its kept copies again
        wait_until(lambda: tx.sent_again >= 2, 10, "the kept replies sent again")
        rx = ZmqReceiver(HOST, port, ctx=ctx)
        assert [rx.get(timeout=10)[1] for _ in range(2)] == [1, 2]
        assert tx.sent_again == 2
    finally:
        tx.close(linger_s=0)
        rx.close()


def test_a_ready_reply_lost_with_its_connection_is_sent_again(ctx):
    """A worker's READY reached the leader's socket, and the connection dropped
    before the leader read it: READY is sent again on the next connection. Before,
    only calls' replies were kept: the start-up waited out its timeout for a rank
    that had answered, and named it as never ready. Sabotage: keep only ``0 < seq``
    in ``ReplySender.put`` -> nothing sent again."""
    from zbus import protocol

    rx = ZmqReceiver(HOST, ctx=ctx)
    port = rx.port
    tx = ReplySender(f"tcp://{HOST}:{port}", ctx=ctx)
    try:
        tx.put([0, protocol.READY, protocol.OK, {"pid": 1}])
        assert rx.sock.poll(10_000), "READY never reached the reader"
        rx.close()  # unread: lost with the connection
        wait_until(lambda: tx.sent_again >= 1, 10, "READY sent again")
        rx = ZmqReceiver(HOST, port, ctx=ctx)
        assert rx.get(timeout=10) == [0, protocol.READY, protocol.OK, {"pid": 1}]
        tx.ack(0)  # the first call: the copy goes
        assert not tx._kept
    finally:
        tx.close(linger_s=0)
        rx.close()


SENDS_THEN_EXITS = """
import os, sys
from zbus.queues import ReplySender

tx = ReplySender(sys.argv[1])
tx.put([0, 1, 0, "last words"])
print("put", flush=True)
tx.close(linger_s=10)
os._exit(0)
"""


def test_a_reply_queued_when_its_worker_exits_still_leaves():
    """A remote worker whose start fails sends its traceback and exits at once
    (``os._exit``): a reply ZeroMQ still held, its link to the leader not formed yet
    (a keyed handshake waits on the leader's ZAP thread), was lost, since only a
    context's end waits for what is queued, and the worker ended none. The leader
    then reported a death without its traceback. Now the sender's own context ends
    at close, waiting up to its linger (1 s for a worker; 10 s here, for a loaded
    machine). Here the leader's socket is bound only 0.3 s after the put.
    Sabotage: no ``term`` in ``ReplySender.close`` -> nothing arrives."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    proc = spawn_python(SENDS_THEN_EXITS, f"tcp://{HOST}:{port}", stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        assert next_line(proc, time.monotonic() + 30).strip() == "put"
        time.sleep(0.3)
        rx = ZmqReceiver(HOST, port, ctx=ctx)
        try:
            assert rx.get(timeout=5) == [0, 1, 0, "last words"]
        finally:
            rx.close()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.term()


PULLS_AND_SAYS = """
import sys
from zbus.queues import ZmqReceiver

rx = ZmqReceiver("127.0.0.1")
print(rx.port, flush=True)
while True:
    print(rx.get(timeout=60)[1], flush=True)
"""


def test_a_reply_link_whose_peer_stops_answering_is_dropped_and_its_replies_sent_again():
    """A worker's reply link is idle between calls: a firewall or NAT that forgets
    idle flows drops it without a reset, and the next reply goes into a dead flow,
    which TCP retries for some 15 minutes while the caller waits. The link now
    carries ZeroMQ's heartbeats (the agent gives its workers the cluster's
    heartbeat interval): a peer that stops answering them (here the leader's
    process stopped by SIGSTOP, whose kernel still acknowledges TCP) is dropped
    after three missed beats, and the kept reply is sent again, to arrive once the
    peer answers. Sabotage: no heartbeat options in ``_with_heartbeats`` -> the
    link is never dropped (nothing sent again)."""
    proc = spawn_python(PULLS_AND_SAYS, stdout=subprocess.PIPE, text=True)
    tx = None
    try:
        port = int(next_line(proc, time.monotonic() + 30))
        tx = ReplySender(f"tcp://{HOST}:{port}", heartbeat_s=0.2)
        tx.put([0, 1, 0, "first"])
        assert next_line(proc, time.monotonic() + 30).strip() == "1"
        proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: tx.sent_again == 1, 20, "the link dropped, the reply sent again")
        finally:
            proc.send_signal(signal.SIGCONT)
        assert next_line(proc, time.monotonic() + 30).strip() == "1"  # (the copy)
    finally:
        if tx is not None:
            tx.close(linger_s=0)
        proc.kill()
        proc.wait(10)


def test_a_reply_waiting_for_room_gives_up_when_its_sender_closes(ctx):
    """A worker's reply thread waits to send to a leader that reads nothing (its
    queue full) while the worker ends and closes the sender: the put raises
    Cancelled and close then closes a socket no thread uses. Before, the put
    waited on (no timeout, nothing to stop it), close gave up on the socket's
    lock after 2 s and closed the socket under the send (ZeroMQ's sockets are not
    thread-safe: an error or an abort). Sabotage: no ``cancel`` in
    ``ReplySender.put`` -> the put ends with ZMQError, not Cancelled; no check of
    ``_closing`` before a put -> the put after close raises ZMQError."""
    with socket.socket() as nobody:
        nobody.bind((HOST, 0))  # refused connections: nothing is ever sent
        tx = ReplySender(f"tcp://{HOST}:{nobody.getsockname()[1]}", ctx=ctx, hwm=1)
        outcome: list = []

        def fill():
            try:
                for i in range(1, 100):
                    tx.put([0, i, 0, "x"])
                outcome.append("all queued")
            except BaseException as e:  # noqa: BLE001 - the test checks the type
                outcome.append(e)

        t = threading.Thread(target=fill)
        t.start()
        try:
            wait_until(lambda: tx._lock.locked() and len(tx._kept) >= 1, 10, "a put waiting for room")
        finally:
            tx.close(linger_s=0)
            t.join(10)
        with pytest.raises(Cancelled):  # (the reply thread's next put: never on a closed socket)
            tx.put([0, 200, 0, "x"])
    assert not t.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Cancelled), outcome
