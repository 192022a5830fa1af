"""The compiled core (zbus._core) against its Python twins in zbus.ring: the same bytes,
the same answers, the same refusals; and a ring whose ends run different cores."""

from __future__ import annotations

import gc
import json
import mmap
import os
import signal
import struct
import subprocess
import threading
import time

import pytest
from conftest import borrowed_alarm, end_process, seconds_to_ctrl_c, spawn_python
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ring import collect, start_readers

from zbus import ring
from zbus.config import RingGeometry
from zbus.ring import RingWriter

core = ring._core
needs_core = pytest.mark.skipif(core is None,
                                reason="the compiled core is not built here (or ZBUS_PURE_PYTHON)")


def test_the_compiled_core_is_chosen_where_it_is_required():
    """`make test` builds the core and sets ZBUS_REQUIRE_CORE: there, the ring must run
    it, not fall back to Python unnoticed. Sabotage: a failed build (optional in
    setup.py) or a ``_load_core`` that always returns None → fails."""
    if not os.environ.get("ZBUS_REQUIRE_CORE"):
        pytest.skip("ZBUS_REQUIRE_CORE is not set (only `make test` requires the core)")
    import zmq  # noqa: F401 - the relay finds the libzmq that pyzmq loads

    assert ring.CORE == "compiled"
    assert ring._write_message is core.write_message and ring._read_message is core.read_message
    assert core.relay_ready()  # the node agent relays calls in C


frame = st.one_of(st.binary(max_size=300),
                  st.lists(st.binary(max_size=90), max_size=4).map(tuple))


@needs_core
@settings(max_examples=300, deadline=None)
@given(frames=st.lists(frame, max_size=10), at=st.sampled_from([0, 8, 64, 200]),
       limit=st.integers(0, 3000))
def test_write_message_matches_its_twin_byte_for_byte(frames, at, limit):
    """Same size, same bytes (header, zero padding, frames), and nothing written when
    over the limit. Sabotage: padding not zeroed, a frame's parts in reverse, the
    limit compared with ``>=`` → differs."""
    fill = os.urandom(at + 4096)
    got = [bytearray(fill), bytearray(fill)]
    sizes = [f(memoryview(b), at, list(frames), limit)
             for f, b in zip((core.write_message, ring._write_message_py), got)]
    assert sizes[0] == sizes[1]
    assert got[0] == got[1]
    if sizes[0] < 0:
        assert got[0] == fill


@needs_core
@settings(max_examples=300, deadline=None)
@given(frames=st.lists(frame, max_size=10), limit=st.integers(0, 3000))
def test_read_message_matches_its_twin(frames, limit):
    buf = memoryview(bytearray(4096))
    size = ring._write_message_py(buf, 64, list(frames), 4096 - 64)
    outs = [f(buf, 64, limit) for f in (core.read_message, ring._read_message_py)]
    if size > limit:
        assert outs == [None, None]
        return
    expected = [b"".join(f) if type(f) is tuple else f for f in frames]
    for out in outs:
        assert [bytes(f) for f in out] == expected
        assert all(type(f) is memoryview and f.format == "B" and not f.readonly for f in out)


@needs_core
@pytest.mark.parametrize("header", [
    (8, 0),  # shorter than its own header
    (16, 1),  # one frame, no room for its length
    (64, 2**61),  # a frame count that would overflow
    (100, 1, 37),  # the frame runs past the total
    (100, 1, 200),  # the frame is longer than the total
    (200, 1, 10),  # the frames end before the total
    (200, 2, 10, 2**63),  # a length past the total
    (200, 2, 2**64 - 64, 200),  # lengths that wrap around to end exactly at the total
])
def test_a_header_that_does_not_lay_out_to_its_size_is_refused_by_both(header):
    """Sabotage: the C check ``end != total`` dropped, or the per-frame one (``ok =
    1``) → wrong frames instead of ValueError."""
    buf = memoryview(bytearray(512))
    struct.pack_into(f"<{len(header)}Q", buf, 0, *header)
    for read in (core.read_message, ring._read_message_py):
        with pytest.raises(ValueError, match="corrupt message header"):
            read(buf, 0, 512)


