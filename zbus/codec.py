"""The wire codec: msgpack with a few extension types, never pickle.

``encode(obj)`` returns frames ``[header, buf0, buf1, ...]``: the msgpack header
and the raw data of large buffers (tensors, arrays, big bytes) as separate
zero-copy views, so a transport can send them without concatenating.
``decode(frames)`` turns them back into plain data. Decoding never imports a
module or runs code the sender names: extension types map to a fixed table, dtypes
to a whitelist, and dataclasses to the ones registered with :func:`register`
(torch or numpy is loaded when a tensor or an array comes; ``plain=True`` takes
plain data alone, as a message that should hold nothing else is decoded).

Supported: None, bool, int, float, str, bytes, bytearray, memoryview, list, tuple
(kept as tuple), dict, ``torch.Tensor`` (CPU, ``TENSOR_DTYPES``, any layout, 0-d included),
``numpy.ndarray`` (numeric dtypes), registered dataclasses, and exceptions (sent as
:class:`ExceptionInfo`: type name, message and traceback text). A bytearray or
memoryview keeps its kind (and travels out of band when large) at the top level and
as a tuple item; inside a list or dict msgpack packs it itself, as inline bytes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

import msgpack

from .config import DEFAULT_MAX_MESSAGE, size_setting
from .errors import CodecError, brief
from .shm import core as _core

# Extension type codes: part of the wire format.
_TUPLE, _TENSOR, _NDARRAY, _BYTES, _DATACLASS, _EXCEPTION, _OBJECT = 1, 2, 3, 4, 5, 6, 7
_PLAIN_EXTS = (_TUPLE, _BYTES, _EXCEPTION)  # what decode(plain=True) takes
_BYTES_KINDS = {0: bytes, 1: bytearray, 2: memoryview}
OOB_THRESHOLD = 16 * 1024  # byte strings at least this long travel as their own frame
MAX_MESSAGE = size_setting("ZBUS_MAX_MESSAGE", DEFAULT_MAX_MESSAGE)
_MAX_FRAMES = 1 << 20
# Nesting of maps, arrays and extension types in one message (a tuple is two levels:
# the extension and its list). Each extension level is also a nested msgpack unpack
# using ~40 KiB of C stack: 64 of them fit the 8 MiB of a thread's stack.
MAX_DEPTH = 64
BUDGET_FACTOR = 4  # a decode holds copies of at most this many times the message size (+ 1 MiB)
# The Python objects a header becomes may take at most OBJECTS_MIN bytes plus
# OBJECTS_FACTOR times the header's size, as estimated from each item by the walk of
# the header (_walk): one byte of msgpack can become a 64-byte empty dict, so 256 MiB
# of them would take 18 GiB. The estimate is high by 1.3x to 3.5x: lists of ints or
# floats measure 6x to 10x their size (estimated 12x to 19x), of small dicts 6x (21x),
# of pairs of small ints 25x (37x: refused past 6 MiB of header), of one-key dicts in
# one-key dicts 48x (71x: refused past 0.8 MiB), of empty memoryviews in the
# arguments tuple 63x (73x: refused past 0.8 MiB).
OBJECTS_MIN = 32 * 2**20
OBJECTS_FACTOR = 32
# Tuples and registered objects in one message that differ from the first one of
# their hash. A dict compares a new key with every key of its hash, and a sender
# can choose a tuple's hash (CPython's can be undone from its items'; a frozen
# dataclass hashes as the tuple of its fields): 8192 such keys took 0.57 s.
MAX_HASH_COLLISIONS = 64

_registry: dict[str, type] = {}
_families: dict[str, TypeFamily] = {}
# Types a family reduced: the checks before the families' are by type, so such a
# type goes straight to its family next time (an engine sends the same few types).
_family_of: dict[type, TypeFamily] = {}


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
        try:
            message = str(exc)
        except Exception as e:  # noqa: BLE001 - its type and traceback still travel
            message = f"<its text could not be made: {type(e).__name__}>"
        return cls(name, message, tb)


def _utf8(text: Any) -> Any:
    """``text`` as UTF-8 can carry it: a file name or argument Python decoded with
    ``surrogateescape`` holds lone surrogates, which msgpack refuses (the error
    would travel as a CodecError of its own instead). Kept in backslash form."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if type(text) is str else text


