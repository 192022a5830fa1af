"""The worker side of vLLM on zbus: vLLM's ``WorkerWrapperBase`` inside a zbus
worker process, set up as vLLM's own multiprocess executor sets it up."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
from typing import Any, Callable

from ..cluster import resolve_ip, route_to
from ..errors import ZbusError
from ..processes import NODE_SHM_PREFIX_ENV, THREADS_ENV, node_shm_prefix
from ..shm import unlink_prefixed
from ..worker import Worker, on_exit
from .wire import load_wire_modules

load_wire_modules()
log = logging.getLogger(__name__)

# Comma-separated names this node allows a leader's configuration to name as code
# (see check_remote_config: a worker class or extension, logits processors, a KV
# connector or offloading spec module, an EC connector module, a speculative proposer
# class, a compilation backend, "inductor.<option>" for a torch.compile option that
# is no flag or number), "trust_remote_code" to let it run a model repository's
# code and "compile_cache_dir" to let it name the folder of compiled code vLLM loads.
ALLOW_ENV = "ZBUS_VLLM_ALLOW"
# The vLLM worker methods a follower runs for the leader: those vLLM's engine calls
# on its workers (serving, LoRA, sleep, profiling, KV connectors, weight updates from
# a trainer), less FOLLOWER_REFUSES. A method of a worker class or extension outside
# vLLM (which ``check_remote_config`` let through by name) runs too; any other
# public method of vLLM's workers is refused, so a method a new vLLM version adds
# is not open to the leader until it is read and listed here.
FOLLOWER_CALLS = frozenset({
    "add_lora", "adjust_rank", "check_health", "checkpoint_prepare", "checkpoint_restore",
    "compile_or_warm_up_model", "compute_weight_checksums", "determine_available_memory", "discard",
    "execute_dummy_batch", "execute_model", "finish_weight_update", "get_encoder_timing_stats",
    "get_kv_cache_spec", "get_kv_connector_handshake_metadata", "get_model_inspection",
    "get_supported_kv_cache_layouts", "get_supported_tasks", "init_device", "init_weight_transfer_engine",
    "init_worker", "initialize_from_config", "list_loras", "load_model", "pin_lora", "profile",
    "reinitialize_distributed", "release_late_interaction_query_cache", "reload_weights", "remove_lora",
    "reset_encoder_cache", "reset_mm_cache", "reset_weights", "sample_tokens", "set_kv_cache_layout",
    "shutdown", "shutdown_weight_transfer_engine", "sleep", "start_draft_weight_update",
    "start_weight_update", "supports_draft_weight_updates", "synchronize_device", "take_draft_token_ids",
    "update_max_model_len", "update_weights", "wake_up",
})
# Methods vLLM's engine may call that a follower refuses: each would undo what
# ``check_remote_config`` checked (the environment ``allowed`` reads, the
# configuration), write files where the leader says, or run what the leader sends
# (``apply_model`` calls its argument; ``elastic_ep_execute`` calls any attribute of
# its executor by name; a fault-tolerance command's instruction may be a pickle,
# which vLLM's ``run_method`` loads, and a follower refuses fault tolerance).
FOLLOWER_REFUSES = frozenset({"update_environment_variables", "update_config", "save_sharded_state",
                              "save_tensorized_model", "handle_ft_command", "apply_model",
                              "elastic_ep_execute"})


class VllmWorker(Worker):
    """One vLLM worker. Every vLLM worker method is callable by name."""

    def __init__(self) -> None:
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        self.wrapper = WorkerWrapperBase(rpc_rank=self.rank, global_rank=self.rank)
        self._outputs: concurrent.futures.ThreadPoolExecutor | None = None
        if NODE_SHM_PREFIX_ENV in os.environ:  # (a zbus worker process)
            name_unnamed_segments(os.environ[NODE_SHM_PREFIX_ENV])

    def rpc_self(self) -> Any:
        return self.wrapper  # what vLLM's own executor hands a function it calls

    def init_worker(self, vllm_config: Any) -> None:
        """vLLM's ``init_worker``, with this process's place in the cluster."""
        if self.node_rank > 0:  # the configuration came over the network
            check_remote_config(vllm_config, allowed())
        if "VLLM_HOST_IP" not in os.environ:  # vLLM's own guess needs a route to the internet
            os.environ["VLLM_HOST_IP"] = route_to(resolve_ip(os.environ["MASTER_ADDR"]))[0]
        process_setup(vllm_config, device_index(self.local_rank), self.rank, remote=self.node_rank > 0)
        bind_cpus(vllm_config, self.local_rank, self.local_world_size)
        tp = vllm_config.parallel_config.tensor_parallel_size
        kwargs: list[dict] = [{} for _ in range(self.world_size)]
        kwargs[self.rank] = {
            "vllm_config": vllm_config, "local_rank": device_index(self.local_rank), "rank": self.rank,
            "distributed_init_method": distributed_init_method(self.node_rank),
            "is_driver_worker": self.rank % tp == 0,
        }
        self.wrapper.init_worker(kwargs)
        # by every worker, as any of them may be the one killed; before vLLM's own
        # atexit hooks, which may wait on a peer gone with the driver. (The message
        # queues' names carry the prefix too: a start that fails after init_device made
        # them never reaches unlink_node_shm.)
        on_exit(functools.partial(unlink_prefixed, os.environ[NODE_SHM_PREFIX_ENV]))

    def unlink_node_shm(self) -> None:
        """Remove the names of the shared memory vLLM's parallel groups made on this
        node (the CPU all-reduce's segments, the message queues that broadcast to a
        group) once every rank has mapped them (``init_device`` returned on all):
        then no end, a SIGKILL of every process at once included, leaves them in
        /dev/shm. (vLLM's own executor leaves them when its server is stopped.)"""
        unlink_created_queues()  # (and multiprocessing's tracker forgets them)
        unlink_prefixed(os.environ[NODE_SHM_PREFIX_ENV])

    def load_model(self) -> None:
        """vLLM's ``load_model``, then what vLLM's own executor does next in each
        worker: the KV cache block size its attention backends want (a hybrid
        model's, aligned with its state pages: 256 where 16 stayed before), and the
        cache of vLLM's environment variables."""
        from vllm.envs import enable_envs_cache
        from vllm.platforms import current_platform

        self.wrapper.load_model()
        current_platform.update_block_size_for_backend(self.wrapper.vllm_config)
        enable_envs_cache()

    def execute_model(self, scheduler_output: Any) -> Any:
        return self._output(self._logged(self.wrapper.execute_model, scheduler_output))

    def sample_tokens(self, grammar_output: Any) -> Any:
        return self._output(self._logged(self.wrapper.sample_tokens, grammar_output))

    def _logged(self, step: Callable[..., Any], *args: Any) -> Any:
        """A model step, whose error the answering rank logs with its traceback, as
        vLLM's own workers do: the engine it ends shows only the error's text. (A
        rank that does not answer logs it anyway: see ``zbus.worker``.)"""
        try:
            return step(*args)
        except Exception:
            if self.replying:
                log.exception("a model step (%s) failed on rank %d", step.__name__, self.rank)
            raise

    def shutdown(self) -> None:
        """vLLM's worker shutdown, then its parallel groups (their shared-memory
        queues with them), as vLLM's own worker processes end."""
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        try:
            if self._outputs is not None:  # the outputs still being made first
                self._outputs.shutdown()
            self.wrapper.shutdown()
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()

    def _output(self, output: Any) -> Any:
        """An asynchronous output is replied to once it is ready, without holding
        up the next call (zbus replies in call order). A rank whose reply the
        engine does not take gets none ready (as vLLM's own workers: no copy)."""
        from vllm.v1.outputs import AsyncModelRunnerOutput

        if not self.replying:
            return None
        if isinstance(output, AsyncModelRunnerOutput):
            if self._outputs is None:  # (async scheduling) one thread keeps them in order
                self._outputs = concurrent.futures.ThreadPoolExecutor(
                    1, "zbus-vllm-output", initializer=self._on_this_device)
            return self._outputs.submit(self._logged, output.get_output)
        return output

    def _on_this_device(self) -> None:
        """Make this thread work on the worker's device, as vLLM's own output thread
        does: a thread does not inherit it, and a CUDA call would make it a context
        on device 0."""
        from vllm.platforms import current_platform

        device = getattr(getattr(self, "wrapper", None), "device", None)
        if device is not None:
            current_platform.set_device(device)

    def __getattr__(self, name: str) -> Any:
        wrapper = self.__dict__.get("wrapper")
        if name.startswith("_") or wrapper is None:
            raise AttributeError(name)
        worker = vars(wrapper).get("worker")
        if worker is None and not hasattr(type(wrapper), name):
            raise AttributeError(name)  # (before init_worker the wrapper's own lookup recurses)
        if self.node_rank > 0 and name in FOLLOWER_REFUSES:  # (whoever defines it)
            raise ZbusError(f"method {name!r} refused: a follower node does not let the leader change "
                            "its environment or configuration, write its files or run what it sends")
        if self.node_rank > 0 and name not in FOLLOWER_CALLS:
            owner = defining_class(wrapper, name)
            if owner is None:
                raise AttributeError(name)
            if not outside_vllm(owner):
                raise ZbusError(f"method {name!r} refused: a follower node runs only the vLLM worker "
                                "methods vLLM's engine calls (zbus.vllm.worker.FOLLOWER_CALLS) and those "
                                "of a worker class or extension its operator allowed")
        return getattr(wrapper, name)


def defining_class(wrapper: Any, name: str) -> type | None:
    """The class that defines the method ``name`` of vLLM's worker ``wrapper``: the
    wrapper's own (vLLM's) before its worker's, as the wrapper looks it up."""
    worker = vars(wrapper).get("worker")
    lineage = type(wrapper).__mro__ + (type(worker).__mro__ if worker is not None else ())
    return next((cls for cls in lineage if cls is not object and name in vars(cls)), None)


def outside_vllm(cls: type) -> bool:
    """Whether ``cls`` is a worker class or extension from outside vLLM, which
    ``check_remote_config`` let through by name on a follower."""
    return cls.__module__ != "vllm" and not cls.__module__.startswith("vllm.")


def process_setup(vllm_config: Any, device: int, rank: int, remote: bool) -> None:
    """What vLLM's own executor does in each worker process before its worker:
    vLLM's logging configuration (on a follower, with the node's own file, never a
    path from the network: a ``dictConfig`` file names classes to build), the GPU
    ids the engine assigned, a NIC per GPU (``VLLM_GPU_NIC_PCIE_MAPPING``), the
    worker's tracer; and where zbus gave the worker a share of the node's cores
    for its start-up (``ZBUS_THREADS``, as vLLM's executor does on GPUs), it lets
    vLLM take them back to 1 for serving."""
    import dataclasses

    import vllm.envs as envs
    from vllm.logger import configure_logging
    from vllm.tracing import maybe_init_worker_tracer
    from vllm.utils.torch_utils import OMP_NUM_THREADS_SET_BY_VLLM
    from vllm.v1.executor.vllm_net_devices import set_worker_net_device

    logging_config = getattr(vllm_config, "logging_config", None)
    if logging_config is not None:
        if remote:
            logging_config = dataclasses.replace(logging_config,
                                                 pylogging_config_file=envs.VLLM_LOGGING_CONFIG_PATH)
        configure_logging(logging_config)
    gpu_ids = vllm_config.parallel_config.assigned_physical_gpu_ids
    if gpu_ids is not None:
        from vllm.platforms.interface import set_assigned_physical_gpu_ids

        set_assigned_physical_gpu_ids(gpu_ids)
    set_worker_net_device(device, vllm_config)
    maybe_init_worker_tracer(instrumenting_module_name="vllm.worker", process_kind="worker",
                             process_name=f"Worker_{rank}")
    if os.environ.get(THREADS_ENV) == "shared":
        os.environ[OMP_NUM_THREADS_SET_BY_VLLM] = "1"


def name_unnamed_segments(prefix: str) -> None:
    """Give the shared memory this process makes without a name (multiprocessing's
    random ``psm_*``: vLLM's message queues, its same-node probe, its object
    stores) the node's ``prefix``, so that every end of the node's workers removes
    it with the rest (``unlink_prefixed``), a SIGKILL during start-up included:
    then no ``atexit`` or ``on_exit`` hook runs, and the group kill takes
    multiprocessing's resource tracker with the worker."""
    from multiprocessing import shared_memory

    make = getattr(shared_memory, "_make_filename", None)  # (CPython's, 3.8 on)
    if make is None or getattr(make, "zbus_prefix", None) == prefix:
        return

    def prefixed() -> str:
        return "/" + prefix + make().lstrip("/")

    prefixed.zbus_prefix = prefix  # type: ignore[attr-defined]
    shared_memory._make_filename = prefixed


def unlink_created_queues() -> None:
    """Remove the names of the message queues this process made (see
    :func:`created_queue_buffers`), and have multiprocessing's resource tracker
    forget them, even where another worker of the node removed the name first
    (``unlink_prefixed``): else the tracker warns of a leak at exit."""
    from multiprocessing import resource_tracker

    for buffer in created_queue_buffers():
        buffer.is_creator = False  # its __del__ would remove the name again
        try:
            buffer.shared_memory.unlink()  # (which makes the tracker forget it)
        except FileNotFoundError:
            resource_tracker.unregister("/" + buffer.shared_memory.name, "shared_memory")


def created_queue_buffers() -> list:
    """The shared-memory rings of the message queues this process made to broadcast
    to its parallel groups (vLLM's ``ShmRingBuffer``); none if vLLM keeps them
    elsewhere than this version does."""
    from vllm.distributed import parallel_state

    buffers = []
    for ref in list(getattr(parallel_state, "_groups", {}).values()):
        buffer = getattr(getattr(ref(), "mq_broadcaster", None), "buffer", None)
        if getattr(buffer, "is_creator", False) and hasattr(buffer, "shared_memory"):
            buffers.append(buffer)
    return buffers


def device_index(local_rank: int) -> int:
    """The index of this worker's GPU among those it sees, which vLLM calls its
    local rank: its local rank, as the vLLM executor shows each worker every GPU of
    its node (``zbus.vllm.executor.WORKER_ENV``); 0 where it sees one alone."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return 0 if visible and "," not in visible else local_rank


def bind_cpus(vllm_config: Any, local_rank: int, local_world_size: int) -> None:
    """On vLLM's CPU platform, pin this worker to the cores vLLM's own executor
    would give it (``VLLM_CPU_OMP_THREADS_BIND``), before torch starts its threads:
    vLLM sets that up in the parent, per child, which zbus workers do not have."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch

    cpu_lists = cpu_plan(vllm_config, local_world_size)
    if local_rank >= len(cpu_lists):
        return
    cpus = cpu_lists[local_rank]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def cpu_plan(vllm_config: Any, local_world_size: int) -> list[list[int]]:
    """The cores of each of this node's ``local_world_size`` workers, as vLLM's own
    multi-node executor plans them on each node (none with ``nobind``). vLLM plans
    for ``world_size / nnodes`` local workers; zbus spreads the world over its own
    nodes, which vLLM's configuration does not know."""
    import copy

    from vllm.utils.ompmultiprocessing import OMPProcessManager

    pc = vllm_config.parallel_config
    node_view = copy.copy(vllm_config)
    node_view.parallel_config = copy.copy(pc)
    node_view.parallel_config.nnodes = max(1, pc.world_size // local_world_size)
    plan = OMPProcessManager(node_view)
    return [] if plan.skip_setup else plan.cpu_lists


def distributed_init_method(node_rank: int) -> str:
    """torch.distributed's rendezvous at the address zbus gives every worker.
    vLLM's CPU worker names its shared-memory all-reduce group after the text
    behind the last ':', so each node gets its own: a group that spans nodes then
    sees different names and uses torch.distributed instead. Those names start
    with the node's shared-memory prefix, so the node removes them when its
    workers end, even SIGKILLed in the all-reduce's spin."""
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    host = f"[{host}]" if ":" in host else host
    init_method = f"tcp://{host}:{port}?zbus_node={node_rank}"
    assert node_shm_prefix(int(port), node_rank) == init_method.split(":")[-1] + "-"
    return init_method


def allowed() -> set[str]:
    return {p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()}


def module_paths(extra: Any) -> list[tuple[str, Any]]:
    """Each ``(key, value)`` under a key that ends in ``module_path``, at any depth of
    a connector's extra configuration: vLLM imports them (an offloading spec, a
    cache policy, a tier), and ``MultiConnector`` builds a connector for each of
    its ``connectors``, importing its ``kv_connector_module_path``."""
    found, todo = [], [extra]
    while todo:  # (the codec bounds the depth of what arrived)
        item = todo.pop()
        if isinstance(item, dict):
            found += [(k, v) for k, v in item.items() if isinstance(k, str) and k.endswith("module_path")]
            todo += item.values()
        elif isinstance(item, (list, tuple)):
            todo += item
    return found


def check_remote_config(config: Any, allow: set[str]) -> None:
    """Refuse a configuration from the leader that names code this node's
    operator did not allow (see docs/security.md)."""
    def named(what: str, value: Any, default_ok: bool = False) -> None:
        if not value or (default_ok and str(value).startswith("vllm.")):
            return
        for item in value if isinstance(value, (list, tuple)) else [value]:
            name = item if isinstance(item, str) else f"{type(item).__module__}.{type(item).__qualname__}"
            dotted = name.replace(":", ".")  # ("module:Class", as vLLM names a logits processor)
            if dotted not in allow and not any(dotted.startswith(p + ".") for p in allow):
                raise ZbusError(f"the leader's configuration names {what} {name!r}, which this node "
                                f"does not allow (set {ALLOW_ENV} on this node to allow it)")

    pc, mc = config.parallel_config, config.model_config
    if getattr(pc, "enable_fault_tolerance", False):
        raise ZbusError("the leader's configuration enables vLLM's fault tolerance, whose commands may "
                        "carry a pickle to run: a follower node refuses it")
    named("the worker class", pc.worker_cls, default_ok=True)
    named("the worker extension", pc.worker_extension_cls)
    named("logits processors", getattr(mc, "logits_processors", None))
    kv = getattr(config, "kv_transfer_config", None)
    named("a KV connector module", getattr(kv, "kv_connector_module_path", None))
    for key, path in module_paths(getattr(kv, "kv_connector_extra_config", None)):
        named(f"a KV connector's module ({key})", path)
    ec = getattr(config, "ec_transfer_config", None)
    named("an EC connector module", getattr(ec, "ec_connector_module_path", None))
    for key, path in module_paths(getattr(ec, "ec_connector_extra_config", None)):
        named(f"an EC connector's module ({key})", path)
    spec = getattr(config, "speculative_config", None)
    if getattr(spec, "method", None) == "custom_class":  # the model is a class vLLM imports
        named("a speculative proposer class", getattr(spec, "model", None) or "?")
    compilation = getattr(config, "compilation_config", None)
    backend = getattr(compilation, "backend", None)
    if backend and (not isinstance(backend, str) or "." in backend):  # a qualified name vLLM imports
        named("a compilation backend", backend)
    # torch.compile's options: vLLM sets flags and numbers; a text is a compiler, a path
    # or a flag put unquoted on the compiler's command line (a shell), an object a pass
    # (a remote cache's flag: inductor would load compiled code from a cache server)
    for key, value in (getattr(compilation, "inductor_compile_config", None) or {}).items():
        if type(value) not in (bool, int, float, type(None)) or ("remote" in str(key) and value):
            named("an inductor option that is no flag or number, or turns on a remote cache",
                  f"inductor.{str(key)[:200]}")
    if getattr(compilation, "cache_dir", None) and "compile_cache_dir" not in allow:
        # vLLM loads the compiled code it finds there
        raise ZbusError(f"the leader's configuration names a compilation cache folder "
                        f"{str(compilation.cache_dir)[:200]!r}, whose compiled code vLLM would load; "
                        f"this node refuses (set {ALLOW_ENV}=compile_cache_dir on this node to allow it)")
    for model in (mc, getattr(spec, "draft_model_config", None)):  # (a draft model loads its own)
        if getattr(model, "trust_remote_code", False) and "trust_remote_code" not in allow:
            raise ZbusError(f"the leader's configuration asks to trust remote code of {model.model!r}; "
                            f"this node refuses (set {ALLOW_ENV}=trust_remote_code on this node to "
                            "allow it)")
