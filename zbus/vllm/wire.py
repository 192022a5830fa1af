"""vLLM's own types on zbus's wire: the engine's configuration, scheduler outputs
and model-runner outputs travel as typed msgpack, by name, never pickled.

An object travels as its class's name and its state (what pickle would take:
``__getstate__`` or the instance dict, a struct's fields, an enum's value), and
the state is encoded like any other value. A class (the executor backend in the
configuration) travels as its qualified name and arrives as that string. On the receiving end a name is only
looked up, never imported: the class must live in a module of vLLM that is
already loaded (:data:`WIRE_MODULES` are loaded up front), and be a dataclass,
an enum, a msgspec struct, a named tuple, a dict or ``UserDict``, or data by its
vLLM base (:data:`DATA_BASES`: a KV or EC connector's metadata, a quantization
config); a Hugging Face model configuration is found through transformers' own
fixed table of model types, a quantization config through vLLM's table of
quantization methods. The object is then made as pickle makes it (no
``__init__`` for plain classes), from plain data. Pickle keeps shared references,
the wire does not: a model configuration's ``hf_text_config``, the very
``hf_config`` (or a part of it) on the sender, is made so again. What cannot be
carried fails loudly and names its type.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import fractions
import importlib
import operator
import pathlib
import sys
import types
from typing import Any, Callable

from ..codec import TypeFamily, register_family
from ..errors import CodecError, brief

# The modules whose types vLLM's executor carries, loaded before any message.
WIRE_MODULES = (
    "vllm.config", "vllm.sampling_params", "vllm.pooling_params", "vllm.lora.request",
    "vllm.v1.core.sched.output", "vllm.v1.outputs", "vllm.v1.kv_cache_interface",
    "vllm.v1.worker.worker_base", "vllm.v1.request", "vllm.multimodal.inputs",
    "vllm.model_executor.models.registry",
)


# Plain classes of vLLM that are data by their base ("module:QualName", looked up
# only once loaded): carried as their state, made as pickle makes them.
DATA_BASES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorMetadata",
    "vllm.v1.kv_offload.base:LoadStoreSpec",  # in the offloading connector's metadata
    "vllm.distributed.kv_events:KVConnectorKVEvents",  # in a step's output, with connectors' events
    "vllm.distributed.kv_events:KVEventAggregator",  # (what LMCache's events hold)
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorWorkerMetadata",
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorHandshakeMetadata",
    "vllm.distributed.ec_transfer.ec_connector.base:ECConnectorMetadata",
    "vllm.model_executor.layers.quantization.base_config:QuantizationConfig",
)
_QUANTIZATION = "vllm.model_executor.layers.quantization."
# Pydantic models of these packages, which vLLM keeps in a checkpoint's quantization
# config (compressed-tensors': llm-compressor's FP8, W8A8, W4A16 checkpoints), travel
# as their JSON dump and are validated back by their class, looked up, never imported
# by name (vLLM's table of quantization methods loads the package).
PYDANTIC_PACKAGES = {"compressed_tensors": "compressed-tensors"}  # package: its quantization method


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _hf_config_class() -> Any:
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "PretrainedConfig", None) if transformers else None


def _state_of(t: type) -> Callable[[Any], Any]:
    """How pickle would take the state of a ``t``: ``__getstate__``, or the
    instance dict and the slots."""
    if getattr(t, "__getstate__", object.__getstate__) is not object.__getstate__:
        return lambda obj: obj.__getstate__()
    slots = [s for cls in t.__mro__ for s in getattr(cls, "__slots__", ())
             if s not in ("__dict__", "__weakref__")]

    def state(obj: Any) -> dict:
        out = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for slot in slots:
            if hasattr(obj, slot):
                out[slot] = getattr(obj, slot)
        return out
    return state


class VllmTypes(TypeFamily):
    """The ``vllm`` type family (see the module's docstring)."""

    name = "vllm"

    def __init__(self) -> None:
        # what was worked out per type (to send) and per name (received, and allowed):
        # a step carries the same few types again and again
        self._reducers: dict[type, Callable[[Any], tuple[str, Any]] | None] = {}
        self._builders: dict[str, Callable[[str, Any], Any]] = {}

    def reduce(self, obj: Any) -> tuple[str, Any] | None:
        t = type(obj)
        try:
            reducer = self._reducers[t]
        except KeyError:
            reducer = self._reducers[t] = _reducer(t)
        return None if reducer is None else reducer(obj)

    def build(self, name: str, state: Any) -> Any:
        builder = self._builders.get(name)
        if builder is None:
            builder = _builder(name, state)
            if not name.startswith("transformers."):  # (those are checked against the state)
                self._builders[name] = builder
        return builder(name, state)


def _reducer(t: type) -> Callable[[Any], tuple[str, Any]] | None:
    """How to reduce an object of type ``t`` to (name, state), or None: not ours."""
    if t is set or t is frozenset:
        return lambda obj: (t.__name__, list(obj))
    if t is collections.Counter:
        return lambda obj: ("Counter", dict(obj))
    if t is slice:  # (a multimodal field's: which items of a batch are whose; its bounds may be
        # 0-d tensors, as vLLM's flat_from_sizes makes them: whole numbers, as vLLM's own wire sends)
        return lambda obj: ("slice", [None if v is None else operator.index(v)
                                      for v in (obj.start, obj.stop, obj.step)])
    if issubclass(t, pathlib.PurePath):  # (the configuration's dump and cache folders)
        return lambda obj: ("path", str(obj))
    if t is fractions.Fraction:  # (a KV cache spec's tokens per state: causal Whisper's)
        return lambda obj: ("fraction", [obj.numerator, obj.denominator])
    if t.__module__.partition(".")[0] in PYDANTIC_PACKAGES and callable(getattr(t, "model_dump", None)):
        name = f"{t.__module__}:{t.__qualname__}"
        return lambda obj: (name, obj.model_dump(mode="json"))
    if issubclass(t, type):  # (the backend, logits processors): its name, never imported here,
        # in the form vLLM's loaders read (a logits processor's "module:Class")
        return lambda obj: ("class", f"{obj.__module__}:{obj.__qualname__}")
    torch = sys.modules.get("torch")
    if torch is not None and t is torch.dtype:
        return lambda obj: ("dtype", str(obj).removeprefix("torch."))
    if torch is not None and t is torch.device:
        return lambda obj: ("device", str(obj))
    hf = _hf_config_class()
    if not (_is_vllm(t.__module__) or (hf is not None and issubclass(t, hf))):
        return None
    name = f"{t.__module__}:{t.__qualname__}"
    if issubclass(t, enum.Enum):
        return lambda obj: (name, obj.value)
    fields = getattr(t, "__struct_fields__", None)
    if fields is not None:
        return lambda obj: (name, {f: getattr(obj, f) for f in fields})
    if issubclass(t, tuple):
        return lambda obj: (name, list(obj))
    state = _state_of(t)
    if issubclass(t, dict):  # its items, which the instance dict does not hold
        return lambda obj: (name, [dict(obj), state(obj)])
    return lambda obj: (name, state(obj))


def _expect(kind: type, make: Callable[[Any], Any]) -> Callable[[str, Any], Any]:
    def build(name: str, state: Any) -> Any:
        if type(state) is not kind:
            raise CodecError(f"malformed {name}")
        return make(state)
    return build


_BUILTINS: dict[str, Callable[[str, Any], Any]] = {
    "set": _expect(list, set), "frozenset": _expect(list, frozenset),
    "Counter": _expect(dict, collections.Counter), "class": _expect(str, str),
    "slice": lambda name, state: _slice(state),
    "path": _expect(str, pathlib.Path),
    "fraction": lambda name, state: _fraction(state),
    "dtype": lambda name, state: _torch_dtype(state),
    "device": lambda name, state: _torch_device(state),
}


def _builder(name: str, state: Any) -> Callable[[str, Any], Any]:
    """How to make an object of the type ``name`` from its state, or CodecError."""
    if name in _BUILTINS:
        return _BUILTINS[name]
    if name.partition(".")[0].partition(":")[0] in PYDANTIC_PACKAGES:
        return _validated(_no_finalizer(_pydantic_class(name), name))
    cls = _no_finalizer(_wire_class(name, state), name)
    if issubclass(cls, enum.Enum):
        return lambda name, state: _member(cls, state)
    if hasattr(cls, "__struct_fields__"):
        return _expect(dict, lambda state: cls(**state))
    if issubclass(cls, tuple):
        return _expect(list, lambda state: cls(*state))
    unsettable = _unsettable(cls)
    if getattr(cls, "__setstate__", None) is not None and \
            getattr(cls, "__getstate__", object.__getstate__) is not object.__getstate__:
        def restore(name: str, state: Any) -> Any:
            items, state = _dict_items(cls, name, state)
            if type(state) is dict:  # (vLLM's update the instance dict with it)
                _check_keys(name, state, unsettable)
            obj = cls.__new__(cls)
            obj.__setstate__(state)
            if items is not None:
                dict.update(obj, items)
            return obj
        return restore

    slotted = any("__slots__" in vars(c) for c in cls.__mro__[:-1])
    after = _AFTER_BUILD.get(name)

    def fill(name: str, state: Any) -> Any:  # as pickle does: no __init__
        items, state = _dict_items(cls, name, state)
        if type(state) is not dict or not set(map(type, state)) <= {str}:
            raise CodecError(f"malformed {name}")
        _check_keys(name, state, unsettable)
        obj = cls.__new__(cls)
        if items is not None:
            dict.update(obj, items)
        if slotted:
            for key, value in state.items():
                object.__setattr__(obj, key, value)
        else:
            obj.__dict__.update(state)
        if after is not None:
            after(obj)
        return obj
    return fill


def _no_finalizer(cls: type, name: str) -> type:
    """``cls``, unless it has a finalizer: made from what a peer sent, its ``__del__``
    would act on it (close, unlink what the state names) as the object goes."""
    if getattr(cls, "__del__", None) is not None:
        raise CodecError(f"type {name[:200]!r} has a finalizer: not carried")
    return cls


def _unsettable(cls: type) -> frozenset[str]:
    """What a received state may not set on an instance of ``cls`` (made without
    ``__init__``): its class's methods, which an instance's value would stand in
    for, and a Hugging Face configuration's ``attribute_map``, through which it
    reads every attribute (``.close`` read as another method). A field of a
    dataclass whose default is a function stays data; so does a value under a
    property's name, which the property keeps reading (transformers' configurations
    keep some of theirs so)."""
    fields = set(getattr(cls, "__dataclass_fields__", ()))
    code = (types.FunctionType, classmethod, staticmethod)
    names = {key for c in cls.__mro__[:-1] for key, value in vars(c).items()
             if isinstance(value, code) and key not in fields}
    hf = _hf_config_class()
    if hf is not None and issubclass(cls, hf):
        names.add("attribute_map")
    return frozenset(names)


def _check_keys(name: str, state: dict, unsettable: frozenset[str]) -> None:
    refused = [key for key in state if type(key) is not str or key.startswith("__") or key in unsettable]
    if refused:
        raise CodecError(f"{name} refused: its state sets {brief(refused[0])}, which is no data of it")


def _dict_items(cls: type, name: str, state: Any) -> tuple[dict | None, Any]:
    """(items, state) of a dict subclass, reduced as ``[items, state]``; (None, state)
    for any other class."""
    if not issubclass(cls, dict):
        return None, state
    if type(state) is not list or len(state) != 2 or type(state[0]) is not dict:
        raise CodecError(f"malformed {name}")
    return state[0], state[1]


def _same_text_config(model_config: Any) -> None:
    """A model configuration's ``hf_text_config`` is its ``hf_config``, or a part of
    it, on the sender (``get_hf_text_config``): made so again where equal. vLLM
    tells them apart by identity (a Transformers model whose two differ is taken
    for a multimodal one)."""
    hf_config = getattr(model_config, "hf_config", None)
    try:
        text = hf_config.get_text_config()
    except Exception:  # noqa: BLE001 - not a Hugging Face configuration: nothing to share
        return
    if text == getattr(model_config, "hf_text_config", None):
        model_config.hf_text_config = text


_AFTER_BUILD: dict[str, Callable[[Any], None]] = {"vllm.config.model:ModelConfig": _same_text_config}


def _member(cls: type, state: Any) -> Any:
    """The member of the enum ``cls`` whose value is ``state``, found as the enum
    finds it but refused briefly: the enum's own error holds the whole repr of what
    it is given (a tensor's is 16x it)."""
    try:
        return cls._value2member_map_[state]  # (a tuple of members too: CUDAGraphMode's)
    except (KeyError, TypeError):  # (TypeError: unhashable, a list)
        pass
    for member in cls:  # values that cannot be keys, as Enum searches them
        try:
            if type(member.value) is type(state) and member.value == state:
                return member
        except Exception:  # noqa: BLE001, S112 - an array's == has no truth value
            continue
    if type(state) in (int, str, float, bool):  # a Flag's composite, an enum's own _missing_:
        return cls(state)  # (its error's repr is the size of what came)
    raise CodecError(f"no {cls.__qualname__} has the value {brief(state)}")


def _slice(state: Any) -> slice:
    if type(state) is not list or len(state) != 3 or not all(type(v) in (int, type(None)) for v in state):
        raise CodecError("malformed slice")
    return slice(*state)


def _fraction(state: Any) -> fractions.Fraction:
    if type(state) is not list or len(state) != 2 or not all(type(v) is int for v in state) or not state[1]:
        raise CodecError("malformed fraction")
    return fractions.Fraction(*state)


def _torch_device(state: Any) -> Any:
    import torch

    if type(state) is not str or len(state) > 32:
        raise CodecError("malformed torch.device")
    return torch.device(state)


def _torch_dtype(state: Any) -> Any:
    import torch

    # the module's own names only: torch's module __getattr__ imports or calls what it is named
    dtype = vars(torch).get(state) if type(state) is str else None
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"unknown torch dtype {brief(state)}")
    return dtype


