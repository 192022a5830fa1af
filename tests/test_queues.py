"""Message queues over real ZeroMQ sockets (127.0.0.1 only) and the shm ring.

Every blocking call has a timeout and every socket is closed by the test.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import psutil
import pytest
import torch
import zmq
from conftest import zbus_segments

from zbus import ZbusError, codec, queues
from zbus.errors import SendTimeout
from zbus.queues import ZERO_COPY_MIN, Broadcaster, ZmqReceiver, ZmqSender, bind
from zbus.ring import RingReader

pytestmark = pytest.mark.timeout(60)
HOST = "127.0.0.1"


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


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


# --- response queues -----------------------------------------------------------


def test_push_pull_round_trip(ctx):
    rx = ZmqReceiver(HOST, ctx=ctx)
    tx = ZmqSender(f"tcp://{HOST}:{rx.port}", ctx=ctx)
    try:
        t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
        big = os.urandom(3 * ZERO_COPY_MIN)
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
    raises TimeoutError, it does not drop."""
    probe = ctx.socket(zmq.PULL)
    port = bind(probe, HOST)
    probe.close(linger=0)  # nobody listens there any more
    tx = ZmqSender(f"tcp://{HOST}:{port}", ctx=ctx, hwm=2)
    try:
        for i in range(50):
            start = time.monotonic()
            try:
                tx.put((i, b"x"), timeout=0.2)
            except TimeoutError:
                assert time.monotonic() - start < 1.5
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
        with pytest.raises(ZbusError):
            rx.get(timeout=5)
    finally:
        tx.close()
        rx.close()


def test_put_never_aliases_caller_memory(ctx):
    """Zero-copy sends wait until ZeroMQ has released the caller's buffers: changing
    them right after put returns must not change what the reader gets."""
    rx = ZmqReceiver(HOST, ctx=ctx)
    tx = ZmqSender(f"tcp://{HOST}:{rx.port}", ctx=ctx)
    try:
        size = 4 * 2**20
        pattern = os.urandom(size)
        buf = bytearray(pattern)
        frames = codec.encode((buf,))
        assert len(frames) > 1, "a 4 MiB bytearray should travel zero-copy in its own frame"
        tensor = torch.arange(size // 4, dtype=torch.int32)
        array = np.arange(size // 8, dtype=np.float64)
        for _ in range(3):
            tx.put((buf,), timeout=10)
            buf[:] = bytes(size)  # in place: same buffer, new contents
            tx.put({"t": tensor, "a": array}, timeout=10)
            tensor.fill_(-1)
            array[:] = -1
            got = rx.get(timeout=10)
            assert type(got[0]) is bytearray and bytes(got[0]) == pattern
            got = rx.get(timeout=10)
            assert torch.equal(got["t"], torch.arange(size // 4, dtype=torch.int32))
            assert np.array_equal(got["a"], np.arange(size // 8, dtype=np.float64))
            buf[:] = pattern
            tensor.copy_(torch.arange(size // 4, dtype=torch.int32))
            array[:] = np.arange(size // 8, dtype=np.float64)
    finally:
        tx.close()
        rx.close()


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
        return (seq, big)  # zero-copy: publish waits for ZeroMQ to release it
    if kind == 1:
        return (seq, bytes([seq % 251]) * (ZERO_COPY_MIN - 4096))  # large, but copied
    return (seq, b"s" * (seq % 50))


def test_slow_subscriber_makes_publish_time_out_and_nothing_is_dropped(ctx, monkeypatch):
    """A subscriber that does not read fills the high-water marks and the TCP
    buffers; publish then raises TimeoutError instead of dropping. After it drains,
    it has every message publish reported as sent, and those whose SendTimeout says
    ``queued``; in order; never one reported as not sent."""
    monkeypatch.setattr(queues, "RELEASE_LIMIT_S", 0.2)  # zero-copy frames stuck in ZeroMQ
    bc = Broadcaster(0, host=HOST, ctx=ctx)
    bc.xpub.setsockopt(zmq.SNDHWM, 4)  # applies to the pipe of the next connection
    bc.xpub.setsockopt(zmq.SNDBUF, 16384)
    sub = sub_socket(ctx, bc.port, rcvhwm=4, rcvbuf=16384)
    try:
        bc.wait_until_ready(1, timeout=5)
        big = os.urandom(4 * ZERO_COPY_MIN)
        sent, queued, not_sent = [], [], []
        streak = 0
        for seq in range(3000):
            start = time.monotonic()
            try:
                bc.publish(_payload(seq, big), timeout=0.2)
            except TimeoutError as e:
                assert time.monotonic() - start < 2.5, "publish overran its timeout"
                assert isinstance(e, SendTimeout)
                (queued if e.queued else not_sent).append(seq)
                streak = 0 if e.queued else streak + 1
                if streak == 3:
                    break
            else:
                sent.append(seq)
                streak = 0
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
        # A range whose only port is taken: an error, not some other port.
        extra = ctx.socket(zmq.PULL)
        socks.append(extra)
        with pytest.raises((zmq.ZMQBindError, zmq.ZMQError)):
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