FLIP_HEADER = """
import mmap, struct, sys, time
with open(sys.argv[1], "r+b") as f:
    words = memoryview(mmap.mmap(f.fileno(), 0))
end = time.monotonic() + 20
while time.monotonic() < end and words[4095] == 0:  # until the test says stop (or 20 s)
    for _ in range(1000):
        struct.pack_into("<Q", words, 16, 8)
        struct.pack_into("<Q", words, 16, 40)
"""


@needs_core
@pytest.mark.timeout(60)
def test_a_header_changed_while_it_is_read_is_refused_or_read_whole(tmp_path):
    """Both check the header on the copy the frames are cut from: another process
    that flips a frame's length (40, laying out to the size; 8, not) while the
    message is read gets either the whole frame or "corrupt message header",
    never 8 bytes. Sabotage: the C check on the ring's bytes before the copy (as
    it was) → 8-byte frames in one read in five to ten here."""
    path = tmp_path / "ring"
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    buf = memoryview(mapping)
    total = ring._write_message_py(buf, 0, [b"x" * 40], 4000)
    flipper = spawn_python(FLIP_HEADER, str(path))
    try:
        while flipper.is_running() and struct.unpack_from("<Q", buf, 16)[0] != 8:  # started flipping
            time.sleep(0.001)
        lengths: dict[int, int] = {}
        for i in range(200_000):
            try:
                out = (ring._read_message_py if i % 10 == 9 else core.read_message)(buf, 0, total)
            except ValueError:
                lengths[-1] = lengths.get(-1, 0) + 1
            else:
                lengths[len(out[0])] = lengths.get(len(out[0]), 0) + 1
        assert flipper.is_running()  # it flipped all along
    finally:
        buf[4095] = 1
        end_process(flipper)
        buf.release()
        mapping.close()
    print("frame lengths read (-1: refused):", lengths)
    assert set(lengths) <= {40, -1} and lengths.get(-1) and lengths.get(40)


@needs_core
def test_the_core_refuses_offsets_outside_the_mapping():
    """A bad offset is a ValueError, never a write or read outside the segment.
    Sabotage: ``check_range`` skipped in one of them → the test process crashes or
    the assertion on the untouched buffer fails."""
    buf = memoryview(bytearray(256))
    for call in (lambda: core.write_message(buf, 250, [b"x" * 10], 1000),
                 lambda: core.write_message(buf, -8, [b"x"], 1000),
                 lambda: core.write_message(buf, 3, [b"x"], 1000),
                 lambda: core.read_message(buf, 256, 1000),
                 lambda: core.store(buf, 32, 1),
                 lambda: core.store(buf, -1, 1),
                 lambda: core.poll(buf, 32, 0, (), 0.0, 0.0),
                 lambda: core.poll(buf, 0, 0, (64,), 0.0, 0.0)):
        with pytest.raises(ValueError):
            call()
    assert bytes(buf) == bytes(256)
    struct.pack_into("<Q", buf, 0, 1000)
    with pytest.raises(ValueError):  # a size that runs past the mapping
        core.read_message(buf, 0, 2000)


@needs_core
def test_store_writes_the_word_as_its_twin_does():
    words = [memoryview(bytearray(64)).cast("Q") for _ in range(2)]
    for f, w in zip((core.store, ring._store_py), words):
        f(w, 3, 2**64 - 5)
        f(w, 0, 7)
    assert words[0].tolist() == words[1].tolist() == [7, 0, 0, 2**64 - 5, 0, 0, 0, 0]