def register(cls: type, name: str | None = None) -> type:
    """Allow dataclass ``cls`` on the wire. Both ends must register it under the
    same name (default ``module.QualName``). Usable as a class decorator."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    _registry[name or f"{cls.__module__}.{cls.__qualname__}"] = cls
    _family_of.clear()  # a registered type is no longer a family's
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
    _family_of.clear()
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
        family = _family_of.get(t)
        if family is not None and _families.get(family.name) is family:
            reduced = family.reduce(obj)
            if reduced is not None:
                return self._object(family, reduced)
        if t is tuple:  # large bytes arguments travel out of band (msgpack packs bytes inline)
            items = [_BigBytes(x) if (type(x) is bytes and len(x) >= OOB_THRESHOLD)
                     or type(x) in _KIND_OF else x for x in obj]
            return _ext(_TUPLE, self.pack(items))
        if t is _BigBytes:
            return self._bytes(obj.data, _KIND_OF.get(type(obj.data), 0))
        if t in (bytearray, memoryview):
            return self._bytes(obj, 1 if t is bytearray else 2)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return _ext(_TENSOR, self.pack(self._tensor(obj, torch)))
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            return _ext(_NDARRAY, self.pack(self._ndarray(obj, np)))
        name = getattr(t, "__zbus_name__", None)
        if name is not None and _registry.get(name) is t:
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return _ext(_DATACLASS, self.pack([name, fields]))
        # An error travels as its type's name, text and traceback, whatever family
        # its module's types belong to: the receiver may not rebuild that class.
        if isinstance(obj, (BaseException, ExceptionInfo)):
            info = obj if isinstance(obj, ExceptionInfo) else ExceptionInfo.from_exception(obj)
            return _ext(_EXCEPTION, self.pack([_utf8(info.type_name), _utf8(info.message),
                                               _utf8(info.traceback)]))
        for family in _families.values():
            reduced = family.reduce(obj)
            if reduced is not None:
                _family_of[t] = family
                return self._object(family, reduced)
        for base in (bool, int, float, str, bytes, list, dict):  # subclasses: IntEnum, np.float64, ...
            if isinstance(obj, base):
                return base(obj)
        if np is not None and isinstance(obj, np.generic):
            return obj.item()
        raise CodecError(f"cannot encode {t.__module__}.{t.__qualname__}: not a supported type "
                         "(register dataclasses with zbus.codec.register)")

    def _object(self, family: TypeFamily, reduced: tuple[str, Any]) -> msgpack.ExtType:
        return _ext(_OBJECT, self.pack([f"{family.name}:{reduced[0]}", reduced[1]]))

    def _bytes(self, obj: Any, kind: int) -> Any:
        view = memoryview(obj)
        if not view.c_contiguous:  # a strided view: send a compact copy
            view = memoryview(view.tobytes())
        elif view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes >= OOB_THRESHOLD:
            return _ext(_BYTES, self.pack([kind, self.oob(view)]))
        return _ext(_BYTES, self.pack([kind, view.tobytes()]))

    def _tensor(self, t: Any, torch: Any) -> list:
        if not t.is_cpu:
            raise CodecError(f"cannot send a tensor on {t.device}: move it to the CPU first")
        if t.layout is not torch.strided:  # (quantized dtypes are not in the table)
            raise CodecError(f"cannot send a {t.layout} tensor: only dense strided tensors")
        dtype = _dtype_names(torch).get(t.dtype)
        if dtype is None:
            raise CodecError(f"cannot send a tensor of dtype {str(t.dtype).removeprefix('torch.')}: "
                             "not one of zbus.codec.TENSOR_DTYPES")
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        nbytes = t.nbytes  # numel x item size, whatever the layout
        if nbytes == 0:
            return [dtype, list(t.shape), None, None]
        strides = list(t.stride())
        if not t.is_contiguous() and not _dense(t.shape, strides):
            t = t.detach().contiguous()  # overlapping or gapped layout: send a compact copy
            strides = list(t.stride())
        # The elements tile one block (size-1 dims may have any stride): send it as is.
        return [dtype, list(t.shape), strides, self.oob(_tensor_bytes(t))]

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


def _ext(code: int, body: bytes) -> msgpack.ExtType:
    """``msgpack.ExtType(code, body)`` without its argument checks (a quarter of a
    microsecond each, three times for a tensor in a call): ours are always right."""
    return _new_tuple(msgpack.ExtType, (code, body))


_new_tuple = tuple.__new__


def _tensor_bytes(t: Any) -> memoryview:
    """A zero-copy byte view of the block a dense CPU tensor's elements tile, with
    no numpy (torch can run without it). The view keeps the tensor alive."""
    block = (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    block._zbus_tensor = t  # the memoryview holds the ctypes array, which holds the tensor
    return memoryview(block).cast("B")


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


def nbytes(frames: Sequence[Any]) -> int:
    """The bytes of a message's frames (what ``ZBUS_MAX_MESSAGE`` bounds)."""
    return sum(memoryview(f).nbytes for f in frames)


