"""vLLM on zbus, for real: vLLM's engine with ``zbus.vllm.ZbusExecutor`` on a tiny
model the tests write (seeded random weights), beside vLLM's own ``mp`` executor.

These need vLLM's CPU build; ``make test`` runs them in ``.venv-vllm``. Elsewhere
they are skipped, with the reason."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from fractions import Fraction

import psutil
import pytest
from conftest import (
    TEST_PATH,
    describe,
    end_process,
    marked_processes,
    next_line,
    no_thread_to_be_had,
    shm_used,
    zbus_segments,
)

from zbus.netns import NetnsCluster, unavailable

try:
    import vllm  # noqa: F401
    NO_VLLM = None
except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
    NO_VLLM = f"vLLM is not importable here ({type(e).__name__}); make test runs these in .venv-vllm"

pytestmark = [pytest.mark.skipif(NO_VLLM is not None, reason=str(NO_VLLM)), pytest.mark.timeout(300)]

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_driver.py")
ZBUS = "zbus.vllm.ZbusExecutor"
# vLLM's CPU workers on this 2-core machine: one core each, 1 GiB of KV cache.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": TEST_PATH}


@pytest.fixture(scope="module", autouse=True)
def rpc_folder():
    """vLLM binds its engine's ZeroMQ sockets as files in ``VLLM_RPC_BASE_PATH``
    (the temp folder by default) and leaves them there, a few per engine: here
    they go to a folder of the module's, removed after it (the session guard
    counts socket files in the temp folder)."""
    folder = tempfile.mkdtemp(prefix="zbus-vllm-rpc-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(VLLM_ENV, "VLLM_RPC_BASE_PATH", folder)
        mp.setenv("VLLM_RPC_BASE_PATH", folder)
        yield folder
    shutil.rmtree(folder, ignore_errors=True)


class Engine:
    """The driver in a process of its own; its JSON events, read with a deadline."""

    def __init__(self, backend: str, *args: str, node=None, env: dict | None = None, log=None):
        full_env = dict(os.environ, **VLLM_ENV, **(env or {}))
        self.model = tempfile.mkdtemp(prefix="zbus-vllm-model-")
        argv = [sys.executable, DRIVER, backend, "--model", self.model, *args]
        self.log = log
        if node is None:
            self.proc = psutil.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=log, text=True)
        else:
            self.proc = node.start(argv, env=full_env, stdout=subprocess.PIPE, stderr=log, text=True)

    def event(self, name: str, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = next_line(self.proc, deadline)
            if not line:
                raise AssertionError(f"the engine ended ({self.proc.wait(10)}) before {name!r}: "
                                     f"{self._tail()}")
            if line.startswith("{"):
                event = json.loads(line)
                if event["event"] in (name, "error"):
                    return event
            elif self.log is not None:  # vLLM logs to stdout: its shutdown steps, say
                self.log.write(line)
        raise AssertionError(f"no {name!r} within {timeout} s")

    def _tail(self) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-3000:]

    def descendants(self) -> list[psutil.Process]:
        return self.proc.children(recursive=True)

    def workers_generating(self) -> list[psutil.Process]:
        """Once the engine (TP=2 on this host) is generating, its zbus workers."""
        self.event("ready")
        assert self.event("tokens")["event"] == "tokens"
        workers = [p for p in self.descendants() if "zbus.worker" in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in workers]
        return workers

    def close(self) -> None:
        try:
            end_tree(self.proc, 30)
        finally:
            shutil.rmtree(self.model, ignore_errors=True)


def end_tree(proc: psutil.Popen, timeout: float) -> None:
    """End ``proc`` (wait, then kill), then whatever it started that outlives it,
    by pid: vLLM's engine process outlives a client that died without shutting it
    down, and keeps its workers (a failed test would leave them running)."""
    try:
        tree = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    end_process(proc, timeout)
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert psutil.wait_procs(tree, timeout=15)[1] == [], describe(tree)


# --- the wire: vLLM's types as typed msgpack -------------------------------------------


@pytest.fixture(scope="module")
def wire():
    from zbus.vllm import wire

    wire.load_wire_modules()
    return wire


def round_trip(obj):
    from zbus import codec

    return codec.decode(codec.encode(obj))


def scheduler_output():
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = NewRequestData(req_id="r1", prompt_token_ids=[5, 6, 7], mm_features=[],
                         sampling_params=SamplingParams(temperature=0, max_tokens=4, seed=3),
                         pooling_params=None, block_ids=([0, 1],), num_computed_tokens=0, lora_request=None)
    cached = CachedRequestData.make_empty()
    cached.req_ids.append("r0")
    cached.resumed_req_ids.add("r0")
    cached.new_token_ids.append([9])
    cached.new_block_ids.append(None)
    cached.num_computed_tokens.append(12)
    cached.num_output_tokens.append(2)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs.append(new)
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens.update({"r1": 3, "r0": 1})
    out.total_num_scheduled_tokens = 4
    out.finished_req_ids.add("r9")
    return out


def test_a_scheduler_output_arrives_whole_and_typed(wire):
    """Sabotage: a family that drops the instance dict, or turns sets into lists,
    makes the objects differ."""
    from vllm.v1.core.sched.output import SchedulerOutput

    sent = scheduler_output()
    got = round_trip(sent)
    assert type(got) is SchedulerOutput and got == sent
    assert type(got.finished_req_ids) is set and type(got.scheduled_cached_reqs.resumed_req_ids) is set
    assert got.scheduled_new_reqs[0].sampling_params == sent.scheduled_new_reqs[0].sampling_params
    assert got.scheduled_new_reqs[0].block_ids == ([0, 1],)


def test_model_runner_and_grammar_outputs_round_trip(wire):
    import numpy as np
    from vllm.v1.core.sched.output import GrammarOutput
    from vllm.v1.outputs import ModelRunnerOutput

    out = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
                            sampled_token_ids=[[1], [2, 3]])
    assert round_trip(out) == out
    grammar = GrammarOutput(["a"], np.arange(8, dtype=np.int32).reshape(2, 4))
    got = round_trip(grammar)
    assert type(got) is GrammarOutput and (got.grammar_bitmask == grammar.grammar_bitmask).all()


def test_an_error_of_vllms_own_raised_on_a_worker_reaches_the_engine_with_its_text(wire):
    """A worker's error of a vLLM class (a LoRA adapter not found, in ``add_lora``
    or a step) travels as any error does: its type's name, text and traceback.
    Before, vLLM's family took it as one of vLLM's objects, which the leader
    refuses to build (no data type): the engine got "cannot decode the reply"
    instead of vLLM's message. Sabotage: the codec's exception branch after the
    families again -> CodecError "not a data type of vLLM"."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    from zbus import codec

    try:
        raise LoRAAdapterNotFoundError("sql-lora", "/nope")
    except LoRAAdapterNotFoundError as e:
        got = round_trip([0, 7, 1, e])
    info = got[3]
    assert type(info) is codec.ExceptionInfo
    assert info.type_name == "vllm.exceptions.LoRAAdapterNotFoundError"
    assert "/nope" in info.message and "LoRAAdapterNotFoundError" in info.traceback


def test_a_failed_model_step_is_logged_with_its_traceback_by_the_rank_that_answers(caplog):
    """The engine that a failed step ends shows only the error's text (``RemoteError``
    holds the traceback, which it never prints): the answering rank logs the
    error with its frames, as vLLM's own workers do; a rank that does not answer
    logs it through zbus's worker loop. Here the step fails in vLLM's wrapper,
    which has no worker yet. Sabotage: no log in ``VllmWorker._logged`` -> no
    record."""
    import logging

    from zbus.vllm.worker import VllmWorker

    worker = VllmWorker()
    for replying, records in ((True, 1), (False, 0)):
        worker.replying = replying
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="zbus.vllm.worker"):
            with pytest.raises(Exception) as raised:  # (vLLM's wrapper looks its missing worker up)
                worker.execute_model(None)
        got = [r for r in caplog.records if r.name == "zbus.vllm.worker"]
        assert len(got) == records, got
        if records:
            assert "execute_model" in got[0].getMessage() and got[0].exc_info[1] is raised.value


def test_the_engine_configuration_round_trips(wire, tmp_path):
    """The VllmConfig that reaches a worker describes the same engine."""
    from vllm import EngineArgs

    from zbus.vllm.bench import tiny_model

    config = EngineArgs(model=tiny_model(str(tmp_path)), load_format="dummy", skip_tokenizer_init=True,
                        tensor_parallel_size=2, enforce_eager=True,
                        max_model_len=256).create_engine_config()
    got = round_trip(config)
    assert type(got) is type(config) and str(got) == str(config)
    assert got.model_config.hf_config.to_dict() == config.model_config.hf_config.to_dict()
    assert got.model_config.dtype == config.model_config.dtype
    assert got.parallel_config.tensor_parallel_size == 2
    assert got.model_config.hf_text_config is got.model_config.hf_config  # as on the sender


