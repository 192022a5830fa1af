"""The shared-memory broadcast ring, over real processes and real shared memory."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import (
    TEST_PATH,
    borrowed_alarm,
    end_process,
    own_segments,
    seconds_to_ctrl_c,
    spawn_python,
    wait_until,
    zbus_segments,
)
from ring_procs import end_message, make_message

import zbus
from zbus import codec, ring, shm
from zbus.config import RingGeometry, WaitPolicy
from zbus.errors import Cancelled, RingClosed, SettingError, ShmSpaceError
from zbus.ring import BufferPool, RingReader, RingWriter

# A wait slice far beyond any test's timeout: a lost wake-up would hang the test
# (and fail it by timeout) instead of being rescued by a periodic re-check.
NO_RESCUE = {"ZBUS_WAIT_SLICE": "600"}


def start_readers(writer: RingWriter, n: int, delays=None, env=None, lend=(), keep=(),
                  keep_every=0) -> list[psutil.Popen]:
    """``n`` checking readers (ring_procs.check_reader); those in ``lend`` lend, and
    those in ``keep`` keep a view of every ``keep_every``-th payload."""
    handle = json.dumps(writer.handle.to_dict())
    delays = delays or [0.0] * n
    return [spawn_python("import sys, ring_procs; ring_procs.check_reader(sys.argv[1], int(sys.argv[2]), "
                         "float(sys.argv[3]), sys.argv[4] == '1', int(sys.argv[5]))", handle, str(i),
                         str(delays[i]), "1" if i in lend else "0", str(keep_every if i in keep else 0),
                         stdout=subprocess.PIPE, env=env or {}) for i in range(n)]


def collect(writer: RingWriter, readers: list[psutil.Popen], timeout: float = 120) -> list[dict]:
    """Send the end message, then each reader's summary (see ring_procs.check_reader)."""
    writer.send(end_message(), timeout=60)
    out = []
    for proc in readers:
        stdout, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"reader failed with {proc.returncode}"
        out.append(json.loads(stdout))
    return out


def send_and_collect(writer: RingWriter, readers: list[psutil.Popen], messages) -> list[dict]:
    """Send each message of ``messages`` (an iterable of frame lists), then collect
    the readers' summaries; the readers are ended and the writer closed."""
    try:
        for frames in messages:
            writer.send(frames, timeout=60)
        return collect(writer, readers)
    finally:
        for r in readers:
            end_process(r)
        writer.close()


def counts(results: list[dict]) -> list[tuple[int, int, int]]:
    """(received, out of sequence, corrupted) of each reader."""
    return [(r["received"], r["out_of_sequence"], r["corrupted"]) for r in results]


def test_100k_messages_three_readers_every_message_once_in_order():
    """Each reader counts what it received until the end message (no reader is
    told how many to expect). Sabotage: lose the 5000th message in
    ``RingWriter.send`` (return at once when a call counter reaches 5000) → fails:
    99 999 received, 1 out of sequence."""
    geo = RingGeometry(1024, 16)
    writer = RingWriter.create(3, geo, WaitPolicy.from_env())
    count = 100_000
    readers = start_readers(writer, 3)
    rng = random.Random(7)
    digest = hashlib.blake2b()

    def messages():
        for i in range(count):
            payload = rng.randbytes(rng.randint(0, 3 * geo.chunk_bytes))
            digest.update(payload)
            yield make_message(i, payload)

    results = send_and_collect(writer, readers, messages())
    assert counts(results) == [(count, 0, 0)] * 3
    assert {r["digest"] for r in results} == {digest.hexdigest()}


def test_message_larger_than_ring_streams_through_shared_memory():
    writer = RingWriter.create(1, RingGeometry(64 * 1024, 8))  # 512 KiB of ring
    payload = os.urandom(64 * 2**20)
    readers = start_readers(writer, 1)
    try:
        writer.send(make_message(0, payload), timeout=60)
        (result,) = collect(writer, readers)
    finally:
        for r in readers:
            end_process(r)
        writer.close()
    assert counts([result]) == [(1, 0, 0)]
    assert result["digest"] == hashlib.blake2b(payload).hexdigest()


def test_a_frame_given_in_parts_arrives_whole_in_a_chunk_and_streamed():
    """A node agent hands a frame that came over a keyed link in parts; the ring
    writes them back to back. Both paths: a message that fits one chunk, and one
    streamed through many. Sabotage: skip a part in ``_send_small`` or in the
    streamed pieces -> a reader's crc fails (corrupted) or its digest differs."""
    writer = RingWriter.create(1, RingGeometry(64 * 1024, 8))
    small, large = os.urandom(40_000), os.urandom(3 * 2**20 + 7)
    readers = start_readers(writer, 1)
    try:
        for i, payload in enumerate((small, large)):
            meta, _ = make_message(i, payload)
            cut = len(payload) // 3
            writer.send([meta, (payload[:cut], b"", memoryview(payload)[cut:])], timeout=60)
        (result,) = collect(writer, readers)
    finally:
        for r in readers:
            end_process(r)
        writer.close()
    assert counts([result]) == [(2, 0, 0)]
    assert result["digest"] == hashlib.blake2b(small + large).hexdigest()


def test_slow_reader_blocks_writer_then_nothing_is_lost():
    """Reader 1 sleeps 1.5 s after attaching; 64 messages cannot fit in 4 chunks, so
    the writer is still sending when reader 1 wakes (both processes read the same
    monotonic clock): it waited for the sleeping reader, not merely for the
    readers to start. Sabotage: leave reader 1 out of ``_refresh_min_read``
    (``if r == 1: continue``) → fails: the writer is done before reader 1 wakes."""
    geo = RingGeometry(1024, 4)
    writer = RingWriter.create(2, geo)
    count = 64
    readers = start_readers(writer, 2, delays=[0.0, 1.5])
    payloads = [os.urandom(700) for _ in range(count)]
    try:
        for i, p in enumerate(payloads):
            writer.send(make_message(i, p), timeout=30)
        done = time.monotonic()
        results = collect(writer, readers)
    finally:
        for r in readers:
            end_process(r)
        writer.close()
    assert done > results[1]["woke"], f"the writer was done {results[1]['woke'] - done:.2f} s before " \
                                      "the sleeping reader woke"
    digest = hashlib.blake2b(b"".join(payloads)).hexdigest()
    assert counts(results) == [(count, 0, 0)] * 2
    assert [r["digest"] for r in results] == [digest, digest]


def test_send_times_out_on_a_full_ring_then_resumes_without_tearing():
    writer = RingWriter.create(1, RingGeometry(256, 2))
    reader = RingReader.attach(writer.handle, 0)
    try:
        writer.send([b"a" * 100], timeout=1)
        writer.send([b"b" * 100], timeout=1)
        with pytest.raises(TimeoutError):
            writer.send([b"c" * 600], timeout=0.2)  # needs 3 chunks; none free
        assert bytes(reader.recv(timeout=1)[0]) == b"a" * 100
        assert bytes(reader.recv(timeout=1)[0]) == b"b" * 100
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("m", bytes(reader.recv(timeout=5)[0])))
        t.start()
        writer.send([b"d"], timeout=5)  # finishes the cut message before it sends this
        t.join(10)
        assert got["m"] == b"c" * 600
        assert bytes(reader.recv(timeout=5)[0]) == b"d"
    finally:
        reader.close()
        writer.close()


def test_a_timeout_of_nan_is_refused_not_waited_for_ever():
    """A ring's send and receive took ``monotonic() + nan`` for their deadline, which
    no clock passes: on a full (or empty) ring they slept slice after slice for
    good, where the ZeroMQ queues refuse NaN (``deadline_of``). Sabotage: the old
    ``time.monotonic() + timeout`` in ``RingReader.recv`` -> the receive is still
    waiting 2 s later."""
    writer = RingWriter.create(1, RingGeometry(256, 2))
    reader = RingReader.attach(writer.handle, 0)
    got: dict = {}

    def attempt(name, step):
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - what it raised is the finding
            got[name] = e

    try:
        for name, step in [("recv", lambda: reader.recv(timeout=math.nan)),
                           ("fill", lambda: writer.send([b"x" * 400], timeout=1)),
                           ("send", lambda: writer.send([b"y" * 100], timeout=math.nan))]:
            t = threading.Thread(target=attempt, args=(name, step), daemon=True)
            t.start()
            t.join(2)
            assert not t.is_alive(), f"{name} with a timeout of NaN still waits"
        assert set(got) == {"recv", "send"}, got
        assert all(type(e) is ValueError and "NaN" in str(e) for e in got.values()), got
    finally:
        reader.close()
        writer.close()


