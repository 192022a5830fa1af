"""ZeroMQ peers that test processes run, to be stalled (SIGSTOP) and resumed by
the test: each prints one line per message it receives, the digest of its frames."""

from __future__ import annotations

import hashlib
import sys

import zmq


def digest(frames) -> str:
    """sha256 over the frames, each preceded by its length."""
    h = hashlib.sha256()
    for f in frames:
        view = memoryview(f).cast("B")
        h.update(view.nbytes.to_bytes(8, "little"))
        h.update(view)
    return h.hexdigest()


def reader(kind: str, address: str, rcvbuf: int) -> None:
    """``sub``: connect a SUB socket to ``address`` (everything subscribed) and print
    the digest of each message's frames after the topic. ``pull``: bind a PULL
    socket on the host ``address``, print ``port <n>``, and print the digest of
    each message's frames. A small ``rcvbuf`` keeps a stalled reader's kernel
    buffer small, so that what it does not read stays with the sender."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB if kind == "sub" else zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, rcvbuf)
    if kind == "sub":
        sock.connect(address)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    else:
        port = sock.bind_to_random_port(f"tcp://{address}")
        print(f"port {port}", flush=True)
    skip = 1 if kind == "sub" else 0
    while sock.poll(60_000, zmq.POLLIN):  # a test that forgot us: end within a minute
        frames = sock.recv_multipart(copy=False)
        print(digest([f.buffer for f in frames[skip:]]), flush=True)
    sock.close()
    ctx.term()


def main() -> None:
    reader(sys.argv[1], sys.argv[2], int(sys.argv[3]))
