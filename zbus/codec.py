"""The wire codec: msgpack with a few extension types, never pickle.

``encode(obj)`` returns frames ``[header, buf0, buf1, ...]``: the msgpack header
and the raw data of large buffers (tensors, arrays, big bytes) as separate
zero-copy views, so a transport can send them without concatenating.
``decode(frames)`` turns them back into plain data. Decoding never imports a
module or runs code the sender names: extension types map to a fixed table, dtypes
to a whitelist, and dataclasses to the ones registered with :func:`register`.

Supported: None, bool, int, float, str, bytes, bytearray, memoryview, list, tuple
(kept as tuple), dict, ``torch.Tensor`` (CPU, any dtype and layout, 0-d included),
``numpy.ndarray`` (numeric dtypes), registered dataclasses, and exceptions (sent as
:class:`ExceptionInfo`: type name, message and traceback text). A bytearray or
memoryview keeps its kind (and travels out of band when large) at the top level and
as a tuple item; inside a list or dict msgpack packs it itself, as inline bytes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import traceback
from typing import Any, Sequence

import msgpack

from .errors import CodecError

# Extension type codes: part of the wire format.
_TUPLE, _TENSOR, _NDARRAY, _BYTES, _DATACLASS, _EXCEPTION, _OBJECT = 1, 2, 3, 4, 5, 6, 7
_BYTES_KINDS = {0: bytes, 1: bytearray, 2: memoryview}
OOB_THRESHOLD = 16 * 1024  # byte strings at least this long travel as their own frame
MAX_MESSAGE = int(os.environ.get("ZBUS_MAX_MESSAGE", 4 * 2**30))
_MAX_FRAMES = 1 << 20
MAX_DEPTH = 32  # nesting of extension types (tuples, dataclasses, ...) in one message

_registry: dict[str, type] = {}
_families: dict[str, TypeFamily] = {}


@dataclasses.dataclass(frozen=True)
class ExceptionInfo:
    """An exception as it travels: what it was, never the object itself."""

    type_name: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> ExceptionInfo:
        t = type(exc)
        name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        tb = "".join(traceback.format_exception(t, exc, exc.__traceback__))
        return cls(name, str(exc), tb)


def register(cls: type, name: str | None = None) -> type:
    """Allow dataclass ``cls`` on the wire. Both ends must register it under the
    same name (default ``module.QualName``). Usable as a class decorator."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    _registry[name or f"{cls.__module__}.{cls.__qualname__}"] = cls
    cls.__zbus_name__ = name or f"{cls.__module__}.{cls.__qualname__}"
    return cls


class TypeFamily:
    """A set of a library's own types that travel by name, for types too many or
    too varied to :func:`register` one by one (an engine's configs and step data).

    ``reduce(obj)`` returns ``(name, state)`` for an object of the family, else
    None; ``state`` is encoded like any other value. ``build(name, state)`` makes
    the object again on the receiving end and raises :class:`CodecError` for a
    name it does not allow: it must never import or run what the sender names
    beyond the family's own, fixed rules. Names travel as ``"family:name"``."""

    name: str = ""

    def reduce(self, obj: Any) -> tuple[str, Any] | None:
        raise NotImplementedError

    def build(self, name: str, state: Any) -> Any:
        raise NotImplementedError


def register_family(family: TypeFamily) -> TypeFamily:
    """Allow ``family``'s types on the wire, in this process (both ends must)."""
    if not family.name or ":" in family.name:
        raise ValueError("a type family needs a name without ':'")
    _families[family.name] = family
    return family


# --- encoding ----------------------------------------------------------------------