def test_recv_timeout_cancel_and_abort():
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.recv(timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 2
        cancel = threading.Event()
        threading.Timer(0.2, cancel.set).start()
        with pytest.raises(Cancelled):
            reader.recv(timeout=10, cancel=cancel)
        # abort from another thread wakes a reader blocked with no timeout, at once
        threading.Timer(0.2, writer.abort).start()
        t0 = time.monotonic()
        with pytest.raises(RingClosed):
            reader.recv()
        assert time.monotonic() - t0 < 2
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("core", ["compiled", "python"])
@pytest.mark.parametrize("corrupt", ["frames", "size", "size-wraps", "size-negative", "size-huge", "lent"])
def test_a_corrupt_message_is_dropped_and_the_next_one_read(core, corrupt, monkeypatch):
    """A message whose header a stray write changed (user native code in a worker,
    another process of the node): its frame count no longer fits its size, or its
    size is one no message has; ``lent``: the frame count of a large message a
    lending reader maps where it lies. The reader drops it (CodecError: the
    driver answers its call with it; a worker ends, its death failing the
    executor) and reads the next one. Before, a small one raised ValueError at
    every recv for good, without moving on, a huge size raised MemoryError the same
    way, and a lent one raised ValueError. Sabotage: no ``try`` around
    ``_read_message`` in ``RingReader.recv`` -> ValueError twice (``frames``); none
    around ``_pool.take`` -> MemoryError (``size``); none around ``_split_frames`` in
    ``_lend`` -> ValueError (``lent``). A size of 2**64-1 (``size-wraps``) or 2**63+5
    (``size-negative``) came to an empty or a negative buffer in the pool (C's
    ssize_t): ValueError or SystemError at every recv, the reader stuck; sabotage:
    no bound on the size before ``_pool.take``. ``size-huge``: 32 TiB, over
    ``ZBUS_MAX_MESSAGE``, which no buffer can hold (MemoryError): a first version
    of skipping a message the reader has no memory for skipped it whole, reading
    every later message as its rest; sabotage: no check of the size against
    ``codec.MAX_MESSAGE`` on a MemoryError -> TimeoutError. (A second version
    took any size over the limit for corrupt, a real message within it too: its
    frames' padding counts.)"""
    if core == "python":
        monkeypatch.setattr(ring, "_read_message", ring._read_message_py)
    elif shm.core is None:
        pytest.skip("the compiled core is not built here (or ZBUS_PURE_PYTHON)")
    lent = corrupt == "lent"
    if lent and not shm.can_lend():
        pytest.skip("this kernel cannot lend (no memfd)")
    writer = RingWriter.create(1, RingGeometry(64 * 1024, 8) if lent else RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0, lend=lent)
    take = reader._pool.take

    def no_memory(n):  # (whatever the machine's overcommit would say)
        if n >= 2**45:
            raise MemoryError
        return take(n)
    reader._pool.take = no_memory
    try:
        at = writer._chunk(0)
        writer.send([b"x" * 300_000] if lent else [b"first"])
        if corrupt.startswith("size"):
            size = {"size": 2**62, "size-wraps": 2**64 - 1, "size-negative": 2**63 + 5,
                    "size-huge": 2**45}[corrupt]
            struct.pack_into("<Q", writer._buf, at, size)  # 4 EiB and more
        else:
            struct.pack_into("<Q", writer._buf, at + 8, 100_000)  # frames: past the message's size
        writer.send([b"second"])
        with pytest.raises(zbus.CodecError, match="corrupt message dropped"):
            reader.recv(timeout=5)
        assert [bytes(f) for f in reader.recv(timeout=5)] == [b"second"]
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("core", ["compiled", "python"])
def test_a_strided_view_is_written_as_its_bytes_by_either_core(core, monkeypatch):
    """A 1-D byte view with a stride is a frame like any other. The compiled core
    asked for a contiguous buffer and raised BufferError where the Python twin
    wrote the view's bytes. Sabotage: ``get_parts`` fails on BufferError instead of
    leaving the message to the Python path -> BufferError (``compiled``)."""
    if core == "python":
        monkeypatch.setattr(ring, "_write_message", ring._write_message_py)
    elif shm.core is None:
        pytest.skip("the compiled core is not built here (or ZBUS_PURE_PYTHON)")
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    try:
        writer.send([memoryview(b"abcdef")[::2], (b"g", memoryview(b"hxix")[::2])])
        assert [bytes(f) for f in reader.recv(timeout=5)] == [b"ace", b"ghi"]
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("core", ["compiled", "python"])
def test_a_state_word_a_stray_write_set_ends_the_ring_for_either_core(core):
    """The state word is 0 until an abort writes 2. Another value (a stray write)
    ended a compiled reader's wait (RingClosed) and left the Python twin's waiting
    (TimeoutError). Sabotage: ``_ended`` compares the word with ``_ABORTED``."""
    if core == "compiled" and shm.core is None:
        pytest.skip("the compiled core is not built here (or ZBUS_PURE_PYTHON)")
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    try:
        if core == "python":
            reader._poll = None
        writer._i[ring._I_STATE] = 1
        with pytest.raises(RingClosed):
            reader.recv(timeout=0.5)
        with pytest.raises(RingClosed):
            writer.send([b"x"])
    finally:
        reader.close()
        writer.close()


def test_close_lets_readers_drain_then_raises():
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    writer.send([b"last"])
    writer.close()
    assert bytes(reader.recv(timeout=1)[0]) == b"last"
    with pytest.raises(RingClosed):
        reader.recv(timeout=1)
    reader.close()


class _AbortOnFirstTouch:
    """The writer's view of the ring's u32 words, through which another mapping of
    the ring aborts it at the first word that close() reads or writes: the
    interleaving (close reads "open", abort, close writes) a plain run hits by chance."""

    def __init__(self, words, abort):
        self._words, self._abort = words, abort

    def _fire(self):
        abort, self._abort = self._abort, None
        if abort is not None:
            abort()

    def __getitem__(self, k):
        value = self._words[k]
        self._fire()
        return value

    def __setitem__(self, k, value):
        self._fire()
        self._words[k] = value

    def release(self):
        self._words.release()


def test_close_never_overwrites_a_concurrent_abort():
    """Sabotage: close() with ``if state == OPEN: state = CLOSED`` on the shared state
    word (read, then write): the abort that lands in between is lost."""
    from zbus import ring

    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    try:
        writer.send([b"before"])
        writer._i = _AbortOnFirstTouch(writer._i, reader.abort)
        writer.close()
        assert reader._i[ring._I_STATE] == ring._ABORTED
        assert bytes(reader.recv(timeout=1)[0]) == b"before"  # published before the abort
        with pytest.raises(RingClosed):
            reader.recv(timeout=1)
    finally:
        reader.close()
        writer.close()


def test_attach_refuses_a_detached_reader_slot_and_a_closed_ring():
    """Sabotage: drop the detached/closed check in RingReader.__init__: the
    re-attached reader would read chunks the writer is free to overwrite."""
    writer = RingWriter.create(2, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    reader.close()
    try:
        with pytest.raises(RingClosed, match="reader 0 detached"):
            RingReader.attach(writer.handle, 0)
        writer.close(unlink=False)
        with pytest.raises(RingClosed, match="is closed"):
            RingReader.attach(writer.handle, 1)
    finally:
        writer.close()
        shm.unlink(writer.handle.name)


@pytest.fixture(params=["compiled", "python"])
def bell_core(request, monkeypatch):
    """Each way a doorbell sleeps: the compiled core's recv, or Python's own."""
    if request.param == "python":
        monkeypatch.setattr(shm, "core", None)
    elif shm.core is None:
        pytest.skip("the compiled core is not built here (or ZBUS_PURE_PYTHON)")
    return request.param


@pytest.mark.parametrize("default", [3.0, 0.0])
def test_a_doorbell_sleeps_its_own_timeout_whatever_the_default_socket_timeout(bell_core, default):
    """``socket.setdefaulttimeout()``, which a driver's own code may set before it
    starts zbus, gave the doorbell's socket that timeout: Python then polls for it
    and ignores SO_RCVTIMEO (a reader's 0.1 s sleep took 3 s), and a default of 0
    made it non-blocking (an idle reader spun: 0.96 s of CPU a second). Sabotage:
    no ``settimeout`` in ``Doorbell.__init__`` -> compiled: 3 s, or no sleep."""
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(default)
    try:
        bell = shm.Doorbell(f"zbus-test-bell-{os.getpid()}-{time.monotonic_ns()}")
    finally:
        socket.setdefaulttimeout(old)
    try:
        for _ in range(2):
            start, cpu = time.monotonic(), time.process_time()
            bell.wait(0.2)
            took, used = time.monotonic() - start, time.process_time() - cpu
            assert 0.15 < took < 1.5 and used < 0.1, (took, used)
    finally:
        bell.close()


def test_a_signal_does_not_lengthen_a_doorbell_sleep(bell_core):
    """Python's recv retries after a signal whose handler returns, with the whole
    SO_RCVTIMEO again: with a handler run every 0.05 s (a profiler's timer, say), a
    sleep of 0.3 s never ended, nor the deadline of a caller waiting on a ring.
    Sabotage: ``self.sock.recv(16)`` in place of ``core.bell_recv`` -> the sleep
    lasts until the test's rescue ring (4 s)."""
    bell = shm.Doorbell(f"zbus-test-bell-{os.getpid()}-{time.monotonic_ns()}")
    ringer = shm.Ringer(bell.address)
    rescue = threading.Timer(4.0, ringer.ring)
    handled, done = [], threading.Event()
    old = signal.signal(signal.SIGUSR1, lambda *_: handled.append(1))

    def signals(main: int = threading.main_thread().ident) -> None:
        while not done.wait(0.05):
            signal.pthread_kill(main, signal.SIGUSR1)

    sender = threading.Thread(target=signals)
    rescue.start()
    sender.start()
    try:
        start = time.monotonic()
        bell.wait(0.3)
        took = time.monotonic() - start
    finally:
        done.set()
        sender.join(5)
        rescue.cancel()
        signal.signal(signal.SIGUSR1, old)
        ringer.close()
        bell.close()
    assert handled and 0.25 < took < 1.5, (len(handled), took)


@pytest.mark.parametrize("poll", ["compiled", "python"])
def test_ctrl_c_ends_a_poll_for_the_next_message_at_once(monkeypatch, poll):
    """A reader polling for its next message (an engine's workers poll between
    steps) is ended by Ctrl-C at once on both cores: the Python twin's loop runs
    the signal's handler between its steps, the compiled poll takes the GIL every
    5 ms for it. Before, the compiled poll held a Ctrl-C back for the whole poll
    (up to a second with ``poll_after_call_s``; 10 s here). Sabotage: no signal
    check in ``_core.poll`` -> the KeyboardInterrupt comes 10 s late."""
    if poll == "python":
        monkeypatch.setattr(ring, "_core", None)
    elif ring._core is None:
        pytest.skip("the compiled core is not built here (or ZBUS_PURE_PYTHON)")
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0, WaitPolicy(0, 10.0, 600))
    try:
        took = seconds_to_ctrl_c(lambda: reader.recv(timeout=30))
    finally:
        reader.close()
        writer.close()
    assert took < 5, f"Ctrl-C ended the poll {took:.1f} s later"


def test_rings_left_at_other_doorbells_do_not_stop_a_wake_up():
    """Sabotage: ring every doorbell through one shared non-blocking socket (the old
    ``shm._ringer``): rings queued at idle doorbells fill its send buffer, the
    wake-up of the sleeping reader fails with EAGAIN, taken as "already rung",
    and the reader sleeps until its timeout."""
    geo = RingGeometry(256, 4)
    idle = []
    writer = reader = None
    try:
        for _ in range(48):  # ends that never wait: each abort leaves a ring at two doorbells
            w = RingWriter.create(1, geo)
            idle.append(w)
            idle.append(RingReader.attach(w.handle, 0))
            for _ in range(12):  # more than a doorbell queues (net.unix.max_dgram_qlen, 10)
                w.abort()
        writer = RingWriter.create(1, geo)
        reader = RingReader.attach(writer.handle, 0, WaitPolicy(0, 0, 600))
        got = {}

        def read():
            frames = reader.recv(timeout=10)
            got["at"], got["data"] = time.monotonic(), bytes(frames[0])

        t = threading.Thread(target=read)
        t.start()
        deadline = time.monotonic() + 10
        while not reader._i[reader._flag] and time.monotonic() < deadline:
            time.sleep(0.005)  # until the reader sleeps on its doorbell
        assert reader._i[reader._flag], "the reader never went to sleep"
        sent = time.monotonic()
        writer.send([b"wake"])
        t.join(15)
        assert got["data"] == b"wake" and got["at"] - sent < 2.0
    finally:
        for end in [*idle, reader, writer]:
            if end is not None:
                end.close()


def test_a_reader_out_of_file_descriptors_loses_no_message_and_still_wakes_the_writer():
    """A reader that gives chunks back rings the waiting writer. Out of file
    descriptors then (EMFILE), it must neither raise after the chunks are given
    back (the caller's retry would take the next message: this one lost) nor
    leave the writer asleep. Sabotage: make the ringers' sockets at the first
    ring again (no ``connect`` at attach) → the receive raises OSError (or, with
    the ring's failure to make one ignored, the writer is never woken: its send
    times out)."""
    import resource

    writer = RingWriter.create(1, RingGeometry(256, 2), WaitPolicy(0, 0, 600))
    reader = RingReader.attach(writer.handle, 0, WaitPolicy(0, 0, 600))
    sent = []
    t = threading.Thread(target=lambda: sent.append(writer.send([b"third"], timeout=30)))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        writer.send([b"first"])
        writer.send([b"second"])  # the ring is full: the third send waits for a chunk
        t.start()
        wait_until(lambda: writer._i[ring._I_WWAIT], 10, "the writer never waited")
        lowest = os.dup(0)  # the next descriptor's number: a limit of it leaves none
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        try:
            got = [bytes(reader.recv(timeout=10)[0]) for _ in range(3)]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        t.join(10)
        assert got == [b"first", b"second", b"third"] and not t.is_alive()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        reader.abort()
        t.join(10)
        reader.close()
        writer.close()


def test_reader_index_cannot_be_attached_twice():
    writer = RingWriter.create(2, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 1)
    try:
        with pytest.raises(OSError, match="attached twice"):
            RingReader.attach(writer.handle, 1)
        with pytest.raises(ValueError):
            RingReader.attach(writer.handle, 2)
    finally:
        reader.close()
        writer.close()


def test_idle_reader_uses_no_cpu_and_wakes_fast():
    """A reader blocked on an empty ring sleeps on its doorbell: under 5 % of a core
    over 2 s (measured from when it raised its waiting flag), and one message wakes
    it within 1 s though no wait slice ends its sleep (600 s): a lost wake-up would
    take the reader's 60 s timeout. Sabotage: a writer that does not ring the
    reader's doorbell (``RingWriter`` skipping its doorbell send) fails the
    latency bound; a reader that waits by yielding instead of sleeping fails the
    CPU bound."""
    writer = RingWriter.create(1, RingGeometry(256, 4))
    proc = spawn_python("import sys, ring_procs; ring_procs.idle_reader(sys.argv[1], 0)",
                        json.dumps(writer.handle.to_dict()), stdout=subprocess.PIPE, env=NO_RESCUE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        flag = writer._reader_flags[0]
        wait_until(lambda: writer._i[flag], 10, "the reader asleep on its doorbell")
        cpu0 = sum(proc.cpu_times()[:2])
        time.sleep(2.0)  # the idle time under test
        idle_cpu = sum(proc.cpu_times()[:2]) - cpu0
        writer.send(make_message(0, b"wake"), timeout=5)
        latency = json.loads(proc.stdout.readline())["latency"]
    finally:
        end_process(proc)
        writer.close()
    print(f"idle reader: {idle_cpu / 2.0:.2%} of a core; wake-up after 2 s idle: {latency * 1e6:.0f} us")
    assert idle_cpu / 2.0 < 0.05
    # a lost wake-up would take the reader's 60 s timeout (no wait slice ends its
    # sleep); 1 s leaves a loaded 2-core machine time to schedule the woken process
    assert latency < 1.0


def test_no_lost_wakeup_bursts_with_idle_gaps():
    """Bursts separated by gaps long enough for every side to park, with no periodic
    re-check to rescue a lost wake-up: the test finishes only if none is lost.
    The ring is small so the writer parks on full as well."""
    geo = RingGeometry(256, 4)
    writer = RingWriter.create(2, geo, WaitPolicy(0.0, 0.0, 600.0))
    rng = random.Random(3)
    plan = [rng.randint(1, 12) for _ in range(300)]
    count = sum(plan)
    readers = start_readers(writer, 2, env=NO_RESCUE)
    digest = hashlib.blake2b()
    i = 0
    try:
        for burst in plan:
            for _ in range(burst):
                payload = rng.randbytes(rng.randint(0, 600))
                digest.update(payload)
                writer.send(make_message(i, payload), timeout=60)
                i += 1
            time.sleep(rng.choice([0, 0.0005, 0.002, 0.01]))
        results = collect(writer, readers)
    finally:
        for r in readers:
            end_process(r)
        writer.close()
    assert counts(results) == [(count, 0, 0)] * 2
    assert [r["digest"] for r in results] == [digest.hexdigest()] * 2
    print(f"worst wake-up latency over {count} messages: "
          f"{max(r['worst_latency'] for r in results) * 1e3:.1f} ms")


def test_segments_are_private_to_their_user_and_never_taken_over(monkeypatch):
    """A segment is made with mode 0600 and O_EXCL: only its user can attach, and
    a name already in /dev/shm is an error, never reused. Sabotage: make segments
    with mode 0o644 (the mode check fails) or without O_EXCL (the existing
    segment is opened and truncated: no FileExistsError)."""
    writer = RingWriter.create(1, RingGeometry(256, 4))
    try:
        assert stat.S_IMODE(os.stat(os.path.join(shm.SHM_DIR, writer.name)).st_mode) == 0o600
        monkeypatch.setattr(shm, "new_name", lambda: writer.name)  # a name that is taken
        with pytest.raises(FileExistsError):
            shm.Segment.create(writer.handle.size)
    finally:
        writer.close()


def test_segment_of_sigkilled_owner_is_swept():
    proc = spawn_python("from zbus.ring import RingWriter; from zbus.config import RingGeometry; "
                        "w = RingWriter.create(1, RingGeometry(256, 4)); print(w.name, flush=True); "
                        "import time; time.sleep(60)", stdout=subprocess.PIPE)
    try:
        name = proc.stdout.readline().decode().strip()
        assert name in zbus_segments()
        assert shm.sweep_stale() == []  # owner alive: kept
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert name in zbus_segments()
        assert name in shm.sweep_stale()
        assert name not in zbus_segments()
    finally:
        end_process(proc)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(10)
    return proc.pid


def _shm_file(name: str, uid: int | None = None) -> str:
    path = os.path.join(shm.SHM_DIR, name)
    with open(path, "wb"):
        pass
    if uid is not None:
        os.chown(path, uid, -1)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's segment")
def test_sweep_leaves_other_users_segments_alone_and_never_raises():
    """Sabotage: drop the ``st_uid != uid`` skip in sweep_stale (root then removes
    a stale file of uid 65533), or the OSError catch (the sweep run as nobody then
    raises PermissionError on root's stale file in the sticky /dev/shm)."""
    ns, dead = shm._pid_namespace(), _dead_pid()
    theirs = _shm_file(f"zbus-{ns}-{dead}-1-900001", uid=65533)
    ours = _shm_file(f"zbus-{ns}-{dead}-1-900002")
    try:
        pid = os.fork()
        if pid == 0:  # the sweep as user nobody, in a forked child (no interpreter to exec)
            code = 3
            try:
                os.setuid(65534)
                shm.sweep_stale()
                code = 0
            except BaseException:  # noqa: BLE001 - reported through the exit code
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "sweep_stale raised as another user"
        assert os.path.exists(ours)  # not nobody's to remove
        assert os.path.basename(ours) in shm.sweep_stale()
        assert os.path.exists(theirs) and not os.path.exists(ours)
    finally:
        for path in (theirs, ours):
            if os.path.exists(path):
                os.unlink(path)


def test_segment_named_without_a_start_time_is_kept_while_its_owner_lives():
    """Sabotage: compare start times only in owner_alive (``_start_time(pid) ==
    start``): "None" never equals a start time, so the live owner's segment goes."""
    ns = shm._pid_namespace()
    live = _shm_file(f"zbus-{ns}-{os.getpid()}-None-900003")
    dead = _shm_file(f"zbus-{ns}-{_dead_pid()}-None-900004")
    try:
        removed = shm.sweep_stale()
        assert os.path.basename(dead) in removed and os.path.basename(live) not in removed
        assert os.path.exists(live)
    finally:
        for path in (live, dead):
            if os.path.exists(path):
                os.unlink(path)


def test_segment_whose_mapping_fails_is_unlinked():
    """Sabotage: return ``cls(name, size, fd)`` in Segment.create without the
    unlink on failure: the reserved segment stays in /dev/shm."""
    code = """
import resource, sys
from zbus import codec, ring, shm
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**24, resource.RLIM_INFINITY))
try:
    shm.Segment.create(2**28)  # reserved in /dev/shm, but no address space to map it
except (OSError, MemoryError) as e:
    print("refused", type(e).__name__)
"""
    before = zbus_segments()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=TEST_PATH))
    assert out.stdout.startswith("refused"), out.stdout + out.stderr
    assert zbus_segments() - before == set()