def test_a_configuration_without_a_class_or_model_type_of_its_own_round_trips(wire):
    """vLLM reads a Mistral-format model (``params.json``) into transformers' base
    configuration class, with a model type of its own ("transformer"), and a
    configuration's sub-configurations made by default (LLaVA's text model) hold no
    model type of their own: both were refused as "not a configuration class of
    transformers' table", so such an engine never started on zbus. The base class
    is carried, and a class of the table is found by its name where its state
    names no model type. Sabotage: ``_hf_class`` as before (the model type from the
    state only)."""
    from transformers import LlavaConfig, PretrainedConfig

    base = PretrainedConfig.from_dict({"model_type": "transformer", "hidden_size": 8})
    got = round_trip(base)
    assert type(got) is type(base) and got.to_dict() == base.to_dict()
    llava = LlavaConfig()
    assert "model_type" not in vars(llava.text_config)
    got = round_trip(llava)
    assert type(got.text_config) is type(llava.text_config) and got.to_dict() == llava.to_dict()


FRESH_DECODE = """
import json, sys
import msgpack
from zbus import codec
from zbus.vllm.wire import load_wire_modules

load_wire_modules()
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata  # (as a worker's KV connector does)

with open(sys.argv[1], "rb") as f:
    options, item, nixl, fp8, model = codec.decode(msgpack.unpackb(f.read()))
print(json.dumps({
    "types": [type(x).__name__ for x in (options, item, nixl, fp8, model)],
    "options": options["image"].count, "item": item["dummy"].data.numel(),
    "nixl": nixl.reqs_to_send, "fp8": fp8.activation_scheme,
    "text_config_is_hf_config": model.hf_text_config is model.hf_config,
}))
"""


def test_what_a_real_engine_sends_decodes_in_a_fresh_worker_process(wire, tmp_path):
    """Types that multimodal, quantized and KV-transfer engines send, decoded in a
    process that loaded only what a worker has before its first call (round trips in
    one process hide a module not loaded there): a ``dict`` subclass (a multimodal
    config's dummy options: its items were lost), a ``UserDict`` (a multimodal
    item of every image request), a KV connector's metadata and a quantization
    config (plain classes, data by their vLLM base; the quantization module not yet
    loaded, found through vLLM's table). Each was refused, so such an engine could
    not start or died at its first request. And a model configuration whose
    ``hf_text_config`` is its ``hf_config``: two objects after the wire, where vLLM
    tells them apart by identity (a Transformers model taken for a multimodal one).
    Sabotage: no ``_data_by_base`` in ``_wire_class`` -> "not a data type of
    vLLM"; no ``_AFTER_BUILD`` hook -> the identity lost."""
    import msgpack
    from vllm import EngineArgs
    from vllm.config.multimodal import ImageDummyOptions, MultiModalDummyOptions
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.multimodal.inputs import MultiModalKwargsItem

    from zbus import codec
    from zbus.vllm.bench import tiny_model

    nixl = NixlConnectorMetadata()
    nixl.reqs_to_send["r1"] = 1.5
    model = EngineArgs(model=tiny_model(str(tmp_path)), load_format="dummy", skip_tokenizer_init=True,
                       enforce_eager=True, max_model_len=256).create_engine_config().model_config
    assert model.hf_text_config is model.hf_config
    sent = [MultiModalDummyOptions(image=ImageDummyOptions(count=2)), MultiModalKwargsItem.dummy(4), nixl,
            Fp8Config(), model]
    path = tmp_path / "frames"
    path.write_bytes(msgpack.packb([bytes(f) for f in codec.encode(sent)]))
    out = subprocess.run([sys.executable, "-c", FRESH_DECODE, str(path)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=TEST_PATH))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "types": ["MultiModalDummyOptions", "MultiModalKwargsItem", "NixlConnectorMetadata", "Fp8Config",
                  "ModelConfig"],
        "options": 2, "item": 4, "nixl": {"r1": 1.5}, "fp8": "dynamic", "text_config_is_hf_config": True}


FRESH_DECODE_MORE = """
import json, sys
import msgpack
from zbus import codec
from zbus.vllm.wire import load_wire_modules

load_wire_modules()
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.common  # (a worker's offloading connector)
import vllm.v1.kv_offload.cpu.common
import vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector  # (the engine's LMCache connector)

with open(sys.argv[1], "rb") as f:
    elems, offload, events, config, compressed, specs = codec.decode(msgpack.unpackb(f.read()))
job = offload.store_jobs[1]
weights = compressed.target_scheme_map["Linear"]["weights"]
print(json.dumps({
    "compressed": [type(compressed).__name__, type(weights).__name__, weights.model_dump(mode="json")],
    "fraction": repr(specs["encoder.attn"].tokens_per_state),
    "slices": [repr(e.field.slices) for e in elems], "data": [list(e.data.shape) for e in elems],
    "job": [type(job.src_spec).__name__, job.src_spec.block_ids.tolist(), type(job.dst_spec).__name__,
            job.dst_spec.block_ids.tolist()],
    "events": [e.token_ids for e in events.get_all_events()],
    "dump": [type(config.compilation_config.debug_dump_path).__name__,
             str(config.compilation_config.debug_dump_path)],
}))
"""


def test_what_flat_multimodal_offloading_and_kv_event_engines_send_decodes_in_a_fresh_process(wire, tmp_path):
    """Found by review in vLLM's code, each refused so that such an engine died at
    its first request or never started: a compressed-tensors checkpoint's
    quantization config (llm-compressor's FP8, W8A8, W4A16) holds pydantic models
    of the ``compressed_tensors`` package, which a fresh worker has not loaded
    when it decodes them (vLLM's table of quantization methods loads it); a KV
    cache spec of causal Whisper holds a ``Fraction``; a multimodal item of a "flat" field (most
    vision models': Qwen2-VL, InternVL, Gemma 3, Llama 4) holds ``slice`` objects;
    the native KV offloading connector's metadata holds its load/store specs
    (plain classes of vLLM, data by their base ``LoadStoreSpec``); a connector's
    KV events (LMCache's, Mooncake's) come back in a step's output as plain
    classes; a compile dump folder (``VLLM_DEBUG_DUMP_PATH``) puts a ``Path`` in
    the configuration. Each decodes, in a process that loaded what a worker (or
    the engine, for events) has (a first version of the slice refused the 0-d
    tensors vLLM makes its bounds of). Sabotage: no ``slice``, no ``path`` in
    ``_reducer`` -> "cannot encode builtins.slice", "cannot encode
    pathlib.PosixPath"; no ``LoadStoreSpec`` or ``KVConnectorKVEvents`` in
    ``DATA_BASES`` -> "not a data type of vLLM"; no ``PYDANTIC_PACKAGES`` ->
    "cannot encode compressed_tensors..."; no package loaded in ``_pydantic_class``
    -> "not a loaded model"; no ``fraction`` -> "cannot encode fractions.Fraction"."""
    import msgpack
    import torch
    from vllm import EngineArgs
    from vllm.distributed.kv_events import BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalFlatField
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from zbus import codec
    from zbus.vllm.bench import tiny_model

    # (as vLLM's processors make them: the slices' bounds are 0-d tensors)
    field = MultiModalFieldConfig.flat_from_sizes("image", torch.tensor([2, 3])).field
    assert isinstance(field, MultiModalFlatField) and isinstance(field.slices[1][0].stop, torch.Tensor)
    elems = field.build_elems("image", "pixel_values", torch.zeros(5, 4))
    offload = OffloadingConnectorMetadata(load_jobs={}, store_jobs={
        1: TransferJob("r1", GPULoadStoreSpec([3, 4], [2], [0]), CPULoadStoreSpec([7]))})
    events = LMCacheKVEvents(2)
    events.add_events([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=16,
                                   lora_id=None, medium="GPU", lora_name=None)])
    dump = tmp_path / "dump"
    config = EngineArgs(model=tiny_model(str(tmp_path)), load_format="dummy", skip_tokenizer_init=True,
                        enforce_eager=True, max_model_len=256,
                        compilation_config={"debug_dump_path": str(dump)}).create_engine_config()
    compressed = CompressedTensorsConfig.from_config({  # an FP8-dynamic checkpoint's
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                  "symmetric": True}}}})
    weights = compressed.target_scheme_map["Linear"]["weights"]
    specs = {"encoder.attn": dataclasses.replace(
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16),
        tokens_per_state=Fraction(1, 4))}
    path = tmp_path / "frames"
    sent = [elems, offload, events, config, compressed, specs]
    path.write_bytes(msgpack.packb([bytes(f) for f in codec.encode(sent)]))
    out = subprocess.run([sys.executable, "-c", FRESH_DECODE_MORE, str(path)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=TEST_PATH))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "compressed": ["CompressedTensorsConfig", "QuantizationArgs", weights.model_dump(mode="json")],
        "fraction": "Fraction(1, 4)",
        "slices": ["[(slice(0, 2, None),), (slice(2, 5, None),)]"] * 2, "data": [[2, 4], [3, 4]],
        "job": ["GPULoadStoreSpec", [3, 4], "CPULoadStoreSpec", [7]], "events": [[1, 2]],
        "dump": ["PosixPath", str(dump)]}