class _Encoder:
    """Encoding state of one ``encode`` call. Packers are reused per thread and per
    nesting depth (extension payloads are packed while the outer pack runs): a fresh
    Packer allocates a 256 KiB buffer, which would dominate a small RPC."""

    __slots__ = ("buffers", "depth", "packers")

    def __init__(self, packers: list) -> None:
        self.buffers: list[memoryview] = []
        self.depth = 0
        self.packers = packers

    def pack(self, obj: Any) -> bytes:
        if self.depth == len(self.packers):
            self.packers.append(msgpack.Packer(default=_default, strict_types=True, use_bin_type=True))
        packer = self.packers[self.depth]
        self.depth += 1
        try:
            return packer.pack(obj)
        except BaseException:
            packer.reset()
            raise
        finally:
            self.depth -= 1

    def oob(self, view: memoryview) -> int:
        self.buffers.append(view)
        return len(self.buffers) - 1

    def default(self, obj: Any) -> Any:
        t = type(obj)
        if t is tuple:  # large bytes arguments travel out of band (msgpack packs bytes inline)
            items = [_BigBytes(x) if (type(x) is bytes and len(x) >= OOB_THRESHOLD)
                     or type(x) in _KIND_OF else x for x in obj]
            return msgpack.ExtType(_TUPLE, self.pack(items))
        if t is _BigBytes:
            return self._bytes(obj.data, _KIND_OF.get(type(obj.data), 0))
        if t in (bytearray, memoryview):
            return self._bytes(obj, 1 if t is bytearray else 2)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return msgpack.ExtType(_TENSOR, self.pack(self._tensor(obj, torch)))
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            return msgpack.ExtType(_NDARRAY, self.pack(self._ndarray(obj, np)))
        name = getattr(t, "__zbus_name__", None)
        if name is not None and _registry.get(name) is t:
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return msgpack.ExtType(_DATACLASS, self.pack([name, fields]))
        for family in _families.values():
            reduced = family.reduce(obj)
            if reduced is not None:
                return msgpack.ExtType(_OBJECT, self.pack([f"{family.name}:{reduced[0]}", reduced[1]]))
        if isinstance(obj, BaseException):
            info = ExceptionInfo.from_exception(obj)
            return msgpack.ExtType(_EXCEPTION, self.pack([info.type_name, info.message, info.traceback]))
        if isinstance(obj, ExceptionInfo):
            return msgpack.ExtType(_EXCEPTION, self.pack([obj.type_name, obj.message, obj.traceback]))
        for base in (bool, int, float, str, bytes, list, dict):  # subclasses: IntEnum, np.float64, ...
            if isinstance(obj, base):
                return base(obj)
        if np is not None and isinstance(obj, np.generic):
            return obj.item()
        raise CodecError(f"cannot encode {t.__module__}.{t.__qualname__}: not a supported type "
                         "(register dataclasses with zbus.codec.register)")

    def _bytes(self, obj: Any, kind: int) -> Any:
        view = memoryview(obj)
        if not view.c_contiguous:  # a strided view: send a compact copy
            view = memoryview(view.tobytes())
        elif view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes >= OOB_THRESHOLD:
            return msgpack.ExtType(_BYTES, self.pack([kind, self.oob(view)]))
        return msgpack.ExtType(_BYTES, self.pack([kind, view.tobytes()]))

    def _tensor(self, t: Any, torch: Any) -> list:
        if t.device.type != "cpu":
            raise CodecError(f"cannot send a tensor on {t.device}: move it to the CPU first")
        if t.layout != torch.strided or t.is_quantized:
            raise CodecError(f"cannot send a {t.layout} tensor: only dense strided tensors")
        t = t.detach().resolve_conj().resolve_neg()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.numel() == 0:
            return [dtype, list(t.shape), None, None]
        strides = list(t.stride())
        if not t.is_contiguous() and not _dense(t.shape, strides):
            t = t.contiguous()  # overlapping or gapped layout: send a compact copy
            strides = list(t.stride())
        # The elements tile one block (size-1 dims may have any stride): send it as is.
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())
        raw = flat.view(torch.uint8).numpy()
        return [dtype, list(t.shape), strides, self.oob(memoryview(raw).cast("B"))]

    def _ndarray(self, a: Any, np: Any) -> list:
        if a.dtype.kind not in _NP_KINDS or a.dtype.fields is not None:
            raise CodecError(f"cannot send a numpy array of dtype {a.dtype}: numeric dtypes only")
        shape = list(a.shape)
        a = np.ascontiguousarray(a)  # (which turns a 0-d array into a 1-d one)
        if a.nbytes == 0:
            return [a.dtype.str, shape, None]
        return [a.dtype.str, shape, self.oob(memoryview(a.reshape(-1).view(np.uint8)))]