def test_a_segment_whose_reservation_a_signal_cuts_short_is_unlinked():
    """SIGINT (KeyboardInterrupt) lands while ``Segment.create`` reserves 256 MiB
    (an interval timer started by a wrapper of the real ``posix_fallocate``): the
    name is removed and the interrupt goes on. Before, only OSError was caught:
    the name, known to nobody, stayed until a later start's sweep. Sabotage:
    ``except OSError`` around ``posix_fallocate`` in ``Segment.create`` -> the
    segment is left."""
    code = """
import os, signal
from zbus import shm

def interrupt(signum, frame):
    signal.setitimer(signal.ITIMER_REAL, 0)
    raise KeyboardInterrupt

real = os.posix_fallocate
def fallocate(*args):
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)  # lands in the reservation or just after
    real(*args)

signal.signal(signal.SIGALRM, interrupt)
os.posix_fallocate = fallocate
try:
    shm.Segment.create(2**28)
except KeyboardInterrupt:
    print("interrupted")
"""
    before = zbus_segments()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=TEST_PATH))
    assert out.stdout.startswith("interrupted"), out.stdout + out.stderr
    left = zbus_segments() - before
    for name in left:
        shm.unlink(name)
    assert left == set()


def test_creation_checks_free_space_and_says_how_much_is_needed():
    free = os.statvfs(shm.SHM_DIR).f_bavail * os.statvfs(shm.SHM_DIR).f_frsize
    geo = RingGeometry(2**30, free // 2**30 + 2)
    before = zbus_segments()
    with pytest.raises(ShmSpaceError, match="MiB"):
        RingWriter.create(1, geo)
    assert zbus_segments() - before == set()


def test_geometry_setting(monkeypatch):
    monkeypatch.setenv("ZBUS_RING", "64Kx32")
    assert RingGeometry.from_env() == RingGeometry(64 * 1024, 32)
    monkeypatch.setenv("ZBUS_RING", "nonsense")
    with pytest.raises(ValueError, match="ZBUS_RING"):
        RingGeometry.from_env()


@pytest.mark.parametrize("name, value", [("ZBUS_WAIT_SLICE", "0"), ("ZBUS_WAIT_SLICE", "-1"),
                                         ("ZBUS_WAIT_SLICE", "nan"), ("ZBUS_YIELD_US", "-5"),
                                         ("ZBUS_SPIN_US", "inf"), ("ZBUS_SPIN_US", "fast"),
                                         ("ZBUS_WAIT_SLICE", "1e-9"), ("ZBUS_WAIT_SLICE", "1e9"),
                                         ("ZBUS_SPIN_US", "1e12")])
def test_wait_settings_out_of_range_are_refused(monkeypatch, name, value):
    """A wait slice of 0 or less made every doorbell sleep 1 us (a busy loop), and
    ``nan`` one that ``min`` with a deadline let through; one of a nanosecond was a
    busy loop still, one of 1e9 s saw a cancel decades late, and a spin had no
    bound. Sabotage: read them with ``float`` alone, as before -> accepted; no
    ``within`` in ``config._number`` -> the last three accepted."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        WaitPolicy.from_env()
    monkeypatch.setenv(name, "0.25")
    assert WaitPolicy.from_env().slice_s == (0.25 if name == "ZBUS_WAIT_SLICE" else 0.5)


@pytest.mark.parametrize("text, on", [("1", True), ("true", True), ("Yes", True), (" on ", True),
                                      ("", False), ("0", False), ("false", False), ("NO", False),
                                      ("off", False), ("2", None), ("maybe", None)])
def test_an_on_off_setting_means_what_it_says_or_is_refused(monkeypatch, text, on):
    """``ZBUS_PURE_PYTHON=false`` turned the Python twins on (anything but "" and
    "0" did), and ``ZBUS_ALLOW_IMPORT_CALLS=true`` or ``ZBUS_INSECURE=yes`` left
    them off without a word (only "1" counted). Sabotage: ``_load_core``'s old
    test (``not in ("", "0")``) -> "false" runs the twins where the core is built."""
    import importlib.util

    from zbus.config import flag

    built = importlib.util.find_spec("zbus._core") is not None
    monkeypatch.setenv("ZBUS_PURE_PYTHON", text)
    if on is None:
        with pytest.raises(SettingError, match=f"ZBUS_PURE_PYTHON={text!r}: expected 1 or 0"):
            flag("ZBUS_PURE_PYTHON")
        with pytest.raises(SettingError, match="ZBUS_PURE_PYTHON"):
            shm._load_core()
        return
    assert flag("ZBUS_PURE_PYTHON") is on
    assert (shm._load_core() is not None) == (built and not on)


def test_waiters_poll_by_default_only_when_each_has_a_core(monkeypatch):
    """By default a waiter yields 200 us before it sleeps (and spins 50 us with more
    than 2 cores) only where each process of the node that waits on rings has a
    usable core; with more of them, it sleeps at once. A setting wins either way.
    Sabotage: ignore ``waiters`` -> 200 us of yielding with one waiter too many."""
    from zbus.config import usable_cores

    monkeypatch.delenv("ZBUS_SPIN_US", raising=False)
    monkeypatch.delenv("ZBUS_YIELD_US", raising=False)
    cores = usable_cores()
    fits = WaitPolicy.from_env(waiters=cores)
    assert (fits.spin_s, fits.yield_s) == (50e-6 if cores > 2 else 0.0, 200e-6)
    crowded = WaitPolicy.from_env(waiters=cores + 1)
    assert (crowded.spin_s, crowded.yield_s) == (0.0, 0.0)
    monkeypatch.setenv("ZBUS_YIELD_US", "70")
    monkeypatch.setenv("ZBUS_SPIN_US", "5")
    assert WaitPolicy.from_env(waiters=cores + 1) == WaitPolicy(5e-6, 70e-6, crowded.slice_s)


def test_received_buffers_are_reused_only_when_nothing_refers_to_them():
    writer = RingWriter.create(1, RingGeometry(64 * 1024, 8))
    reader = RingReader.attach(writer.handle, 0)
    size = 1024 * 1024
    try:
        def roundtrip(fill: int) -> list[memoryview]:
            t = threading.Thread(target=writer.send, args=([bytes([fill]) * size],), kwargs={"timeout": 10})
            t.start()
            frames = reader.recv(timeout=10)
            t.join(10)
            return frames

        kept = roundtrip(1)  # still referenced: its buffer must not be reused
        first_buffer = kept[0].obj
        second = roundtrip(2)
        second_buffer = second[0].obj
        assert second_buffer is not first_buffer
        assert bytes(kept[0][:8]) == b"\x01" * 8 and bytes(kept[0][-8:]) == b"\x01" * 8
        del second
        third = roundtrip(3)  # the second buffer is free again: reused, warm
        assert third[0].obj is second_buffer
        assert bytes(kept[0][-8:]) == b"\x01" * 8 and bytes(third[0][-8:]) == b"\x03" * 8
    finally:
        reader.close()
        writer.close()


def test_receive_buffers_of_pool_misses_hold_exactly_each_message():
    """A pool miss takes its buffer from malloc without zero-filling it: whatever
    the memory held before must never show through. Every message, of sizes that
    miss (all buffers still in use), reuse a larger buffer or start a new one, is
    received exactly, frame lengths and padding included. Fails if the copy out of
    the ring skips any byte of the buffer it hands over."""
    from zbus.ring import BufferPool, _exported, _uninitialized

    b = _uninitialized(BufferPool.MIN_BYTES)
    assert type(b) is bytearray and len(b) == BufferPool.MIN_BYTES
    view = memoryview(b)
    assert _exported(b)  # the reuse check works on it as on any bytearray
    view.release()
    assert not _exported(b)

    writer = RingWriter.create(1, RingGeometry(64 * 1024, 8))
    reader = RingReader.attach(writer.handle, 0)
    rng = random.Random(11)
    try:
        def roundtrip(frames: list[bytes]) -> list[memoryview]:
            t = threading.Thread(target=writer.send, args=(frames,), kwargs={"timeout": 10})
            t.start()
            got = reader.recv(timeout=10)
            t.join(10)
            return got

        kept = []
        for size in [300_000, 1_000_000, 2_500_000, 700_000, 1_000_000, 300_000, 2_000_000]:
            sent = [rng.randbytes(size), rng.randbytes(rng.randint(0, 100)), b"", rng.randbytes(size // 3)]
            got = roundtrip(sent)
            assert [bytes(f) for f in got] == sent
            if size != 700_000:
                kept.append(got)  # holds its buffer: the next message misses
            else:
                kept.clear()  # all free: the next ones reuse warm buffers
    finally:
        reader.close()
        writer.close()


# --- the reader's end, in this process -------------------------------------------


def test_a_message_cut_by_timeouts_on_both_ends_arrives_whole_and_a_cancel_stops_it():
    """A 4 KiB message through a 1 KiB ring: the writer's sends and the reader's
    receives time out in turn until it is through; each end keeps its part. Then a
    second message, cancelled mid-way. Sabotage: ``self._partial = None`` on a
    timeout (the rest read as a new message), ``out, got = None`` or
    ``self._partial = ""`` on resuming (the next recv breaks), the rest of a
    message read with no deadline (``_next_chunk(None, cancel)``: hangs) or no
    cancel (``_next_chunk(deadline, None)``: a TimeoutError after 5 s instead of
    Cancelled) → fails."""
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    payloads = [os.urandom(4096), os.urandom(4096)]
    try:
        with pytest.raises(TimeoutError):
            writer.send([b"head", payloads[0]], timeout=0.05)
        frames, reader_timeouts, writer_timeouts = None, 0, 0
        for _ in range(20):
            try:
                frames = reader.recv(timeout=0.05)
                break
            except TimeoutError:
                reader_timeouts += 1
            try:
                writer.flush(time.monotonic() + 0.05)
            except TimeoutError:
                writer_timeouts += 1
        assert frames is not None and reader_timeouts >= 3 and writer_timeouts >= 3
        assert [bytes(f) for f in frames] == [b"head", payloads[0]]

        with pytest.raises(TimeoutError):
            writer.send([payloads[1]], timeout=0.05)
        with pytest.raises(TimeoutError):
            reader.recv(timeout=0.05)  # a part read and kept
        cancel = threading.Event()
        cancel.set()
        t0 = time.monotonic()
        with pytest.raises(Cancelled, match="^recv cancelled$"):
            reader.recv(timeout=5, cancel=cancel)  # the next chunk is not there yet
        assert time.monotonic() - t0 < 2
        for _ in range(20):  # the cancelled message is still whole
            try:
                writer.flush(time.monotonic() + 0.05)
            except TimeoutError:
                pass
            try:
                frames = reader.recv(timeout=0.05)
                break
            except TimeoutError:
                pass
        assert [bytes(f) for f in frames] == [payloads[1]]
        writer.send([b"next"], timeout=1)
        assert [bytes(f) for f in reader.recv(timeout=1)] == [b"next"]
    finally:
        reader.close()
        writer.close()


def test_messages_of_many_frames_keep_every_frame_in_place():
    """Frames of all sizes (empty ones too) come back at their lengths and in order,
    each starting 64-byte aligned in the receive buffer. Sabotage: the frame lengths
    read from the start of the message (``struct.unpack_from(f"<{n}Q", out)``) →
    fails."""
    writer = RingWriter.create(1, RingGeometry(1024, 8))
    reader = RingReader.attach(writer.handle, 0)
    rng = random.Random(5)
    try:
        for n in (1, 2, 3, 7, 40):
            frames = [rng.randbytes(rng.choice([0, 1, 63, 64, 65, 300])) for _ in range(n)]
            writer.send(frames, timeout=5)
            got = reader.recv(timeout=5)
            assert [bytes(f) for f in got] == frames
            base = got[0].obj
            assert all(f.obj is base for f in got)
    finally:
        reader.close()
        writer.close()


def test_a_ring_closed_keeping_its_name_loses_it_when_closed_again():
    """A close that keeps the name (``unlink=False``), then one that asks for its
    removal: the name goes. Before, the second close returned at once and the name
    stayed; a CI run (pure Python) of the test below left one so, where a close
    from a timer thread and the test's own raced (the other outcome of that race:
    "operation forbidden on released memoryview", now serialised by a lock).
    Sabotage: ``return`` when unmapped already, first thing in ``RingWriter.close``
    (as before) -> the name is left."""
    writer = RingWriter.create(1, RingGeometry(256, 4))
    path = os.path.join(shm.SHM_DIR, writer.name)
    writer.close(unlink=False)
    assert os.path.exists(path)
    writer.close()
    assert not os.path.exists(path)
    ends = [threading.Thread(target=f) for f in (writer.end, writer.close)]  # (closed: nothing to do)
    for t in ends:
        t.start()
    for t in ends:
        t.join(5)


def test_refusals_of_attach_and_recv_say_what_and_which():
    """The errors name the end, the index and the ring. Sabotage: ``ValueError(None)``
    or ``handle.n_readers + 1`` in attach's range; the doorbell's role as None or
    its default (``this end``); ``"recv"`` changed or None in the waits;
    ``RingClosed(None)`` for a ring closed while waiting; the index not kept
    (``self.index = None``) → fails."""
    writer = RingWriter.create(2, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle.to_dict(), 1)  # as a handle travels: a dict
    try:
        assert reader.index == 1
        with pytest.raises(ValueError) as e:
            RingReader.attach(writer.handle, 2)
        assert str(e.value) == "reader index 2 out of range 0..1"
        with pytest.raises(OSError, match=r"is reader 1 of this ring attached twice\?$"):
            RingReader.attach(writer.handle, 1)
        with pytest.raises(TimeoutError) as e:
            reader.recv(timeout=0.05)
        assert str(e.value) == f"recv timed out on ring {writer.name}"
        threading.Timer(0.1, writer.close, kwargs={"unlink": False}).start()
        with pytest.raises(RingClosed) as e:
            reader.recv(timeout=5)
        assert str(e.value) == f"ring {reader.name} closed"
    finally:
        reader.close()
        writer.close()
        shm.unlink(writer.handle.name)


def test_a_segment_that_is_not_a_ring_is_refused():
    """Sabotage: the magic word not checked (``... != _MAGIC) and False``), or the
    reasons' text changed → fails."""
    from zbus.ring import RingHandle, segment_size

    geo = RingGeometry(256, 4)
    seg = shm.Segment.create(segment_size(geo, 1))  # zeros: no magic word
    try:
        handle = RingHandle(seg.name, seg.size, 1, geo.chunk_bytes, geo.n_chunks)
        with pytest.raises(RingClosed) as e:
            RingReader.attach(handle, 0)
        assert str(e.value) == f"segment {seg.name} is not a zbus ring"
    finally:
        seg.close()
        shm.unlink(seg.name)
    writer = RingWriter.create(2, geo)
    name = writer.handle.name
    RingReader.attach(writer.handle, 0).close()
    try:
        with pytest.raises(RingClosed) as e:
            RingReader.attach(writer.handle, 0)
        assert str(e.value) == f"segment {name} has reader 0 detached"
        writer.close(unlink=False)
        with pytest.raises(RingClosed) as e:
            RingReader.attach(writer.handle, 1)
        assert str(e.value) == f"segment {name} is closed"
    finally:
        writer.close()
        shm.unlink(writer.handle.name)


