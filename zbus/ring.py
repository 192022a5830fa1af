"""A shared-memory broadcast ring: one writer, N readers in other processes.

Every reader sees every message, in order. A message is a list of byte frames; it
is streamed through fixed-size chunks, so a message may be larger than the ring
and never leaves shared memory. The writer blocks while the slowest reader is a
full ring behind: nothing is dropped or overwritten.

Layout (little-endian; each independently written word on its own cache line)::

    0              magic u64, n_readers u32, n_chunks u32, chunk_bytes u64,
                   token u64 (random: names the doorbells, known only to processes
                   that can open the segment)
    64             write_seq u64        chunks published so far (readers wait on it)
    128            writer_waiting u32, state u32 (only ever set to aborted, by
                   anyone), closed u32 (set by the writer: a word of its own, so a
                   close never overwrites a concurrent abort)
    192 + 64*r     read_seq[r] u64      chunks reader r has released (the writer waits on it)
                   reader_waiting[r] u32, detached[r] u32
    data           n_chunks * chunk_bytes, chunk s lives at (s % n_chunks)

Protocol (see docs/architecture.md for why it is safe):

- Single writer per word: write_seq and writer_waiting are written only by the
  writer; read_seq[r], reader_waiting[r], detached[r] only by reader r. No
  read-modify-write atomics are needed, only ordered loads and stores.
- Publish: copy data into chunk s, fence, write_seq = s + 1, fence, then wake the
  readers whose reader_waiting is 1, and at a message's last chunk those whose
  reader_waiting is 2 as well (a lending reader waits for whole messages only).
- Consume: see write_seq > s, fence, copy chunk s out, fence, read_seq[r] = s + 1,
  fence, then wake the writer if writer_waiting is set.
- Park (either side): set own waiting flag, fence, re-check the condition, then
  sleep on own doorbell (:class:`zbus.shm.Doorbell`). The fences order
  flag-store before counter-load on both sides (Dekker), so either the waiter
  sees the new counter or the publisher sees the flag and rings; and a ring is a
  queued datagram, so one that lands between the check and the sleep ends the
  sleep at once: no wake-up is lost.

A message's byte stream is ``total u64 | nframes u64 | len u64 * nframes | frames``,
each frame starting 64-byte aligned.

A reader attached with ``lend`` does not copy a large message that fits the ring:
it maps the message's chunks privately (copy-on-write) and holds them until its
next receive; see :meth:`RingReader.recv` and :class:`zbus.shm.Loan`.

The steps of every message (write one that fits a chunk, read it, publish a counter
between fences, poll before sleeping) run in the compiled core ``zbus._core`` where
it is built, else in their Python twins below, which do the same byte for byte;
``CORE`` says which. ``ZBUS_PURE_PYTHON=1`` forces the Python steps.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import threading
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, Callable, Sequence

from . import codec, shm
from .config import RingGeometry, WaitPolicy
from .errors import Cancelled, CodecError, RingClosed, SendTimeout

Buffer = Any  # bytes, bytearray, memoryview, or anything with the buffer protocol

log = logging.getLogger(__name__)

_MAGIC = int.from_bytes(b"ZBUSRNG1", "little")
_ABORTED = 2  # the state word: 0 until aborted
# u64 word indices
_W_MAGIC, _W_CHUNK, _W_TOKEN, _W_WSEQ = 0, 2, 3, 8
# u32 word indices
_I_NREADERS, _I_NCHUNKS, _I_WWAIT, _I_STATE, _I_CLOSED = 2, 3, 32, 33, 34
_READER_BASE = 192


def deadline_of(timeout: float | None) -> float | None:
    """When ``timeout`` seconds from now are over: None for no limit (None, or more
    than any wait takes: ``inf``); ValueError for NaN, which no clock reaches."""
    if timeout is None or timeout >= threading.TIMEOUT_MAX:  # (a lock's wait refuses more)
        return None
    if timeout != timeout:
        raise ValueError("a timeout of NaN seconds")
    return time.monotonic() + timeout


_core = shm.core
CORE = "compiled" if _core is not None else "python"


def _reader_off(r: int) -> int:
    return _READER_BASE + 64 * r


_PAGE = max(4096, mmap.PAGESIZE)  # data on a page of its own: lent chunks map from it
# What a message may take in a ring beyond its frames' bytes (its header, and for each
# of up to codec's 2**20 frames 8 bytes of length and up to 63 of padding): a size
# further over ZBUS_MAX_MESSAGE that no buffer can hold is a stray write's, not a
# message to read past.
MESSAGE_LAYOUT_SLACK = 16 + 71 * codec._MAX_FRAMES


def _data_offset(n_readers: int) -> int:
    end = _reader_off(n_readers)
    return (end + _PAGE - 1) // _PAGE * _PAGE


def segment_size(geometry: RingGeometry, n_readers: int) -> int:
    return _data_offset(n_readers) + geometry.chunk_bytes * geometry.n_chunks


@dataclass(frozen=True)
class RingHandle:
    """Plain data that lets another process attach: pass it as a dict."""

    name: str
    size: int
    n_readers: int
    chunk_bytes: int
    n_chunks: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RingHandle:
        return cls(**d)


def create(n_readers: int, geometry: RingGeometry | None = None) -> RingHandle:
    """Create an empty ring owned by this process, for a writer and readers to attach
    to; the owner removes it with ``shm.unlink(handle.name)``."""
    geometry = geometry or RingGeometry.from_env()
    if n_readers < 1:
        raise ValueError("a ring needs at least one reader")
    seg = shm.Segment.create(segment_size(geometry, n_readers))
    q, i = seg.buf.cast("Q"), seg.buf.cast("I")
    q[_W_MAGIC] = _MAGIC
    i[_I_NREADERS], i[_I_NCHUNKS] = n_readers, geometry.n_chunks
    q[_W_CHUNK] = geometry.chunk_bytes
    q[_W_TOKEN] = int.from_bytes(os.urandom(8), "little")
    q.release()
    i.release()
    seg.close()
    return RingHandle(seg.name, seg.size, n_readers, geometry.chunk_bytes, geometry.n_chunks)


class _Ring:
    """State shared by the two ends: the mapping and word accessors."""

    def __init__(self, seg: shm.Segment, policy: WaitPolicy | None):
        self._seg = seg
        self._q = seg.buf.cast("Q")
        self._i = seg.buf.cast("I")
        self.n_readers = self._i[_I_NREADERS]
        self.n_chunks = self._i[_I_NCHUNKS]
        self.chunk_bytes = self._q[_W_CHUNK]
        self._data = _data_offset(self.n_readers)
        self._policy = policy or WaitPolicy.from_env()
        self.handle = RingHandle(seg.name, seg.size, self.n_readers, self.chunk_bytes, self.n_chunks)
        self._bell_prefix = f"zbus-{self._q[_W_TOKEN]:016x}/"
        self._writer_bell = shm.Ringer(shm.bell_address(self._bell_prefix + "w"))
        self._reader_bells = [shm.Ringer(shm.bell_address(f"{self._bell_prefix}r{r}"))
                              for r in range(self.n_readers)]
        self._bell: shm.Doorbell | None = None

    def keep_polling(self, seconds: float) -> None:
        """After each message, poll (yielding the core) this long before sleeping:
        for callers whose next message comes within that time (an engine's steps)."""
        self._policy = replace(self._policy, yield_s=seconds)

    @property
    def name(self) -> str:
        return self._seg.name

    def _chunk(self, seq: int) -> int:
        return self._data + (seq % self.n_chunks) * self.chunk_bytes

    def _raise_if_aborted(self) -> None:
        if self._i[_I_STATE]:  # (any value but 0, as the compiled poll reads it)
            raise RingClosed(f"ring {self.name} aborted")

    def abort(self) -> None:
        """Mark the ring dead and wake every waiter on it (any process may call this:
        used when a peer died). Blocked and later calls raise :class:`RingClosed`."""
        self._i[_I_STATE] = _ABORTED
        _fence()
        self._wake_all()

    @property
    def aborted(self) -> bool:
        """Whether the ring was aborted (by any process); False once closed here."""
        return self._seg._mmap is not None and bool(self._i[_I_STATE])

    def _ended(self) -> bool:
        return bool(self._i[_I_CLOSED] or self._i[_I_STATE])

    def _wake_all(self) -> None:
        self._writer_bell.ring()
        for bell in self._reader_bells:
            bell.ring()

    def _wait(self, ready: Callable[[], bool], flag: int, deadline: float | None, cancel: Any,
              what: str, on_full: Callable[[], None] | None = None,
              poll: Callable[[float, float], bool] | None = None, raised: int = 1) -> None:
        """Wait until ``ready()``: spin, yield (``poll``, which checks the same), then
        sleep on our doorbell with our waiting flag (u32 index ``flag``) set to
        ``raised`` (a reader: 1, wake me at each chunk; 2, only at a message's end)."""
        pol = self._policy
        spin, yld = pol.spin_s, pol.yield_s
        if deadline is not None:  # a poll of up to MAX_POLL_S must not outlast the deadline
            left = max(0.0, deadline - time.monotonic())
            spin = min(spin, left)
            yld = min(yld, left - spin)
        if (poll or partial(_poll, ready))(spin, yld):
            return
        i = self._i
        try:
            while True:
                if on_full is not None:
                    on_full()
                i[flag] = raised
                _fence()
                if ready():
                    return
                self._raise_if_aborted()  # only when nothing is left to read or write
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"{what} cancelled")
                wait = pol.slice_s
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{what} timed out on ring {self.name}")
                    wait = min(wait, left)
                self._bell.wait(wait)
        finally:
            i[flag] = 0

    def _open_bells(self, name: str, role: str, ringers: list[shm.Ringer]) -> None:
        """Bind our doorbell and make the sockets of those we ring; on failure close
        the mapping (nothing of this end is left)."""
        try:
            self._bell = shm.Doorbell(name, role)
            for ringer in ringers:
                ringer.connect()
        except BaseException:
            self._close_mapping()
            raise

    def _close_mapping(self) -> None:
        if self._bell is not None:
            self._bell.close()
        for bell in (self._writer_bell, *self._reader_bells):
            bell.close()
        self._q.release()
        self._i.release()
        self._seg.close()