_NP_KINDS = "biufc?"
_NP_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")  # a numeric dtype as ``dtype.str`` writes it
_KIND_OF = {bytearray: 1, memoryview: 2}  # the wire kinds of _BYTES_KINDS


class _BigBytes:
    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the elements exactly tile a block of memory (a permuted contiguous
    layout, e.g. a transpose), so the block can be sent as it is."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(shape, strides) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


_local = threading.local()


def _default(obj: Any) -> Any:
    return _local.encoder.default(obj)


def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames: ``[header, *buffers]``. Buffers are views of the
    caller's memory, valid until the caller changes it: send before that."""
    outer = getattr(_local, "encoder", None)
    if outer is None:
        packers = getattr(_local, "packers", None)
        if packers is None:
            packers = _local.packers = []
    else:  # encode() called from inside an encode (a dataclass field's property, say)
        packers = []
    enc = _local.encoder = _Encoder(packers)
    try:
        header = enc.pack(_BigBytes(obj) if type(obj) in _KIND_OF else obj)
    except CodecError:
        raise
    except Exception as e:  # noqa: BLE001 - a property of the object raised, say
        raise CodecError(f"cannot encode: {type(e).__name__}: {e}") from e
    finally:
        _local.encoder = outer
    return [header, *enc.buffers]


# --- decoding ----------------------------------------------------------------------


class _Decoder:
    __slots__ = ("frames", "depth")

    def __init__(self, frames: Sequence[Any]) -> None:
        self.frames = frames
        self.depth = 0

    def unpack(self, data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=self.ext, raw=False, strict_map_key=False,
                               use_list=True)

    def frame(self, index: Any) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.frames) - 1:
            raise CodecError(f"buffer index {index!r} out of range")
        return self.frames[index + 1]

    def ext(self, code: int, data: bytes) -> Any:
        # Each level is a nested unpack using ~40 KiB of C stack: ~200 levels (a 1 KiB
        # message) would overflow it and kill the process.
        if self.depth >= MAX_DEPTH:
            raise CodecError(f"extension types nested deeper than {MAX_DEPTH}")
        self.depth += 1
        try:
            body = self.unpack(data)
        finally:
            self.depth -= 1
        if code == _TUPLE and type(body) is list:
            return tuple(body)
        if code == _BYTES:
            return self._bytes(body)
        if code == _TENSOR:
            return self._tensor(body)
        if code == _NDARRAY:
            return self._ndarray(body)
        if code == _DATACLASS:
            return self._dataclass(body)
        if code == _OBJECT:
            return self._object(body)
        if code == _EXCEPTION and _shape(body, str, str, str):
            return ExceptionInfo(*body)
        raise CodecError(f"unknown or malformed extension type {code}")

    def _bytes(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 2 and body[0] in _BYTES_KINDS):
            raise CodecError("malformed bytes extension")
        kind, data = _BYTES_KINDS[body[0]], body[1]
        if type(data) is int:
            data = self.frame(data)
        elif type(data) is not bytes:
            raise CodecError("malformed bytes extension")
        if kind is memoryview:  # writable, like one decoded from its own frame
            return memoryview(_writable(data) if type(data) is memoryview else bytearray(data))
        return kind(data)

    def _tensor(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 4 and type(body[0]) is str and _ints(body[1])):
            raise CodecError("malformed tensor extension")
        import torch  # lazily: only a peer that sends tensors makes us load torch

        dtype = _torch_dtypes(torch).get(body[0])
        if dtype is None:
            raise CodecError(f"unknown tensor dtype {body[0]!r}")
        shape, strides, index = body[1], body[2], body[3]
        if index is None:
            if _numel(shape) != 0:
                raise CodecError("tensor without data")
            return torch.empty(shape, dtype=dtype)
        if not _ints(strides) or len(strides) != len(shape):
            raise CodecError("malformed tensor strides")
        data = _writable(self.frame(index))
        itemsize = dtype.itemsize
        numel = _numel(shape)
        if len(data) != numel * itemsize or not _dense(shape, strides):
            raise CodecError("tensor data does not match its shape and dtype")
        flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        return flat.as_strided(shape, strides)

    def _ndarray(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 3 and type(body[0]) is str and _ints(body[1])):
            raise CodecError("malformed ndarray extension")
        import numpy as np

        if not _NP_DTYPE.fullmatch(body[0]):  # only what encode writes: no aliases, no parsing
            raise CodecError(f"bad ndarray dtype {body[0][:20]!r}")
        try:
            dtype = np.dtype(body[0])
        except TypeError as e:
            raise CodecError(f"bad ndarray dtype {body[0]!r}") from e
        if dtype.kind not in _NP_KINDS or dtype.fields is not None:
            raise CodecError(f"refused ndarray dtype {body[0]!r}")
        shape = body[1]
        if body[2] is None:
            if _numel(shape) != 0:
                raise CodecError("ndarray without data")
            return np.empty(shape, dtype)
        data = _writable(self.frame(body[2]))
        if len(data) != _numel(shape) * dtype.itemsize:
            raise CodecError("ndarray data does not match its shape and dtype")
        return np.frombuffer(data, dtype).reshape(shape)

    def _dataclass(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 2 and type(body[0]) is str and type(body[1]) is dict):
            raise CodecError("malformed dataclass extension")
        cls = _registry.get(body[0])
        if cls is None:
            raise CodecError(f"unregistered type {body[0]!r} (register it with zbus.codec.register "
                             "on both ends)")
        try:
            return cls(**body[1])
        except TypeError as e:
            raise CodecError(f"cannot build {body[0]}: {e}") from e

    def _object(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 2 and type(body[0]) is str):
            raise CodecError("malformed object extension")
        family_name, _, name = body[0].partition(":")
        family = _families.get(family_name)
        if family is None:
            raise CodecError(f"type {body[0][:200]!r} of an unknown family (register_family on both ends)")
        try:
            return family.build(name, body[1])
        except CodecError:
            raise
        except Exception as e:  # noqa: BLE001 - the family's constructor refused the state
            raise CodecError(f"cannot build {body[0][:200]}: {type(e).__name__}: {e}") from e


