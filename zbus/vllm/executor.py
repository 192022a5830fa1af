"""The vLLM executor backend on zbus."""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from typing import Any, Callable

from vllm.utils.torch_utils import set_torch_threads_for_runtime
from vllm.v1.executor.abstract import Executor as VllmExecutor

from .. import Executor
from ..cluster import ClusterSettings
from ..errors import ZbusError
from ..processes import GPUS_ENV, THREADS_ENV, node_shm_prefix
from ..queues import deadline_of
from ..shm import unlink_prefixed
from .wire import load_wire_modules

log = logging.getLogger(__name__)
WORKER = "zbus.vllm.worker:VllmWorker"
# A decode step comes every few milliseconds: between steps the workers, the node
# agents and the engine poll (yielding the core) instead of sleeping, as vLLM's own
# workers spin for 1 s after each message.
POLL_BETWEEN_STEPS_S = 0.01
# vLLM SIGKILLs an engine not gone VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) after
# SIGTERM: its workers' shutdown (0.4-0.5 s here) may take this share of it, and
# what is left goes to stopping the processes.
SHUTDOWN_RPC_SHARE = 0.6


# Every worker sees every GPU of its node, as under vLLM's own executor: vLLM takes
# a worker's local rank for its device and maps its peers' local ranks through
# CUDA_VISIBLE_DEVICES (its custom all-reduce's P2P check failed on one GPU each).
WORKER_ENV = {GPUS_ENV: "node"}


def worker_env() -> dict[str, str]:
    """``WORKER_ENV``, and on a GPU platform a share of each node's cores for the
    workers' start-up (weight loading), as vLLM's own executor gives its GPU
    workers (its CPU platform leaves the thread count alone: zbus binds those
    workers' cores as vLLM would, see ``zbus.vllm.worker.bind_cpus``)."""
    from vllm.platforms import current_platform

    return WORKER_ENV if current_platform.is_cpu() else {**WORKER_ENV, THREADS_ENV: "share"}


