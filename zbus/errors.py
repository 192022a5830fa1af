"""The exceptions zbus raises. Every one is a :class:`ZbusError`, except timeouts,
which raise the built-in :class:`TimeoutError`."""

from __future__ import annotations

import dataclasses
import reprlib
from typing import Any


class ZbusError(Exception):
    """Base class of every zbus error."""


class SettingError(ZbusError, ValueError):
    """A setting (an argument, a flag or a ``ZBUS_*`` variable) out of its range:
    a ValueError too."""


class CodecError(ZbusError):
    """Bytes that cannot be decoded (malformed, truncated, oversize, unknown type),
    or an object that cannot be encoded."""


class SendTimeout(TimeoutError):
    """A send ran out of time. ``queued`` says whether the message was committed
    anyway (it will still be delivered) or not sent at all."""

    def __init__(self, message: str, queued: bool):
        super().__init__(message)
        self.queued = queued

    def __reduce__(self) -> tuple:  # (pickled, copied: made again from its own arguments)
        return type(self), (self.args[0], self.queued)


class RingClosed(ZbusError):
    """The ring was closed by its writer (after the last message) or aborted."""


class Cancelled(ZbusError):
    """A blocking call was cancelled through its cancel event."""


class ShmSpaceError(ZbusError):
    """Not enough free space in /dev/shm for a new segment."""


class RemoteError(ZbusError):
    """The called method raised on a worker.

    ``rank``, ``type_name``, ``message`` and ``remote_traceback`` describe the
    remote exception; ``str()`` shows ``"TypeName: message"`` and the rank.
    """

    def __init__(self, rank: int, type_name: str, message: str, remote_traceback: str = ""):
        super().__init__(rank, type_name, message, remote_traceback)
        self.rank = rank
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message} (on rank {self.rank})"


class ExecutorFailedError(ZbusError):
    """The executor can no longer serve calls: a worker or a node is gone."""


class WorkerDiedError(ExecutorFailedError):
    """A worker process exited. ``rank`` and ``exitcode`` (negative: the signal)."""

    def __init__(self, rank: int, exitcode: int | None, detail: str = ""):
        self.rank = rank
        self.exitcode = exitcode
        how = "unknown status" if exitcode is None else (
            f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}")
        msg = f"worker rank {rank} died ({how})"
        super().__init__(msg + (f": {detail}" if detail else ""))
        self.detail = detail

    def __reduce__(self) -> tuple:
        return type(self), (self.rank, self.exitcode, self.detail)


class NodeLostError(ExecutorFailedError):
    """A follower node stopped answering (agent died or link cut)."""

    def __init__(self, node_rank: int, host: str, detail: str = ""):
        self.node_rank = node_rank
        self.host = host
        msg = f"node {node_rank} ({host}) lost"
        super().__init__(msg + (f": {detail}" if detail else ""))
        self.detail = detail

    def __reduce__(self) -> tuple:
        return type(self), (self.node_rank, self.host, self.detail)


class _Brief(reprlib.Repr):
    """reprlib's short repr, with no value's whole repr made: reprlib makes the whole
    repr of a type it does not know, then cuts it, and for bytes, a tensor or an
    array from the network that is many times their size (16x for a tensor), and
    slow. Bytes are cut first, the fields of a dataclass (an error's info) are
    named briefly, and another object is named by its type (and shape)."""

    def repr_bytes(self, x: bytes | bytearray, level: int) -> str:
        if len(x) <= self.maxstring:
            return repr(x)
        return f"{repr(x[:self.maxstring])}... ({len(x)} bytes)"

    repr_bytearray = repr_bytes

    def repr_instance(self, x: Any, level: int) -> str:
        if type(x) in (bool, float, complex, type(None)):
            return repr(x)
        name = type(x).__name__
        if level <= 0:
            return f"<{name}>"
        if dataclasses.is_dataclass(x):
            fields = dataclasses.fields(x)
            named = ", ".join(f"{f.name}={self.repr1(getattr(x, f.name), level - 1)}"
                              for f in fields[:self.maxtuple])
            return f"{name}({named})"
        shape = getattr(x, "shape", None)
        return f"<{name} of shape {self.repr1(list(shape), level - 1)}>" if shape is not None else f"<{name}>"


_REPR = _Brief()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def brief(obj: Any) -> str:
    """A short repr of a value from the network for a log line: bounded in depth and
    length (``str`` of a deeply nested value recurses without bound)."""
    try:
        return _REPR.repr(obj)
    except Exception as e:  # noqa: BLE001 - a dataclass whose repr raises, say
        return f"<{type(obj).__name__}: repr failed: {type(e).__name__}>"


def said(reason: Any, limit: int = 500) -> str:
    """What a peer gave as its reason, for an error or a terminal: text cut to
    ``limit`` characters, its escapes and control characters shown as "?" (anything
    else briefly)."""
    text = reason[:limit] if type(reason) is str else brief(reason)
    return "".join(c if c.isprintable() else "?" for c in text)