@needs_core
def test_poll_ends_on_the_counter_or_a_stop_word_and_lets_other_threads_run():
    """It returns at once when ready, False when its time runs out, and True when
    another thread of this process moves the counter meanwhile: it waits without the
    GIL. Sabotage: ``Py_BEGIN_ALLOW_THREADS`` removed → the setter thread cannot run
    and poll returns False after its 5 s; ``>`` as ``>=`` → True at once below."""
    buf = bytearray(128)
    q, i = memoryview(buf).cast("Q"), memoryview(buf).cast("I")
    q[1] = 5
    assert core.poll(buf, 1, 4, (), 0.0, 0.0) is True
    assert core.poll(buf, 1, 5, (4, 5), 0.001, 0.01) is False
    i[5] = 1
    assert core.poll(buf, 1, 5, (4, 5), 0.0, 0.0) is True
    i[5] = 0
    setter = threading.Timer(0.05, lambda: q.__setitem__(1, 6))
    setter.start()
    started = time.monotonic()
    assert core.poll(buf, 1, 5, (4, 5), 0.0, 5.0) is True
    assert time.monotonic() - started < 4
    setter.join(5)


@pytest.mark.parametrize("writer_core", ["compiled", "python"])
def test_a_ring_carries_messages_between_ends_on_different_cores(monkeypatch, writer_core):
    """A writer on one core, a reader on each (one process forced to Python): every
    message arrives once, in order, intact, small ones in a chunk and streamed ones.
    Sabotage: the C layout's alignment or header differs from the Python one → the
    other core's reader sees corrupt messages."""
    if writer_core == "compiled" and core is None:
        pytest.skip("the compiled core is not built here")
    if writer_core == "python":
        monkeypatch.setattr(ring, "_write_message", ring._write_message_py)
        monkeypatch.setattr(ring, "_store", ring._store_py)
    writer = RingWriter.create(2, RingGeometry(4096, 4))
    readers = []
    try:
        handle = json.dumps(writer.handle.to_dict())
        readers += start_readers(writer, 1, env={})
        readers += [spawn_python("import sys, ring_procs; ring_procs.check_reader(sys.argv[1], 1, 0.0)",
                                 handle, stdout=-1, env={"ZBUS_PURE_PYTHON": "1"})]
        from ring_procs import make_message

        for n in range(600):
            writer.send(make_message(n, os.urandom(n * 37 % 9000)), timeout=30)
        results = collect(writer, readers)
    finally:
        writer.close()
        for r in readers:
            end_process(r)
    assert [(r["received"], r["out_of_sequence"], r["corrupted"]) for r in results] == [(600, 0, 0)] * 2
    assert results[0]["digest"] == results[1]["digest"]


@needs_core
def test_a_frame_of_no_contiguous_buffer_is_refused_alike_by_both_cores(monkeypatch):
    """A strided numpy array as a frame: both cores raise TypeError and the ring
    stays usable. Before, the compiled one let numpy's ValueError ("not
    C-contiguous") out, where memoryview's BufferError takes the Python path.
    Sabotage: only BufferError taken as "not contiguous" in ``get_parts`` ->
    ValueError."""
    np = pytest.importorskip("numpy")
    strided = np.arange(64, dtype=np.uint8)[::2]
    writer = RingWriter.create(1, RingGeometry(4096, 4))
    try:
        for write in (core.write_message, ring._write_message_py):
            monkeypatch.setattr(ring, "_write_message", write)
            with pytest.raises(TypeError):
                writer.send([b"head", strided], timeout=5)
        writer.send([b"head", strided.copy()], timeout=5)  # (a contiguous copy goes)
    finally:
        writer.close()


# --- the relay: one call from a ZeroMQ socket straight into the ring ----------------

@pytest.fixture(scope="module")
def pair():
    """Two connected ZeroMQ sockets (sender, receiver) in this process; each test
    takes every message it sends."""
    import zmq

    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    tx.bind(f"inproc://relay-{id(ctx)}")
    rx.connect(f"inproc://relay-{id(ctx)}")
    assert core is None or core.relay_ready()
    yield tx, rx
    ctx.destroy(linger=0)