def test_a_slice_path_fraction_or_pydantic_model_of_another_shape_is_refused(wire):
    """What arrives as a slice, a path, a fraction or a compressed-tensors model is
    checked first: a slice's bounds are whole numbers or None (no object's
    ``__index__`` runs), a path is text, a fraction two whole numbers (not over
    0), a model one of a loaded module of the package (never imported by its
    name), validated by its class."""
    import msgpack

    from zbus import codec
    from zbus.errors import CodecError

    def decode(name, state):
        return codec.decode([msgpack.packb(msgpack.ExtType(7, msgpack.packb([f"vllm:{name}", state])))])

    assert decode("slice", [1, None, -2]) == slice(1, None, -2)
    for state in ([1, 2], [1.5, None, None], ["a", None, None], {"start": 1}):
        with pytest.raises(CodecError, match="malformed slice"):
            decode("slice", state)
    with pytest.raises(CodecError, match="malformed path"):
        decode("path", ["/etc"])
    assert decode("fraction", [1, 4]) == Fraction(1, 4)
    for state in ([1, 0], [1.0, 2], [1], "1/4"):
        with pytest.raises(CodecError, match="malformed fraction"):
            decode("fraction", state)
    # a compressed-tensors model: a pydantic model of a loaded module, validated; nothing else
    args = "compressed_tensors.quantization.quant_args"
    for name, why in [("compressed_tensors.zbus_never_loaded:Thing", "not a loaded model"),
                      (f"{args}:QuantizationArgs.__class__", "refused"),
                      (f"{args}:QuantizationStrategy", "not a loaded model")]:  # (an enum: no model)
        with pytest.raises(CodecError, match=why):
            decode(name, {})
    assert "compressed_tensors.zbus_never_loaded" not in sys.modules
    with pytest.raises(CodecError, match="malformed compressed_tensors.*validation error"):
        decode(f"{args}:QuantizationArgs", {"num_bits": "many"})


def test_what_cannot_travel_fails_loudly_and_names_its_type(wire):
    """Code never travels, and a name is looked up, never imported; what the family
    remembers per name holds allowed names only. Sabotage: a build that imports
    the module a name gives. Or remember every name received, refused ones too
    (``self._builders[name] = None`` before ``_builder`` in ``VllmTypes.build``):
    100 refused names grow the memory by 100. ``getattr`` in ``_wire_class`` or
    ``_torch_dtype`` (as before): "vllm:LLM" imports vLLM's LLM, "has_cuda" runs.
    Look a Hugging Face model type up before its class name is compared (as
    before): a refused name imports that type's configuration module."""
    import msgpack
    from vllm.v1.core.sched.output import KVConnectorBlockState

    from zbus import codec
    from zbus.errors import CodecError

    out = scheduler_output()
    out.kv_connector_block_state = KVConnectorBlockState(
        req_ids={"r1"}, resolve_block_ids=lambda req: ([],), boundary_state_offloads={})
    with pytest.raises(CodecError, match="cannot encode builtins.function"):
        codec.encode(out)
    def decode(name):
        body = msgpack.packb([f"vllm:{name}", {}])
        return codec.decode([msgpack.packb(msgpack.ExtType(7, body))])

    assert "vllm.collect_env" not in sys.modules  # a real module of vLLM, not loaded
    for name in ("vllm.collect_env:SystemEnv", "vllm.zbus_never_loaded:Thing"):
        with pytest.raises(CodecError, match="not one of vLLM's loaded types"):
            decode(name)
    assert "vllm.collect_env" not in sys.modules
    with pytest.raises(CodecError, match="not a data type of vLLM"):
        decode("vllm.config:get_current_vllm_config")
    with pytest.raises(CodecError, match="refused"):
        decode("vllm.config:VllmConfig.__init__")
    with pytest.raises(CodecError, match="not one of vLLM's"):
        decode("os:system")
    # a module's __getattr__ is never asked: vLLM's imports what it is named, torch's
    # imports its lazy modules and calls its deprecated names
    assert "vllm.entrypoints.llm" not in sys.modules
    with pytest.raises(CodecError, match="not a data type of vLLM"):
        decode("vllm:LLM")
    assert "vllm.entrypoints.llm" not in sys.modules
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's __getattr__ warns before it calls has_cuda's function
        for dtype in ("has_cuda", "_inductor", "float32x"):
            with pytest.raises(CodecError, match="unknown torch dtype"):
                codec.decode([msgpack.packb(msgpack.ExtType(7, msgpack.packb(["vllm:dtype", dtype])))])
    with pytest.raises(CodecError, match="transformers' table"):
        decode("transformers.models.llama.configuration_llama:LlamaNotConfig")  # no class of the table
    with pytest.raises(CodecError, match="transformers' table"):  # the base class of another module
        decode("transformers.models.llama.configuration_llama:PreTrainedConfig")
    whisper = "transformers.models.whisper.configuration_whisper"  # a model type no test loads
    assert whisper not in sys.modules
    with pytest.raises(CodecError, match="transformers' table"):  # refused without importing it
        codec.decode([msgpack.packb(msgpack.ExtType(7, msgpack.packb(
            ["vllm:transformers.nope:X", {"model_type": "whisper"}])))])
    assert whisper not in sys.modules
    # what the family remembers per name holds allowed types only: refused names
    # sent again and again cannot grow it
    family = codec._families["vllm"]
    known = len(family._builders)
    for i in range(100):
        with pytest.raises(CodecError):
            decode(f"vllm.config:Nothing{i}")
    assert len(family._builders) == known


def test_no_object_with_a_finalizer_or_a_state_that_shadows_its_code_is_made(wire, tmp_path):
    """The leader decodes every rank's reply to ``init_worker`` and the like, in
    vLLM's engine process, where ``vllm.v1.engine.utils`` is loaded: its
    ``EngineZmqListeners``, a dataclass, unlinks its listeners' ``ipc://`` paths in
    ``__del__``, and a transformers configuration whose own ``attribute_map`` sends
    ``.close`` to ``__sizeof__`` stands in for a listener's socket. A reply made of
    them removed a file of the sender's choosing on the leader's host as it went.
    Sabotage: no ``_no_finalizer`` in ``_builder`` -> the listeners are made;
    ``_unsettable`` without ``attribute_map`` -> that configuration is made, and
    without methods -> a listener whose ``cleanup`` is the sender's; no
    ``_check_keys`` in ``restore`` -> a media's ``__array__`` is the sender's.
    A value under a property's name stays data (a first version refused it: a Llama
    configuration with a flag set by ``hf_overrides`` failed the engine's start).
    Sabotage: ``property`` among ``_unsettable``'s kinds -> refused."""
    import msgpack
    import vllm.v1.engine.utils  # noqa: F401 - loaded in the engine's process, as there

    from zbus import codec
    from zbus.errors import CodecError

    def ext(name, state):
        return msgpack.ExtType(7, msgpack.packb([f"vllm:{name}", state]))

    def decode(obj):
        return codec.decode([msgpack.packb(obj)])

    victim = tmp_path / "victim"
    victim.write_text("kept")
    base = "transformers.configuration_utils:PreTrainedConfig"
    socket = ext(base, {"attribute_map": {"close": "__sizeof__"}})
    listener = ext("vllm.utils.network_utils:ZmqListener", {"address": f"ipc://{victim}", "socket": socket})
    listeners = ext("vllm.v1.engine.utils:EngineZmqListeners", {"inputs": [listener], "outputs": []})
    with pytest.raises(CodecError):
        decode(listeners)
    gc.collect()
    assert victim.read_text() == "kept"
    with pytest.raises(CodecError, match="EngineZmqListeners'? has a finalizer: not carried"):
        decode(ext("vllm.v1.engine.utils:EngineZmqListeners", {"inputs": [], "outputs": []}))
    with pytest.raises(CodecError, match="its state sets 'attribute_map', which is no data of it"):
        decode(socket)
    for key in ("cleanup", "close", "__class__", "__dict__"):
        with pytest.raises(CodecError, match=f"its state sets '{key}'"):
            decode(ext("vllm.utils.network_utils:ZmqListener", {"address": "x", key: 1}))
    plain = ext("vllm.utils.network_utils:ZmqListener", {"address": "x", "socket": None})
    assert decode(plain).address == "x"
    # a value under a property's name is data: transformers' configurations keep some so
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128)
    config.allow_global_per_layer_attribute_access = True  # (vLLM's hf_overrides set it so)
    assert "allow_global_per_layer_attribute_access" in vars(config)
    assert round_trip(config).allow_global_per_layer_attribute_access is True
    # a class with its own __setstate__ (which updates the instance dict with the state)
    media = "vllm.multimodal.media.base:MediaWithBytes"
    with pytest.raises(CodecError, match="its state sets '__array__'"):
        decode(ext(media, {"media": 1, "original_bytes": b"", "__array__": 2}))
    assert decode(ext(media, {"media": 1, "original_bytes": b"x"})).original_bytes == b"x"