def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames: ``[header, *buffers]``. Buffers are views of the
    caller's memory, valid until the caller changes it: send before that (every
    zbus send copies what it keeps)."""
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
    __slots__ = ("frames", "used", "budget", "hashes", "collisions", "plain")

    def __init__(self, frames: Sequence[Any], budget: int, plain: bool = False) -> None:
        self.frames = frames
        self.plain = plain
        self.used: set[int] = set()
        self.budget = budget
        self.hashes: dict[int, Any] = {}  # the first tuple or object of each hash
        self.collisions: dict[int, int] = {}  # of each hash: values unlike its first

    def spend(self, nbytes: int) -> None:
        """Count bytes that decoding materialises (copies of frames and bodies)."""
        self.budget -= nbytes
        if self.budget < 0:
            raise CodecError("decoding this message would exceed its byte budget "
                             f"({BUDGET_FACTOR}x its size + 1 MiB)")

    def unpack(self, data: Any) -> Any:
        n = len(data)  # no declared length may reach past the data
        return msgpack.unpackb(data, ext_hook=self.ext, raw=False, strict_map_key=False, use_list=True,
                               max_str_len=n, max_bin_len=n, max_ext_len=n, max_array_len=n,
                               max_map_len=n // 2)

    def frame(self, index: Any) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.frames) - 1:
            raise CodecError(f"buffer index {brief(index)} out of range")  # (an array's repr: 17x it)
        if index in self.used:  # encode never reuses one; each use could copy the frame again
            raise CodecError(f"buffer index {index} used twice")
        self.used.add(index)
        return self.frames[index + 1]

    def copy(self, data: Any, kind: type = bytearray) -> Any:
        self.spend(len(data))
        return kind(data)

    def private(self, view: memoryview) -> Any:
        """The frame itself if writable, else a private copy (see :func:`decode`)."""
        return view if not view.readonly else self.copy(view)

    def ext(self, code: int, data: bytes) -> Any:
        # msgpack hands each body over as a copy, nesting copies again, and frees it
        # once this returns: what counts is the bodies held at once (those around this
        # one), not every one made (a list of 4000 records makes 4000 copies in turn)
        self.spend(len(data))
        try:
            if data and data[0] in _EXT_BYTES:
                # (every body is a list) One extension right inside another would nest a
                # msgpack unpacker (tens of KiB of C stack) per level the depth check
                # counts: 64, a crash on a thread stack of 2 MiB; a list between keeps it to 32.
                raise CodecError(f"extension type {code} right inside another")
            if self.plain and code not in _PLAIN_EXTS:
                raise CodecError(f"extension type {code} (a tensor, array or registered type) where plain "
                                 "data alone may come")
            body = self.unpack(data)
            if code == _TUPLE and type(body) is list:
                return self._count_hash(tuple(body))
            if code == _BYTES:
                return self._bytes(body)
            if code == _TENSOR:
                return self._tensor(body)
            if code == _NDARRAY:
                return self._ndarray(body)
            if code == _DATACLASS:
                return self._count_hash(self._dataclass(body))
            if code == _OBJECT:
                return self._count_hash(self._object(body))
            if code == _EXCEPTION and _shape(body, str, str, str):
                return ExceptionInfo(*body)
            raise CodecError(f"unknown or malformed extension type {code}")
        finally:
            self.budget += len(data)

    def _count_hash(self, value: Any) -> Any:
        """``value``, counted if it differs from the first value of its hash: past
        MAX_HASH_COLLISIONS of one hash the message is refused, before msgpack makes
        dict keys of them, each compared with all of its hash before it (n**2 / 2
        comparisons). Per hash: pairs that collide (``hash(-1) == hash(-2)``) are
        common in plain data, and cost nothing much."""
        hash_of = type(value).__hash__
        if hash_of is None or hash_of is _IDENTITY_HASH:  # unhashable, or no two alike
            return value
        try:
            h = hash(value)
        except Exception:  # noqa: BLE001 - a list, a writable memoryview inside: no key either
            return value
        first = self.hashes.setdefault(h, value)
        if first is not value and first != value:
            self.collisions[h] = count = self.collisions.get(h, 0) + 1
            if count > MAX_HASH_COLLISIONS:
                raise CodecError(f"more than {MAX_HASH_COLLISIONS} tuples or objects that differ from "
                                 "another of their hash (as map keys, each is compared with all before it)")
        return value

    def _bytes(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 2 and body[0] in _BYTES_KINDS):
            raise CodecError("malformed bytes extension")
        kind, data = _BYTES_KINDS[body[0]], body[1]
        if type(data) is int:
            data = self.frame(data)
        elif type(data) is not bytes:
            raise CodecError("malformed bytes extension")
        if kind is memoryview:  # writable, like one decoded from its own frame
            return memoryview(self.private(data) if type(data) is memoryview else self.copy(data))
        return data if kind is bytes and type(data) is bytes else self.copy(data, kind)

    def _tensor(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 4 and type(body[0]) is str and _ints(body[1])):
            raise CodecError("malformed tensor extension")
        torch = sys.modules.get("torch")
        if torch is None:
            import torch  # lazily: only a peer that sends tensors makes us load torch
        dtype = _torch_dtypes(torch).get(body[0])
        if dtype is None:
            raise CodecError(f"unknown tensor dtype {body[0][:40]!r}")
        shape, strides, index = body[1], body[2], body[3]
        if index is None:
            if _numel(shape) != 0:
                raise CodecError("tensor without data")
            return torch.empty(shape, dtype=dtype)
        if not _ints(strides) or len(strides) != len(shape):
            raise CodecError("malformed tensor strides")
        data = self.private(self.frame(index))
        numel = _numel(shape)
        if len(data) != numel * dtype.itemsize or not numel or (
                strides != [1] and not _dense(shape, strides)):
            raise CodecError("tensor data does not match its shape and dtype")
        if dtype is torch.bool and int(torch.frombuffer(data, dtype=torch.uint8).max()) > 1:
            raise CodecError("bool tensor data other than 0 and 1")
        # One torch call for most tensors (1-d, contiguous), two for the others: each
        # costs microseconds on a worker woken for the call, where caches are cold.
        t = torch.frombuffer(data, dtype=dtype)
        return t if strides == [1] else t.as_strided(shape, strides)

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
        data = self.private(self.frame(body[2]))
        if len(data) != _numel(shape) * dtype.itemsize:
            raise CodecError("ndarray data does not match its shape and dtype")
        if dtype.kind == "b" and len(data) and int(np.frombuffer(data, np.uint8).max()) > 1:
            raise CodecError("bool ndarray data other than 0 and 1")  # (as for tensors)
        return np.frombuffer(data, dtype).reshape(shape)

    def _dataclass(self, body: Any) -> Any:
        if not (type(body) is list and len(body) == 2 and type(body[0]) is str and type(body[1]) is dict):
            raise CodecError("malformed dataclass extension")
        cls = _registry.get(body[0])
        if cls is None:
            raise CodecError(f"unregistered type {body[0][:200]!r} (register it with zbus.codec.register "
                             "on both ends)")
        return _build_dataclass(cls, body[0][:200], body[1])

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
            raise CodecError(f"cannot build {body[0][:200]}: {type(e).__name__}: {str(e)[:200]}") from e


def decode(frames: Sequence[Any], max_bytes: int | None = None, plain: bool = False) -> Any:
    """Decode frames made by :func:`encode`. Raises :class:`CodecError` on anything
    malformed, truncated, unknown, nested deeper than ``MAX_DEPTH`` or larger than
    ``max_bytes`` (default ``ZBUS_MAX_MESSAGE``, 4 GiB); with ``plain``, on a
    tensor, an array or a registered type too (tuples, bytes and exceptions pass):
    nothing is loaded or built for them.

    Each buffer frame is used at most once, and what decoding copies (read-only
    frames, bytearrays, and the extension bodies held at once) stays within
    ``BUDGET_FACTOR`` times the message size plus 1 MiB. Tensors, arrays and
    memoryviews use a writable frame in place: pass only frames that belong to
    this message alone (a private ring buffer, a ZeroMQ frame received with
    ``copy=False``); read-only ones are copied."""
    limit = MAX_MESSAGE if max_bytes is None else max_bytes
    if not frames or len(frames) > _MAX_FRAMES:
        raise CodecError(f"a message needs 1 to {_MAX_FRAMES} frames, got {len(frames)}")
    views = [f if isinstance(f, memoryview) else memoryview(f) for f in frames]
    size = sum(v.nbytes for v in views)
    if size > limit:
        raise CodecError(f"message of {size} bytes exceeds the limit of {limit} bytes")
    try:  # (msgpack reads the checked copy: a shared page may change after the check)
        return _Decoder(views, BUDGET_FACTOR * size + 2**20, plain).unpack(_check_header(views[0]))
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several types on bad input; none may escape
        raise CodecError(f"cannot decode message: {type(e).__name__}: {e}") from e


def _build_dataclass(cls: type, name: str, values: dict) -> Any:
    """``cls`` made as pickle makes a dataclass: its fields set (a missing one to its
    default), neither ``__init__`` nor ``__post_init__`` run. They ran on the sender,
    and may change what they are given (a field scaled twice) or take other
    arguments (``init=False`` fields, ``InitVar``s). Only fields travel: an attribute
    that ``__post_init__`` sets and no field declares is not there."""
    obj = cls.__new__(cls)  # (not object's: a dataclass may be an Exception, say)
    fields = dataclasses.fields(cls)
    for f in fields:
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise CodecError(f"cannot build {name}: no field {f.name!r}")
        object.__setattr__(obj, f.name, value)  # (frozen ones too)
    unknown = values.keys() - {f.name for f in fields}
    if unknown:
        named = ", ".join(sorted(map(brief, unknown))[:5])  # (no key's whole repr: a tensor's is 16x it)
        raise CodecError(f"cannot build {name}: unknown fields {named}")
    return obj


# How msgpack lays out each type byte (github.com/msgpack/msgpack/blob/master/spec.md).
_FIXED = bytearray(256)  # size of an item that is a type byte and a fixed payload; else 0
for _b in [*range(0x00, 0x80), *range(0xe0, 0x100), 0xc0, 0xc2, 0xc3]:
    _FIXED[_b] = 1
for _b in range(0xa0, 0xc0):  # fixstr
    _FIXED[_b] = 1 + (_b & 0x1f)
for _b, _n in {0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9, 0xd0: 2, 0xd1: 3, 0xd2: 5,
               0xd3: 9}.items():
    _FIXED[_b] = _n
_BLOB = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}  # bin, str: width of the length
_LIST = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # width of the count, items each
_FIXEXT = {0xd4: 1, 0xd5: 2, 0xd6: 4, 0xd7: 8, 0xd8: 16}  # body size
_EXT = {0xc7: 1, 0xc8: 2, 0xc9: 4}  # width of the body size
_ONE_BYTE_ITEMS = re.compile(rb"[\x00-\x7f\xa0\xc0\xc2\xc3\xe0-\xff]+")
_EXT_BYTES = frozenset([*_FIXEXT, *_EXT])
_LEVELS = bytes([*range(0x80, 0xa0), *_LIST, *_EXT_BYTES])  # type bytes that open a level
# Extension type -1 is msgpack's timestamp, which msgpack builds itself (no ext_hook)
# from a body of 4, 8 or 12 bytes: a header that may hold one is walked, which
# refuses it like any code not in _EXT_CODES.
_TIMESTAMPS = (b"\xd6\xff", b"\xd7\xff", *(bytes([0xc7, n, 0xff]) for n in (4, 8, 12)),
               *(bytes([0xc8, 0, n, 0xff]) for n in (4, 8, 12)),
               *(bytes([0xc9, 0, 0, 0, n, 0xff]) for n in (4, 8, 12)))
_IDENTITY_HASH = object.__hash__
_EXT_CODES = frozenset({_TUPLE, _TENSOR, _NDARRAY, _BYTES, _DATACLASS, _EXCEPTION, _OBJECT})
# What an extension builds beyond its list, where more than 64 bytes (measured,
# 64-bit CPython, torch 2.13): a memoryview (its bytearray, buffer and view); a
# tensor on a frame (from the frame, then a strided view of it: 1454 B for a 0-d
# tensor in all); an array on a frame (839 B).
_EXT_OBJECT = {_BYTES: 304, _TENSOR: 1280, _NDARRAY: 640}
_NEGATIVE_FIXINTS = bytes(range(0xe0, 0xfb))  # -32..-6: ints Python makes anew (from -5 it keeps)
_INT_OBJECT = 40  # bytes of such an int, and its slot
_WORST_ITEM = 160 + 16  # bytes of objects one header byte may become: an empty map in an array


def _check_header(view: memoryview) -> bytes:
    """A copy of the header, refused if nested deeper than MAX_DEPTH, counting every
    map, array and extension type, or if its objects would take more than
    OBJECTS_MIN + OBJECTS_FACTOR times its size, before msgpack builds anything:
    msgpack alone nests 1024 deep, beyond what ``str`` or ``==`` of the value
    survive, and makes a 64-byte dict of one byte. Only a header with more bytes
    that may open a level than MAX_DEPTH, or too big for the worst case to fit, is
    walked."""
    data = bytes(view)
    limit = OBJECTS_MIN + OBJECTS_FACTOR * len(data)
    if len(data) - len(data.translate(None, _LEVELS)) > MAX_DEPTH or len(data) * _WORST_ITEM > limit or (
            b"\xff" in data and any(t in data for t in _TIMESTAMPS)):
        try:
            _walk(data, limit - _negative_fixints(data))
        except IndexError:
            raise CodecError("truncated header") from None
        except _OverBudget:
            raise _too_many_objects(data) from None
    return data


class _OverBudget(Exception):
    """The walk's estimate passed its budget (it stops there)."""


