"""Code that test processes run: a ring reader that checks what it receives."""

from __future__ import annotations

import hashlib
import json
import struct
import time
import zlib

from zbus.ring import RingReader

META = struct.Struct("<QId")  # message index, crc32 of the payload, send time
END = 2**64 - 1  # the index of the message that ends a run


def make_message(index: int, payload: bytes) -> list[bytes]:
    return [META.pack(index, zlib.crc32(payload), time.monotonic()), payload]


def end_message() -> list[bytes]:
    return [META.pack(END, 0, time.monotonic())]


def check_reader(handle_json: str, index: int, delay: float = 0.0, lend: bool = False,
                 keep_every: int = 0) -> None:
    """Sleep ``delay`` s, then receive until the end message, counting what came:
    messages, those out of sequence (an index other than the one after the last)
    and those whose payload fails its crc. Prints a JSON summary: those counts,
    the digest of all payloads, the worst wake-up latency, and when it woke from
    the delay (``time.monotonic()``, which the writer's process shares).

    ``lend``: attach as a lending reader, and count the messages that came as
    loans; ``keep_every``: keep a view of every n-th payload, and check each
    again at the end (``kept_corrupted``), lending every message all the same
    (each kept loan is copied)."""
    ring = RingReader.attach(json.loads(handle_json), index, lend=lend)
    if keep_every:
        ring.COPY_AFTER_KEPT = 0
    digest = hashlib.blake2b()
    worst = 0.0
    received = out_of_sequence = corrupted = lent = 0
    kept: list = []
    try:
        time.sleep(delay)
        woke = time.monotonic()
        expected = 0
        while True:
            frames = ring.recv(timeout=60)
            got, crc, sent = META.unpack(frames[0])
            if got == END:
                break
            payload = bytes(frames[1])
            lent += ring._loan is not None
            if keep_every and got % keep_every == 0:
                kept.append((frames[1], crc))
            received += 1
            out_of_sequence += got != expected
            corrupted += zlib.crc32(payload) != crc
            expected = got + 1
            digest.update(payload)
            worst = max(worst, time.monotonic() - sent)
            del frames
    finally:
        ring.close()
    kept_corrupted = sum(zlib.crc32(view) != crc for view, crc in kept)
    print(json.dumps({"received": received, "out_of_sequence": out_of_sequence, "corrupted": corrupted,
                      "digest": digest.hexdigest(), "worst_latency": worst, "woke": woke,
                      "lent": lent, "kept": len(kept), "kept_corrupted": kept_corrupted}))


def idle_reader(handle_json: str, index: int) -> None:
    """Block on an empty ring until one message comes; report its wake-up latency."""
    ring = RingReader.attach(json.loads(handle_json), index)
    try:
        print("ready", flush=True)
        frames = ring.recv(timeout=60)
        _, _, sent = META.unpack(frames[0])
        print(json.dumps({"latency": time.monotonic() - sent}), flush=True)
    finally:
        ring.close()


def kept_loan_that_cannot_be_copied(handle_json: str) -> None:
    """Keep a lent message, then receive while a page of it is read-only, so the
    kernel refuses to make it this reader's own (EINVAL): that recv fails and the
    chunks stay held. Told to go on (a line on stdin), make the page writable and
    receive again. Prints what it saw."""
    import ctypes
    import mmap
    import sys

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ring = RingReader.attach(json.loads(handle_json), 0, lend=True)
    kept = ring.recv(timeout=30)[0]
    lent = ring._loan is not None
    page = ctypes.addressof(ctypes.c_char.from_buffer(kept)) // mmap.PAGESIZE * mmap.PAGESIZE
    libc.mprotect(page + 64 * mmap.PAGESIZE, mmap.PAGESIZE, mmap.PROT_READ)
    try:
        ring.recv(timeout=0.2)
        failed = None
    except OSError as e:
        failed = e.errno
    print(json.dumps({"lent": lent, "failed": failed}), flush=True)
    sys.stdin.readline()
    libc.mprotect(page + 64 * mmap.PAGESIZE, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)
    second = bytes(ring.recv(timeout=30)[0])
    print(json.dumps({"kept_intact": bytes(kept) == b"A" * len(kept), "kept": len(kept),
                      "second": [second[:1].decode(), len(second)]}), flush=True)
    ring.close()


def many_frames(index: int, n: int, size: int) -> list[bytes]:
    """Message ``index``: META, then ``n`` frames of ``size`` bytes, frame ``k``
    all of byte ``(index + k) % 251``: a piece shifted or lost shows at a frame's
    ends (cheap to check, so the reader keeps up)."""
    return [META.pack(index, n, time.monotonic()), *(bytes([(index + k) % 251]) * size for k in range(n))]


def check_joined(frames: list) -> tuple[int, bool]:
    """A ``many_frames`` message's index, and whether its frames are intact."""
    index, n, _ = META.unpack(frames[0])
    if index == END:
        return index, True
    sizes = {len(f) for f in frames[1:]}
    return index, len(frames) == n + 1 and len(sizes) == 1 and all(
        f[0] == f[-1] == (index + k) % 251 for k, f in enumerate(frames[1:]))


def frames_reader(handle_json: str) -> None:
    """Receive ``many_frames`` messages until the end message; print the counts of
    messages, those out of sequence and those torn."""
    ring = RingReader.attach(json.loads(handle_json), 0)
    received = out_of_sequence = torn = 0
    try:
        while True:
            frames = ring.recv(timeout=60)
            got, intact = check_joined(frames)
            if got == END:
                break
            out_of_sequence += got != received
            torn += not intact
            received += 1
    finally:
        ring.close()
    print(json.dumps({"received": received, "out_of_sequence": out_of_sequence, "torn": torn}))


def frames_writer(handle_json: str, count: int, n: int, size: int) -> None:
    """Send ``count`` ``many_frames`` messages, then the end message."""
    from zbus.ring import RingWriter

    ring = RingWriter.attach(json.loads(handle_json))
    try:
        for index in range(count):
            ring.send(many_frames(index, n, size), timeout=60)
        ring.send(end_message(), timeout=60)
    finally:
        ring.close(unlink=False)