class RingWriter(_Ring):
    """The writing end. Create with :meth:`create`; the writer owns the segment."""

    @classmethod
    def create(cls, n_readers: int, geometry: RingGeometry | None = None,
               policy: WaitPolicy | None = None) -> RingWriter:
        """Create a ring (this process owns its segment) and be its writer."""
        handle = create(n_readers, geometry)
        try:
            return cls.attach(handle, policy)
        except BaseException:
            shm.unlink(handle.name)
            raise

    @classmethod
    def attach(cls, handle: RingHandle | dict, policy: WaitPolicy | None = None) -> RingWriter:
        """Become the writer of a ring another process created (it stays the owner)."""
        if isinstance(handle, dict):
            handle = RingHandle.from_dict(handle)
        return cls(shm.Segment.attach(handle.name, handle.size), policy)

    def __init__(self, seg: shm.Segment, policy: WaitPolicy | None):
        super().__init__(seg, policy)
        self._seq = self._announced = self._q[_W_WSEQ]  # (announced: its waiting readers rung)
        # A message begun, not all written: its pieces, where the next chunk starts
        # (piece index, offset in it) and the bytes left.
        self._pending: tuple[list[memoryview], int, int, int] | None = None
        self.started = 0  # messages begun: each is finished, whatever cuts its send short
        self._min_read = 0
        self._reader_flags = [(_reader_off(r) + 8) // 4 for r in range(self.n_readers)]
        self._buf = seg.buf
        self._closing = threading.RLock()  # (end and close from two threads: a released view)
        self._open_bells(self._bell_prefix + "w", "the writer", self._reader_bells)

    def _refresh_min_read(self) -> int:
        q, i = self._q, self._i
        best = None
        for r in range(self.n_readers):
            off = _reader_off(r)
            if i[off // 4 + 3]:  # detached
                continue
            v = q[off // 8]
            if best is None or v < best:
                best = v
        self._min_read = self._seq if best is None else best
        return self._min_read

    def _has_space(self) -> bool:
        return self._seq - self._refresh_min_read() < self.n_chunks

    def send(self, frames: Sequence[Buffer], timeout: float | None = None, cancel: Any = None,
             on_full: Callable[[], None] | None = None) -> None:
        """Publish one message made of ``frames`` to every reader. A frame may be
        given as a tuple of buffers: its parts, written back to back.

        Blocks while the ring is full, at most ``timeout`` seconds, then raises
        :class:`~zbus.errors.SendTimeout` (a TimeoutError; ``queued`` says whether
        this message was started). A message cut short that way stays pending: it is
        finished (before anything else) by the next ``send`` or :meth:`flush`, so
        readers never see a torn message. ``on_full`` runs each time the writer is
        about to sleep on a full ring (the executor drains replies there). The
        frames are copied into shared memory before this returns.
        """
        if self._ended():
            raise RingClosed(f"ring {self.name} is closed")
        if type(frames) is not list:
            frames = list(frames)
        if self._pending is None and (self._seq - self._min_read < self.n_chunks or self._has_space()):
            # most calls: the message fits one free chunk and is written straight into it
            if _write_message(self._buf, self._chunk(self._seq), frames, self.chunk_bytes) >= 0:
                self._seq, self.started = self._seq + 1, self.started + 1  # (together: see flush)
                self._announce(whole=True)
                return
        views, lens, offsets, total = _views_and_layout(frames)
        deadline = deadline_of(timeout)
        try:
            self.flush(deadline, cancel, on_full)
        except TimeoutError as e:
            raise SendTimeout(str(e), queued=False) from None
        header = struct.pack(f"<{len(views) + 2}Q", total, len(views), *lens)
        pieces: list[memoryview] = []
        at = 0
        for view, off, n in zip([memoryview(header), *views], [0, *offsets], [len(header), *lens]):
            if off > at:
                pieces.append(memoryview(_PAD)[:off - at])
            pieces.extend(p for p in (view if type(view) is tuple else (view,)) if p.nbytes)
            at = off + n
        self._pending, self.started = (pieces, 0, 0, total), self.started + 1  # (together: see flush)
        try:
            self.flush(deadline, cancel, on_full)
        except BaseException as e:
            if self._pending is None:  # all written: the signal landed as the flush returned
                raise
            # The rest goes later: copy it now, the caller may change its buffers.
            pieces, i, off, left = self._pending
            rest = [pieces[i][off:], *pieces[i + 1:]] if i < len(pieces) else []
            self._pending = None  # (never the caller's buffers, whatever cuts the copy short)
            try:
                rest = [memoryview(bytes(p)) for p in rest if p.nbytes]
            except BaseException:  # no memory for it, a second Ctrl-C: it cannot be finished, and
                self.abort()  # its readers see the ring end, never bytes the caller wrote since
                raise
            self._pending = (rest, 0, 0, left)
            if isinstance(e, TimeoutError):
                raise SendTimeout(str(e), queued=True) from None
            raise

    @property
    def pending(self) -> bool:
        """Whether a message an earlier ``send`` began waits for :meth:`flush` (its
        rest, or its announce, which an exception such as Ctrl-C cut short)."""
        return self._pending is not None or (self._seg._mmap is not None and self._announced != self._seq)

    def flush(self, deadline: float | None = None, cancel: Any = None,
              on_full: Callable[[], None] | None = None) -> None:
        """Finish streaming a message that an earlier ``send`` left pending."""
        if self._pending is None or not self._pending[3]:
            if self._announced != self._seq:  # written, its announce cut short (Ctrl-C)
                self._announce(whole=True)
            self._pending = None
            return
        buf, cb = self._buf, self.chunk_bytes
        while self._pending[3]:
            if self._seq - self._min_read >= self.n_chunks and not self._has_space():
                self._wait(self._has_space, _I_WWAIT, deadline, cancel, "send", on_full)
            pieces, i, off, left = self._pending
            pos, room = self._chunk(self._seq), min(cb, left)
            end = pos + room
            while pos < end:
                take = min(end - pos, pieces[i].nbytes - off)
                buf[pos:pos + take] = pieces[i][off:off + take]
                pos, off = pos + take, off + take
                if off == pieces[i].nbytes:
                    i, off = i + 1, 0
            # What is written and the chunk it is in move together (no call, no jump
            # between them): an exception raised in the copy above (Ctrl-C) leaves
            # both as they were, and the next flush writes this chunk again.
            self._pending, self._seq = (pieces, i, off, left - room), self._seq + 1
            self._announce(whole=left == room)
        self._pending = None

    def free_chunk(self) -> int | None:
        """The byte offset in :attr:`mapping` where the next message may be written
        straight, in at most ``chunk_bytes`` (the relay writes a call there from its
        socket), when a chunk is free and no message is pending; publish it with
        :meth:`publish_written`. None otherwise: use :meth:`send`."""
        if self._pending is None and not self._ended() and (
                self._seq - self._min_read < self.n_chunks or self._has_space()):
            return self._chunk(self._seq)
        return None

    @property
    def mapping(self) -> memoryview:
        return self._buf

    def publish_written(self) -> None:
        """Publish the message written at :meth:`free_chunk`."""
        self._publish()

    def _publish(self) -> None:
        self._seq += 1
        self._announce(whole=True)

    def _announce(self, whole: bool) -> None:
        """Publish the chunks written so far; ``whole``: they end a message."""
        _store(self._q, _W_WSEQ, self._seq)
        i = self._i
        for r, f in enumerate(self._reader_flags):
            waiting = i[f]  # 2: a reader waiting for a whole message, not for each chunk
            if waiting == 1 or (waiting and whole):
                self._reader_bells[r].ring()
        self._announced = self._seq  # (a Ctrl-C before here: the next flush rings again)

    def end(self) -> None:
        """Tell readers no more messages come: they read what is there, then get
        RingClosed. (The mapping stays: :meth:`close` unmaps it.)"""
        with self._closing:
            if self._seg._mmap is None:
                return
            self._i[_I_CLOSED] = 1  # never the state word: an abort there must stay
            _fence()
            self._wake_all()

    def close(self, unlink: bool = True) -> None:
        """Tell readers no more messages come (they drain, then get RingClosed),
        unmap, and remove the segment's name (also when an earlier close kept it).
        Any thread may call it, and :meth:`end`, at once: one unmaps, the others
        see it done."""
        with self._closing:
            if self._seg._mmap is not None:
                self.end()
                self._close_mapping()
        if unlink:
            self._seg.unlink()


class RingReader(_Ring):
    """Reader ``index`` of a ring, attached through its handle."""

    COPY_AFTER_KEPT = 8  # a lent message kept past the next recv: copy this many, then lend again

    @classmethod
    def attach(cls, handle: RingHandle | dict, index: int, policy: WaitPolicy | None = None,
               lend: bool = False) -> RingReader:
        """``lend``: decode large messages where they lie in the ring (see :meth:`recv`)."""
        if isinstance(handle, dict):
            handle = RingHandle.from_dict(handle)
        if not 0 <= index < handle.n_readers:
            raise ValueError(f"reader index {index} out of range 0..{handle.n_readers - 1}")
        seg = shm.Segment.attach(handle.name, handle.size)
        return cls(seg, policy, index, lend)

    def __init__(self, seg: shm.Segment, policy: WaitPolicy | None, index: int = 0, lend: bool = False):
        super().__init__(seg, policy)
        off = _reader_off(index)
        # A detached reader's chunks are the writer's to overwrite at once, and a
        # closed ring is being removed: attaching to either would read garbage.
        why = ("is not a zbus ring" if self._q[_W_MAGIC] != _MAGIC else
               f"has reader {index} detached" if self._i[off // 4 + 3] else
               "is closed" if self._i[_I_CLOSED] else None)
        if why:
            self._close_mapping()
            raise RingClosed(f"segment {seg.name} {why}")
        self.index = index
        self._rseq_w = off // 8
        self._flag = off // 4 + 2
        self._detached = off // 4 + 3
        self._pos = self._q[self._rseq_w]
        # a long message, as far as it is read: (its buffer, None where it is skipped; bytes read; size)
        self._partial: tuple[memoryview | None, int, int] | None = None
        self._taken: list[memoryview] | None = None  # a small one read, its release cut short
        self._pool = BufferPool()
        self._buf = seg.buf
        self._open_bells(f"{self._bell_prefix}r{index}", f"reader {index}", [self._writer_bell])
        self._poll = self._poll_core if _core is not None else None
        self._loan: shm.Loan | None = None
        self._copy_instead = 0  # large messages to copy before lending again
        self._fd: int | None = None  # the segment, for loans: only where pages align with chunks
        if lend and (self._data | self.chunk_bytes) % mmap.PAGESIZE == 0 and shm.can_lend():
            try:
                self._fd = os.open(os.path.join(shm.SHM_DIR, seg.name), os.O_RDONLY)
            except OSError as e:
                log.warning("ring %s: cannot open it to lend messages (%s); copying them", self.name, e)

    def _has_data(self) -> bool:
        return self._q[_W_WSEQ] > self._pos

    def poll(self) -> bool:
        """Whether a message (or its first chunk) is waiting."""
        return self._has_data()

    def _next_chunk(self, deadline: float | None, cancel: Any) -> int:
        if not self._has_data():
            self._wait(self._ready_or_closed, self._flag, deadline, cancel, "recv", poll=self._poll)
            _fence()  # (acquire: a close seen, the messages published before it are seen too)
            if not self._has_data():
                raise RingClosed(f"ring {self.name} closed")
        _fence()  # acquire: the chunk's bytes are read after write_seq
        return self._chunk(self._pos)

    def _poll_core(self, spin_s: float, yield_s: float) -> bool:
        """The compiled core's poll for this reader: data, a close or an abort."""
        return _core.poll(self._q, _W_WSEQ, self._pos, (_I_CLOSED, _I_STATE), spin_s, yield_s)

    def _ready_or_closed(self) -> bool:
        return self._has_data() or self._ended()

    def _give_back(self) -> None:
        """Hand the writer every chunk before ``_pos``. The store's first fence:
        our copy is complete before the writer may reuse them."""
        _store(self._q, self._rseq_w, self._pos)
        if self._i[_I_WWAIT]:
            self._writer_bell.ring()

    def _lend(self, total: int, deadline: float | None, cancel: Any) -> list[memoryview] | None:
        """The frames of the message at ``_pos``, which fits the ring, mapped where it
        lies once all of it is published; None where the mapping fails (then this
        reader copies from now on)."""
        cb, n = self.chunk_bytes, self.n_chunks
        k = -(-total // cb)
        last = self._pos + k - 1  # the message's last chunk
        if self._q[_W_WSEQ] <= last:
            if self._q[_W_WSEQ] < last:  # polling would take the core the writer needs
                poll = _no_poll
            elif _core is not None:  # only the last chunk is due
                poll = partial(_core.poll, self._q, _W_WSEQ, last, (_I_CLOSED, _I_STATE))
            else:
                poll = None
            self._wait(lambda: self._q[_W_WSEQ] > last or self._ended(), self._flag, deadline, cancel,
                       "recv", poll=poll, raised=2)
            _fence()  # (as in _next_chunk)
            if self._q[_W_WSEQ] <= last:
                raise RingClosed(f"ring {self.name} closed")
        _fence()  # acquire: the chunks' bytes are read after write_seq (published before or not)
        first = self._pos % n
        head = min(k, n - first)
        pieces = [(self._data + first * cb, head * cb)]
        if k > head:  # it wraps: its second part follows the first in the mapping
            pieces.append((self._data, (k - head) * cb))
        try:
            loan = shm.Loan(self._fd, pieces, total)
        except OSError as e:
            log.warning("ring %s: cannot map a message in place (%s); copying from now on", self.name, e)
            os.close(self._fd)
            self._fd = None
            return None
        self._pos += k  # before the loan is ours to end: never the same message twice
        self._loan = loan
        try:
            return _split_frames(loan.view())
        except ValueError as e:  # corrupt: dropped (its loan ends at the next recv)
            raise CodecError(f"ring {self.name}: a corrupt message dropped: {e}") from None

    def _end_loan(self) -> None:
        """Give the lent message's chunks back. A view of it still alive gets a
        private copy first; should that fail (OSError: no memory), the chunks stay
        held and the next call tries again."""
        if self._loan.end():
            # This reader keeps what it gets: copying while the writer streams beats
            # a loan's copy, made once the whole message is written.
            self._copy_instead = self.COPY_AFTER_KEPT
        self._loan = None
        self._give_back()

    def recv(self, timeout: float | None = None, cancel: Any = None) -> list[memoryview]:
        """Receive the next message as a list of frames (views of one private buffer).

        On :class:`TimeoutError` in the middle of a long message, the part already
        read is kept and the next ``recv`` carries on with it. After an abort,
        what was published before it can still be read; then RingClosed.

        A reader attached with ``lend`` receives a message of ``BufferPool.MIN_BYTES``
        or more that fits the ring without copying it: the frames are a private,
        copy-on-write mapping of its chunks (:class:`zbus.shm.Loan`), which this
        reader holds until its next ``recv`` (or ``close``). Views of it that are
        still alive then get a private copy, so keeping them is safe; dropping
        them before is what saves the copy."""
        deadline = deadline_of(timeout)  # the copy below counts
        if self._loan is not None:
            self._end_loan()
        if self._taken is not None:  # read, and an exception (Ctrl-C) cut its return short
            frames, self._taken = self._taken, None
            self._give_back()
            return frames
        buf, cb = self._buf, self.chunk_bytes
        if self._partial is None:
            pos = self._next_chunk(deadline, cancel)
            try:
                frames = _read_message(buf, pos, min(cb, BufferPool.MIN_BYTES - 1))
            except ValueError as e:
                raise self._dropped(e) from None
            if frames is not None:  # most calls: a small message in one chunk
                self._pos, self._taken = self._pos + 1, frames  # (together: see below)
                self._give_back()
                self._taken = None
                return frames
            total = struct.unpack_from("<Q", buf, pos)[0]
            if self._fd is not None and BufferPool.MIN_BYTES <= total <= cb * self.n_chunks:
                if self._copy_instead:
                    self._copy_instead -= 1
                else:
                    frames = self._lend(total, deadline, cancel)
                    if frames is not None:
                        return frames
            take = min(cb, total)
            out: memoryview | None
            try:
                if total >= 1 << 62:  # (rounded up in the pool, C's ssize_t would wrap it)
                    raise OverflowError("larger than any message")
                out = self._pool.take(total)
            except MemoryError:
                if total > codec.MAX_MESSAGE + MESSAGE_LAYOUT_SLACK:  # a stray write's: corrupt
                    raise self._dropped(ValueError(f"its size {total}: MemoryError")) from None
                out = None  # a message this process has no room for: read past it whole
            except (OverflowError, OSError, ValueError) as e:  # a size no message has
                raise self._dropped(ValueError(f"its size {total}: {type(e).__name__}")) from None
            if out is not None:
                out[:take] = buf[pos:pos + take]
            self._pos, self._partial = self._pos + 1, (out, take, total)  # (together: see below)
        out, got, total = self._partial
        self._give_back()  # (the chunk just read; at a carry-on, a release cut short)
        while got < total:
            pos = self._next_chunk(deadline, cancel)
            take = min(cb, total - got)
            if out is not None:
                out[got:got + take] = buf[pos:pos + take]
            got += take
            # The chunk taken and the part kept move together (no call, no jump
            # between them): whatever raises in this method (a deadline, Ctrl-C)
            # leaves them in step, and the next recv carries on from there.
            self._pos, self._partial = self._pos + 1, (out, got, total)
            self._give_back()
        if out is None:
            self._partial = None
            raise CodecError(f"ring {self.name}: a message of {total} bytes dropped: no memory for it")
        try:
            frames = _split_frames(out)
        except ValueError as e:  # a corrupt message is dropped (a signal's exception keeps it)
            self._partial = None
            raise CodecError(f"ring {self.name}: a corrupt message dropped: {e}") from None
        self._partial = None
        return frames

    def _dropped(self, why: Exception) -> CodecError:
        """Drop the chunk at ``_pos``, whose message is corrupt (a stray write of a
        process on this node): the next ``recv`` reads what follows it."""
        self._pos += 1
        self._give_back()
        return CodecError(f"ring {self.name}: a corrupt message dropped: {why}")

    def close(self) -> None:
        """Detach: the writer stops waiting for this reader."""
        if self._seg._mmap is None:
            return
        if self._loan is not None:
            try:
                self._end_loan()
            except OSError as e:  # the writer must not wait for a reader that is gone
                log.warning("ring %s: a kept view's copy failed (%s): it may change", self.name, e)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._i[self._detached] = 1
        _fence()
        self._writer_bell.ring()
        self._close_mapping()


def _no_poll(spin_s: float, yield_s: float) -> bool:
    return False


def _byte_view(f: Buffer) -> memoryview:
    return f if isinstance(f, memoryview) and f.format == "B" and f.ndim == 1 else memoryview(f).cast("B")


_ALIGN = 64  # frames start 64-byte aligned in the message: tensors decode in place
_PAD = bytes(_ALIGN)


def _views_and_layout(frames: Sequence[Any]) -> tuple[list, list[int], list[int], int]:
    """Byte views of ``frames`` (a tuple of parts stays a tuple), their lengths, their
    offsets in the message and its size."""
    views = [tuple(map(_byte_view, f)) if type(f) is tuple else _byte_view(f) for f in frames]
    lens = [sum(p.nbytes for p in v) if type(v) is tuple else v.nbytes for v in views]
    offsets, total = _layout(lens)
    return views, lens, offsets, total


def _layout(lens: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of frames of ``lens`` bytes in a message, and the message size."""
    pos, offsets = 16 + 8 * len(lens), []
    for ln in lens:
        pos = (pos + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(pos)
        pos += ln
    return offsets, pos


class BufferPool:
    """Receive buffers for large messages, reused once nothing refers to them.

    First-touching fresh memory costs more than copying into it (a page fault per
    4 KiB page; on virtual machines several times more), so a reader that gets
    16 MiB tensors step after step keeps a few warm buffers. A buffer is reused
    only when no decoded object still holds a view of it.
    """

    MIN_BYTES = 256 * 1024
    # buffers kept, at most KEEP_BYTES of them, the smallest dropped first; one over
    # KEEP_BYTES is not kept (a reply of gigabytes must not stay for the process's life)
    KEEP = 4
    KEEP_BYTES = 256 * 2**20

    def __init__(self) -> None:
        self._buffers: list[bytearray] = []

    def take(self, n: int) -> memoryview:
        if n < self.MIN_BYTES:
            return memoryview(bytearray(n))
        best = None
        for i in range(len(self._buffers)):
            b = self._buffers[i]
            if len(b) >= n and (best is None or len(b) < len(best)) and not _exported(b):
                best = b
            del b
        if best is not None:  # the smallest free buffer that fits: already faulted in
            return memoryview(best)[:n]
        step = max(self.MIN_BYTES, 1 << max(0, n.bit_length() - 4))  # at most ~12 % spare
        b = _uninitialized((n + step - 1) // step * step)
        if len(b) <= self.KEEP_BYTES:
            self._buffers.append(b)
        while len(self._buffers) > self.KEEP or sum(map(len, self._buffers)) > self.KEEP_BYTES:
            self._buffers.remove(min(self._buffers, key=len))  # views keep dropped ones alive
        return memoryview(b)[:n]


def _uninitialized(n: int) -> bytearray:
    """A bytearray of ``n`` bytes as malloc leaves them, not zero-filled: a receive
    buffer is written in full by the copy out of the ring before anything reads it,
    and filling it first was a whole extra pass (a 16 MiB miss: 2.2 ms, 1.0 ms
    without; docs/benchmarks.md). mmap or torch.empty would be no help: their pages
    are fresh from the kernel every time, and faulting them in costs ten times more
    here. Without CPython's C API, a plain bytearray."""
    global _new_bytearray
    if _new_bytearray is None:
        try:
            f = ctypes.pythonapi.PyByteArray_FromStringAndSize
            f.restype, f.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
            _new_bytearray = lambda size: f(None, size)  # noqa: E731
        except (AttributeError, OSError):  # not CPython
            _new_bytearray = bytearray
    return _new_bytearray(n)


_new_bytearray: Callable[[int], bytearray] | None = None


def _exported(b: bytearray) -> bool:
    """Whether a view of ``b`` is alive (a decoded tensor, say): a bytearray with
    exports cannot be resized. Shrinking by one byte and growing back keeps the
    allocation, so this costs no copy."""
    try:
        last = b[-1]
        del b[-1:]
    except BufferError:
        return True
    b.append(last)
    return False


def _split_frames(out: memoryview) -> list[memoryview]:
    n = struct.unpack_from("<Q", out, 8)[0] if len(out) >= 16 else -1
    if not 0 <= n <= (len(out) - 16) // 8:
        raise ValueError("corrupt message header")
    lens = struct.unpack_from(f"<{n}Q", out, 16)
    offsets, total = _layout(lens)
    if total != len(out):
        raise ValueError("corrupt message header")
    return [out[off:off + ln] for off, ln in zip(offsets, lens)]


# --- the per-message steps in Python: twins of zbus._core's --------------------------


def _poll_py(ready: Callable[[], bool], spin_s: float, yield_s: float) -> bool:
    """Spin ``spin_s``, then yield the core ``yield_s`` more, until ``ready()``;
    whether it became so."""
    now = time.monotonic()
    spin_end = now + spin_s
    while now < spin_end:
        if ready():
            return True
        now = time.monotonic()
    yield_end = now + yield_s
    while now < yield_end:
        if ready():
            return True
        os.sched_yield()
        now = time.monotonic()
    return False


def _store_py(words: memoryview, index: int, value: int) -> None:
    """fence, ``words[index] = value``, fence: how a counter is published."""
    shm.fence()
    words[index] = value
    shm.fence()


def _write_message_py(buf: memoryview, at: int, frames: list, limit: int) -> int:
    """Write the message of ``frames`` at ``buf[at:]`` and return its size; -1,
    writing nothing, when it is over ``limit`` bytes."""
    views, lens, offsets, total = _views_and_layout(frames)
    if total > limit:
        return -1
    struct.pack_into(f"<{len(views) + 2}Q", buf, at, total, len(views), *lens)
    end = 16 + 8 * len(views)
    for view, off, n in zip(views, offsets, lens):
        buf[at + end:at + off] = _PAD[:off - end]
        start = at + off
        for part in view if type(view) is tuple else (view,):  # a frame's parts, back to back
            buf[start:start + part.nbytes] = part
            start += part.nbytes
        end = off + n
    return total


def _read_message_py(buf: memoryview, at: int, limit: int) -> list[memoryview] | None:
    """The frames of the message at ``buf[at:]``, copied out; None, reading nothing
    past its size word, when it is over ``limit`` bytes."""
    total = struct.unpack_from("<Q", buf, at)[0]
    if total > limit:
        return None
    return _split_frames(memoryview(bytearray(buf[at:at + total])))


_poll = _poll_py
_fence = _core.fence if _core is not None else shm.fence
_store = _core.store if _core is not None else _store_py
_write_message = _core.write_message if _core is not None else _write_message_py
_read_message = _core.read_message if _core is not None else _read_message_py