def _too_many_objects(header: bytes) -> CodecError:
    """The refusal of a header over its object budget, naming the whole limit (the
    budget the walk is given is that less the negative fixints' share)."""
    limit = OBJECTS_MIN + OBJECTS_FACTOR * len(header)
    return CodecError(f"decoding this header would build over {limit >> 20} MiB of objects "
                      f"({OBJECTS_MIN >> 20} MiB + {OBJECTS_FACTOR}x its size): too many small "
                      "maps, arrays or values (send bulk data as bytes, arrays or tensors)")


def _negative_fixints(data: bytes) -> int:
    """Negative fixints are one-byte items that make an int object: their bytes,
    counted as if every such byte were one (an upper bound)."""
    return _INT_OBJECT * (len(data) - len(data.translate(None, _NEGATIVE_FIXINTS)))


def object_bytes(header: Any, most: int | None = None) -> int:
    """The estimate of what decoding a message whose first frame is ``header``
    builds as Python objects, in bytes (see OBJECTS_MIN), not counting its buffer
    frames: for a receiver that keeps decoded messages and bounds them by bytes,
    before it decodes them. Past ``most`` the walk stops and returns ``most + 1``
    (a container's declared size counts when it opens: a small header that
    declares many items costs microseconds to refuse). CodecError for a header
    decode would refuse."""
    data = bytes(header)
    ints = _negative_fixints(data)
    try:
        return ints + _walk(data, None if most is None else most - ints)
    except IndexError:
        raise CodecError("truncated header") from None
    except _OverBudget:
        return most + 1


