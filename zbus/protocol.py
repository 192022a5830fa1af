"""Message shapes shared by the driver, the node agents and the workers.

Broadcast (driver -> every worker), encoded with :mod:`zbus.codec`:

- the first message: the worker spec, ``{"worker": "pkg.mod:Cls", "kwargs": {...},
  "allow_import": bool}``;
- a call: the envelope ``[CALL, seq, method, reply_rank, n]`` as one frame, then
  the ``n`` frames of ``(args, kwargs)``, encoded apart so that arguments a worker
  cannot decode are answered with the error (reply_rank -1: every rank replies);
- ``[STOP]``.

The envelope is plain msgpack (no extension types), so it is decoded without the
codec's hooks.

Reply (one worker -> the driver): ``[rank, seq, status, value]``; the READY reply
has ``seq == READY``. ``status`` says what ``value`` is: the result (OK), the
exception the method raised (RAISED, as :class:`zbus.codec.ExceptionInfo`), or why
the call was refused before it ran (REFUSED).
"""

from . import codec

CALL, STOP = 1, 2
NO_ARGS = codec.encode(((), {}))[0]  # the arguments of most calls, encoded once
READY = -1
OK, RAISED, REFUSED = 0, 1, 2