def _wire_class(name: str, state: Any) -> type:
    """The class ``name`` ("module:QualName") may stand for, or CodecError."""
    module_name, _, qualname = name.partition(":")
    if module_name.startswith("transformers."):
        return _hf_class(name, state)
    module = sys.modules.get(module_name)
    if module is None and module_name.startswith(_QUANTIZATION):
        return _quantization_class(name)
    if not _is_vllm(module_name) or module is None or not qualname or "<" in qualname:
        raise CodecError(f"type {name[:200]!r} is not one of vLLM's loaded types: not carried")
    obj: Any = module
    for part in qualname.split("."):
        if part.startswith("__"):
            raise CodecError(f"type {name[:200]!r} refused")
        # what is there only: a module's __getattr__ (vLLM's, torch's) imports what it is named
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    if not isinstance(obj, type) or obj.__module__ != module_name or not (
            dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            or hasattr(obj, "__struct_fields__") or (issubclass(obj, tuple) and hasattr(obj, "_fields"))
            or _data_by_base(obj)):
        raise CodecError(f"type {name[:200]!r} is not a data type of vLLM: not carried")
    return obj


def _data_by_base(cls: type) -> bool:
    """Whether ``cls`` is data by its base (a dict, a ``UserDict``, one of
    :data:`DATA_BASES`)."""
    if issubclass(cls, (dict, collections.UserDict)):
        return True
    for base in DATA_BASES:
        module_name, _, qualname = base.partition(":")
        found = vars(sys.modules[module_name]).get(qualname) if module_name in sys.modules else None
        if isinstance(found, type) and issubclass(cls, found):
            return True
    return False