def _walk(data: bytes, budget: int | None = None) -> int:
    """:func:`_walk_py`, in the compiled core where it is built (item by item in
    Python, a header built to be slow to check took seconds a MiB)."""
    if _core is None:
        return _walk_py(data, budget)
    why, value = _core.walk(data, _NO_BUDGET if budget is None else min(budget, _NO_BUDGET))
    if why:
        raise _WALK_REFUSALS[why](value)
    return value


_NO_BUDGET = (1 << 63) - 1
_WALK_REFUSALS: dict[int, Callable[[int], Exception]] = {  # the compiled walk's answers, as _walk_py's
    1: lambda _: IndexError("index out of range"),
    2: lambda _: _OverBudget(),
    3: lambda _: CodecError("an extension body of the wrong length"),
    4: lambda _: CodecError("unknown extension type"),
    5: lambda b: CodecError(f"reserved type byte 0x{b:02x}"),
    6: lambda _: CodecError("a count or length reaches past the end of the header"),
    7: lambda _: CodecError(f"maps, arrays and extension types nested deeper than {MAX_DEPTH}"),
}


def _walk_py(data: bytes, budget: int | None = None) -> int:
    """Follow the type bytes: nesting, counts and lengths that reach past the end,
    extension codes and body lengths (one list of levels, no recursion). With a
    ``budget``, also estimate the bytes of the objects msgpack would build, from
    CPython's sizes (64-bit): a list 64 bytes and 16 an item (a slot, and a
    slot of the tuple an extension makes of it), a dict 160 and 48 an entry, an
    int, float or short str of n bytes 48 + 2n, a longer str or bytes 56 + 2n,
    an extension 64 or more (``_EXT_OBJECT``: a tensor 1280); refuse the
    header once that passes ``budget`` (``_OverBudget``). Returns the estimate."""
    end, pos, fixed = len(data), 0, _FIXED
    left, body_end = 1, -1  # items left at this level; where its extension body ends
    stack: list[tuple[int, int]] = []
    spent, budget = 0, (1 << 63) if budget is None else budget
    while True:
        while left and fixed[data[pos]]:  # scalars, the bulk of a long header: by runs
            size = fixed[data[pos]]
            if size == 1:  # nil, booleans, small ints, "": objects Python keeps once
                run = _ONE_BYTE_ITEMS.match(data, pos, pos + left).end() - pos
            else:  # items of one type byte (floats, uint16, ...) at a fixed stride
                types = data[pos:pos + size * min(left, 256):size]
                run = len(types) - len(types.lstrip(types[:1]))
                spent += run * (48 + 2 * size)
            pos += size * run
            left -= run
        if not left:
            if body_end >= 0 and pos != body_end:
                raise CodecError("an extension body of the wrong length")
            if not stack:
                if spent > budget:  # scalars after the last container
                    raise _OverBudget
                return spent
            left, body_end = stack.pop()
            continue
        b = data[pos]
        left -= 1
        if b in _BLOB:
            w = _BLOB[b]
            n = int.from_bytes(data[pos + 1:pos + 1 + w], "big")
            pos += 1 + w + n
            spent += 56 + 2 * n
            continue
        if 0x80 <= b <= 0x9f:  # fixmap, fixarray
            items, pos, inner_end = (b & 0x0f) * (2 if b < 0x90 else 1), pos + 1, -1
            spent += 160 + 24 * items if b < 0x90 else 64 + 16 * items
        elif b in _LIST:
            w, each = _LIST[b]
            items = int.from_bytes(data[pos + 1:pos + 1 + w], "big") * each
            pos, inner_end = pos + 1 + w, -1
            spent += 160 + 24 * items if each == 2 else 64 + 16 * items
        elif b in _FIXEXT or b in _EXT:
            w = _EXT.get(b, 0)
            size = _FIXEXT[b] if b in _FIXEXT else int.from_bytes(data[pos + 1:pos + 1 + w], "big")
            code = data[pos + 1 + w]
            if code not in _EXT_CODES:
                raise CodecError("unknown extension type")
            items, pos = 1, pos + 2 + w
            inner_end = pos + size
            spent += _EXT_OBJECT.get(code, 64)
        else:
            raise CodecError(f"reserved type byte 0x{b:02x}")
        if items > (end if inner_end < 0 else inner_end) - pos:  # each item takes a byte at least
            raise CodecError("a count or length reaches past the end of the header")
        if len(stack) >= MAX_DEPTH:
            raise CodecError(f"maps, arrays and extension types nested deeper than {MAX_DEPTH}")
        if spent > budget:
            raise _OverBudget
        stack.append((left, body_end))
        left, body_end = items, inner_end