def relay(rx, buf: memoryview, seq: int, at: int = 64, limit: int = 2048, topic: bytes = b"R"):
    """relay_one once the message is there (inproc hands it over at once)."""
    for _ in range(1000):
        got = core.relay_one(rx.underlying, buf, at, limit, topic, seq)
        if got is not None:
            return got
        time.sleep(0.001)
    raise AssertionError("nothing arrived")


@needs_core
@settings(max_examples=200, deadline=None)
@given(payload=st.lists(st.binary(max_size=500), max_size=6), seq=st.integers(1, 2**64 - 1),
       method=st.text(st.characters(max_codepoint=127), max_size=40),
       reply_rank=st.integers(-2**63, 2**63 - 1))
def test_relay_one_writes_a_call_as_write_message_does(pair, payload, seq, method, reply_rank):
    """A call in number order is written into the ring byte for byte as
    write_message writes its frames, and not otherwise touched. Sabotage: a frame's
    padding not zeroed, the length word of the wrong frame, a msgpack integer width
    misread → differs or falls to the Python path (a list)."""
    from zbus import protocol

    tx, rx = pair
    frames = [protocol.call_envelope(seq, method, reply_rank, len(payload)), *payload]
    fill = os.urandom(4096)
    got, want = bytearray(fill), bytearray(fill)
    tx.send_multipart([b"R", *frames])
    size = relay(rx, memoryview(got), seq)
    written = core.write_message(memoryview(want), 64, frames, 2048)
    if type(size) is list:  # over the limit: the Python path gets it
        assert written == -1 and size == [b"R", *frames] and got == want
        return
    assert size == written and got == want


@needs_core
def test_relay_one_hands_every_other_message_to_python_whole(pair):
    """Another topic, a call out of number order, one over the limit, a STOP, an
    envelope the Python path alone judges, more parts than the C stack holds: the
    parts as sent, the mapping untouched; nothing there: None. Sabotage: compare
    ``seq == want`` dropped → the out-of-order call is written; ``more`` parts
    not drained → the 100-part message comes back short."""
    import msgpack

    from zbus import protocol

    tx, rx = pair
    buf = memoryview(bytearray(4096))
    call = protocol.call_envelope(7, "noop", 0, 1)
    cases = [[b"H", call, b"x"], [b"R", call, b"x"], [b"NR", call, b"x"],
             [b"R", protocol.call_envelope(8, "noop", 0, 1), b"x" * 3000],
             [b"R", msgpack.packb([protocol.STOP])],
             [b"R", msgpack.packb([True, 8, "noop", 0, 0, 0])],  # True == CALL in Python
             [b"R", msgpack.packb([1, 8, "né", 0, 0, 0])],  # not ASCII
             [b"R", msgpack.packb([1, 8, "noop", 0, 0, 0]) + b"\x00"],  # bytes after it
             [b"R", msgpack.packb([1, 8, "noop", 0, 0])],
             [b"R"], [b"R", *[b"p"] * 100]]
    for parts in cases:
        tx.send_multipart(parts)
        assert relay(rx, buf, 8) == parts
    assert bytes(buf) == bytes(4096)
    assert core.relay_one(rx.underlying, buf, 64, 2048, b"R", 8) is None
    tx.send_multipart([b"R", protocol.call_envelope(8, "noop", 0, 1), b"x"])
    assert relay(rx, buf, 8, at=4000) == [b"R", protocol.call_envelope(8, "noop", 0, 1), b"x"]  # no room
    assert bytes(buf) == bytes(4096)


@needs_core
@settings(max_examples=300, deadline=None)
@given(envelope=st.lists(st.one_of(st.integers(-2**63, 2**64 - 1), st.booleans(), st.none(),
                                   st.text(max_size=5), st.binary(max_size=3)), max_size=7))