def _validated(cls: Any) -> Callable[[str, Any], Any]:
    def build(name: str, state: Any) -> Any:
        if type(state) is not dict:
            raise CodecError(f"malformed {name}")
        try:
            return cls.model_validate(state)
        except ValueError as e:  # (pydantic's ValidationError)
            raise CodecError(f"malformed {name}: {brief(str(e))}") from None
    return build


def _pydantic_class(name: str) -> type:
    """A pydantic model class of :data:`PYDANTIC_PACKAGES`, its package loaded by
    vLLM's own module of its quantization method, or CodecError."""
    module_name, _, qualname = name.partition(":")
    package = module_name.partition(".")[0]
    if module_name not in sys.modules:  # a fresh worker: its arguments are decoded before their config
        from vllm.model_executor.layers.quantization import get_quantization_config

        try:
            get_quantization_config(PYDANTIC_PACKAGES[package])
        except Exception:  # noqa: BLE001 - not on this platform: refused below
            pass
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if qualname else ["__"]:
        if part.startswith("__"):
            raise CodecError(f"type {name[:200]!r} refused")
        obj = vars(obj).get(part) if obj is not None and hasattr(obj, "__dict__") else None
    pydantic = sys.modules.get("pydantic")
    if not (isinstance(obj, type) and pydantic is not None and issubclass(obj, pydantic.BaseModel)
            and obj.__module__ == module_name):
        raise CodecError(f"type {name[:200]!r} is not a loaded model of {package}: not carried")
    return obj


