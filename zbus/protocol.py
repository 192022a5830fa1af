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

Reply (one worker -> the driver): ``[rank, seq, status, value]``; the READY reply
has ``seq == READY``. ``status`` says what ``value`` is: the result (OK), the
exception the method raised (RAISED, as :class:`zbus.codec.ExceptionInfo`), or why
the call was refused before it ran (REFUSED).
"""

from typing import Any

import msgpack

from . import codec
from .errors import CodecError

CALL, STOP = 1, 2
NO_ARGS = codec.encode(((), {}))[0]  # the arguments of most calls, encoded once
READY = -1
OK, RAISED, REFUSED = 0, 1, 2


def call_envelope(seq: int, method: str, reply_rank: int, n_payload: int, answered: int = 0) -> bytes:
    """The first frame of a call."""
    return codec.encode([CALL, seq, method, reply_rank, n_payload, answered])[0]


def read_envelope(frame: Any) -> list:
    """``[STOP]`` or ``[CALL, seq, method, reply_rank, n_payload, answered]`` from a
    message's first frame; :class:`CodecError` for anything else."""
    try:
        envelope = msgpack.unpackb(frame, raw=False, use_list=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types on bad input
        raise CodecError(f"cannot decode the envelope: {type(e).__name__}: {e}") from None
    if envelope != [STOP] and not (type(envelope) is list and len(envelope) == 6 and envelope[0] == CALL
                                   and type(envelope[1]) is type(envelope[3]) is type(envelope[4])
                                   is type(envelope[5]) is int):
        raise CodecError(f"not a call envelope: {str(envelope)[:100]}")
    return envelope
