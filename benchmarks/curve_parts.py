"""Benchmark: why CurveZMQ costs more on a 16 MiB message than its cipher alone,
and what cutting the message in parts buys. Raw pyzmq PUSH -> PULL on loopback,
16 MiB sent as 1, 4, 16 or 64 parts, with and without keys, alternating; and the
throughput of the cipher itself (libsodium's crypto_box_easy_afternm, the one
pyzmq's wheel bundles).

    python benchmarks/curve_parts.py [--rounds N]

Figures: docs/benchmarks.md, "The cost of CurveZMQ".
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import time

import zmq

SIZE = 16 << 20


def round_trip_ms(keyed: bool, parts: int, reps: int = 12) -> float:
    """Median time to send SIZE bytes in ``parts`` parts and receive them."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    if keyed:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        pull.curve_server, pull.curve_secretkey, pull.curve_publickey = True, server_secret, server_public
        push.curve_serverkey, push.curve_publickey, push.curve_secretkey = (
            server_public, client_public, client_secret)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    data = memoryview(bytearray(SIZE))
    step = SIZE // parts
    chunks = [data[i * step:(i + 1) * step] for i in range(parts)]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        push.send_multipart(chunks, copy=True)
        pull.recv_multipart(copy=False)
        times.append(time.perf_counter() - t)
    push.close(0)
    pull.close(0)
    ctx.term()
    return statistics.median(times[2:]) * 1e3


def cipher_gib_s(size: int) -> float | None:
    """libsodium's crypto_box_easy_afternm over SIZE bytes in ``size`` pieces."""
    found = glob.glob(os.path.join(os.path.dirname(zmq.__file__), os.pardir, "pyzmq.libs", "libsodium*"))
    if not found:
        return None
    lib = ctypes.CDLL(found[0])
    lib.sodium_init()
    message, box = ctypes.create_string_buffer(size + 32), ctypes.create_string_buffer(size + 32)
    key, nonce = ctypes.create_string_buffer(32), ctypes.create_string_buffer(24)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(SIZE // size):
            lib.crypto_box_easy_afternm(box, message, ctypes.c_ulonglong(size), nonce, key)
        best = min(best, time.perf_counter() - t)
    return SIZE / best / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    rounds = ap.parse_args().rounds
    for size in (1 << 20, SIZE):
        rate = cipher_gib_s(size)
        if rate is not None:
            print(f"cipher, {size >> 20} MiB pieces: {rate:.2f} GiB/s")
    rows: dict[int, list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for parts in (1, 4, 16, 64):
            rows.setdefault(parts, []).append((round_trip_ms(False, parts), round_trip_ms(True, parts)))
    for parts, runs in rows.items():
        plain = statistics.median(r[0] for r in runs)
        keyed = statistics.median(r[1] for r in runs)
        print(f"16 MiB in {parts:2d} parts: no keys {plain:6.2f} ms, CurveZMQ {keyed:6.2f} ms, "
              f"ratio {keyed / plain:.2f}")


if __name__ == "__main__":
    main()