def _quantization_class(name: str) -> type:
    """A quantization config class not loaded yet, through vLLM's own table of
    quantization methods (which imports vLLM's modules of them, never one named)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    for method in QUANTIZATION_METHODS:
        try:
            cls = get_quantization_config(method)
        except Exception:  # noqa: BLE001 - a method this platform cannot load
            continue
        if f"{cls.__module__}:{cls.__qualname__}" == name:
            return cls
    raise CodecError(f"type {name[:200]!r} is not a quantization config of vLLM's table: not carried")


_HF_BASE = "transformers.configuration_utils"
_HF_BASE_NAMES = ("PreTrainedConfig", "PretrainedConfig")


def _hf_class(name: str, state: Any) -> type:
    """A Hugging Face configuration class, through transformers' table of model
    types; or transformers' base class, which vLLM fills from a Mistral-format
    model's ``params.json``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    module_name, _, qualname = name.partition(":")
    if module_name == _HF_BASE and qualname in _HF_BASE_NAMES:
        cls = vars(importlib.import_module(_HF_BASE)).get(qualname)
        if isinstance(cls, type):
            return cls
    # The table's class name first: looking a model type up imports its module
    # (unless it was registered at run time: then it is loaded already).
    names = getattr(CONFIG_MAPPING, "_mapping", None)
    names = names if isinstance(names, dict) else {}
    model_type = state.get("model_type") if type(state) is dict else None
    if type(model_type) is not str or (model_type not in getattr(CONFIG_MAPPING, "_extra_content", {})
                                       and names.get(model_type) != qualname):
        # the model type of the class so named (a sub-configuration made by default
        # holds none of its own)
        model_type = next((t for t, n in names.items() if n == qualname), None)
    try:
        cls = CONFIG_MAPPING[model_type] if model_type is not None else None
    except KeyError:
        cls = None
    if cls is None or f"{cls.__module__}:{cls.__qualname__}" != name:
        raise CodecError(f"type {name[:200]!r} is not a configuration class of transformers' table")
    return cls


def load_wire_modules() -> None:
    """Load the modules whose types travel, and allow the family."""
    for module in WIRE_MODULES:
        importlib.import_module(module)
    register_family(VllmTypes())
