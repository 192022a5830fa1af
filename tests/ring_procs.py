"""Code that test processes run: a ring reader that checks what it receives."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import time
import zlib

from zbus.ring import RingReader

META = struct.Struct("<QId")  # message index, crc32 of the payload, send time


def make_message(index: int, payload: bytes) -> list[bytes]:
    return [META.pack(index, zlib.crc32(payload), time.monotonic()), payload]


def check_reader(handle_json: str, index: int, count: int, delay: float = 0.0) -> None:
    """Receive ``count`` messages; fail loudly on a gap, reorder or corruption.
    Prints a JSON summary: count, digest of all payloads, worst wake-up latency."""
    ring = RingReader.attach(json.loads(handle_json), index)
    digest = hashlib.blake2b()
    worst = 0.0
    try:
        time.sleep(delay)
        for expected in range(count):
            frames = ring.recv(timeout=60)
            got, crc, sent = META.unpack(frames[0])
            payload = bytes(frames[1])
            if got != expected:
                sys.exit(f"reader {index}: expected message {expected}, got {got}")
            if zlib.crc32(payload) != crc:
                sys.exit(f"reader {index}: message {got} corrupted")
            digest.update(payload)
            worst = max(worst, time.monotonic() - sent)
    finally:
        ring.close()
    print(json.dumps({"count": count, "digest": digest.hexdigest(), "worst_latency": worst}))


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