def test_a_vllm_enum_or_dtype_sent_a_tensor_or_a_long_text_is_refused_briefly(wire, monkeypatch):
    """An enum of vLLM's, or a torch dtype, whose value on the wire is a tensor of
    2^16 elements or 4 MB of text: refused with an error of a few hundred
    characters, and no repr of the tensor made. Before, the enum's own ValueError
    made the value's whole repr (about 1 MB for the tensor: no dimension is long
    enough for torch to elide), as did the dtype's error (``str`` of it, then cut).
    Sabotage: ``cls(state)`` for enums in ``wire._builder``, or ``str(state)[:40]``
    in ``_torch_dtype`` (as before) -> a repr made; a scalar value alone taken for
    an enum's (as a first version did) -> ``FULL_AND_PIECEWISE`` refused; no
    ``cls(state)`` for a scalar found no member's (a second) -> the Flag refused."""
    import msgpack
    import torch
    from vllm.sampling_params import RequestOutputKind

    from zbus import codec
    from zbus.errors import CodecError

    reprs = []
    monkeypatch.setattr(torch.Tensor, "__repr__", lambda t, *a, **k: reprs.append(1) or "<a tensor>")
    tensor = msgpack.ExtType(2, msgpack.packb(["uint8", [2] * 16, [2**i for i in range(15, -1, -1)], 0]))
    from vllm.config import CUDAGraphMode

    name = f"vllm:{RequestOutputKind.__module__}:{RequestOutputKind.__qualname__}"
    assert codec.decode(codec.encode(RequestOutputKind.DELTA)) is RequestOutputKind.DELTA
    # a tuple of members for a value (vLLM's default CUDA graph mode) still comes back,
    # and so does a Flag's composite value, which is no member's
    both = CUDAGraphMode.FULL_AND_PIECEWISE
    assert type(both.value) is tuple and codec.decode(codec.encode(both)) is both
    import enum
    import types

    module = types.ModuleType("vllm.zbus_test_flags")

    class Access(enum.Flag):
        READ = 1
        WRITE = 2
    Access.__module__, Access.__qualname__ = module.__name__, "Access"
    module.Access = Access
    monkeypatch.setitem(sys.modules, module.__name__, module)
    # (as a fresh worker gets it: the composite never made here before it is decoded)
    sent = msgpack.packb([f"vllm:{module.__name__}:Access", 3])
    composite = codec.decode([msgpack.packb(msgpack.ExtType(7, sent))])
    assert composite == Access.READ | Access.WRITE
    for state, frames in [(tensor, [bytearray(2**16)]), ("k" * 2**22, [])]:
        for kind in (name, "vllm:dtype"):
            with pytest.raises(CodecError) as e:
                codec.decode([msgpack.packb(msgpack.ExtType(7, msgpack.packb([kind, state]))), *frames])
            assert len(str(e.value)) < 500 and not reprs, (kind, str(e.value)[:300])


@pytest.mark.parametrize("budget, share", [("20", 12.0), ("", 3.0)])
def test_the_workers_shutdown_takes_its_share_of_vllms_shutdown_budget(monkeypatch, budget, share):
    """vLLM gives the engine ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` to end: the
    workers' shutdown call may take 0.6 of it (12 s of 20 s, 3 s of the default
    5 s), the rest going to stopping the processes. Before, 3 s whatever the
    setting: a slower teardown set 30 s for was cut short at 3 s. A real executor;
    its workers have no ``shutdown`` (answered with an error, logged). Sabotage: a
    fixed timeout in ``_shutdown`` -> 3.0 at 20 s."""
    import workers

    import zbus
    from zbus.vllm import executor as adapter

    if budget:
        monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", budget)
    else:
        monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", raising=False)
    ex = zbus.Executor(workers.EchoWorker, nproc_per_node=1)
    asked, call = [], ex.collective_rpc

    def recorded(method, *args, timeout=None, **kwargs):
        asked.append((method, timeout))
        return call(method, *args, timeout=timeout, **kwargs)
    monkeypatch.setattr(ex, "collective_rpc", recorded)
    adapter._shutdown(ex)
    assert asked == [("shutdown", pytest.approx(share))] and ex.failure.error is None


def test_the_workers_may_take_as_long_to_start_as_vllm_gives_its_engine(monkeypatch, tmp_path):
    """vLLM waits ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s) for its engine, and gives
    its own workers no shorter limit; the zbus executor's workers get the same,
    where they had zbus's 120 s (importing vLLM and torch on many workers from a
    slow shared disk failed the start). The executor is stopped as it would be
    made. Sabotage: no ``startup_timeout`` given -> 120.0."""
    from vllm import EngineArgs

    from zbus.vllm import executor as adapter
    from zbus.vllm.bench import tiny_model

    class Made(Exception):
        pass

    made = []

    def executor(*args, **kwargs):
        made.append(kwargs)
        raise Made
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "900")
    monkeypatch.setattr(adapter, "Executor", executor)
    config = EngineArgs(model=tiny_model(str(tmp_path)), load_format="dummy", skip_tokenizer_init=True,
                        enforce_eager=True, max_model_len=256).create_engine_config()
    with pytest.raises(Made):
        adapter.ZbusExecutor(config)
    assert [kw.get("startup_timeout", 120.0) for kw in made] == [900.0]


def test_a_ctrl_c_in_a_mapped_futures_function_goes_on(wire):
    """A Ctrl-C raised as a step's output is mapped (vLLM's aggregation, run by the
    thread that completes the step's future) fails the mapped future and goes on in
    that thread, as zbus lets a callback's Ctrl-C go on. Before, it was kept in the
    mapped future alone, which vLLM reads only at times: lost. The mapped future is
    running, as its step's, so ``cancel()`` says False. Sabotage: one ``except
    BaseException`` that only sets the exception in ``_mapped`` -> no
    KeyboardInterrupt; no ``set_running_or_notify_cancel()`` there -> cancelled."""
    import concurrent.futures

    from zbus.vllm.executor import _mapped

    def interrupted(_):
        raise KeyboardInterrupt

    step = concurrent.futures.Future()  # (a step's RpcFuture is running once returned)
    out = _mapped(step, interrupted)
    assert out.cancel() is False  # (as the step's own: its call is sent)
    with pytest.raises(KeyboardInterrupt):
        step.set_result(1)
    assert isinstance(out.exception(0), KeyboardInterrupt)


def test_a_mapped_steps_future_reads_its_replies_when_no_thread_completes_futures(wire, monkeypatch):
    """An engine with a KV connector waits on a step's mapped future (its outputs
    aggregated). Where the thread that completes futures cannot start (a pids
    limit), the step's own future is completed by whoever waits on it; the mapped
    one was completed by no one: the engine waited for good, past the step's
    timeout too. Now waiting on it waits on the step's future: the result comes,
    and a step past its timeout fails with TimeoutError. Sabotage: a plain Future
    in ``_mapped`` -> TimeoutError of the 20 s wait; the late step waits it out."""
    import workers

    import zbus
    from zbus.vllm.executor import _mapped

    refused = no_thread_to_be_had(monkeypatch, "zbus-completer")
    with zbus.Executor(workers.EchoWorker, nproc_per_node=2) as ex:
        out = _mapped(ex.collective_rpc("rank_value", args=(3,), non_block=True, timeout=30), lambda r: r[1])
        assert out.result(timeout=20) == 31 and refused
        began = time.monotonic()
        late = _mapped(ex.collective_rpc("sleep", args=(3.0,), non_block=True, timeout=0.3), lambda r: r)
        assert isinstance(late.exception(timeout=20), TimeoutError)
        assert time.monotonic() - began < 2.5


def test_a_mapped_future_and_its_step_go_with_their_last_holder(wire):
    """A step's future holds every rank's outputs: once its mapped future has
    completed and been dropped, the two go at once, not at the next collection. A
    first version kept a cycle (the mapped future held its source, whose callback
    held it). Sabotage: no ``out._source = None`` in ``_mapped``'s callback -> the
    step's future lives on."""
    import concurrent.futures
    import weakref

    from zbus.vllm.executor import _mapped

    gc.disable()
    try:
        step = concurrent.futures.Future()
        out = _mapped(step, lambda outputs: outputs[0])
        step.set_result([b"x" * 1000, None])
        assert out.result(0) == b"x" * 1000
        gone = weakref.ref(step)
        del step, out
        assert gone() is None
    finally:
        gc.enable()