def test_relay_one_takes_only_calls_the_python_relay_numbers_alike(pair, envelope):
    """Any envelope the compiled relay writes as call ``seq`` is one that
    ``zbus.protocol.read_envelope`` reads as that call. Sabotage: skip the checks of
    the last three items → a list Python refuses is relayed as a call."""
    import msgpack

    from zbus.agent import _call_seq

    tx, rx = pair
    frame = msgpack.packb(envelope)
    seq = envelope[1] if len(envelope) > 1 and type(envelope[1]) is int and envelope[1] > 0 else 1
    tx.send_multipart([b"R", frame])
    got = relay(rx, memoryview(bytearray(4096)), seq)
    if type(got) is int:
        assert _call_seq(frame) == seq
    else:
        assert got == [b"R", frame]


@needs_core
def test_relay_one_leaves_an_envelope_over_its_limit_to_python(pair):
    """An envelope of 64 KiB and a few bytes (a method name of 65 530 characters)
    is no call for ``read_envelope``; the compiled relay wrote it as one, and
    numbered it, where the Python path took it for no call. Sabotage: no
    ``n > MAX_ENVELOPE`` in ``call_envelope_seq`` -> written as call 3."""
    from zbus import protocol
    from zbus.agent import _call_seq

    tx, rx = pair
    frame = protocol.call_envelope(3, "m" * 65_530, -1, 0)
    assert protocol.MAX_ENVELOPE < len(frame) and _call_seq(frame) is None
    tx.send_multipart([b"R", frame])
    assert relay(rx, memoryview(bytearray(2**17)), 3, limit=2**17 - 64) == [b"R", frame]


@needs_core
@pytest.mark.parametrize("wait", ["wait_readable", "wait_message"])
def test_a_wait_for_a_message_ends_on_one_or_its_time_without_the_gil(pair, wait):
    """The agent's wait (``wait_readable``) and the leader's (``wait_message``).
    Sabotage: ``Py_BEGIN_ALLOW_THREADS`` removed → the sending thread cannot run
    and the wait ends False after its 5 s."""
    tx, rx = pair
    wait_for = getattr(core, wait)
    assert wait_for(rx.underlying, 0.01) is False
    sender = threading.Timer(0.05, lambda: tx.send(b"x"))
    sender.start()
    started = time.monotonic()
    assert wait_for(rx.underlying, 5.0) is True
    assert time.monotonic() - started < 4
    sender.join(5)
    assert wait_for(rx.underlying, 0.0) is True  # still there: it only waits
    assert rx.recv() == b"x"


def taken(rx, max_parts: int = 1 << 16, user_id: bool = False) -> tuple:
    """What take_message puts in its list once the message is there."""
    for _ in range(1000):
        into: list = []
        if core.take_message(rx.underlying, max_parts, user_id, into):
            assert len(into) == 1
            return into[0]
        assert into == []
        time.sleep(0.001)
    raise AssertionError("nothing arrived")


@needs_core
def test_take_message_takes_a_message_whole_as_writable_views(pair):
    """Small parts copied, large ones (64 KiB and over) lent from ZeroMQ's own
    message until the last view goes, all writable as pyzmq's frames are (the codec
    builds an array of a reply on its frame in place: a read-only one it copies);
    more parts than the C stack holds; the first ``max_parts`` of a longer one, the
    rest left on the socket; nothing there: False, the list untouched. Sabotage:
    ``more`` not read after each part -> the 100-part message comes back as one
    part; ``readonly`` 1 in ``part_getbuffer`` -> the array is a copy."""
    import numpy as np
    import zmq

    from zbus import codec

    tx, rx = pair
    big = bytes(range(256)) * 1024
    for parts in ([b"a"], [b"", big, b"z" * 65535], [b"%d" % i for i in range(100)]):
        tx.send_multipart(parts)
        views, whole, uid = taken(rx, user_id=True)
        assert [bytes(v) for v in views] == parts and whole and uid is None
        assert all(type(v) is memoryview and not v.readonly for v in views)
    assert [type(v.obj).__name__ for v in views] == ["bytearray"] * 100
    tx.send_multipart([b"x", big])
    views, _, _ = taken(rx)
    assert type(views[1].obj).__name__ == "Part" and bytes(views[1]) == big
    tx.send_multipart(codec.encode(np.arange(20_000, dtype=np.float64)))
    views, _, _ = taken(rx)
    array = codec.decode(views)
    assert array.tolist() == list(range(20_000))
    assert np.shares_memory(array, np.frombuffer(views[1], np.uint8))
    del views, array
    tx.send_multipart([b"%d" % i for i in range(10)])
    views, whole, _ = taken(rx, max_parts=4)
    assert [bytes(v) for v in views] == [b"0", b"1", b"2", b"3"] and not whole
    assert rx.getsockopt(zmq.RCVMORE) and rx.recv_multipart() == [b"%d" % i for i in range(4, 10)]
    into: list = []
    assert core.take_message(rx.underlying, 64, False, into) is False and into == []