def test_each_end_waits_by_the_policy_it_was_given():
    """Sabotage: attach or ``__init__`` dropping the policy (``cls(seg, None, index)``,
    ``super().__init__(seg, None)``: the environment's instead), ``keep_polling``
    setting anything but the polling time; the spin loop's clock lost (``now =
    None``: only a policy that spins, as on more than 2 cores, runs it) → fails."""
    writer_policy, reader_policy = WaitPolicy(0.001, 0.002, 0.3), WaitPolicy(0.004, 0.005, 0.6)
    writer = RingWriter.create(1, RingGeometry(256, 4), writer_policy)
    reader = RingReader.attach(writer.handle, 0, reader_policy)
    try:
        assert writer._policy == writer_policy and reader._policy == reader_policy
        reader.keep_polling(0.25)
        assert reader._policy == WaitPolicy(0.004, 0.25, 0.6)
        reader.keep_polling(0.0)
        with pytest.raises(TimeoutError):  # spins, then sleeps, then times out
            reader.recv(timeout=0.05)
        for _ in range(4):
            writer.send([b"x"], timeout=1)
        with pytest.raises(TimeoutError):  # the writer spins on the full ring likewise
            writer.send([b"y"], timeout=0.05)
        assert bytes(reader.recv(timeout=1)[0]) == b"x"
    finally:
        reader.close()
        writer.close()