def _ints(x: Any) -> bool:
    """A list of at most 64 ints >= 0 (a loop: half the time of ``all`` on a generator)."""
    if type(x) is not list or len(x) > 64:
        return False
    for v in x:
        if type(v) is not int or v < 0:
            return False
    return True


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shape(body: Any, *types: type) -> bool:
    return type(body) is list and len(body) == len(types) and all(
        type(v) is t for v, t in zip(body, types))


# The tensor dtypes on the wire: the real numeric ones, and bool (whose bytes are
# checked). Sub-byte, bits, quantized and complex32 types are refused both ways.
TENSOR_DTYPES = ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
                 "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
                 "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_dtype_cache: dict[str, Any] = {}
_name_cache: dict[Any, str] = {}


def _torch_dtypes(torch: Any) -> dict[str, Any]:
    if not _dtype_cache:  # the names this torch has, made whole before any thread sees them
        _dtype_cache.update({n: getattr(torch, n) for n in TENSOR_DTYPES if hasattr(torch, n)})
    return _dtype_cache


def _dtype_names(torch: Any) -> dict[Any, str]:
    """The wire name of each dtype in ``TENSOR_DTYPES`` (one lookup: no ``str(dtype)``)."""
    if not _name_cache:
        _name_cache.update({d: n for n, d in _torch_dtypes(torch).items()})
    return _name_cache