@needs_core
@pytest.mark.timeout(60)
def test_a_signal_handler_raising_as_messages_are_taken_loses_none_of_them():
    """A SIGALRM every 0.1 ms whose handler raises, as the leader's reader takes
    50 000 messages of three parts off a socket: every message is in the list it
    gave, whole and in order, whether the handler raised as the message was taken
    or after. pyzmq runs a pending handler inside its receive, after the part left
    ZeroMQ's queue, and drops the part when the handler raises: the leader lost a
    reply to a Ctrl-C there. libzmq's receive answers EINTR when the signal lands as
    it processes its commands, between parts too: the core tries the part again.
    Sabotage: take the parts with pyzmq (``zmq.backend.Socket.recv`` one by one, as
    ``DataPath._read_one_py``), or no second try in ``recv_part`` -> parts lost,
    the messages after them cut apart (the second in 5 runs of 6)."""
    import zmq

    class Interrupted(Exception):
        pass
    armed = [False]

    def interrupt(signum, frame):
        if armed[0]:
            raise Interrupted

    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (tx, rx):
        sock.sndhwm = sock.rcvhwm = 0
    rx.bind("inproc://storm")
    tx.connect("inproc://storm")
    n, got, interrupts = 50_000, [], 0
    try:
        for i in range(n):
            tx.send_multipart([b"%d" % i, b"a", b"b"])
        # (no collection within: a finalizer it ran would take the handler's exception
        # as unraisable, wherever the collector happened to start)
        gc.collect()
        gc.disable()
        with borrowed_alarm(interrupt):
            signal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)
            for _ in range(50 * n):
                if len(got) >= n:
                    break
                into: list = []
                try:
                    armed[0] = True
                    core.take_message(rx.underlying, 64, False, into)
                    armed[0] = False
                except Interrupted:
                    armed[0] = False
                    interrupts += 1
                got.extend(into)
    finally:
        gc.enable()
        ctx.destroy(linger=0)
    assert interrupts >= 20, "too few interrupts landed to test anything"
    messages = [[bytes(v) for v in views] for views, _, _ in got]
    assert messages == [[b"%d" % i, b"a", b"b"] for i in range(n)], f"{interrupts} interrupts"


def _walked(walk, data: bytes, budget) -> tuple:
    """What a header walk answers: its estimate, or its refusal's type and text."""
    try:
        return ("ok", walk(data, budget))
    except Exception as e:  # noqa: BLE001 - compared between the twins
        return (type(e).__name__, str(e))


msgpack_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=40),
              st.binary(max_size=300)),
    lambda inner: st.one_of(st.lists(inner, max_size=20),
                            st.dictionaries(st.text(max_size=8), inner, max_size=8)),
    max_leaves=60)


@needs_core
@settings(max_examples=600, deadline=None)
@given(value=msgpack_value, ext=st.sampled_from([None, 1, 2, 3, 4, 5, 6, 7, 9, 127]),
       cut=st.integers(0, 2000), flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)),
                                                max_size=3),
       budget=st.one_of(st.none(), st.integers(-100, 10**5)), noise=st.binary(max_size=64))