class ZbusExecutor(VllmExecutor):
    """vLLM's executor interface over a :class:`zbus.Executor`: TP x PP workers,
    spread over ``ZBUS_NNODES`` nodes (the engine's node first)."""

    uses_ray = False
    supports_pp = True

    def _init_executor(self) -> None:
        load_wire_modules()
        pc = self.parallel_config
        self.world_size = pc.world_size
        nnodes = ClusterSettings.resolve().nnodes
        if self.world_size % nnodes:
            raise ValueError(f"world size {self.world_size} (TP x PP) does not divide over "
                             f"ZBUS_NNODES={nnodes} nodes")
        # the first TP worker of the last PP stage, as vLLM's own executor
        self.output_rank = self.world_size - pc.tensor_parallel_size * pc.prefill_context_parallel_size
        self._attach(Executor(WORKER, nnodes=nnodes, nproc_per_node=self.world_size // nnodes,
                              output_rank=self.output_rank, poll_after_call_s=POLL_BETWEEN_STEPS_S,
                              startup_timeout=_ready_timeout(), env=worker_env()))
        if getattr(self.parallel_config, "numa_bind", False):  # vLLM binds its workers as it starts them
            log.warning("numa_bind is not applied by the zbus executor: start each node's follower "
                        "(and the engine) under numactl instead")
        try:
            self.collective_rpc("init_worker", args=(self.vllm_config,))
            self.collective_rpc("init_device")
            self.collective_rpc("unlink_node_shm")
            self.collective_rpc("load_model")
            set_torch_threads_for_runtime()  # as vLLM's own: this process only schedules
        except BaseException:
            self._finalizer.detach()  # no worker may be there to answer a shutdown call
            # (its stop also removes the names the workers made: see LocalWorkers)
            self._zbus.shutdown()
            raise

    def _attach(self, zbus: Executor) -> None:
        """Run on ``zbus`` from now on. It is shut down by :meth:`shutdown`, or when
        this executor is collected or, at the latest, when the process exits, as
        vLLM's own executor is: vLLM does not shut down an engine whose start
        failed after its executor was built (its KV cache did not fit, say). (In
        vLLM's engine the failure callback it registers keeps this executor alive:
        then at exit.)"""
        self._zbus = zbus
        self._finalizer = weakref.finalize(self, _shutdown, zbus)

    # --- calls ---------------------------------------------------------------------

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None, kv_output_aggregator: Any = None,
                       ec_output_aggregator: Any = None) -> Any:
        """vLLM's ``collective_rpc``, in vLLM's argument order. A function travels by
        its import path (never as code); outputs of several ranks are aggregated
        when vLLM passes its KV or EC aggregators."""
        aggregators = [a for a in (kv_output_aggregator, ec_output_aggregator) if a]
        reply_rank = None if aggregators else unique_reply_rank
        out = self._zbus.collective_rpc(method, args=tuple(args), kwargs=kwargs, timeout=timeout,
                                        non_block=non_block, unique_reply_rank=reply_rank)
        if not aggregators:
            return out
        rank = unique_reply_rank or 0

        def aggregate(outputs: list) -> Any:
            result = outputs[rank]
            for a in aggregators:
                result = a.aggregate(outputs, output_rank=rank)
            return result

        return _mapped(out, aggregate) if non_block else aggregate(out)

    def _output_rpc(self, method: str, arg: Any, non_block: bool = False) -> Any:
        # non-blocking too: the future fails at the timeout (vLLM's engine waits on it
        # without one, as on its own executor's futures, which time out by themselves)
        return self.collective_rpc(method, args=(arg,), unique_reply_rank=self.output_rank,
                                   non_block=non_block, timeout=_step_timeout(),
                                   kv_output_aggregator=self.kv_output_aggregator,
                                   ec_output_aggregator=self.ec_output_aggregator)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        return self._output_rpc("execute_model", scheduler_output, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        return self._output_rpc("sample_tokens", grammar_output, non_block)

    def execute_dummy_batch(self) -> None:
        self.collective_rpc("execute_dummy_batch", unique_reply_rank=self.output_rank,
                            timeout=_step_timeout())

    def take_draft_token_ids(self) -> Any:
        return self.collective_rpc("take_draft_token_ids", unique_reply_rank=self.output_rank,
                                   timeout=_step_timeout())

    @property
    def max_concurrent_batches(self) -> int:
        return self.vllm_config.max_concurrent_batches

    # --- health and failure --------------------------------------------------------

    def check_health(self) -> None:
        """Raise if the cluster failed; else ask every worker (10 s at most)."""
        self._zbus.check_health()
        self.collective_rpc("check_health", timeout=10)

    @property
    def is_failed(self) -> bool:
        """Whether the cluster failed (for good: vLLM's fault tolerance asks this
        to tell a dead engine from one it may recover)."""
        zbus = getattr(self, "_zbus", None)
        return zbus is not None and zbus.failure.error is not None

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once when the cluster fails (at once if it has): the
        zbus executor's failure is the one state (it logs the error)."""
        self._zbus.register_failure_callback(callback)

    def shutdown(self) -> None:
        """Ask the workers to shut vLLM down, then stop every process and free every
        segment, on every node. Once; later calls return at once."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True  # zbus futures complete by themselves


def _shutdown(zbus: Executor) -> None:
    """:meth:`ZbusExecutor.shutdown` (a function: the finalizer must not hold the executor)."""
    started = time.monotonic()
    # Names first (mappings stay valid): vLLM gives this process a few seconds to
    # end, then SIGKILLs it. Each worker removes them too as it ends (on_exit),
    # orphaned or not, and each node once its workers have ended.
    unlink_prefixed(node_shm_prefix(zbus.torch_port, 0))
    # Failed: no worker may be there to answer. A step past its timeout (a worker
    # stuck in it): the answer would queue behind it, past the few seconds vLLM gives.
    try:
        if zbus.failure.error is None and not zbus.overdue:
            try:
                zbus.collective_rpc("shutdown", timeout=SHUTDOWN_RPC_SHARE * _shutdown_budget())
            except (ZbusError, TimeoutError) as e:
                log.warning("workers' shutdown: %s", e)
            log.info("vLLM's workers shut down in %.2f s", time.monotonic() - started)
    finally:  # whatever ends the call (Ctrl-C): this runs once, so it stops everything
        zbus.shutdown()
    log.info("zbus shut down in %.2f s", time.monotonic() - started)


def _shutdown_budget() -> float:
    """How long vLLM gives the engine to end before it SIGKILLs it."""
    import vllm.envs as envs

    return envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS


def _ready_timeout() -> float:
    """How long the workers may take to start (vLLM's wait for its engine, which
    gives its own workers no shorter limit): importing vLLM and torch from a slow
    shared disk can take minutes."""
    import vllm.envs as envs

    return float(envs.VLLM_ENGINE_READY_TIMEOUT_S)


def _step_timeout() -> float:
    """How long one model step may take, as vLLM's own executor waits."""
    import vllm.envs as envs

    return envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS


class _Mapped(concurrent.futures.Future):
    """A future completed from another, ``source``: waiting on it waits on the
    source first, which reads the call's replies itself and fails at the call's
    timeout (as when the thread that completes futures could not be started)."""

    def __init__(self, source: concurrent.futures.Future) -> None:
        super().__init__()
        self._source: concurrent.futures.Future | None = source

    def result(self, timeout: float | None = None) -> Any:
        return super().result(self._wait_source(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._wait_source(timeout))

    def _wait_source(self, timeout: float | None) -> float | None:
        """The source settled (else TimeoutError); the time left of ``timeout``."""
        deadline = deadline_of(timeout)
        source = self._source  # (None once it completed this one)
        if source is not None and not self.done():
            source.exception(timeout)
        return None if deadline is None else max(0.0, deadline - time.monotonic())


def _mapped(future: concurrent.futures.Future, func: Callable[[Any], Any]) -> concurrent.futures.Future:
    """A future of ``func(future's result)``, completed when ``future`` is."""
    out = _Mapped(future)
    out.set_running_or_notify_cancel()  # (as ``future``: its call is sent, too late to cancel)

    def done(f: concurrent.futures.Future) -> None:
        out._source = None  # (no cycle: the replies go with the last holder, not at a collection)
        try:
            out.set_result(func(f.result()))
        except Exception as e:  # noqa: BLE001 - the caller's future carries it
            out.set_exception(e)
        except BaseException as e:  # Ctrl-C: it goes on, in whichever thread completes futures
            out.set_exception(e)
            raise

    future.add_done_callback(done)
    return out