def test_buffer_pool_sizes_reuses_and_drops_its_buffers():
    """A receive buffer is a whole number of steps (256 KiB, or 1/16 of the size's
    power of two above that), reused for any message it fits once no view of it is
    left, and at most KEEP of them (KEEP_BYTES in all: one larger is not kept) are
    kept, the smallest dropped first. Before, the largest was always kept, a 2 GiB
    reply's buffer for the process's life. Sabotage: ``n <= MIN_BYTES`` (a
    256 KiB buffer not pooled); ``len(b) > n`` (an exact fit not reused), ``best =
    None``, ``_exported`` always True (nothing reused) or shrinking the buffer
    (``del b[-2:]``); the step ``1 >> ...``, ``2 << ...``, ``+ 4`` or ``- 5``;
    rounding ``n + step + 1`` or ``n + step - 2``; eviction with ``and``, ``>= KEEP``,
    ``>= KEEP_BYTES``, every buffer pooled (as before), or by content (``min(...)``
    with no ``key=len``) → fails."""
    from zbus.ring import BufferPool

    MIN = BufferPool.MIN_BYTES
    pool = BufferPool()
    assert len(pool.take(MIN - 1)) == MIN - 1 and pool._buffers == []  # small: not pooled
    for n, size in [(MIN, MIN), (MIN + 1, 2 * MIN), (2 * MIN, 2 * MIN), (16 * 2**20 + 1, 18 * 2**20),
                    (3 * 2**20 + 1, 3 * 2**20 + MIN)]:
        pool = BufferPool()
        view = pool.take(n)
        assert len(view) == n and len(view.obj) == size, (n, len(view.obj))
        del view
        again = pool.take(n)  # an exact fit, free again: the same buffer, whole
        assert len(again) == n and again.obj is pool._buffers[0] and len(pool._buffers[0]) == size
        assert pool.take(n).obj is not again.obj  # in use: a new one
        del again

    pool = BufferPool()
    pool.KEEP_BYTES = 10 * MIN
    held = [pool.take(k * MIN) for k in (4, 1, 3, 2)]  # all in use
    for v, fill in zip(held, (b"\x00", b"\xff", b"\x00", b"\x00")):
        v.obj[:] = fill * len(v.obj)  # content must not decide which is dropped
    del v
    assert sorted(map(len, pool._buffers)) == [MIN, 2 * MIN, 3 * MIN, 4 * MIN]  # 10 * MIN: kept
    held.append(pool.take(5 * MIN))  # a fifth: the smallest go (one for KEEP, two for KEEP_BYTES)
    assert sorted(map(len, pool._buffers)) == [4 * MIN, 5 * MIN]
    del held
    small = pool.take(MIN)  # one kept fits: reused, though larger
    assert small.obj is pool._buffers[0] and len(small.obj) == 4 * MIN
    big = pool.take(20 * MIN)  # larger than KEEP_BYTES alone: not kept
    assert len(big) == 20 * MIN and sorted(map(len, pool._buffers)) == [4 * MIN, 5 * MIN]


# --- the writer's end, in this process -------------------------------------------


def test_frames_are_laid_out_as_the_format_says():
    """``total | nframes | len * nframes | frames``, each frame 64-byte aligned, none
    overlapping. Sabotage: the header counted as ``17 + 8 n`` or ``16 + 9 n``, the
    alignment rounding ``+ _ALIGN + 1`` or ``- 2`` → fails."""
    from zbus.ring import _layout

    assert _layout([]) == ([], 16)
    assert _layout([5]) == ([64], 69)
    assert _layout([1, 0, 65, 64, 1, 1]) == ([64, 128, 128, 256, 320, 384], 385)
    assert _layout([0] * 6) == ([64] * 6, 64)  # a 64-byte header
    assert _layout([0] * 7) == ([128] * 7, 128)


def test_frames_of_any_buffer_format_and_shape_go_through_as_bytes():
    """bytes, bytearray, memoryviews of other formats and shapes, numpy arrays: each
    frame arrives as its bytes, in one chunk or streamed. Sabotage: a memoryview
    taken as it is when its format is not ``B`` (``!= "B"``, ``== "b"``) or it is
    not 1-D (``ndim != 1``, ``== 2``) → the copy into the ring fails."""
    import numpy as np

    writer = RingWriter.create(1, RingGeometry(1024, 4))
    reader = RingReader.attach(writer.handle, 0)
    try:
        for scale in (1, 64):  # in one chunk; streamed through the ring
            raw = os.urandom(12 * scale)
            frames = [raw, bytearray(raw), memoryview(raw), memoryview(raw).cast("b"),
                      memoryview(raw).cast("i"), memoryview(raw).cast("B", (3, 4 * scale)),
                      np.frombuffer(raw, np.int16).reshape(2, -1)]
            got: list = []
            t = threading.Thread(target=lambda got=got: got.append(reader.recv(timeout=10)))
            t.start()
            writer.send(frames, timeout=10)
            t.join(10)
            assert [bytes(f) for f in got[0]] == [raw] * len(frames)
    finally:
        reader.close()
        writer.close()


def test_a_long_message_without_a_timeout_streams_through():
    """Sabotage: a deadline computed from ``timeout=None`` (``(timeout is None) and
    False``) → a message longer than a chunk fails to send."""
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    payload = os.urandom(10_000)
    got = {}
    try:
        t = threading.Thread(target=lambda: got.setdefault("m", reader.recv(timeout=10)))
        t.start()
        writer.send([payload])
        t.join(10)
        assert [bytes(f) for f in got["m"]] == [payload]
    finally:
        reader.close()
        writer.close()


def test_detached_readers_do_not_hold_the_writer_and_live_ones_do():
    """Sabotage: the detached flag read from another word (``off // 4 - 3``,
    ``// 5``, ``+ 4``) → a detached reader holds the writer; ``break`` for
    ``continue`` → the readers after a detached one are forgotten and their chunks
    overwritten; with every reader detached, ``_min_read`` not the writer's own
    count (``(best is None) and False``) → sends fail."""
    writer = RingWriter.create(3, RingGeometry(256, 4))
    readers = [RingReader.attach(writer.handle, i) for i in range(3)]
    try:
        readers[0].close()
        for i in range(12):  # reader 0 gone: 1 and 2 keep up
            writer.send([b"%d" % i], timeout=1)
            for r in readers[1:]:
                assert bytes(r.recv(timeout=1)[0]) == b"%d" % i
        for i in range(4):  # reader 2 stops reading: the ring fills for it
            writer.send([b"x%d" % i], timeout=1)
            assert bytes(readers[1].recv(timeout=1)[0]) == b"x%d" % i
        with pytest.raises(TimeoutError):
            writer.send([b"over"], timeout=0.1)
        assert [bytes(readers[2].recv(timeout=1)[0]) for _ in range(4)] == [b"x0", b"x1", b"x2", b"x3"]
        readers[1].close()
        readers[2].close()
        for _ in range(12):  # no reader left: nothing holds the writer
            writer.send([b"y"], timeout=1)
    finally:
        for r in readers:
            r.close()
        writer.close()


def test_a_full_ring_wait_honours_timeout_cancel_and_on_full_and_says_what_was_queued():
    """Both waits of a send, for the space a message cut earlier still needs and for
    its own, end on the timeout (``SendTimeout`` saying whether it was queued),
    the cancel event (``Cancelled``), and run ``on_full`` while they wait.
    Sabotage: either flush without the deadline (hangs), the cancel (``None``, or
    arguments shifted) or ``on_full``; the flag ``queued`` None or swapped; the
    message ``None``, ``str(None)``, or the wait named other than ``send``; the
    pending message dropped after each chunk (``self._pending = None``) → fails."""
    from zbus.errors import SendTimeout

    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    name = writer.name
    fulls = []
    try:
        with pytest.raises(SendTimeout) as e:  # 8 chunks: 4 go in, then the ring is full
            writer.send([os.urandom(2000)], timeout=0.1, on_full=lambda: fulls.append(1))
        assert e.value.queued is True and str(e.value) == f"send timed out on ring {name}"
        assert fulls, "on_full did not run while the writer waited"

        fulls.clear()
        with pytest.raises(SendTimeout) as e:  # the cut message first: it cannot go on
            writer.send([b"next"], timeout=0.1, on_full=lambda: fulls.append(1))
        assert e.value.queued is False and str(e.value) == f"send timed out on ring {name}"
        assert fulls

        cancel = threading.Event()
        cancel.set()
        t0 = time.monotonic()
        with pytest.raises(Cancelled, match="^send cancelled$"):  # waiting for the cut one's room
            writer.send([b"next"], timeout=5, cancel=cancel)
        assert time.monotonic() - t0 < 2
        for _ in range(8):  # the reader drains; the cut message is finished
            try:
                writer.flush(time.monotonic() + 0.05)
            except TimeoutError:
                pass
            try:
                reader.recv(timeout=0.05)
                break
            except TimeoutError:
                pass
        t0 = time.monotonic()
        with pytest.raises(Cancelled, match="^send cancelled$"):  # waiting for its own room
            writer.send([os.urandom(2000)], timeout=5, cancel=cancel)
        assert time.monotonic() - t0 < 2
    finally:
        reader.close()
        writer.close()