def test_a_followers_worker_refuses_a_configuration_that_names_code(wire):
    """Sabotage: no check of what a remote configuration names (worker class,
    extension, remote code; a KV offloading spec module, an EC connector module, a
    custom speculative proposer class, a compilation backend by qualified name,
    each of which vLLM imports during ``init_device`` or ``load_model``; a
    torch.compile option that is text, which inductor puts on its compiler's command
    line; a compilation cache folder, whose compiled code vLLM loads). Before,
    only the top level of a KV connector's extra configuration was read: a
    ``MultiConnector``'s connectors (each imports its module) passed; now every
    key ending in ``module_path``, at any depth (sabotage: ``module_paths``
    reads the top level only)."""
    from types import SimpleNamespace as NS

    from zbus.errors import ZbusError
    from zbus.vllm.worker import check_remote_config

    def config(**over):
        pc = NS(worker_cls="vllm.v1.worker.cpu_worker.CPUWorker", worker_extension_cls="")
        mc = NS(logits_processors=None, trust_remote_code=False, model="/m")
        for key, value in over.items():
            setattr(pc if key.startswith("worker") else mc, key, value)
        return NS(parallel_config=pc, model_config=mc, kv_transfer_config=None)

    check_remote_config(config(), set())
    # vLLM's fault tolerance: its commands' instruction may be a pickle, which vLLM loads
    # (sabotage: no check of enable_fault_tolerance)
    ft = config()
    ft.parallel_config.enable_fault_tolerance = True
    with pytest.raises(ZbusError, match="fault tolerance"):
        check_remote_config(ft, {"mine", "trust_remote_code"})
    for bad, match in ((dict(worker_cls="os.system"), "worker class"),
                       (dict(worker_extension_cls="evil.Ext"), "extension"),
                       (dict(logits_processors=["evil.lp"]), "logits"),
                       (dict(trust_remote_code=True), "remote code")):
        with pytest.raises(ZbusError, match=match):
            check_remote_config(config(**bad), set())
    check_remote_config(config(worker_cls="mine.Worker", trust_remote_code=True,
                               logits_processors=["mine.lp:Keep", "mine:Top"]), {"mine", "trust_remote_code"})
    with pytest.raises(ZbusError, match="logits"):
        check_remote_config(config(logits_processors=["mine.lp:Keep"]), {"mine.lp.Other"})

    def with_parts(**parts):
        c = config()
        vars(c).update(parts)
        return c

    def kv(**extra):
        return NS(kv_connector_module_path=None, kv_connector_extra_config=extra)

    for parts, match in (
            (dict(kv_transfer_config=kv(spec_module_path="evil")), "spec_module_path"),
            # MultiConnector imports each of its connectors' modules, at any depth
            (dict(kv_transfer_config=kv(connectors=[{"kv_connector": "Evil",
                                                      "kv_connector_module_path": "evil.conn"}])),
             "kv_connector_module_path"),
            (dict(kv_transfer_config=kv(connectors=[
                {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
                    {"kv_connector": "OffloadingConnector",
                     "kv_connector_extra_config": {"cache_policy_module_path": "evil"}}]}}])),
             "cache_policy_module_path"),
            (dict(ec_transfer_config=NS(ec_connector_module_path=None,
                                        ec_connector_extra_config={"tiers": [{"module_path": "evil"}]})),
             "EC connector's module"),
            (dict(ec_transfer_config=NS(ec_connector_module_path="evil")), "EC connector"),
            (dict(speculative_config=NS(method="custom_class", model="evil.Proposer")), "proposer"),
            # a draft model's own flag: its repository's code runs at load_model (sabotage: check
            # model_config's flag only)
            (dict(speculative_config=NS(method="draft_model", model="/d",
                                        draft_model_config=NS(trust_remote_code=True, model="/d"))),
             "remote code of '/d'"),
            (dict(compilation_config=NS(backend="evil.backend")), "compilation backend"),
            # put unquoted on the C++ compiler's command line: "-wrapper /bin/sh,-c,..." ran a
            # shell in a follower's warm-up before 2026-12-06 (sabotage: no check of the options)
            (dict(compilation_config=NS(backend="inductor", inductor_compile_config={
                "cpp.enable_floating_point_contract_flag": "off -wrapper /bin/sh,-c,touch /tmp/x"})),
             "inductor.cpp.enable_floating_point_contract_flag"),
            (dict(compilation_config=NS(inductor_compile_config={"cpp.cxx": ["/tmp/evil-cc"]})),
             "inductor.cpp.cxx"),
            # inductor would load compiled code from a cache server
            (dict(compilation_config=NS(inductor_compile_config={"fx_graph_remote_cache": True})),
             "inductor.fx_graph_remote_cache"),
            (dict(compilation_config=NS(cache_dir="/shared/compiled")), "compilation cache folder")):
        with pytest.raises(ZbusError, match=match):
            check_remote_config(with_parts(**parts), set())
    check_remote_config(with_parts(compilation_config=NS(backend="inductor"),
                                   speculative_config=NS(method="ngram", model=None)), set())
    own = {"dce": True, "size_asserts": False, "compile_threads": 1, "cpp.dynamic_threads": True,  # vLLM's
           "fx_graph_remote_cache": False}
    check_remote_config(with_parts(compilation_config=NS(backend="inductor", cache_dir="",
                                                         inductor_compile_config=own)), set())
    check_remote_config(with_parts(compilation_config=NS(cache_dir="/shared/compiled",
                                                         inductor_compile_config={"cpp.cxx": ["/opt/cc"]})),
                        {"inductor.cpp.cxx", "compile_cache_dir"})
    check_remote_config(with_parts(kv_transfer_config=kv(connectors=[
        {"kv_connector_module_path": "mine.conn"}, {"kv_connector": "LMCacheConnectorV1"}])), {"mine"})


class Extension:
    """A worker extension outside vLLM (one its operator allowed by name)."""

    def reset_model_weights(self):
        return "reset"


def test_a_followers_worker_runs_only_the_methods_vllms_engine_calls_and_allowed_ones(wire):
    """A follower checks the leader's configuration once, in ``init_worker``; it then
    runs only the vLLM worker methods vLLM's engine calls (``FOLLOWER_CALLS``) and
    those of a worker class or extension outside vLLM, which that check let through.
    Those that would undo the check or run what the leader sends are refused by
    name, and so is any other vLLM worker method: ``get_model`` (never called by the
    engine) here. The leader's node runs them all. Before ``init_worker`` an unknown
    name is an unknown method. Sabotage: no check in ``VllmWorker.__getattr__``
    (``update_environment_variables`` set ``ZBUS_VLLM_ALLOW`` for the leader; until
    2026-12-06 only a deny-list: ``elastic_ep_execute`` and ``get_model`` ran); the
    wrapper's own methods looked up after its worker's (a worker class outside vLLM
    made ``update_environment_variables`` pass); no check for a wrapper without its
    worker (RecursionError); no ``FOLLOWER_REFUSES`` check before the defining
    class's (an allowed class's own ``apply_model`` ran)."""
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from zbus.errors import ZbusError
    from zbus.vllm.worker import FOLLOWER_CALLS, FOLLOWER_REFUSES, VllmWorker
    from zbus.worker import resolve_method

    class OperatorsWorker(Worker, Extension):  # (a class of this module: outside vLLM)
        def update_environment_variables(self, envs):  # (the wrapper's own runs, not this)
            raise AssertionError("not reached")

        def apply_model(self, fn):  # an allowed class's own: refused by name all the same
            return super().apply_model(fn)

    def worker_on(node_rank, with_worker=True):
        worker = VllmWorker.__new__(VllmWorker)
        worker.node_rank = node_rank
        worker.wrapper = WorkerWrapperBase(rpc_rank=0, global_rank=0)  # no vLLM worker in it yet
        if with_worker:  # (as init_worker makes it, without its __init__)
            worker.wrapper.worker = OperatorsWorker.__new__(OperatorsWorker)
        return worker

    assert not FOLLOWER_CALLS & FOLLOWER_REFUSES
    assert {"update_environment_variables", "handle_ft_command", "elastic_ep_execute"} <= FOLLOWER_REFUSES
    for name in sorted(FOLLOWER_REFUSES | {"get_model"}):  # (get_model: vLLM's, not called by its engine)
        with pytest.raises(ZbusError, match="refused"):
            resolve_method(worker_on(1), name, False)
        assert callable(resolve_method(worker_on(0), name, False))
    with pytest.raises(ZbusError, match="refused"):  # (the wrapper's own, before its worker)
        resolve_method(worker_on(1, with_worker=False), "update_environment_variables", False)
    assert callable(resolve_method(worker_on(1, with_worker=False), "init_device", False))
    assert resolve_method(worker_on(1, True), "reset_model_weights", False)() == "reset"
    assert callable(resolve_method(worker_on(1, True), "check_health", False))
    with pytest.raises(ZbusError, match="unknown method"):
        resolve_method(worker_on(1), "no_such_method", False)


@pytest.mark.parametrize("allowed", ["zbus.vllm", "zbus"])
def test_a_follower_starts_vllm_workers_only_for_a_leader_with_keys(allowed):
    """vLLM's workers unpickle what rank 0, on the leader's node, sends them through
    torch.distributed (the set-up of its groups, on every follower): a follower
    refuses them to a leader without keys whatever ``--allow-worker`` says, and the
    leader's start fails naming the node and why. Sabotage: no ``KEYED_LEADER_ONLY``
    check in ``NodeAgent._check_worker`` -> the follower starts the workers (until
    2026-12-06 ``--allow-worker zbus.vllm``, or ``zbus``, let any leader run code
    there)."""
    import zbus
    from zbus.cluster import free_port_pair
    from zbus.vllm.worker import VllmWorker

    port = free_port_pair()
    env = dict(os.environ, **VLLM_ENV, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE="1")
    for name in ("ZBUS_ALLOW_WORKERS", "ZBUS_SECRET", "ZBUS_SECRET_FILE", "ZBUS_CURVE_DIR"):
        env.pop(name, None)
    proc = psutil.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank", "1", "--join-timeout",
                         "60", "--allow-worker", allowed], env=env, stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(zbus.StartupError, match="node 1 .*refused to start the workers.*keys"):
            with zbus.Executor(VllmWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                               master_port=port, join_timeout=60, startup_timeout=60):
                pass
        assert proc.wait(30) == 1
        assert "torch.distributed" in proc.stderr.read()
    finally:
        end_process(proc)


