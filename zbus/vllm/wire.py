"""vLLM's own types on zbus's wire: the engine's configuration, scheduler outputs
and model-runner outputs travel as typed msgpack, by name, never pickled.

An object travels as its class's name and its state (what pickle would take:
``__getstate__`` or the instance dict, a struct's fields, an enum's value), and
the state is encoded like any other value. A class (the executor backend in the
configuration) travels as its qualified name and arrives as that string. On the receiving end a name is only
looked up, never imported: the class must live in a module of vLLM that is
already loaded (:data:`WIRE_MODULES` are loaded up front), and be a dataclass,
an enum, a msgspec struct or a named tuple; a Hugging Face model configuration
is found through transformers' own fixed table of model types. The object is
then made as pickle makes it (no ``__init__`` for plain classes), from plain data.
What cannot be carried fails loudly and names its type.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import sys
from typing import Any

from ..codec import TypeFamily, register_family
from ..errors import CodecError

# The modules whose types vLLM's executor carries, loaded before any message.
WIRE_MODULES = (
    "vllm.config", "vllm.sampling_params", "vllm.pooling_params", "vllm.lora.request",
    "vllm.v1.core.sched.output", "vllm.v1.outputs", "vllm.v1.kv_cache_interface",
    "vllm.v1.worker.worker_base", "vllm.v1.request", "vllm.multimodal.inputs",
    "vllm.model_executor.models.registry",
)


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _hf_config_class() -> Any:
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "PretrainedConfig", None) if transformers else None


def _state(obj: Any) -> Any:
    t = type(obj)
    if getattr(t, "__getstate__", object.__getstate__) is not object.__getstate__:
        return obj.__getstate__()
    state = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in t.__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                state[slot] = getattr(obj, slot)
    return state


class VllmTypes(TypeFamily):
    """The ``vllm`` type family (see the module's docstring)."""

    name = "vllm"

    def reduce(self, obj: Any) -> tuple[str, Any] | None:
        t = type(obj)
        if t is set or t is frozenset:
            return t.__name__, list(obj)
        if t is collections.Counter:
            return "Counter", dict(obj)
        if isinstance(obj, type):  # (a backend class in the config): its name, never imported
            return "class", f"{obj.__module__}.{obj.__qualname__}"
        torch = sys.modules.get("torch")
        if torch is not None and t is torch.dtype:
            return "dtype", str(obj).removeprefix("torch.")
        if torch is not None and t is torch.device:
            return "device", str(obj)
        hf = _hf_config_class()
        if not (_is_vllm(t.__module__) or (hf is not None and isinstance(obj, hf))):
            return None
        name = f"{t.__module__}:{t.__qualname__}"
        if isinstance(obj, enum.Enum):
            return name, obj.value
        if hasattr(t, "__struct_fields__"):
            return name, {f: getattr(obj, f) for f in t.__struct_fields__}
        if isinstance(obj, tuple):
            return name, list(obj)
        return name, _state(obj)

    def build(self, name: str, state: Any) -> Any:
        if name in ("set", "frozenset"):
            if type(state) is not list:
                raise CodecError(f"malformed {name}")
            return set(state) if name == "set" else frozenset(state)
        if name == "Counter":
            if type(state) is not dict:
                raise CodecError("malformed Counter")
            return collections.Counter(state)
        if name == "class":
            if type(state) is not str:
                raise CodecError("malformed class name")
            return state
        if name == "dtype":
            return _torch_dtype(state)
        if name == "device":
            import torch

            if type(state) is not str or len(state) > 32:
                raise CodecError("malformed torch.device")
            return torch.device(state)
        cls = _wire_class(name, state)
        if issubclass(cls, enum.Enum):
            return cls(state)
        if hasattr(cls, "__struct_fields__"):
            if type(state) is not dict:
                raise CodecError(f"malformed {name}")
            return cls(**state)
        if issubclass(cls, tuple):
            if type(state) is not list:
                raise CodecError(f"malformed {name}")
            return cls(*state)
        obj = cls.__new__(cls)
        if getattr(cls, "__setstate__", None) is not None and \
                getattr(cls, "__getstate__", object.__getstate__) is not object.__getstate__:
            obj.__setstate__(state)
            return obj
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise CodecError(f"malformed {name}")
        for key, value in state.items():
            object.__setattr__(obj, key, value)
        return obj


def _torch_dtype(state: Any) -> Any:
    import torch

    dtype = getattr(torch, state, None) if type(state) is str and state.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"unknown torch dtype {str(state)[:40]!r}")
    return dtype


def _wire_class(name: str, state: Any) -> type:
    """The class ``name`` ("module:QualName") may stand for, or CodecError."""
    module_name, _, qualname = name.partition(":")
    if module_name.startswith("transformers."):
        return _hf_class(name, state)
    module = sys.modules.get(module_name)
    if not _is_vllm(module_name) or module is None or not qualname or "<" in qualname:
        raise CodecError(f"type {name[:200]!r} is not one of vLLM's loaded types: not carried")
    obj: Any = module
    for part in qualname.split("."):
        if part.startswith("__"):
            raise CodecError(f"type {name[:200]!r} refused")
        obj = getattr(obj, part, None)
    if not isinstance(obj, type) or obj.__module__ != module_name or not (
            dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            or hasattr(obj, "__struct_fields__") or (issubclass(obj, tuple) and hasattr(obj, "_fields"))):
        raise CodecError(f"type {name[:200]!r} is not a data type of vLLM: not carried")
    return obj


def _hf_class(name: str, state: Any) -> type:
    """A Hugging Face configuration class, through transformers' table of model types."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = state.get("model_type") if type(state) is dict else None
    try:
        cls = CONFIG_MAPPING[model_type] if type(model_type) is str else None
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