def test_an_abort_ends_a_waiting_send_and_later_ones_and_says_so():
    """Sabotage: ``RingClosed(None)`` for either → fails."""
    writer = RingWriter.create(1, RingGeometry(256, 4))
    reader = RingReader.attach(writer.handle, 0)
    try:
        threading.Timer(0.1, reader.abort).start()
        with pytest.raises(RingClosed) as e:  # waiting on the full ring
            writer.send([os.urandom(2000)], timeout=5)
        assert str(e.value) == f"ring {writer.name} aborted"
        with pytest.raises(RingClosed) as e:
            writer.send([b"x"], timeout=1)
        assert str(e.value) == f"ring {writer.name} is closed"
    finally:
        reader.close()
        writer.close()


def test_the_segment_layout_puts_each_reader_on_its_cache_lines_and_data_on_a_page():
    """Sabotage: readers 65 bytes apart (``65 * r``), the data page rounded from
    ``end + 4096`` → fails."""
    from zbus.ring import _data_offset, _reader_off

    assert [_reader_off(r) for r in range(4)] == [192, 256, 320, 384]
    assert _data_offset(1) == 4096 and _data_offset(61) == 4096 and _data_offset(62) == 8192


def test_a_ring_made_by_its_owner_is_attached_by_a_writer_elsewhere():
    """The owner makes the ring (``ring.create``) and hands its handle, as a dict,
    to the writer and the readers (the executor's reply rings). Sabotage: no
    readers refused (the message changed), the handle's counts and sizes left out
    (``None``), ``RingWriter.attach`` dropping a dict handle or the policy, the
    writer's doorbell role (``None``, the default, changed) → fails."""
    from zbus import ring

    with pytest.raises(ValueError) as e:
        ring.create(0, RingGeometry(256, 4))
    assert str(e.value) == "a ring needs at least one reader"
    geo, policy = RingGeometry(256, 4), WaitPolicy(0.0, 0.001, 0.2)
    handle = ring.create(2, geo)
    try:
        assert handle == ring.RingHandle(handle.name, ring.segment_size(geo, 2), 2, 256, 4)
        writer = RingWriter.attach(handle.to_dict(), policy)
        try:
            assert writer.handle == handle and writer._policy == policy
            with pytest.raises(OSError, match=r"is the writer of this ring attached twice\?$"):
                RingWriter.attach(handle)
            readers = [RingReader.attach(handle.to_dict(), i) for i in range(2)]
            writer.send([b"hello"], timeout=1)
            assert [bytes(r.recv(timeout=1)[0]) for r in readers] == [b"hello", b"hello"]
            for r in readers:
                r.close()
        finally:
            writer.close(unlink=False)
    finally:
        shm.unlink(handle.name)


def test_waiting_flags_are_lowered_when_a_wait_ends():
    """A side raises its waiting flag only while it sleeps, so the other side rings
    its doorbell only then. Sabotage: the flag left raised (``i[flag] = 1`` when
    the wait ends) → fails."""
    from zbus import ring

    writer = RingWriter.create(1, RingGeometry(256, 2), WaitPolicy(0.0, 0.0, 0.5))
    reader = RingReader.attach(writer.handle, 0, WaitPolicy(0.0, 0.0, 0.5))
    try:
        threading.Timer(0.1, writer.send, args=([b"a"],)).start()
        assert bytes(reader.recv(timeout=5)[0]) == b"a"  # slept, then woken
        assert writer._i[writer._reader_flags[0]] == 0
        writer.send([b"b"], timeout=1)
        writer.send([b"c"], timeout=1)
        threading.Timer(0.1, reader.recv, kwargs={"timeout": 1}).start()
        writer.send([b"d"], timeout=5)  # slept on the full ring, then woken
        assert writer._i[ring._I_WWAIT] == 0
    finally:
        reader.close()
        writer.close()


def test_a_writer_that_fails_to_start_removes_the_ring_it_made():
    """Sabotage: ``shm.unlink(None)`` on the way out → the segment is left."""

    class Failing(RingWriter):
        def __init__(self, seg, policy):
            seg.close()
            raise OSError("no start")

    before = zbus_segments()
    with pytest.raises(OSError, match="no start"):
        Failing.create(1, RingGeometry(256, 4))
    assert own_segments(zbus_segments() - before) == set()


# --- lending readers: large messages decoded where they lie ---------------------------

LEND_GEO = RingGeometry(64 * 1024, 16)  # 1 MiB of ring in page-sized chunks


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of this process's mapping that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms, _, _, _, *path = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms, path[0] if path else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _mappings_of(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(name) for line in f)


def test_a_large_message_that_fits_is_lent_where_it_lies_in_the_ring():
    """A lending reader gets a message of 256 KiB or more that fits the ring as a
    private copy-on-write mapping of the segment itself (no copy), a wrapped one
    contiguous; a small one, or one larger than the ring, is copied as before. A
    write to a lent frame is private to that reader. The loan's mapping is gone
    once the next message is received and no view is left. Sabotage: no ``lend``
    path in ``recv`` -> the frame is in an anonymous buffer, not the segment;
    ``MAP_SHARED`` in ``shm.Loan`` -> refused on the reader's read-only
    descriptor, so the message is copied ("not lent"): no reader can write
    to the ring through a loan."""
    writer = RingWriter.create(2, LEND_GEO)
    lender = RingReader.attach(writer.handle, 0, lend=True)
    copier = RingReader.attach(writer.handle, 1)
    name, segment = writer.name, f"/dev/shm/{writer.name}"

    def exchange(payload: bytes) -> tuple[list, list]:
        # The writer and the copier in threads: the writer may need the lender's
        # last loan back (given at its next recv), and a message larger than the
        # ring streams only while both readers read.
        copied: list = []
        threads = [threading.Thread(target=writer.send, args=([b"meta", payload],), kwargs={"timeout": 10}),
                   threading.Thread(target=lambda: copied.append(copier.recv(timeout=10)))]
        for t in threads:
            t.start()
        try:
            return lender.recv(timeout=10), copied
        finally:
            for t in threads:
                t.join(10)

    try:
        base = _mappings_of(name)
        for size in (300_000, 700_000, 700_000):  # the third starts at chunk 16 of 16: it wraps
            payload = os.urandom(size)
            lent, (copied,) = exchange(payload)
            assert _mapping_of(_address(lent[1])) == ("rw-p", segment), "not lent"
            assert bytes(lent[1]) == payload == bytes(copied[1])
            lent[1][:4] = b"mine"  # private to this reader
            assert bytes(copied[1]) == payload
            assert _mappings_of(name) > base
            del lent, copied
        for size in (1000, 2 * 2**20):  # small; larger than the ring
            payload = os.urandom(size)
            got, (copied,) = exchange(payload)
            assert bytes(got[1]) == payload == bytes(copied[1])
            assert _mapping_of(_address(got[1]))[1] != segment, "lent, not copied"
            assert _mappings_of(name) == base, "the last loan's mapping is left"
            del got, copied
    finally:
        lender.close()
        copier.close()
        writer.close()


def test_lent_messages_of_every_size_arrive_whole_and_kept_views_keep_their_bytes():
    """Three reader processes, two lending (one keeping a view of every 3rd
    payload until the end), one copying, get 400 messages of mixed sizes
    (small, lent, wrapped, larger than the ring). Each counts and checks every
    message, and at the end each kept view again, after the ring has reused its
    chunks many times. Sabotage: in ``Loan.end`` unmap without the copy when a
    view is alive -> the keeping reader dies (SIGSEGV); keep the mapping without
    the copy -> ``kept_corrupted``; lend before the last chunk is published ->
    ``corrupted``; ring no reader waiting for a whole message (2) at a
    message's end -> a lending reader sleeps through it (no wait slice rescues
    it here): its recv times out."""
    writer = RingWriter.create(3, LEND_GEO)
    rng = random.Random(7)
    sizes = [rng.choice((100, 5000, 300_000, 500_000, 900_000, 1_500_000)) for _ in range(400)]
    payloads = [rng.randbytes(n) for n in sizes]
    readers = start_readers(writer, 3, lend=(1, 2), keep=(2,), keep_every=3, env=NO_RESCUE)
    results = send_and_collect(writer, readers, (make_message(i, p) for i, p in enumerate(payloads)))
    digest = hashlib.blake2b(b"".join(payloads)).hexdigest()
    assert counts(results) == [(400, 0, 0)] * 3
    assert [r["digest"] for r in results] == [digest] * 3
    lendable = sum(256 * 1024 <= n + 100 <= LEND_GEO.chunk_bytes * LEND_GEO.n_chunks for n in sizes)
    assert [r["lent"] for r in results] == [0, lendable, lendable]
    assert (results[2]["kept"], results[2]["kept_corrupted"]) == (134, 0)


def test_a_lent_message_not_yet_whole_honours_the_deadline_and_comes_whole_later():
    """The writer has published part of a message that fits the ring (a copying
    reader holds the rest of the ring) when its send times out. The lending
    reader's recv then times out within its deadline, and the next one returns
    the whole message once the writer finishes it. Sabotage: lend the message
    when its first chunk is published -> the bytes differ."""
    writer = RingWriter.create(2, LEND_GEO)
    lender = RingReader.attach(writer.handle, 0, lend=True)
    copier = RingReader.attach(writer.handle, 1)
    first, second = os.urandom(300_000), os.urandom(760_000)  # 5 and 12 of 16 chunks
    try:
        writer.send([first], timeout=10)
        assert bytes(lender.recv(timeout=10)[0]) == first
        with pytest.raises(TimeoutError) as e:
            writer.send([second], timeout=0.2)  # the copier has not read the first
        assert e.value.queued
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            lender.recv(timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 2.0
        assert bytes(copier.recv(timeout=10)[0]) == first
        writer.flush(time.monotonic() + 10)
        assert bytes(lender.recv(timeout=10)[0]) == second
        assert bytes(copier.recv(timeout=10)[0]) == second
    finally:
        lender.close()
        copier.close()
        writer.close()


def test_closing_a_lending_reader_gives_its_chunks_back_and_a_kept_view_its_bytes():
    """A lending reader closes while it holds a loan whose view is kept: the view
    keeps its bytes while the writer fills the ring again and again for the other
    reader. Sabotage: close without ending the loan -> the view's bytes change."""
    writer = RingWriter.create(2, LEND_GEO)
    lender = RingReader.attach(writer.handle, 0, lend=True)
    other = RingReader.attach(writer.handle, 1)
    payload = os.urandom(600_000)
    try:
        writer.send([payload], timeout=10)
        kept = lender.recv(timeout=10)[0]
        lender.close()
        assert bytes(other.recv(timeout=10)[0]) == payload
        for _ in range(8):
            writer.send([os.urandom(600_000)], timeout=10)  # would block if the loan were held
            other.recv(timeout=10)
        assert bytes(kept) == payload
    finally:
        lender.close()
        other.close()
        writer.close()


def test_copies_of_kept_views_are_unmapped_once_dropped():
    """A lending reader that keeps its last two messages' views, 60 times: each
    kept message gets a copy, whose mapping goes with its last view. This
    process's mappings do not grow with the messages. Sabotage: ``Loan.end``
    keeps its mmap object alive (``_kept.append(self._map)``) -> 60 mappings
    more."""
    writer = RingWriter.create(1, LEND_GEO)
    lender = RingReader.attach(writer.handle, 0, lend=True)
    lender.COPY_AFTER_KEPT = 0  # lend every message: each kept one is copied at the next recv

    def mappings() -> int:  # of a lent or copied message's size: 10 chunks
        with open("/proc/self/maps") as f:
            spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f]
        return sum(hi - lo == 10 * LEND_GEO.chunk_bytes for lo, hi in spans)

    payloads = [os.urandom(600_000) for _ in range(60)]
    kept: list = []
    try:
        before = mappings()
        for p in payloads:
            sender = threading.Thread(target=writer.send, args=([p],), kwargs={"timeout": 10})
            sender.start()
            frames = lender.recv(timeout=10)
            sender.join(10)
            kept = [*kept[-1:], frames[0]]
            del frames
        assert bytes(kept[0]) == payloads[-2] and bytes(kept[1]) == payloads[-1]
        kept.clear()
        assert mappings() - before <= 2, "mappings left by the copies of kept views"
    finally:
        lender.close()
        writer.close()