def test_every_method_vllms_engine_calls_on_its_workers_is_run_or_refused_by_a_follower():
    """The methods vLLM's engine names in its ``collective_rpc`` calls, read from
    vLLM's installed sources, are each in ``FOLLOWER_CALLS`` or ``FOLLOWER_REFUSES``:
    a vLLM version that calls a new one fails here, not on a follower in service
    (refused there). Sabotage: ``check_health`` out of ``FOLLOWER_CALLS``."""
    import ast
    import pathlib

    import vllm

    from zbus.vllm.worker import FOLLOWER_CALLS, FOLLOWER_REFUSES

    called = set()
    for path in pathlib.Path(vllm.__file__).parent.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "collective_rpc" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "collective_rpc":
                first = node.args[:1] + [k.value for k in node.keywords if k.arg == "method"]
                if first and isinstance(first[0], ast.Constant) and isinstance(first[0].value, str):
                    called.add(first[0].value)
    assert {"init_device", "execute_model", "check_health", "handle_ft_command"} <= called  # the scan works
    assert called - FOLLOWER_CALLS - FOLLOWER_REFUSES == set()


def test_each_worker_sees_its_nodes_gpus_and_maps_its_peers_as_vllm_does(monkeypatch):
    """vLLM takes a worker's local rank for its device and maps its peers' local
    ranks through ``CUDA_VISIBLE_DEVICES`` (its custom all-reduce's P2P check, at
    ``init_device`` with TP 2 on one node). The vLLM executor shows each worker every
    GPU of its node, as vLLM's own executor does. Sabotage: no ``WORKER_ENV`` (zbus's
    one GPU each, as before) -> IndexError mapping the peer, and the engine's start
    failed on every GPU node with two workers or more."""
    from vllm.platforms.interface import Platform

    from zbus.processes import worker_env
    from zbus.vllm.executor import WORKER_ENV
    from zbus.vllm.worker import device_index

    class Gpus(Platform):  # vLLM's own mapping, over CUDA's variable
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    for local_rank in (0, 1):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the node's, as the operator set them
        place = {"rank": local_rank, "local_rank": local_rank, "world_size": 2, "local_world_size": 2,
                 "node_rank": 0}
        env = worker_env(place, "127.0.0.1", 29500, dict(WORKER_ENV))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])  # the worker's
        assert device_index(local_rank) == local_rank
        assert [Gpus.logical_device_id_to_visible_device_id(peer) for peer in (0, 1)] == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # a worker that sees one GPU alone
    assert device_index(0) == 0


SETUP_SCRIPT = r"""
import dataclasses, json, logging, os, sys
from vllm.config import VllmConfig
from zbus.vllm.worker import process_setup
config = VllmConfig()
config.logging_config = dataclasses.replace(config.logging_config, log_level="DEBUG",
                                            pylogging_config_file=sys.argv[1])
out = {}
try:
    process_setup(config, 0, 0, remote=False)
    out["local"] = "applied"
except Exception as e:
    out["local"] = type(e).__name__
os.environ["ZBUS_THREADS"] = "shared"
process_setup(config, 0, 1, remote=True)
out["level"] = logging.getLogger("vllm").level
out["set_by_vllm"] = os.environ.get("VLLM_OMP_NUM_THREADS_SET_BY_VLLM")
print(json.dumps(out))
"""


def test_each_worker_process_is_set_up_as_vllms_own_executor_sets_it_up(tmp_path):
    """Each worker applies what vLLM's own executor applies in its worker processes:
    the engine's logging configuration (its level here), with the node's own
    logging file on a follower, never a path from the network (a ``dictConfig``
    file names classes to build); and where zbus gave the worker a share of the
    node's cores for its start-up, vLLM may take them back to 1 for serving.
    Sabotage: use the network's ``pylogging_config_file`` on a follower -> the
    missing file is opened there too; no ``configure_logging`` -> level 0."""
    missing = str(tmp_path / "no-such-logging.json")
    out = subprocess.run([sys.executable, "-c", SETUP_SCRIPT, missing], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, **{**VLLM_ENV, "PYTHONPATH": TEST_PATH}))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"local": result["local"], "level": logging.DEBUG, "set_by_vllm": "1"}, result
    assert result["local"] != "applied"  # the driver's own file is used where it runs


def test_cores_are_planned_for_the_workers_of_this_node(monkeypatch, wire, tmp_path):
    """Two nodes of one worker each (TP=2): each node binds its one worker as
    vLLM's multi-node executor would, from a list of its own cores. Sabotage: plan
    from vLLM's configuration as it is (the whole world on one node) → a one-entry
    list is refused ("doesn't match local world size 2")."""
    from vllm import EngineArgs

    from zbus.vllm.bench import tiny_model
    from zbus.vllm.worker import cpu_plan

    config = EngineArgs(model=tiny_model(str(tmp_path)), load_format="dummy", skip_tokenizer_init=True,
                        tensor_parallel_size=2, enforce_eager=True,
                        max_model_len=256).create_engine_config()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert cpu_plan(config, local_world_size=1) == [[1]]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert cpu_plan(config, local_world_size=2) == [[0], [1]]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert cpu_plan(config, local_world_size=1) == []
    assert config.parallel_config.nnodes == 1  # the engine's own configuration is untouched


def test_only_the_rank_that_replies_makes_its_asynchronous_output_ready(wire):
    """Under async scheduling a step's output is made ready (a copy from the device)
    by the output thread; vLLM's own workers do that only on the rank whose reply
    the engine takes. Sabotage: no ``replying`` check in ``VllmWorker._output``: the
    other TP ranks copy their output every step."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    from zbus.vllm.worker import VllmWorker

    class Output(AsyncModelRunnerOutput):
        made = 0

        def get_output(self):
            Output.made += 1
            return "ready"

    worker = VllmWorker.__new__(VllmWorker)  # (no vLLM worker inside: only the output's path)
    worker._outputs = None
    worker.replying = False
    assert worker._output(Output()) is None and Output.made == 0
    worker.replying = True
    assert worker._output(Output()).result(timeout=10) == "ready" and Output.made == 1
    worker._outputs.shutdown()


def test_the_benchmarks_timer_keeps_an_asynchronous_output_one(wire):
    """``zbus bench vllm`` times each step on the workers and makes an asynchronous
    output (async scheduling: the default on GPUs) ready there. It gave a plain
    object back, which the worker replied with as it was: not encodable, so every
    step failed on zbus, and vLLM's own executor pickled it to an engine that could
    not use it. Sabotage: ``_ready_class`` returning a class of its own base."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    from zbus.vllm.bench import install_timer

    class Made(AsyncModelRunnerOutput):
        def get_output(self):
            return "the output"

    class Worker:
        def execute_model(self, *args):
            return Made()

        def sample_tokens(self, *args):
            return None

    worker = Worker()
    install_timer(worker)
    out = worker.execute_model()
    assert isinstance(out, AsyncModelRunnerOutput) and out.get_output() == "the output"
    assert worker.sample_tokens() is None and worker.zbus_compute[1] == 2


def test_the_output_thread_works_on_the_workers_device(wire, monkeypatch):
    """The thread that makes asynchronous outputs ready sets the worker's device
    first, as vLLM's own output thread: a thread does not inherit it (CUDA would
    give it a context on device 0). Sabotage: no ``initializer`` for the thread
    pool in ``VllmWorker._output`` -> ``set_device`` is never called there."""
    import threading
    import types

    from vllm.platforms import current_platform
    from vllm.v1.outputs import AsyncModelRunnerOutput

    from zbus.vllm.worker import VllmWorker

    seen = []

    def set_device(cls, device):
        seen.append((threading.current_thread().name, device))

    monkeypatch.setattr(type(current_platform), "set_device", classmethod(set_device))

    class Output(AsyncModelRunnerOutput):
        def get_output(self):
            return threading.current_thread().name

    worker = VllmWorker.__new__(VllmWorker)  # (no vLLM worker inside: only the output's path)
    worker._outputs, worker.replying = None, True
    worker.wrapper = types.SimpleNamespace(device="the worker's device")
    thread = worker._output(Output()).result(timeout=10)
    worker._outputs.shutdown()
    assert thread.startswith("zbus-vllm-output") and seen == [(thread, "the worker's device")]


