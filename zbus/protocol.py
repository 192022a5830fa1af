"""Message shapes shared by the driver, the node agents and the workers.

Broadcast (driver -> every worker), encoded with :mod:`zbus.codec`:

- the first message: the worker spec, ``{"worker": "pkg.mod:Cls", "kwargs": {...},
  "allow_import": bool}``;
- a call: the envelope ``[CALL, seq, method, reply_rank, n, answered]`` as one
  frame, then the ``n`` frames of ``(args, kwargs)``, encoded apart so that
  arguments a worker cannot decode are answered with the error (reply_rank -1:
  every rank replies); ``answered``: the driver has every reply to the calls up
  to that number (a remote worker forgets its copies of them, see
  :class:`zbus.queues.ReplySender`);
- ``[STOP]``.

The envelope is plain msgpack (no extension types), so it is decoded without the
codec's hooks.

On a keyed link a call's frames larger than ``PART_BYTES`` travel cut in parts
(:func:`in_parts`): the topic ends with ``PARTS`` and a frame of the part counts
(plain msgpack) comes first; the node agent writes the parts of a frame back to
back into its ring (:func:`from_parts`), so its workers see the frames sent.

Reply (one worker -> the driver): ``[rank, seq, status, value]`` (a remote rank's
names its leader's session first: ``[session, rank, ...]``); the READY reply
has ``seq == READY``. ``status`` says what ``value`` is: the result (OK), the
exception the method raised (RAISED, as :class:`zbus.codec.ExceptionInfo`), or why
the call was refused before it ran (REFUSED).
"""

import reprlib
from typing import Any

import msgpack

from . import codec
from .errors import CodecError

# Checked at a node's join: 2: calls say which replies the driver has; heartbeats
# name the last call relayed. 3: the leader's heartbeats name its session, which
# its welcome gave. 4: its calls go on the topic of its session (cluster.rpc_topic).
# 5: a member's heartbeats, deaths, gaps and leaving, and its workers' replies,
# name that session too. 6: so do the leader's stopping, bye and failed.
PROTOCOL_VERSION = 6
CALL, STOP = 1, 2
MAX_ENVELOPE = 65536  # bytes: a method's name and five ints
NO_ARGS = codec.encode(((), {}))[0]  # the arguments of most calls, encoded once
READY = -1
OK, RAISED, REFUSED = 0, 1, 2


def call_envelope(seq: int, method: str, reply_rank: int, n_payload: int, answered: int = 0) -> bytes:
    """The first frame of a call."""
    return codec.encode([CALL, seq, method, reply_rank, n_payload, answered])[0]


def read_envelope(frame: Any) -> list:
    """``[STOP]`` or ``[CALL, seq, method, reply_rank, n_payload, answered]`` from a
    message's first frame; :class:`CodecError` for anything else. Bounded: at most
    ``MAX_ENVELOPE`` bytes, arrays of at most 6 items and no maps, bytes or
    extensions (msgpack allocates a declared array before it reads the items: at
    the frame's length each, arrays nested a thousand deep took 78 MiB)."""
    n = len(frame)
    try:
        if n > MAX_ENVELOPE:
            raise ValueError(f"{n} bytes, at most {MAX_ENVELOPE}")
        envelope = msgpack.unpackb(frame, raw=False, use_list=True, max_str_len=n, max_bin_len=0,
                                   max_array_len=6, max_map_len=0, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types on bad input
        raise CodecError(f"cannot decode the envelope: {type(e).__name__}: {e}") from None
    if envelope != [STOP] and not (type(envelope) is list and len(envelope) == 6 and envelope[0] == CALL
                                   and type(envelope[1]) is type(envelope[3]) is type(envelope[4])
                                   is type(envelope[5]) is int):
        raise CodecError(f"not a call envelope: {_named(envelope)}")
    return envelope


def _named(envelope: Any) -> str:
    """At most 100 characters of what was refused."""
    try:
        return str(envelope)[:100]
    except RecursionError:  # lists nested deeper than str goes
        return reprlib.repr(envelope)[:100]


# CurveZMQ encrypts one message part at a time, each with a copy in and out: a
# 16 MiB frame in 1 MiB parts is encrypted by the sender while the receiver
# decrypts the parts before, in cache, in half the time (docs/benchmarks.md#curve).
PART_BYTES = 1 << 20
PARTS = b"*"  # a topic's suffix: the frames come in parts


def in_parts(frames: list) -> tuple[bytes, list]:
    """(the part counts frame, the frames with each over ``PART_BYTES`` but the
    envelope cut in parts); (b"", frames) when none is. Sizes first: a small call
    (the most) makes no view of its frames."""
    if all(_nbytes(f) <= PART_BYTES for f in frames[1:]):
        return b"", frames
    views = [memoryview(f).cast("B") for f in frames]
    counts, parts = [], []
    for i, v in enumerate(views):
        n = 1 if i == 0 else max(1, -(-v.nbytes // PART_BYTES))  # the envelope stays whole
        counts.append(n)
        parts.extend([v] if n == 1 else (v[i * PART_BYTES:(i + 1) * PART_BYTES] for i in range(n)))
    return msgpack.packb(counts), parts


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


def from_parts(counts_frame: Any, parts: list) -> list:
    """The frames again: a frame cut in parts as a tuple of them (a ring writes
    them back to back). :class:`CodecError` for counts that do not fit."""
    try:
        counts = msgpack.unpackb(counts_frame, use_list=True, max_array_len=len(parts), max_map_len=0,
                                 max_str_len=0, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types on bad input
        raise CodecError(f"cannot decode the part counts: {type(e).__name__}: {e}") from None
    if not (type(counts) is list and counts and all(type(n) is int and n > 0 for n in counts)
            and sum(counts) == len(parts)):
        raise CodecError(f"part counts {reprlib.repr(counts)} do not fit {len(parts)} parts")
    frames, at = [], 0
    for n in counts:
        frames.append(parts[at] if n == 1 else tuple(parts[at:at + n]))
        at += n
    return frames