def test_a_reader_that_keeps_what_it_gets_copies_the_next_messages_then_lends_again():
    """A lent message kept past the next recv costs a copy made after the whole
    message was written; copying while the writer streams costs less. So the
    next ``COPY_AFTER_KEPT`` large messages are copied, then lending resumes.
    Sabotage: no ``_copy_instead`` set in ``_end_loan`` -> the second message
    is lent."""
    writer = RingWriter.create(1, LEND_GEO)
    lender = RingReader.attach(writer.handle, 0, lend=True)
    segment = f"/dev/shm/{writer.name}"
    lent = []
    kept = None
    try:
        for i in range(RingReader.COPY_AFTER_KEPT + 3):
            payload = os.urandom(300_000)
            sender = threading.Thread(target=writer.send, args=([payload],), kwargs={"timeout": 10})
            sender.start()
            frames = lender.recv(timeout=10)
            sender.join(10)
            assert bytes(frames[0]) == payload
            lent.append(_mapping_of(_address(frames[0]))[1] == segment)
            if i == 0:
                kept = frames[0]  # kept past the next recv
            del frames
        assert lent == [True] + [False] * RingReader.COPY_AFTER_KEPT + [True, True]
        assert kept is not None and len(kept) == 300_000
    finally:
        del kept
        lender.close()
        writer.close()