def test_the_executor_says_it_failed_for_good():
    """vLLM's fault tolerance asks ``is_failed`` to tell a dead engine from one it
    may recover: a zbus failure is for good. Sabotage: no ``is_failed`` (vLLM
    then reports a recoverable engine)."""
    import zbus
    from zbus.vllm.executor import ZbusExecutor

    adapter = ZbusExecutor.__new__(ZbusExecutor)  # vLLM's interface over a plain cluster
    assert adapter.is_failed is False
    adapter._zbus = zbus.Executor("workers:EchoWorker", nproc_per_node=1)
    try:
        assert adapter.is_failed is False
        with pytest.raises(zbus.WorkerDiedError):
            adapter._zbus.collective_rpc("die", timeout=30)
        assert adapter.is_failed is True
    finally:
        adapter._zbus.shutdown()


def test_shutdown_does_not_wait_behind_a_step_that_timed_out():
    """A step timed out and its worker is still in it: the shutdown does not ask
    the workers to shut vLLM down (their answer would come after that step's),
    and ends within vLLM's 5 s plus the stop's grace. Sabotage: no
    ``zbus.overdue`` check in ``ZbusExecutor.shutdown`` -> it waits out the
    shutdown call's 3 s first (over 8 s)."""
    import zbus
    from zbus.vllm.executor import ZbusExecutor

    adapter = ZbusExecutor.__new__(ZbusExecutor)  # vLLM's interface over a plain cluster
    adapter._attach(zbus.Executor("workers:EchoWorker", nproc_per_node=1))
    try:
        with pytest.raises(TimeoutError):
            adapter._zbus.collective_rpc("sleep", args=(30,), timeout=0.5)
        assert adapter._zbus.overdue == 1
        start = time.monotonic()
        adapter.shutdown()
        assert time.monotonic() - start < 7.5
    finally:
        adapter._zbus.shutdown()


def test_an_executor_never_shut_down_is_when_it_is_collected():
    """vLLM does not shut down an engine whose start failed after its executor was
    built: the executor's workers end when it is collected (or at exit). Sabotage:
    no ``weakref.finalize`` in ``ZbusExecutor._attach`` (the shutdown's work done
    by ``shutdown`` alone): the worker lives on."""
    import zbus
    from zbus.vllm.executor import ZbusExecutor

    adapter = ZbusExecutor.__new__(ZbusExecutor)  # vLLM's interface over a plain cluster
    cluster = zbus.Executor("workers:EchoWorker", nproc_per_node=1)
    try:
        adapter._attach(cluster)
        worker = psutil.Process(cluster._workers.procs[0].pid)
        del adapter
        gc.collect()
        assert psutil.wait_procs([worker], timeout=10)[1] == []
        with pytest.raises(zbus.ZbusError, match="shut down"):
            cluster.collective_rpc("noop", timeout=5)
    finally:
        cluster.shutdown()


# --- the engine ------------------------------------------------------------------


def generate(backend: str, *args: str, tmp_path, **kwargs) -> dict:
    """The engine's tokens, once it and every process it started have ended (vLLM
    SIGKILLs an engine core slow to end: its orphaned workers then clean up)."""
    with open(tmp_path / f"{backend.replace('.', '_')}.log", "w") as log:
        engine = Engine(backend, *args, log=log, **kwargs)
        try:
            ready = engine.event("ready")
            everyone = engine.descendants()
            out = engine.event("tokens")
            assert out["event"] == "tokens", out
            assert engine.event("done")["event"] == "done"
            assert engine.proc.wait(60) == 0
            assert psutil.wait_procs(everyone, timeout=20)[1] == [], engine._tail()
            return {**out, "block_size": ready["block_size"]}
        finally:
            engine.close()


@pytest.fixture(scope="module")
def mp_tokens(tmp_path_factory) -> list[list[int]]:
    """The greedy tokens of vLLM's own executor, TP=2 on one node."""
    return generate("mp", "--tp", "2", tmp_path=tmp_path_factory.mktemp("mp"))["tokens"]


def test_tp2_on_one_node_gives_the_tokens_of_vllms_own_executor(mp_tokens, tmp_path):
    """Sabotage: a scheduler output that reaches the workers changed (a field
    dropped by the wire) gives other tokens or fails the engine; a worker shutdown
    without vLLM's parallel groups destroyed leaves their queue's segment to
    Python's resource tracker, which says so."""
    before = zbus_segments()
    out = generate(ZBUS, "--tp", "2", tmp_path=tmp_path)
    assert out["tokens"] == mp_tokens
    assert len(mp_tokens) == 4 and all(len(t) == 16 for t in mp_tokens)
    assert zbus_segments() - before == set()
    # vLLM's parallel groups were destroyed: their shared-memory queue was not left
    # to Python's resource tracker
    assert "leaked shared_memory" not in (tmp_path / f"{ZBUS.replace('.', '_')}.log").read_text()


def test_worker_killed_during_generation_fails_the_engine_within_the_bound(tmp_path):
    """A SIGKILLed worker reaches vLLM's engine as a failure, never a hang, and the
    engine's shutdown leaves no process or segment. Sabotage: a failure callback
    that never reaches vLLM makes the engine wait forever (the test times out)."""
    before = zbus_segments()
    with open(tmp_path / "engine.log", "w") as log:
        engine = Engine(ZBUS, "--tp", "2", "--tokens", "200", "--hold", log=log)
        try:
            workers = engine.workers_generating()
            everyone = engine.descendants()
            workers[1].send_signal(signal.SIGKILL)
            killed_at = time.time()
            failed = engine.event("done", timeout=60)
            assert failed["event"] == "error", failed
            elapsed = failed["at"] - killed_at
            print(f"worker SIGKILL -> vLLM {failed['type']} after {elapsed:.2f} s")
            assert elapsed < 10.0  # the liveness bound
            assert engine.proc.wait(60) == 0
        finally:
            engine.close()
    assert psutil.wait_procs(everyone, timeout=15)[1] == []
    assert zbus_segments() - before == set()


def named_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("killed", ["engine", "every_process"])
def test_an_engine_killed_leaves_no_segment(tmp_path, killed):
    """While the engine generates, nothing it or its workers made in /dev/shm has a
    name (zbus's rings, vLLM's CPU all-reduce and its group's message queue): the
    memory is there, and freed whoever dies. ``[engine]``: vLLM SIGKILLs an
    engine's process not gone 5 s after SIGTERM; its orphaned workers end.
    ``[every_process]``: the engine and every process under it SIGKILLed at once,
    as vLLM's server does at SIGTERM. Sabotage: no ``unlink_node_shm`` call in
    ``ZbusExecutor._init_executor`` -> the all-reduce's and the queue's names stay
    (both cases: the orphans remove only zbus's and the node's)."""
    before, used = named_shm(), shm_used()
    with open(tmp_path / "engine.log", "w") as log:
        engine = Engine(ZBUS, "--tp", "2", "--tokens", "200", "--hold", log=log)
        try:
            workers = engine.workers_generating()
            assert named_shm() - before == set()
            assert shm_used() - used > 32 * 2**20  # zbus's ring of calls alone
            core = workers[0].parent()  # the engine's process (the driver is vLLM's client)
            if killed == "every_process":
                doomed = [engine.proc, *engine.descendants()]
                for p in doomed:
                    p.send_signal(signal.SIGKILL)
            else:
                doomed = [core, *core.children(recursive=True)]
                core.send_signal(signal.SIGKILL)
            assert psutil.wait_procs(doomed, timeout=15)[1] == [], describe(doomed)
            assert named_shm() - before == set()
            assert shm_used() - used < 2**20
        finally:
            engine.close()


BASELINE_SCRIPT = r"""
import os
from zbus.baselines import VllmBaseline
baseline = VllmBaseline(2)
try:
    baseline.call()
finally:
    baseline.close()
print("ok" if not [p for p in baseline.procs if p.is_alive()] else "alive", os.environ["VLLM_RPC_BASE_PATH"])
"""