def test_the_header_walk_answers_as_its_twin(value, ext, cut, flips, budget, noise):
    """The compiled header walk (``zbus.codec._walk``) answers every header as
    ``_walk_py`` does: the same estimate, or the same refusal (truncated, over its
    budget, a body of the wrong length, an unknown extension, a reserved byte, a
    count past the end, too deep), on valid headers, extension bodies, headers cut
    short, bytes changed, random bytes and deep nesting. Sabotage: a map's entry
    counted once, lengths read little-endian, the depth limit at 65 -> differs."""
    import msgpack

    from zbus import codec

    data = msgpack.packb(value, use_bin_type=True)
    if ext is not None:
        data = msgpack.packb([msgpack.ExtType(ext, data)], use_bin_type=True)
    data = bytearray(data[:cut] if cut < len(data) else data)
    for at, byte in flips:
        if at < len(data):
            data[at] = byte
    assert codec._core is core  # (the compiled walk is the one under test)
    for header in (bytes(data), noise, b"\x91" * (cut % 80) + b"\x90", b"\xdd\xff\xff\xff\xff" + noise):
        assert _walked(codec._walk, header, budget) == _walked(codec._walk_py, header, budget)


@needs_core
@pytest.mark.parametrize("wait", ["poll", "wait_readable", "wait_message"])
def test_ctrl_c_ends_a_wait_of_the_core_at_once(wait):
    """Ctrl-C ends the core's waits without the GIL in the main thread at once: the
    ring's poll, the relay's wait for a message (a follower's agent waits so
    between calls, in its main thread) and the leader's wait for a reply. Before,
    the first two held it back for the whole wait. Sabotage: no signal check in
    ``_core.wait_readable`` (or ``_core.poll``, or ``_core.wait_message``'s EINTR
    branch) -> the KeyboardInterrupt comes 10 s late."""
    import zmq

    if wait != "poll" and not core.relay_ready():
        pytest.skip("the core did not find libzmq")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    words = bytearray(64)
    run = {"poll": lambda: core.poll(memoryview(words).cast("Q"), 0, 0, (), 0.0, 10.0),
           "wait_readable": lambda: core.wait_readable(pull.underlying, 10.0),
           "wait_message": lambda: core.wait_message(pull.underlying, 10.0)}[wait]
    try:
        took = seconds_to_ctrl_c(run)
    finally:
        pull.close(linger=0)
        ctx.term()
    assert took < 5, f"Ctrl-C ended the wait {took:.1f} s later"


FORKED_FROM_A_THREAD = """
import os, threading
from conftest import seconds_to_ctrl_c
from zbus import ring


def child():
    try:
        words = bytearray(64)
        took = seconds_to_ctrl_c(lambda: ring._core.poll(memoryview(words).cast("Q"), 0, 0, (), 0.0, 10.0))
        print(f"{took:.2f}", flush=True)
    finally:
        os._exit(0)


pids = []
thread = threading.Thread(target=lambda: pids.append(os.fork() or child()))
thread.start()
thread.join()
os.waitpid(pids[0], 0)
"""


@needs_core
def test_ctrl_c_ends_a_wait_of_the_core_in_a_process_forked_from_a_thread():
    """A process forked from a thread other than the main one (a server's worker
    thread, say): the forking thread is the child's main thread, and Ctrl-C ends
    the core's wait there at once too. Before, the core knew the main thread by
    the id it read at import, the parent's: the child's waits never looked at
    signals and ran out their time. Sabotage: no ``pthread_atfork`` handler in
    ``_core.c`` -> the child's Ctrl-C comes 10 s late (it reports 10 s, or the
    wait's end without it)."""
    proc = spawn_python(FORKED_FROM_A_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        end_process(proc)
    assert proc.returncode == 0 and out.strip(), err[-2000:]
    assert float(out) < 5, f"Ctrl-C ended the forked child's wait {float(out):.1f} s later"