def test_a_kept_view_whose_copy_fails_keeps_its_chunks_and_is_copied_next_time():
    """A reader process keeps a lent 6 MiB message, then receives while the kernel
    cannot make its pages the reader's own (one is read-only: EINVAL, as ENOMEM
    would be): that recv fails with the OSError, the chunks stay held (the
    writer's next 12 MiB cannot get them: it times out), and the next recv makes
    the copy and gives them back: the kept view still holds its bytes, the second
    message arrives whole. Sabotage: in ``Loan.end`` forget the loan before the
    copy (``self._map = None`` first) -> the second recv gives the chunks back
    uncopied: the kept view reads the second message's bytes."""
    writer = RingWriter.create(1, RingGeometry(2**20, 16))
    proc = spawn_python("import sys, ring_procs; ring_procs.kept_loan_that_cannot_be_copied(sys.argv[1])",
                        json.dumps(writer.handle.to_dict()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True)
    try:
        writer.send([b"A" * (6 * 2**20)], timeout=10)
        assert json.loads(proc.stdout.readline()) == {"lent": True, "failed": 22}  # EINVAL
        with pytest.raises(TimeoutError):
            writer.send([b"B" * (12 * 2**20)], timeout=0.5)  # 13 chunks; 7 are still held
        proc.stdin.write("go\n")
        proc.stdin.flush()
        writer.flush(time.monotonic() + 30)
        assert json.loads(proc.stdout.readline()) == {"kept_intact": True, "kept": 6 * 2**20,
                                                       "second": ["B", 12 * 2**20]}
        assert proc.wait(30) == 0
    finally:
        end_process(proc)
        writer.close()


def test_a_kept_view_written_by_another_thread_while_it_is_copied_loses_no_write():
    """A thread writes, byte after byte, to a kept 48 MiB lent message while the
    reader's next recv makes its pages the reader's own. There
    the kernel copies each page at once (``MADV_POPULATE_WRITE``), so no write is
    lost. (A copy by ``memmove`` then moved into place by ``mremap`` lost
    tens of thousands: those made between the two.)"""
    writer = RingWriter.create(1, RingGeometry(2**20, 64))
    reader = RingReader.attach(writer.handle, 0, lend=True)
    try:
        writer.send([bytes(48 * 2**20)], timeout=10)
        kept = reader.recv(timeout=10)[0]
        started, stop, wrote = threading.Event(), threading.Event(), []

        def write() -> None:
            k = 0
            started.set()
            while not stop.is_set() and k < len(kept):
                kept[k] = 1
                k += 1
            wrote.append(k)

        thread = threading.Thread(target=write)
        thread.start()
        started.wait(10)
        time.sleep(0.005)
        with pytest.raises(TimeoutError):
            reader.recv(timeout=0.05)  # ends the loan: the copy, then nothing to receive
        stop.set()
        thread.join(10)
        n = wrote[0]
        assert 0 < n < len(kept)
        assert bytes(kept[:n]).count(b"\x01") == n, "writes lost between the copy and its move"
        kept.release()
    finally:
        reader.close()
        writer.close()


def test_a_process_forked_during_a_loan_keeps_the_lent_bytes():
    """A lending reader forks while it holds a lent message (as a worker's
    DataLoader would during a call). The parent then receives four more messages,
    which rewrite every chunk of the ring, before the child reads its inherited
    view: it still holds the first message. Sabotage: no ``os.register_at_fork``
    hook in ``zbus.shm`` -> the child reads later messages' bytes."""
    import select

    writer = RingWriter.create(1, LEND_GEO)
    lender = RingReader.attach(writer.handle, 0, lend=True)
    segment = f"/dev/shm/{writer.name}"
    payload = os.urandom(600_000)  # 10 of 16 chunks
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = 0
    try:
        writer.send([payload], timeout=10)
        view = lender.recv(timeout=10)[0]
        assert _mapping_of(_address(view))[1] == segment, "not lent"
        pid = os.fork()
        if pid == 0:  # the child: read the view once the ring has moved on
            try:
                os.read(go_r, 1)
                os.write(res_w, b"1" if bytes(view) == payload else b"0")
            finally:
                os._exit(0)
        del view
        for _ in range(4):
            later = [os.urandom(600_000)]
            sender = threading.Thread(target=writer.send, args=(later,), kwargs={"timeout": 10})
            sender.start()
            lender.recv(timeout=10)
            sender.join(10)
        os.write(go_w, b"g")
        assert select.select([res_r], [], [], 10)[0], "the forked child did not answer"
        assert os.read(res_r, 1) == b"1", "the forked child reads later messages' bytes"
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        for fd in (go_r, go_w, res_r, res_w):
            os.close(fd)
        lender.close()
        writer.close()


def test_a_kept_lent_message_costs_its_own_size_not_its_chunks():
    """A 300 000-byte message lent from 1 MiB chunks and kept past the next recv:
    the copy made for it is its pages (293 KiB), not its whole chunk (1 MiB).
    Sabotage: ``Loan.own`` populates ``self.size`` -> 1024 KiB of the mapping
    become anonymous."""
    writer = RingWriter.create(1, RingGeometry(2**20, 4))
    lender = RingReader.attach(writer.handle, 0, lend=True)
    payload = os.urandom(300_000)
    try:
        writer.send([payload], timeout=10)
        kept = lender.recv(timeout=10)[0]
        with pytest.raises(TimeoutError):
            lender.recv(timeout=0.01)  # ends the loan: the kept view gets its copy
        assert bytes(kept) == payload
        page = os.sysconf("SC_PAGE_SIZE")
        own_kib = -(-300_000 // page) * page // 1024
        assert _smaps_field(_address(kept), "Anonymous") == own_kib
        del kept
    finally:
        lender.close()
        writer.close()


def _smaps_field(address: int, field: str) -> int:
    """``field`` (kB) of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and head[0] == field + ":":
                return int(head[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_pages_made_private_for_a_fork_are_not_copied_again():
    """A reader forks during a lent message (its pages become its own, then are
    shared copy-on-write with the child); then the pages are asked to be its own
    again, as the next fork or the end of a kept loan asks: no copy is made, the
    pages stay shared with the child. Sabotage: no ``_owned`` check in
    ``Loan.own`` -> every page is copied again (Private_Dirty, not shared)."""
    writer = RingWriter.create(1, RingGeometry(2**20, 4))
    lender = RingReader.attach(writer.handle, 0, lend=True)
    go_r, go_w = os.pipe()
    pid = 0
    try:
        writer.send([os.urandom(300_000)], timeout=10)
        kept = lender.recv(timeout=10)[0]
        pid = os.fork()
        if pid == 0:  # the child holds the shared pages until told to end
            try:
                os.read(go_r, 1)
            finally:
                os._exit(0)
        lender._loan.own()  # as a second fork would
        page = os.sysconf("SC_PAGE_SIZE")
        own_kib = -(-300_000 // page) * page // 1024
        assert _smaps_field(_address(kept), "Shared_Dirty") == own_kib, "copied again"
        assert _smaps_field(_address(kept), "Private_Dirty") == 0
        del kept
    finally:
        os.write(go_w, b"g")
        if pid:
            os.waitpid(pid, 0)
        os.close(go_r)
        os.close(go_w)
        lender.close()
        writer.close()


class Interrupts:
    """SIGALRM at a random moment 0-``spread_s`` after ``arm()`` (a kernel timer:
    it lands wherever this process is, GIL held or not), whose handler raises
    KeyboardInterrupt, a Ctrl-C, in the main thread."""

    def __init__(self, spread_s: float) -> None:
        self.spread_s, self.armed, self.landed = spread_s, False, 0
        self._rng = random.Random(7)

    def __enter__(self) -> Interrupts:
        self._alarm = borrowed_alarm(self._handle)
        self._alarm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.armed = False
        self._alarm.__exit__(*exc)

    def _handle(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            self.landed += 1
            raise KeyboardInterrupt

    def arm(self) -> None:
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, self._rng.uniform(1e-5, self.spread_s))

    def disarm(self) -> None:
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)

    def run(self, action) -> None:
        """``action()`` with an interrupt armed: it may raise KeyboardInterrupt,
        which this lets out alone (never from outside the armed stretch)."""
        try:
            try:
                self.arm()
                action()
            finally:
                self.disarm()
        except KeyboardInterrupt:
            pass


def test_a_send_cut_short_by_ctrl_c_is_finished_whole_by_the_next_flush():
    """Ctrl-C lands in ``send`` while a message of 12 frames of 600 KB streams into
    a 1 MiB x 8 ring; the writer then flushes the rest (as the executor's completer
    does). Every message arrives whole and in order. Sabotage: pop the pieces from
    the pending list as they are copied (as before): the state a signal left was a
    piece short, the next flush shifted the bytes and then raised IndexError (every
    later send too); the reader got torn messages."""
    from ring_procs import many_frames

    writer = RingWriter.create(1, RingGeometry(2**20, 8))
    reader = spawn_python("import sys, ring_procs; ring_procs.frames_reader(sys.argv[1])",
                          json.dumps(writer.handle.to_dict()), stdout=subprocess.PIPE)
    try:
        with Interrupts(0.004) as interrupts:
            for index in range(100):
                frames, started = many_frames(index, 12, 600_000), writer.started
                interrupts.run(functools.partial(writer.send, frames, timeout=60))
                if writer.pending:
                    writer.flush(time.monotonic() + 60)
                elif writer.started == started:  # not begun: send it again
                    writer.send(frames, timeout=60)
        assert interrupts.landed >= 10, "few signals landed in a send: little was tested"
        result = collect(writer, [reader])[0]
        assert result == {"received": 100, "out_of_sequence": 0, "torn": 0}
    finally:
        end_process(reader)
        writer.close()


def test_a_ring_geometry_that_a_core_cannot_use_is_refused_when_made():
    """A geometry made in code is held to ``ZBUS_RING``'s rule: chunks of a multiple
    of 64 bytes, at least 256, and at least 2 of them. Before, only the variable was
    checked: ``RingGeometry(100, 4)`` made a ring whose chunks the compiled core
    refused as misaligned where the pure-Python one wrote them, and 0 chunks
    divided by zero. Sabotage: no ``RingGeometry.__post_init__`` -> none raises."""
    from zbus.errors import SettingError

    for chunk, count in [(100, 4), (200, 4), (128, 4), (256, 1), (256, 0)]:
        with pytest.raises(SettingError, match="multiple of 64 bytes >= 256 and count >= 2"):
            RingGeometry(chunk, count)
    assert RingGeometry(320, 2).n_chunks == 2


def test_a_send_whose_rest_cannot_be_copied_ends_the_ring_and_keeps_none_of_the_callers_bytes(monkeypatch):
    """A send times out on a full ring (its reader reads nothing) with its message
    begun, and copying the rest (so that the caller may change its buffer) fails:
    MemoryError here, a second Ctrl-C the same. The error goes on, the ring is
    aborted, and nothing of the caller's is kept: its reader gets no message, and
    no flush can send the bytes the caller writes since. Before, the rest still
    pointed into the caller's buffer, and the next flush streamed what it held
    then. Sabotage: keep ``self._pending`` as it was when the copy fails (no
    ``self._pending = None`` and ``abort()``) -> ``pending`` still, and not aborted."""
    writer = RingWriter.create(1, RingGeometry(256, 4), WaitPolicy(0, 0, 600))
    reader = RingReader.attach(writer.handle, 0, WaitPolicy(0, 0, 600))
    buf = bytearray(b"a" * 4096)
    try:
        def no_memory(*args):
            raise MemoryError
        monkeypatch.setattr(ring, "bytes", no_memory, raising=False)  # (the copy is its one use)
        with pytest.raises(MemoryError):
            writer.send([buf], timeout=0.05)
        monkeypatch.delattr(ring, "bytes")
        buf[:] = b"b" * 4096
        assert writer.aborted and not writer.pending
        writer.flush(time.monotonic() + 1)  # (nothing left to send)
        with pytest.raises(zbus.RingClosed):
            reader.recv(timeout=5)
        with pytest.raises(zbus.RingClosed):
            writer.send([b"next"], timeout=1)
    finally:
        reader.close()
        writer.close()
    assert writer.aborted is False  # (closed here: nothing of it is read any more)


def test_a_message_whose_frames_fill_the_message_limit_is_read_whole(monkeypatch):
    """Frames of exactly ``ZBUS_MAX_MESSAGE`` (1 MiB here) in three parts take more
    in the ring (its header, each frame's padding): streamed through a ring of
    256 KiB, the message is read whole. Sabotage: a size over the limit taken for
    corrupt (``total > codec.MAX_MESSAGE`` with the bound on 2**62, as a version
    of the skip of a message no buffer can hold did) -> CodecError, and the rest
    read as messages."""
    monkeypatch.setattr(codec, "MAX_MESSAGE", 2**20)
    writer = RingWriter.create(1, RingGeometry(65536, 4), WaitPolicy(0, 0, 600))
    reader = RingReader.attach(writer.handle, 0, WaitPolicy(0, 0, 600))
    frames = [b"a" * 100, b"b" * (2**20 - 200), b"c" * 100]
    got: list = []
    receiver = threading.Thread(target=lambda: got.extend(bytes(f) for f in reader.recv(timeout=30)))
    receiver.start()
    try:
        writer.send(frames, timeout=30)
        receiver.join(30)
        assert got == frames
    finally:
        receiver.join(30)
        reader.close()
        writer.close()


def test_a_segment_name_made_first_by_another_process_does_not_stop_a_ring():
    """A segment's name is known from /proc but for a random part: another local
    user who creates the next names of this process first cannot make the ring's
    creation fail. Sabotage: ``new_name`` without its random part (as before) ->
    FileExistsError."""
    n, pid = next(shm._counter), os.getpid()
    mine = f"{shm.PREFIX}{shm._pid_namespace()}-{pid}-{shm._start_time(pid)}"
    taken = [f"{mine}-{k}" for k in range(n + 1, n + 20)]
    try:
        for name in taken:
            with open(os.path.join(shm.SHM_DIR, name), "x"):
                pass
        writer = RingWriter.create(1, RingGeometry(4096, 4), WaitPolicy(0, 0, 600))
        writer.close()
    finally:
        for name in taken:
            shm.unlink(name)


def test_a_message_a_reader_has_no_memory_for_is_skipped_whole():
    """A message of 5 chunks whose buffer the reader cannot have (MemoryError: a
    limit on the process's memory) fails that receive, saying so, and the next
    receive gets the next message. Before, one chunk was dropped as corrupt and
    the next 4 were read as messages of their own: garbage, errors, or a reply to
    the wrong call. Sabotage: ``MemoryError`` back among the sizes no message has
    (``_dropped``) -> the message is dropped as a corrupt chunk, not skipped."""
    writer = RingWriter.create(1, RingGeometry(65536, 16), WaitPolicy(0, 0, 600))
    reader = RingReader.attach(writer.handle, 0, WaitPolicy(0, 0, 600))
    take = reader._pool.take

    def no_memory(n):
        if n >= BufferPool.MIN_BYTES:
            raise MemoryError
        return take(n)
    try:
        writer.send([b"x" * 300_000], timeout=5)
        writer.send([b"next", b"one"], timeout=5)
        reader._pool.take = no_memory
        with pytest.raises(zbus.CodecError, match=r"a message of 3000\d\d bytes dropped: no memory for it"):
            reader.recv(timeout=5)
        assert [bytes(f) for f in reader.recv(timeout=5)] == [b"next", b"one"]
        reader._pool.take = take
        writer.send([b"y" * 300_000], timeout=5)
        assert [bytes(f) for f in reader.recv(timeout=5)] == [b"y" * 300_000]
    finally:
        reader.close()
        writer.close()


def test_a_ctrl_c_as_a_message_is_announced_leaves_no_reader_asleep(monkeypatch):
    """A Ctrl-C lands in ``send`` once the message is published, before the reader
    asleep waiting for it is rung: the writer says it has something pending, and
    its next ``flush`` (the executor's completer flushes a pending ring) rings the
    reader, which gets the message at once though its sleep would last 30 s. Before,
    the published count said nothing was pending, no flush rang, and the reader
    slept until its timeout's end (its slice, 0.5 s by default, up to an hour).
    Sabotage: ``pending`` and ``flush`` compare the published count again (drop
    ``_announced``) -> ``pending`` is False and the receive takes 30 s."""
    writer = RingWriter.create(1, RingGeometry(2**16, 4), WaitPolicy(0, 0, 600))
    reader = RingReader.attach(writer.handle, 0, WaitPolicy(0, 0, 600))
    got: list = []
    receiving = threading.Thread(target=lambda: got.append((reader.recv(timeout=30), time.monotonic())))
    receiving.start()
    try:
        wait_until(lambda: writer._i[writer._reader_flags[0]] == 1, 10, "the reader asleep")
        bell, ring_bell = writer._reader_bells[0], writer._reader_bells[0].ring

        def ctrl_c_at_the_bell():  # a signal handled as ring() is entered
            monkeypatch.setattr(bell, "ring", ring_bell)
            raise KeyboardInterrupt
        monkeypatch.setattr(bell, "ring", ctrl_c_at_the_bell)
        with pytest.raises(KeyboardInterrupt):
            writer.send([b"call"], timeout=5)
        assert writer.pending
        flushed = time.monotonic()
        writer.flush(time.monotonic() + 5)
        receiving.join(30)
        assert [bytes(f) for f in got[0][0]] == [b"call"]
        assert got[0][1] - flushed < 5, "the reader slept on"
        assert not writer.pending
    finally:
        receiving.join(35)
        reader.close()
        writer.close()


def test_a_ctrl_c_as_a_streamed_message_is_all_written_comes_out_as_itself():
    """A Ctrl-C that lands as ``send``'s flush of a streamed message returns, the
    message all written, comes out as KeyboardInterrupt and leaves nothing
    pending. Before, ``send`` read the pending state the flush had just cleared:
    TypeError, in place of the Ctrl-C. Sabotage: no ``if self._pending is None``
    in ``RingWriter.send``'s handler -> TypeError."""
    writer = RingWriter.create(1, RingGeometry(2**20, 8))
    flushes, flush = [], writer.flush

    def flush_then_ctrl_c(*args, **kwargs):  # (the first flush finds nothing pending)
        flush(*args, **kwargs)
        flushes.append(1)
        if len(flushes) == 2:
            raise KeyboardInterrupt
    writer.flush = flush_then_ctrl_c
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.send([bytes(3 * 2**20)], timeout=10)
        assert len(flushes) == 2 and not writer.pending
    finally:
        writer.close()


def test_a_receive_cut_short_by_ctrl_c_carries_on_where_it_stopped():
    """Ctrl-C lands in ``recv`` while messages of 3 frames of 1.5 MB stream out of a
    1 MiB x 8 ring; the reader receives again. Every message comes whole and in
    order. Sabotage: keep the part read only on a deadline or a cancel (as before):
    the next ``recv`` began in the middle of a message (ValueError, MemoryError, or
    a torn message)."""
    from ring_procs import END, check_joined

    handle = ring.create(1, RingGeometry(2**20, 8))
    reader = RingReader.attach(handle, 0)
    writer = spawn_python("import sys, ring_procs; ring_procs.frames_writer(sys.argv[1], 100, 3, 1_500_000)",
                          json.dumps(handle.to_dict()))
    got: list = []
    try:
        with Interrupts(0.002) as interrupts:
            for _ in range(1000):  # bounded: 101 messages, each interrupted a few times at most
                received: list = []
                interrupts.run(lambda got=received: got.append(reader.recv(timeout=60)))
                if not received:
                    continue
                index, intact = check_joined(received[0])
                if index == END:
                    break
                got.append((index, intact))
        assert interrupts.landed >= 10, "few signals landed in a receive: little was tested"
        assert got == [(i, True) for i in range(100)]
        assert writer.wait(30) == 0
    finally:
        end_process(writer)
        reader.close()
        shm.unlink(handle.name)