def test_the_vllm_baseline_of_zbus_bench_leaves_no_socket_file():
    """vLLM's message queues bind their sockets as files in ``VLLM_RPC_BASE_PATH``
    (the temp folder by default) and leave them: ``zbus bench``'s vLLM baseline keeps
    them in a folder of its own, removed with it. Sabotage: no folder of its own in
    ``VllmBaseline`` -> the 6 files of one run (a broadcast queue and two response
    queues, two sockets each) stay where ``VLLM_RPC_BASE_PATH`` says (before
    2026-12-06, in /tmp after every ``zbus bench compare``)."""
    folder = os.environ["VLLM_RPC_BASE_PATH"]  # (this module's, from rpc_folder)
    before, temp = set(os.listdir(folder)), set(os.listdir(tempfile.gettempdir()))
    # (in a process of its own: multiprocessing's resource tracker ends with it)
    run = subprocess.run([sys.executable, "-c", BASELINE_SCRIPT], env=dict(os.environ, **VLLM_ENV),
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ok", folder]  # the variable as it was, no worker alive
    assert set(os.listdir(folder)) == before
    assert set(os.listdir(tempfile.gettempdir())) - temp == set()


def test_a_start_that_fails_after_the_workers_made_their_queues_leaves_no_segment(tmp_path):
    """A seed numpy refuses fails each worker's ``init_device`` after vLLM made its
    TP group's message queue there (24 MiB in /dev/shm): the engine fails to start
    naming the error, and once its processes are gone nothing it made has a name
    or holds memory, and multiprocessing's resource tracker counts no leak.
    Sabotage: no ``name_unnamed_segments`` in ``VllmWorker.__init__`` -> the
    queue's ``psm_*`` name stays (the start never reaches ``unlink_node_shm``)."""
    before, used = named_shm(), shm_used()
    with open(tmp_path / "engine.log", "w") as log:
        engine = Engine(ZBUS, "--tp", "2", "--seed", str(2**32 + 1), log=log)
        try:
            assert engine.proc.wait(180) != 0
            assert "Seed must be between 0 and 2**32 - 1" in engine._tail()
            assert psutil.wait_procs(marked_processes(), timeout=30)[1] == []
            assert "leaked shared_memory" not in engine._tail()
            deadline = time.monotonic() + 10
            while named_shm() - before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert named_shm() - before == set()
            assert shm_used() - used < 2**20
        finally:
            engine.close()


SEGMENT_SCRIPT = r"""
import os, sys, time
os.environ["ZBUS_NODE_SHM_PREFIX"] = sys.argv[1]
from zbus.vllm.worker import VllmWorker
VllmWorker()  # as a worker process makes it
from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer
buffer = ShmRingBuffer(1, 4096, 2)  # a message queue's ring, as vLLM's groups make them
print(buffer.shared_memory.name, flush=True)
time.sleep(60)
"""


def test_a_segment_a_vllm_worker_makes_without_a_name_goes_with_its_node(tmp_path):
    """vLLM makes its message queues' segments under multiprocessing's random names;
    in a zbus worker they carry the node's prefix, so a SIGKILL of the worker's
    process group during start-up (no exit hook runs, and multiprocessing's
    resource tracker dies with it) leaves them to ``unlink_prefixed``, which every
    end of a node's workers runs. Sabotage: no ``name_unnamed_segments`` in
    ``VllmWorker.__init__`` -> a ``psm_`` name that outlives everything."""
    from zbus.processes import NODE_SHM_PREFIX_ENV, node_shm_prefix
    from zbus.shm import unlink_prefixed

    assert NODE_SHM_PREFIX_ENV == "ZBUS_NODE_SHM_PREFIX"
    prefix = node_shm_prefix(65001, 3)
    before = named_shm()
    proc = psutil.Popen([sys.executable, "-c", SEGMENT_SCRIPT, prefix], env=dict(os.environ, **VLLM_ENV),
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    name = ""
    try:
        name = next_line(proc, time.monotonic() + 120).strip().lstrip("/")
        assert name in named_shm() - before
        assert name.startswith(prefix), name
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and its resource tracker
        proc.wait(10)
        unlink_prefixed(prefix)  # as the node's workers' end does
        assert named_shm() - before == set()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        end_process(proc)
        if name and os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_a_logits_processor_given_as_a_class_reaches_the_workers(mp_tokens, tmp_path):
    """vLLM takes logits processors as classes or as ``"module:Class"`` names; a
    class travels to zbus's workers as its name, which vLLM's loader reads only
    in that form. Before, the name was ``module.Class``: every worker refused it
    ("Invalid logits processor FQCN") and the engine did not start. Sabotage:
    ``module.Class`` in ``wire._reducer``."""
    out = generate(ZBUS, "--tp", "2", "--logits-processor", "vllm_logits:KeepLogits", tmp_path=tmp_path)
    assert out["tokens"] == mp_tokens  # (it changes no logit)


def test_a_hybrid_model_gets_the_kv_block_size_of_vllms_own_executor(tmp_path):
    """A hybrid model (attention and linear-attention layers, Qwen3-Next's layout,
    tiny) on zbus: each worker sets the KV cache block size its backends want, as
    vLLM's own executor does after ``load_model`` (aligned with the layers' state
    pages: 256 here), and the tokens are vLLM's own. Sabotage: no
    ``update_block_size_for_backend`` in ``VllmWorker.load_model`` -> 16."""
    mp = generate("mp", "--tp", "2", "--hybrid", "--prompts", "1", "--tokens", "8", tmp_path=tmp_path)
    zbus = generate(ZBUS, "--tp", "2", "--hybrid", "--prompts", "1", "--tokens", "8", tmp_path=tmp_path)
    print(f"KV block size of a hybrid model: vLLM's executor {mp['block_size']}, zbus {zbus['block_size']}")
    assert zbus["block_size"] == mp["block_size"] != 16
    assert zbus["tokens"] == mp["tokens"]


def test_vllm_server_on_zbus_answers_and_leaves_nothing_at_sigterm(mp_tokens, tmp_path):
    """vLLM's OpenAI server with ``--distributed-executor-backend
    zbus.vllm.ZbusExecutor``: a completion gives the greedy tokens of vLLM's own
    executor. At SIGTERM the server gives its engine no time and SIGKILLs every
    process under it at once; nothing is left: no process, no name in /dev/shm,
    no memory. Sabotage: no ``_unlink_names`` after start-up in
    ``MultiprocExecutor._start`` -> zbus's three rings stay."""
    from vllm_driver import PROMPTS

    from zbus.cluster import free_port_pair
    from zbus.vllm.bench import tiny_model

    model, port = tiny_model(str(tmp_path)), free_port_pair()
    before, used = named_shm(), shm_used()
    # (the `vllm` command of vLLM's CPU build cannot find its own version: the module runs the same)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--load-format", "dummy", "--skip-tokenizer-init", "--seed", "0", "--enforce-eager",
            "--tensor-parallel-size", "2", "--max-model-len", "256", "--distributed-executor-backend", ZBUS]
    with open(tmp_path / "server.log", "w") as log:
        server = psutil.Popen(argv, env=dict(os.environ, **VLLM_ENV), stdout=log, stderr=log)
        try:
            wait_for_http(server, f"http://127.0.0.1:{port}/health", 240, log.name)
            body = json.dumps({"model": model, "prompt": PROMPTS[0], "max_tokens": len(mp_tokens[0]),
                               "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                assert json.load(answer)["choices"][0]["token_ids"] == mp_tokens[0]
            assert named_shm() - before == set()
            everyone = server.children(recursive=True)
            server.send_signal(signal.SIGTERM)
            assert server.wait(30) == 0
            assert psutil.wait_procs(everyone, timeout=15)[1] == [], describe(everyone)
            assert named_shm() - before == set()
            assert shm_used() - used < 2**20
        finally:
            end_tree(server, 10)


def wait_for_http(proc: psutil.Popen, url: str, timeout: float, log: str) -> None:
    """Wait until ``url`` answers 200, or fail with the log's tail if ``proc`` ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                raise AssertionError(f"the server ended ({proc.returncode}): {f.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout} s")


NETNS = unavailable()


@pytest.mark.netns
@pytest.mark.skipif(NETNS is not None, reason=f"no namespaces: {NETNS}")
def test_tp2_across_two_hosts_gives_the_same_tokens_and_followers_exit(mp_tokens, tmp_path):
    """TP=2 over two namespace hosts with one worker each, keyed by one secret: the
    leader is the engine's process, the other host runs ``zbus follower``. Same greedy tokens;
    at the engine's shutdown the follower exits and no host keeps a segment or a
    process. Sabotage: one all-reduce group name on both hosts (vLLM's CPU
    shared-memory all-reduce across hosts) hangs the engine's start."""
    with NetnsCluster(2) as c:
        leader, host = c.nodes
        # keyed: a follower starts vLLM's workers only for a leader with keys
        secret = {"ZBUS_SECRET": "zbus-test-only-vllm-secret"}
        env = {"ZBUS_NNODES": "2", "ZBUS_MASTER_ADDR": leader.address, "ZBUS_LIVENESS_S": "10", **secret}
        with open(tmp_path / "follower.log", "w") as flog, open(tmp_path / "engine.log", "w") as log:
            zbus_cli = os.path.join(os.path.dirname(sys.executable), "zbus")
            follower = host.start([zbus_cli, "follower", "--master-addr", leader.address,
                                   "--nproc-per-node", "1", "--node-rank", "1"],
                                  env=dict(os.environ, **VLLM_ENV, **secret), stdout=flog, stderr=flog)
            engine = Engine(ZBUS, "--tp", "2", node=leader, env=env, log=log)
            try:
                engine.event("ready", timeout=240)
                out = engine.event("tokens")
                assert out["event"] == "tokens", out
                assert out["tokens"] == mp_tokens
                assert engine.event("done")["event"] == "done"
                assert engine.proc.wait(60) == 0
                assert follower.wait(30) == 0
            finally:
                engine.close()
                end_process(follower, 5)
        for node in c.nodes:  # (multiprocessing's resource tracker leaves a moment later)
            deadline = time.monotonic() + 15
            while (node.pids() or node.shm_segments()) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert node.shm_segments() == [] and node.pids() == [], (
                node.name, [psutil.Process(p).cmdline() for p in node.pids() if psutil.pid_exists(p)])