def decode(frames: Sequence[Any], max_bytes: int | None = None) -> Any:
    """Decode frames made by :func:`encode`. Raises :class:`CodecError` on anything
    malformed, truncated, unknown or larger than ``max_bytes`` (default
    ``ZBUS_MAX_MESSAGE``, 4 GiB)."""
    limit = MAX_MESSAGE if max_bytes is None else max_bytes
    if not frames or len(frames) > _MAX_FRAMES:
        raise CodecError(f"a message needs 1 to {_MAX_FRAMES} frames, got {len(frames)}")
    views = [f if isinstance(f, memoryview) else memoryview(f) for f in frames]
    size = sum(v.nbytes for v in views)
    if size > limit:
        raise CodecError(f"message of {size} bytes exceeds the limit of {limit} bytes")
    try:
        return _Decoder(views).unpack(views[0])
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several types on bad input; none may escape
        raise CodecError(f"cannot decode message: {type(e).__name__}: {e}") from e


def _writable(view: memoryview) -> Any:
    """The buffer itself if writable (ring frames are), else a private copy: a
    tensor must never alias read-only or transport-owned memory."""
    return view if not view.readonly else bytearray(view)


def _ints(x: Any) -> bool:
    return type(x) is list and all(type(v) is int and v >= 0 for v in x) and len(x) <= 64


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shape(body: Any, *types: type) -> bool:
    return type(body) is list and len(body) == len(types) and all(
        type(v) is t for v, t in zip(body, types))


_dtype_cache: dict[str, Any] = {}


def _torch_dtypes(torch: Any) -> dict[str, Any]:
    if not _dtype_cache:
        for name in dir(torch):
            value = getattr(torch, name)
            if isinstance(value, torch.dtype) and not str(value).startswith("torch.q"):
                _dtype_cache[str(value).removeprefix("torch.")] = value
    return _dtype_cache
