"""The driver API: :class:`Executor` runs a method on every worker and returns the
answers in rank order.

Backends (``backend=``): ``"mp"`` (default) starts worker processes that read the
shared-memory broadcast ring; ``"inproc"`` runs one worker inside the driver
process, for debugging and unit tests; ``"pkg.mod:Cls"`` names a user subclass.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import operator
import os
import queue
import socket
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from . import codec, protocol, ring, shm
from .cluster import COMING_BYTES, ClusterSettings, port_range, resolve_ip, route_to, typed_setting
from .config import MAX_POLL_S, WaitPolicy, flag
from .curve import curve_dir_from_env, secret_from_env
from .errors import (
    Cancelled,
    CodecError,
    ExecutorFailedError,
    RemoteError,
    RingClosed,
    SendTimeout,
    SettingError,
    WorkerDiedError,
    ZbusError,
    brief,
)
from .failure import Failure, again, raise_if_callers, run_every
from .leader import Leader
from .metrics import Metrics, serve_prometheus
from .processes import LocalWorkers, with_gloo_ifname
from .queues import Broadcaster, ShmReceiver, deadline_of, remaining
from .worker import Worker, import_object

log = logging.getLogger(__name__)

BACKENDS = ("mp", "inproc")
STARTUP_REPORT_GRACE_S = 1.0  # how long a failed start-up waits for the worker's own report
EXIT_REPORT_S = 2.0  # how long a worker that closed its replies has to exit (and be reported)
SHUTDOWN_WAIT_S = 60.0  # how long a second shutdown waits for the first (which bounds its own steps)
FAILED_GRACE_S = 0.2  # how long a failed executor's workers get to end by themselves (then SIGTERM)
# A large call's announcement to its nodes (cluster.COMING_BYTES) waits for a full node as
# long as the call may (without a deadline: this long).
SAY_COMING_S = 3600.0
WorkerSpec = "type[Worker] | str"


class StartupError(ExecutorFailedError):
    """A worker failed while starting; the message holds its traceback."""


class Call:
    """One sent call: the replies it waits for, then its outcome, set once by the
    replies or by a failure (whichever comes first), and counted then. A blocking
    call needs nothing more; a non-blocking one also completes its ``future``,
    which fails with TimeoutError at the call's ``deadline`` if it has one."""

    __slots__ = ("executor", "seq", "reply_ranks", "unique", "replies", "started", "outcome", "future",
                 "deadline", "due", "expired", "sent")

    def __init__(self, executor: Executor, seq: int, reply_ranks: Sequence[int], unique: bool,
                 future: RpcFuture | None = None, deadline: float | None = None,
                 due: float | None = None):
        self.executor = executor
        self.seq = seq
        self.reply_ranks = list(reply_ranks)
        self.unique = unique
        self.replies: dict[int, tuple[int, Any]] = {}
        self.started = time.perf_counter()
        self.outcome: tuple[bool, Any] | None = None  # (ok, the value or the error)
        self.future = future
        self.deadline = deadline  # a non-blocking call's: its future fails then
        self.due = due  # the caller's deadline, blocking or not
        self.expired = False  # its future's TimeoutError is queued
        self.sent = False  # its send returned: it can no longer be forgotten, its number reused
        if future is not None:
            future._call, future.seq, future.reply_ranks = self, seq, self.reply_ranks

    def done(self) -> bool:
        return self.outcome is not None

    def finish(self) -> None:
        """All replies are in: the result (rank order) or the first error."""
        values = []
        for rank in self.reply_ranks:
            status, value = self.replies[rank]
            if type(status) is not int or status != protocol.OK:  # (an array's == has no truth value)
                return self.settle(False, self.first_error())
            values.append(value)
        self.settle(True, values[0] if self.unique else values)

    def first_error(self) -> Exception | None:
        """The error of the first rank, in rank order, whose reply is in and is no
        result; None if there is none."""
        for rank in self.reply_ranks:
            if rank not in self.replies:
                continue
            status, value = self.replies[rank]
            if type(status) is not int:  # compared below: an array's == has no truth value
                status = None
            if status == protocol.OK:
                continue
            if status == protocol.REFUSED:
                why = getattr(value, "message", value)  # (a forged one: a tensor, say)
                return ZbusError(f"rank {rank}: {why if type(why) is str else brief(why)}")
            if status == protocol.RAISED and type(value) is codec.ExceptionInfo:
                return RemoteError(rank, value.type_name, value.message, value.traceback)
            # only a peer that is not a zbus worker sends this (the leader's port is open)
            return ZbusError(f"rank {rank}: a malformed reply (status {brief(status)}, "
                             f"a {type(value).__name__})")
        return None

    def settle(self, ok: bool, value: Any, complete: bool = True) -> None:
        """Set the outcome unless it is set (a reply and a failure may race), and
        complete its future unless ``complete`` is false (the caller then does)."""
        ex = self.executor
        with ex._settle_lock:
            if self.outcome is not None:
                return
            self.outcome = (ok, value)
            if self.future is not None and not self.expired:  # queued with it (not once expired)
                ex._completions.append((self.future, ok, value))
        ex.metrics.rpc_done(time.perf_counter() - self.started, None if ok else value)
        if self.future is not None and complete:
            ex._run_completions()

    def expire(self) -> None:
        """Past its deadline without its replies: the future fails with TimeoutError.
        The call stays pending, as a blocking call that timed out: its replies, if
        they come, are taken and dropped, and later calls complete after it."""
        ex = self.executor
        with ex._settle_lock:
            if self.future is None or self.expired or self.future.done():
                return
            self.expired = True
            ex._completions.append((self.future, False, TimeoutError(
                f"collective_rpc call {self.seq} timed out waiting for the replies of ranks "
                f"{self.reply_ranks}")))
        ex._run_completions()

    def value(self) -> Any:
        """The result of a settled call, or its error raised."""
        ok, value = self.outcome
        if ok:
            return value
        raise again(value)  # (the failure's error may be every pending call's)


_PENDING, _RUNNING = concurrent.futures._base.PENDING, concurrent.futures._base.RUNNING


class RpcFuture(concurrent.futures.Future):
    """The result of a non-blocking ``collective_rpc``. It completes by itself, so
    ``done()``, ``add_done_callback``, :func:`concurrent.futures.wait` and
    :func:`asyncio.wrap_future` work without anyone calling ``result()``. Calls
    complete in issue order. ``result(timeout)`` raises :class:`TimeoutError` and
    leaves the call pending. A call sent with a ``timeout`` fails with
    TimeoutError once it passes without all replies."""

    _call: Call | None  # until the call settles
    seq: int  # the call's number
    reply_ranks: list[int]  # the ranks whose replies make the result

    def sent(self) -> None:
        """Its call reached every rank: running, no longer to be cancelled, unless
        another thread completed it first (a failure, its deadline)."""
        with self._condition:
            if self._state == _PENDING:
                self._state = _RUNNING

    def result(self, timeout: float | None = None) -> Any:
        left = self._complete(deadline_of(timeout))
        try:
            return super().result(left)
        except BaseException as e:  # noqa: BLE001 - raised again, as it came
            raise again(e)  # noqa: B904 - the same error (the failure's may be every future's)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._complete(deadline_of(timeout)))

    def _complete(self, mine: float | None) -> float | None:
        """Read replies until this call is settled, up to the caller's deadline
        ``mine``; the time left of it, for the wait for the future itself."""
        call = self._call
        if call is not None and not self.done():  # (done: a callback reads its outcome)
            if not call.done():
                self._read_replies(call, mine)
            call.executor._complete_asked(self)
        return None if mine is None else max(0.0, mine - time.monotonic())

    def _read_replies(self, call: Call, mine: float | None) -> None:
        """Read replies until ``call`` is settled, up to ``mine`` or the call's own
        deadline if that comes first (the call then expires)."""
        due = call.deadline is not None and (mine is None or call.deadline <= mine)
        try:
            call.executor._complete_until(call, call.deadline if due else mine)
        except TimeoutError:
            if not due:
                raise
            call.expire()
        except Exception as e:
            ex = call.executor
            if e is not ex.failure.error and not ex._closed:
                raise
            # The failure or the shutdown settles this future, maybe not yet: settled here
            # too (the first outcome stands), so that a done-callback that asked for it,
            # whose thread completes futures, completes it out of turn and does not wait
            # for a thread that waits for it.
            call.settle(False, ex.failure.error or e)


def _set_outcome(future: RpcFuture, ok: bool, value: Any) -> None:
    """Complete ``future``, which runs its callbacks, unless it is done."""
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except concurrent.futures.InvalidStateError:  # expired, cancelled by its holder, or set
        pass
    finally:
        # Done: it needs the call no more. Without the cycle a call and the replies it
        # holds go when their last holder drops them, not at the next collection.
        future._call = None


def rank_of(value: Any, what: str, world_size: int) -> int:
    """``value`` as a rank of ``world_size``: a whole number (a numpy one too), not
    a float or a bool. A call's envelope carries it, and a worker drops an
    envelope whose rank is anything but an int: no rank would answer."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be a whole number, got {brief(value)}")
    rank = operator.index(value)
    if not 0 <= rank < world_size:
        raise ValueError(f"{what} {rank} outside 0..{world_size - 1}")
    return rank


MAX_METHOD_NAME = 4096  # characters (a call's envelope holds at most protocol.MAX_ENVELOPE bytes)


def method_name(method: str | Callable) -> str:
    """What a call names on the wire: a method name, or ``"pkg.mod:func"`` for a
    module-level function that workers import and call with the worker first.
    Code itself never travels."""
    name = _wire_name(method)
    if len(name) > MAX_METHOD_NAME:  # (its envelope would be refused by every worker: no reply)
        raise ValueError(f"a method name of {len(name)} characters: at most {MAX_METHOD_NAME}")
    return name


def _wire_name(method: str | Callable) -> str:
    if isinstance(method, str):
        if not method:
            raise TypeError("method must be a non-empty string")
        return method
    if not callable(method):
        raise TypeError(f"method must be a name or an importable function, got {method!r}")
    module, qualname = getattr(method, "__module__", None), getattr(method, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname or not qualname:
        raise TypeError(
            f"cannot send {method!r}: zbus never sends code, and a lambda, closure or function "
            "of the driver script cannot be imported by a worker. Define it at module level in "
            "an importable module (workers call it as func(worker, *args)), or call a worker "
            "method by name")
    return f"{module}:{qualname}"


def _resolve_backend(backend: str) -> type[Executor]:
    if backend == "mp":
        return MultiprocExecutor
    if backend == "inproc":
        return InprocExecutor
    if ":" not in backend:
        raise ValueError(f"unknown executor backend {backend!r}; valid: {', '.join(BACKENDS)}, "
                         "or 'pkg.mod:ExecutorSubclass'")
    cls = import_object(backend)
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise TypeError(f"backend {backend!r} is not a subclass of zbus.Executor")
    return cls


def _check_spec(worker: WorkerSpec) -> None:
    """What either backend refuses before starting anything."""
    if isinstance(worker, str):
        if ":" not in worker:
            raise ValueError(f"worker {worker!r}: give a class or an import path 'pkg.mod:Cls'")
    elif not (isinstance(worker, type) and issubclass(worker, Worker)):
        raise TypeError(f"worker must be a zbus.Worker subclass or 'pkg.mod:Cls', got {worker!r}")


def _worker_path(worker: WorkerSpec) -> str:
    _check_spec(worker)
    if isinstance(worker, str):
        return worker
    if worker.__module__ == "__main__":
        raise TypeError(
            f"worker class {worker.__qualname__} is defined in the driver script (__main__); "
            "worker processes import it by name and never run the driver script: move it "
            "into an importable module, or use backend='inproc'")
    if "<locals>" in worker.__qualname__:
        raise TypeError(f"worker class {worker.__qualname__} is local to a function: "
                        "define it at module level")
    return f"{worker.__module__}:{worker.__qualname__}"


class Executor:
    """Runs a :class:`zbus.Worker` on ``nproc_per_node`` processes and calls its
    methods on all of them. Use as a context manager, or call :meth:`shutdown`.

    ``Executor(...)`` returns the backend's class (see ``backend``).
    """

    world_size: int
    output_rank: int

    def __new__(cls, *args: Any, backend: str = "mp", **kwargs: Any) -> Executor:
        if cls is Executor:
            cls = _resolve_backend(backend)
        return super().__new__(cls)

    def __init__(self, worker: WorkerSpec, *, nproc_per_node: int = 1,
                 worker_kwargs: dict | None = None, backend: str = "mp", output_rank: int = 0,
                 startup_timeout: float = 120.0, allow_import_calls: bool = True,
                 env: dict[str, str] | None = None, poll_after_call_s: float | None = None):
        if nproc_per_node < 1:
            raise ValueError("nproc_per_node must be at least 1")
        if poll_after_call_s is not None and not 0 <= poll_after_call_s <= MAX_POLL_S:
            raise ValueError(f"poll_after_call_s must lie in 0..{MAX_POLL_S} s")
        self.worker = worker
        self.worker_kwargs = dict(worker_kwargs or {})
        self.nproc_per_node = nproc_per_node
        self.world_size = nproc_per_node
        self.output_rank = output_rank
        self.startup_timeout = startup_timeout
        self.allow_import_calls = allow_import_calls
        self.extra_env = dict(env or {})
        self.poll_after_call_s = poll_after_call_s
        self.failure = Failure()  # shared with the leader: one error for every path
        self.metrics = Metrics()
        self._state_lock = threading.Lock()
        self._settle_lock = threading.Lock()  # a call's outcome is set once (Call.settle)
        # Futures of settled calls, completed in order by a thread that holds no lock
        # of the executor: their callbacks may call it (see _run_completions).
        self._completions: collections.deque[tuple[RpcFuture, bool, Any]] = collections.deque()
        self._completing = OwnedLock()
        self._shut_down = threading.Event()  # set once the first shutdown is done
        self._shutting_down_in = 0  # the thread of the first shutdown (its callbacks may call it)
        _start_reaper()
        self._pid = os.getpid()  # a forked child's copy shuts nothing down: it is all its parent's
        self._closed = False  # (after: one that failed to start is not shut down when dropped)

    # --- public API ----------------------------------------------------------------

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None) -> Any:
        """Run ``method`` on every rank. Returns the replies in rank order, or the
        reply of ``unique_reply_rank`` alone; with ``non_block`` a Future of that,
        which completes by itself. ``method`` is a worker method's name or a
        module-level function (see :func:`method_name`)."""
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """What ``zbus status`` shows: world size, nodes, RPC counts and latency."""
        return {"world_size": self.world_size, "output_rank": self.output_rank,
                "failed": str(self.failure.error) if self.failure.error else None,
                "nodes": self._nodes_status(), **self.metrics.snapshot()}

    def _nodes_status(self) -> list[dict[str, Any]]:
        import socket as _socket

        return [{"node_rank": 0, "host": _socket.gethostname(), "ranks": list(range(self.world_size)),
                 "core": ring.CORE}]

    def check_health(self) -> None:
        """Raise the executor's failure if it failed; else return None."""
        self.failure.raise_if_failed()

    @property
    def overdue(self) -> int:
        """Calls given up on (past their timeout, or failed by a rank's error) whose
        replies have not all come (a worker stuck in one): the replies of any later
        call queue behind them."""
        now = time.monotonic()
        return sum(1 for c in list(getattr(self, "_pending", ()))
                   if c.done() or (c.due is not None and c.due <= now))

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once when the executor fails (at once if it has)."""
        self.failure.on_failure(lambda _error: callback())

    def shutdown(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Dropped without a shutdown (its own threads hold it weakly: see _weakly):
        # the reaper thread shuts it down. Not here: the collector may run this in
        # any thread, holding any lock (a shutdown's, or one a thread start takes).
        if not getattr(self, "_closed", True):
            _dropped.put(self)  # (SimpleQueue.put may be called from __del__)

    # --- shared machinery ---------------------------------------------------------

    def _check_call(self, method: str | Callable, unique_reply_rank: int | None,
                    kwargs: dict | None) -> tuple[str, int | None]:
        """The method's wire name and the rank that answers, once the executor may
        take the call."""
        if self._closed:
            raise ZbusError("executor is shut down")
        self.failure.raise_if_failed()
        method = method_name(method)
        if kwargs and not all(isinstance(k, str) for k in kwargs):  # (every rank would refuse the call)
            raise TypeError(f"keyword argument names must be strings: {brief(list(kwargs))}")
        if unique_reply_rank is not None:
            unique_reply_rank = rank_of(unique_reply_rank, "unique_reply_rank", self.world_size)
        return method, unique_reply_rank

    def _complete_until(self, call: Call, deadline: float | None) -> None:
        """Read replies until ``call`` is settled; TimeoutError past ``deadline``."""
        raise NotImplementedError

    def _holds_a_lock(self) -> bool:
        """Whether this thread holds a lock that a call waits for."""
        return False

    def _complete_asked(self, future: RpcFuture) -> None:
        """Complete ``future``, which has its outcome, for a caller who asks for it.
        Where no other thread can complete it first, it completes now, out of turn:
        asked by a callback run by ``_run_completions`` (a later future), or by a
        thread that holds a lock (a failure callback run by a reader of replies)."""
        self._run_completions()
        if not future.done() and (self._completing.held_here() or self._holds_a_lock()):
            with self._settle_lock:  # (no append meanwhile; list() copies in one step)
                queued = [entry for entry in list(self._completions) if entry[0] is future]
            if queued:
                _set_outcome(*queued[0])  # (its turn then finds it done)

    def _run_completions(self) -> None:
        """Complete the futures of settled calls, in order, unless this thread holds
        a lock of the executor: a callback runs with none held, so it may call the
        executor, and a call it makes while the rings are full does not wait for the
        replies that its own thread would read. Whoever releases a lock calls this.
        One thread at a time completes them; the others leave it the work."""
        escaped: BaseException | None = None
        while self._completions and not self._holds_a_lock():
            if not self._completing.acquire(blocking=False):
                break  # its holder looks again once it lets go
            try:
                while self._completions:
                    try:
                        _set_outcome(*self._completions.popleft())
                    except BaseException as e:  # noqa: BLE001 - a callback's SystemExit, Ctrl-C
                        escaped = escaped or e  # (Future catches Exception): the rest complete first
            finally:
                self._completing.release()
        raise_if_callers(escaped, "a future's done-callback")


class InprocExecutor(Executor):
    """One worker in the driver process: same API and futures, no processes and no
    shared memory. For pdb and unit tests of worker code. ``timeout`` cannot
    interrupt a running method here."""

    def __init__(self, worker: WorkerSpec, **kwargs: Any):
        from .worker import ReplyPipe, build_worker

        kwargs.pop("backend", None)
        if kwargs.get("nproc_per_node", 1) != 1:
            raise ValueError("backend='inproc' runs exactly one worker (nproc_per_node=1)")
        super().__init__(worker, **kwargs)
        self._closed = True  # until built: nothing to shut down before (see __del__)
        self.output_rank = rank_of(self.output_rank, "output_rank", 1)
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("LOCAL_WORLD_SIZE", "1"), ("NODE_RANK", "0")):
            os.environ.setdefault(key, value)
        self._seq = 0
        _check_spec(worker)  # (as mp: a TypeError or ValueError; what fails in the worker, StartupError)
        try:
            self._worker = build_worker({"worker": worker, "kwargs": self.worker_kwargs}, {
                "rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "node_rank": 0})
        except Exception as e:  # (as mp says it: the worker's own error, named)
            raise StartupError(f"worker rank 0 failed to start: {type(e).__name__}: {e}") from e
        self._calls: dict[int, Call] = {}
        self._numbering = threading.Lock()  # callers on several threads: one number each
        self._delivering = threading.local()  # in _deliver, under the reply pipe's lock
        self._replies = ReplyPipe(_weakly(self._deliver), then=_weakly(self._run_completions))
        self._closed = False

    def _deliver(self, reply: list) -> None:
        seq, status, value = reply
        call = self._calls.pop(seq)
        if status != protocol.OK and isinstance(value, BaseException):
            value = codec.ExceptionInfo.from_exception(value)
        call.replies[0] = (status, value)
        self._delivering.now = True
        try:
            call.finish()
        finally:
            self._delivering.now = False

    def _holds_a_lock(self) -> bool:
        return getattr(self._delivering, "now", False)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None) -> Any:
        from .worker import run_call

        method, unique_reply_rank = self._check_call(method, unique_reply_rank, kwargs)
        deadline = deadline_of(timeout)
        remaining(deadline, method)  # (none left: no rank runs it, as with mp)
        with self._numbering:
            if self._closed:  # (a shutdown settles only the calls numbered before it)
                raise ZbusError("executor is shut down")
            self._seq += 1
            seq = self._seq
            # a method may return a Future, answered later: a blocking call waits on this one
            call = self._calls[seq] = Call(self, seq, [0], unique_reply_rank is not None, RpcFuture(),
                                           deadline if non_block else None)
            call.future.sent()  # (it runs now: too late to cancel)
        result, status = run_call(self._worker, method, args, kwargs, self.allow_import_calls)
        self._replies.send(seq, result, status)
        self._run_completions()
        if not non_block:
            return call.future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if deadline is not None and not call.done():  # its future fails by itself at its timeout
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), call.expire)
            timer.daemon, timer.name = True, "zbus-expire"  # (zbus's: what a callback lets out is logged)
            timer.start()
            call.future.add_done_callback(lambda _: timer.cancel())
        return call.future

    def _complete_until(self, call: Call, deadline: float | None) -> None:
        if not call.done() and threading.current_thread() is self._replies.thread:
            raise ZbusError("backend='inproc': a callback run by the thread that sends the later "
                            "replies cannot wait for one: make the call from another thread")
        while not call.done():  # the call, not its future: a callback may be the one to complete it
            left = remaining(deadline, "collective_rpc")
            concurrent.futures.wait([call.future], timeout=Completer.SLICE_S if left is None
                                    else min(left, Completer.SLICE_S))

    def shutdown(self) -> None:
        with self._numbering:
            self._closed = True
        self.failure.close()
        # Calls whose method returned a Future not yet answered: failed, as the other
        # backend fails its pending calls (an answer that comes later is dropped).
        for call in list(self._calls.values()):
            call.settle(False, ZbusError("executor is shut down"), complete=False)
        self._replies.close()
        self._run_completions()


def reserve_port(host: str) -> int:
    """A free TCP port on ``host`` for torch.distributed's rendezvous, which binds
    it itself in rank 0 (zbus's own sockets bind and read their port back). From
    ``ZBUS_PORT_RANGE`` when set, so one firewall rule covers it."""
    lo_hi = port_range()
    candidates = range(lo_hi[0], lo_hi[1] + 1) if lo_hi else [0]
    for port in candidates:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise ZbusError(f"no free port on {host} in ZBUS_PORT_RANGE={lo_hi[0]}-{lo_hi[1]}")


def _sooner(deadline: float | None, other: float) -> float:
    return other if deadline is None else min(deadline, other)


class OwnedLock:
    """A lock that knows the thread holding it: a thread that holds the reply or send
    lock must not wait on the executor (it would wait for itself, see CALLBACK_WAITS),
    and futures complete once it lets go (see Executor._run_completions)."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking, timeout):
            self._owner = threading.get_ident()
            return True
        return False

    def release(self) -> None:
        self._owner = 0
        self._lock.release()

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, holding its object weakly: a thread or a failure callback must
    not keep a dropped executor alive (its ``__del__`` shuts it down). Once the
    object is gone a call does nothing and returns None."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)
    return call


# Executors dropped without a shutdown, shut down by one thread ("zbus-reaper"),
# started with the first executor (no thread may start in __del__) and finished at
# the interpreter's exit (atexit: before the modules go). One dropped while the
# interpreter finalizes is left to its workers' death pipe.
_dropped: queue.SimpleQueue = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def _start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            reaper = threading.Thread(target=_reap, name="zbus-reaper", daemon=True)
            reaper.start()
            _reaper = reaper  # (once started: a start that failed, at a pids limit, is tried again)


def _reap() -> None:
    while (executor := _dropped.get()) is not None:
        try:
            executor.shutdown()
        except Exception:  # noqa: BLE001 - this thread serves every executor
            log.exception("shutting down a dropped executor failed")
        del executor  # (not held while the next is waited for)


@atexit.register
def _reap_at_exit() -> None:
    if _reaper is not None and _reaper.is_alive():
        _dropped.put(None)
        _reaper.join(SHUTDOWN_WAIT_S)


def _forget_reaper() -> None:
    """In a forked child: the reaper thread is not there."""
    global _reaper, _dropped
    _reaper, _dropped = None, queue.SimpleQueue()


os.register_at_fork(after_in_child=_forget_reaper)


CALLBACK_WAITS = ("this thread holds a lock of the executor (a callback run by one of its threads "
                  "while it waits) and must not wait on the executor: make the call from another thread")


class Completer:
    """Completes non-blocking calls in the background, so that their futures finish
    with nobody calling ``result()``. It reads replies only while such a call is
    undone and no caller holds the reply lock (a caller blocked in ``result()``
    reads them itself, the faster path), in slices so that it never holds the lock
    for long. It leaves a new call to its caller for ``GRACE_S`` first: a caller
    that asks at once (an engine's step) then waits one wake-up, not two. It hands
    the lock over as soon as the call it reads is complete and a caller waits for
    it: an engine waiting for step N must not also wait for step N+1."""

    SLICE_S = 0.05
    GRACE_S = 0.002

    def __init__(self, executor: MultiprocExecutor):
        self._executor = weakref.ref(executor)  # a dropped executor must go (its __del__ stops this)
        self._cond = threading.Condition()
        self._undone = 0
        self._callers = 0  # callers waiting for the reply lock
        self._last_add = 0.0
        self._complete_asked = False
        self._flush_asked = False
        self._flushed_last = False  # flushing and reading replies take turns
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, future: RpcFuture) -> None:
        """Complete ``future`` in the background (it was sent)."""
        with self._cond:
            if self._stopped:
                return
            self._undone += 1
            self._last_add = time.monotonic()
            self._start()
        future.add_done_callback(self._done)

    def flush_soon(self) -> None:
        """Finish sending the rest of a call the ring began (its send timed out) from
        this thread: its ranks, and the nodes' ranks that have it whole (maybe in a
        collective with them), must not wait for the driver's next send."""
        with self._cond:
            if not self._stopped:
                self._flush_asked = True
                self._start()

    def _start(self) -> None:  # the condition held
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="zbus-completer", daemon=True)
            try:
                thread.start()
                self._thread = thread
            except RuntimeError as e:  # no thread to be had (a pids limit): the next call tries
                log.warning("cannot start the thread that completes futures (%s): they complete "
                            "when read", e)
        self._cond.notify()

    def _done(self, _future: RpcFuture) -> None:
        with self._cond:
            self._undone -= 1

    def acquire_for_caller(self, lock: threading.Lock, timeout: float) -> bool:
        """``lock.acquire(timeout)`` for a caller, which this thread then lets have it."""
        if lock.acquire(blocking=False):
            return True
        with self._cond:
            self._callers += 1
        try:
            return lock.acquire(timeout=timeout)
        finally:
            with self._cond:
                self._callers -= 1
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def complete_soon(self) -> None:
        """Complete the futures of settled calls from this thread: the thread that
        settled them holds the reply lock on for a later call."""
        with self._cond:
            self._complete_asked = True
            self._cond.notify()

    def _next(self) -> str | None:
        """What to do next: "complete" futures, "flush" the ring, "read" replies (the
        last two in turn: a ring that stays full must not keep futures from
        failing at their deadline), or None: stopped."""
        with self._cond:
            while not self._stopped:
                if self._complete_asked:
                    self._complete_asked = False
                    return "complete"
                grace = self._last_add + self.GRACE_S - time.monotonic()
                # (none pending: the undone futures wait for the thread completing them)
                work = self._undone > 0 and not self._callers and self._calls_pending()
                read = work and grace <= 0
                if self._flush_asked and not (read and self._flushed_last):
                    self._flush_asked, self._flushed_last = False, True
                    return "flush"
                if read:
                    self._flushed_last = False
                    return "read"
                self._cond.wait(grace if work else None)
            return None

    def _calls_pending(self) -> bool:
        ex = self._executor()
        return ex is not None and bool(ex._pending)

    def _run(self) -> None:
        while (step := self._next()) is not None and self._take(step):
            pass

    def _take(self, step: str) -> bool:
        """Take one step; whether to go on. A method of its own: the executor must not
        be held in ``_run``'s frame while it waits for the next step."""
        ex = self._executor()
        if ex is None:
            return False
        if step == "complete":
            ex._run_completions()
            return True
        try:
            if step == "flush":
                self._flush(ex)
            elif ex._recv_lock.acquire(timeout=self.SLICE_S):
                try:
                    sending = self._read_heads(ex)
                finally:
                    ex._recv_lock.release()
                if sending and ex._send_lock.acquire(timeout=self.SLICE_S):  # until it is sent
                    ex._send_lock.release()
        except Exception as e:  # noqa: BLE001 - failed or closed: the futures get the error
            if not isinstance(e, ExecutorFailedError):
                e = ExecutorFailedError(f"completing calls failed: {type(e).__name__}: {e}")
            ex.failure.fail(e)
            return False  # every pending future now holds the error (see _on_failure)
        finally:
            ex._run_completions()  # (of the calls completed meanwhile, a full ring's too)
        return True

    def _flush(self, ex: MultiprocExecutor) -> None:
        """One slice of the rest of a message in the ring, with the send lock (a
        caller's own send finishes it first, as well); asked again until it is out."""
        ring = ex._bcast.ring if ex._bcast is not None else None
        if ring is None or not ring.pending:
            return
        if not ex._send_lock.acquire(timeout=self.SLICE_S):
            self.flush_soon()
            return
        try:
            ring.flush(time.monotonic() + self.SLICE_S, ex.failure.cancel, ex._drain_ready)
        except TimeoutError:
            self.flush_soon()
        except (RingClosed, Cancelled):
            pass  # failed or shut down: nothing is sent any more
        finally:
            ex._send_lock.release()

    def _read_heads(self, ex: MultiprocExecutor) -> bool:
        """Complete the pending calls in order, holding the reply lock, until one
        has a future (it completes once the lock is released) or a caller waits;
        True where the head is still being sent. A call whose send is cut short
        before any rank got it is forgotten and its number is the next call's: its
        replies, read meanwhile, would be that call's. A method of its own: the
        call it read must not outlive it in ``_run``'s frame."""
        while self._undone > 0 and not self._stopped and ex._pending and not self._callers:
            head = ex._pending[0]
            if not head.sent:
                return True
            try:
                ex._complete_head(time.monotonic() + self.SLICE_S)
            except TimeoutError:
                ex._on_wait_slice()
                return False
            if head.future is not None:
                return False
        return False


class MultiprocExecutor(Executor):
    """Worker processes fed by a shared-memory broadcast ring, answering on one
    shared-memory response queue each. With ``nnodes > 1`` this process is also
    the cluster's leader: follower nodes (``zbus follower``) join over TCP, get
    one copy of each RPC, and their ranks answer over ZeroMQ (see
    :mod:`zbus.cluster`)."""

    def __init__(self, worker: WorkerSpec, *, nnodes: int | None = None,
                 nproc_per_node: int | None = None, master_addr: str | None = None,
                 master_port: int | None = None, liveness_s: float | None = None,
                 join_timeout: float = 300.0, curve_dir: str | None = None,
                 secret: bytes | str | None = None, insecure: bool | None = None,
                 metrics_port: int | None = None,
                 on_join: Callable[[int, int], None] | None = None, **kwargs: Any):
        kwargs.pop("backend", None)
        self.settings = ClusterSettings.resolve(nnodes, nproc_per_node, master_addr, master_port,
                                                liveness_s)
        super().__init__(worker, nproc_per_node=self.settings.nproc_per_node, **kwargs)
        self._closed = True  # until it starts: nothing to shut down before (see __del__)
        self.nnodes = self.settings.nnodes
        self.world_size = self.nnodes * self.nproc_per_node
        self.output_rank = rank_of(self.output_rank, "output_rank", self.world_size)
        self.worker_path = _worker_path(worker)
        self.master_addr = self.settings.master_addr
        self.join_timeout = join_timeout
        self.on_join = on_join  # (nodes joined, nnodes), as the cluster forms
        self.curve_dir = curve_dir_from_env(curve_dir)
        # keys derived from one cluster secret (an explicit curve_dir beats ZBUS_SECRET)
        self.secret = secret_from_env(secret) if secret or not curve_dir else None
        if self.secret and self.curve_dir:
            raise SettingError("give a cluster secret or a key folder (curve_dir), not both")
        self.insecure = flag("ZBUS_INSECURE") if insecure is None else insecure
        # (0 is none, as ``metrics_port=int(os.getenv("PORT", 0))`` means it)
        port = typed_setting(int, "metrics_port", metrics_port, None, "ZBUS_METRICS_PORT")
        self.metrics_port = port or None
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:  # (before any node joins)
            raise SettingError(f"metrics_port {self.metrics_port} outside 1..65535")
        self._metrics_server: Any = None
        self._seq = 0
        self._announced = 0  # the last call announced to the nodes as coming (cluster.COMING_BYTES)
        self._answered = 0  # every call up to this number has all its replies
        self._replies_closed_at: dict[int, float] = {}  # rank: when its reply queue was seen closed
        self._pending: collections.deque[Call] = collections.deque()
        self._expired_at = 0.0  # when the pending calls were last checked for their deadlines
        self._send_lock = OwnedLock()
        self._recv_lock = OwnedLock()
        self._completer = Completer(self)
        self._bcast: Broadcaster | None = None
        self._leader: Leader | None = None
        self._resp_handles: list[ring.RingHandle] = []
        self._max_args = (codec.MAX_MESSAGE, "the leader's node")  # the least a node's workers decode
        self._receivers: list[Any] = []
        self._workers: LocalWorkers | None = None
        self.failure.on_failure(_weakly(self._on_failure))  # first: before the leader's and the user's
        self._closed = False
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        shm.sweep_stale()
        if self.metrics_port:  # first: a port taken fails the start before any worker or node
            self._metrics_server = serve_prometheus(self.metrics, self.metrics_port,
                                                    resolve_ip(self.master_addr))
        n, s = self.nproc_per_node, self.settings
        policy = WaitPolicy.from_env(waiters=n + 1)  # this node's workers and this process
        if self.nnodes > 1:
            self._leader = Leader(s, lambda **kw: Broadcaster(n, policy=policy, **kw), self.failure,
                                  self.curve_dir, self.metrics, _weakly(self.status),
                                  secret=self.secret, insecure=self.insecure)
            self._bcast = self._leader.bcast
            torch_port = reserve_port(self._leader.bind_ip)
            ifname = route_to(self._leader.bind_ip)[1]
        else:
            self._bcast = Broadcaster(n, policy=policy)
            torch_port = reserve_port(resolve_ip(self.master_addr))
            ifname = None
        self.torch_port = torch_port  # workers' MASTER_PORT
        for _ in range(n):  # one at a time: shutdown() removes those made before a failure
            self._resp_handles.append(ring.create(1))
        for h in self._resp_handles:  # one at a time, for the same reason
            reader = ring.RingReader.attach(h, 0, policy)
            if self.poll_after_call_s is not None:  # a reply follows a call as a call a reply
                reader.keep_polling(self.poll_after_call_s)
            self._receivers.append(ShmReceiver(reader))
        segments = [self._bcast.handle.name, *(h.name for h in self._resp_handles)]
        places = [{"rank": r, "local_rank": r, "world_size": self.world_size, "local_world_size": n,
                   "node_rank": 0} for r in range(n)]
        env = with_gloo_ifname(dict(self.extra_env), ifname)
        self._workers = LocalWorkers(
            places, self._bcast.handle.to_dict(), [h.to_dict() for h in self._resp_handles],
            segments, self.master_addr, torch_port, env, _weakly(self._worker_died))
        spec = {"worker": self.worker_path, "kwargs": self.worker_kwargs,
                "allow_import": self.allow_import_calls, "poll_s": self.poll_after_call_s}
        deadline = deadline_of(self.startup_timeout)
        try:
            # the spec goes to this node's ring only: followers get theirs in the welcome
            self._bcast.ring.send(codec.encode(spec), remaining(deadline, "worker start-up"))
            if self._leader is not None:
                try:
                    self._leader.admit(spec, torch_port, self.join_timeout, self.extra_env,
                                       self.on_join)
                except (TimeoutError, ZbusError) as e:
                    # a local worker that failed tells why in its ring; else the leader's reason
                    died = isinstance(self.failure.error, WorkerDiedError)
                    raise StartupError(self._startup_failure() if died else str(e)) from None
                self._receivers += [self._leader.receivers[r] for r in range(n, self.world_size)]
                self._max_args = min([self._max_args, *((node.max_message, f"node {r} ({node.host})")
                                                        for r, node in self._leader.nodes.items())])
                deadline = deadline_of(self.startup_timeout)
            for rank in range(self.world_size):
                self._await_ready(rank, deadline)
            # Every process that maps this node's segments has them: the names can go,
            # so that no end leaves them in /dev/shm, a SIGKILL of every process at
            # once included (vLLM's server does that to its engine's process tree).
            self._unlink_names()
        except TimeoutError:
            raise StartupError(f"workers not ready within {self.startup_timeout} s "
                               f"(local workers alive: {self._workers.alive()})") from None
        except RingClosed:
            raise StartupError(self._startup_failure()) from None

    def _startup_failure(self) -> str:
        """Why start-up failed: a worker's own report if one made it (its queue keeps
        what was sent before the abort), else the death the monitor saw. A remote
        worker's report and its agent's death notice travel on different
        connections, so the report gets a moment to arrive."""
        deadline = time.monotonic() + STARTUP_REPORT_GRACE_S
        pending = dict(enumerate(self._receivers[:self.nproc_per_node]))
        if self._leader is not None:  # the nodes' ranks from their welcome on: the cluster may be forming
            pending.update(list(self._leader.receivers.items()))  # (the I/O thread may add one)
        while pending:
            for rank, rx in list(pending.items()):
                try:
                    reply = rx.get(0)
                except (TimeoutError, RingClosed):
                    continue
                del pending[rank]
                if type(reply) is list and len(reply) == 4 and reply[1] == protocol.READY \
                        and reply[2] != protocol.OK:
                    return f"worker rank {rank} failed to start:\n{getattr(reply[3], 'traceback', reply[3])}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return f"a worker died during start-up: {self.failure.error}"

    def _nodes_status(self) -> list[dict[str, Any]]:
        n = self.nproc_per_node
        nodes = super()._nodes_status()
        nodes[0]["ranks"] = list(range(n))
        if self._leader is not None:
            for node in sorted(self._leader.nodes.values(), key=lambda x: x.node_rank):
                nodes.append({"node_rank": node.node_rank, "host": node.host, "address": node.address,
                              "ranks": list(range(node.node_rank * n, (node.node_rank + 1) * n)),
                              "last_heartbeat_s": round(time.monotonic() - node.last_seen, 3),
                              "core": node.core})
        return nodes

    def _await_ready(self, rank: int, deadline: float | None) -> None:
        reply = self._receivers[rank].get(remaining(deadline, "worker start-up"))
        self._receivers[rank].taken()
        _, seq, status, value = reply
        if seq != protocol.READY or status != protocol.OK:
            detail = getattr(value, "traceback", "") or brief(value)
            raise StartupError(f"worker rank {rank} failed to start:\n{detail}")

    def _worker_died(self, local_rank: int, exitcode: int | None) -> None:
        self.failure.fail(WorkerDiedError(local_rank, exitcode))

    def _on_failure(self, error: Exception) -> None:
        # Wake every blocked wait; they raise RingClosed or Cancelled -> the error.
        # (The leader wakes its own: it shares the failure.)
        if self._bcast is not None and self._bcast.ring is not None:
            self._bcast.ring.abort()
        for rx in self._receivers:
            rx.abort()
        # End this node's workers now, as the follower nodes end theirs on the
        # leader's "failed": one stuck in a collective with a dead peer would spin
        # until shutdown. (A thread: this may run in the caller's or the watcher's.)
        # The pending calls fail whatever that start raises (no thread to be had).
        run_every(self._end_workers_soon, lambda: self._fail_pending(error),
                  self._run_completions)  # last: the futures' callbacks run here

    def _end_workers_soon(self) -> None:
        if self._workers is not None:
            threading.Thread(target=self._workers.stop, kwargs={"grace": FAILED_GRACE_S},
                             name="zbus-end-workers", daemon=True).start()

    # --- calls ---------------------------------------------------------------------

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None) -> Any:
        self._refuse_a_forked_process()
        method, unique_reply_rank = self._check_call(method, unique_reply_rank, kwargs)
        if self._send_lock.held_here() or (not non_block and self._recv_lock.held_here()):
            raise ZbusError(CALLBACK_WAITS)
        deadline = deadline_of(timeout)
        unique = unique_reply_rank is not None
        ranks = [unique_reply_rank] if unique else range(self.world_size)
        if not self._send_lock.acquire(timeout=-1 if deadline is None else remaining(deadline, method)):
            raise TimeoutError(f"collective_rpc({method!r}) timed out waiting to send")
        try:
            if self._closed:  # shut down while this caller waited for the lock
                raise ZbusError("executor is shut down")
            self.failure.raise_if_failed()  # or failed: the nodes must not run one call more
            payload = codec.encode((tuple(args), kwargs or {})) if args or kwargs else [protocol.NO_ARGS]
            size = codec.nbytes(payload)
            if size > self._max_args[0]:  # no rank could take it (a node's socket would drop)
                raise CodecError(f"the arguments of {brief(method)} take {size} bytes, over the "
                                 f"{self._max_args[0]} that {self._max_args[1]} takes (ZBUS_MAX_MESSAGE)")
            seq = self._seq + 1  # (taken in the try below: a Ctrl-C before it changes nothing)
            frames = [protocol.call_envelope(seq, method, unique_reply_rank if unique else -1,
                                             len(payload), self._answered), *payload]
            # the future exists before the call is sent: whoever reads the replies completes it
            call = Call(self, seq, ranks, unique, RpcFuture() if non_block else None,
                        deadline if non_block else None, deadline)
            ring, nodes_got = self._bcast.ring, [False]
            started = ring.started if ring is not None else 0
            try:
                self._seq = seq
                self._pending.append(call)
                self._publish(frames, size, deadline, nodes_got, self.failure.cancel)
                call.sent = True
                if call.future is not None:  # every rank has it: too late to cancel
                    call.future.sent()
                self.metrics.sent(len(frames[0]) + size)
            except BaseException as e:  # its deadline, a shutdown, Ctrl-C in a wait to send
                got = ([ring.started > started] if ring is not None else []) + (
                    nodes_got if self._leader is not None else [])
                self._send_cut_short(call, got, e)
                if isinstance(e, SendTimeout):
                    raise TimeoutError(f"collective_rpc({method!r}) timed out sending: {e}") from None
                if isinstance(e, (RingClosed, Cancelled)):
                    raise again(self.failure.error or ZbusError("executor is shut down")) from None
                raise
        finally:
            self._send_lock.release()
            self._run_completions()  # those the wait to send completed (see _drain_ready)
        if non_block:
            self._completer.add(call.future)
            return call.future
        remaining(deadline, method)
        self._complete_until(call, deadline)
        return call.value()

    def _publish(self, frames: list, size: int, deadline: float | None, nodes_got: list[bool],
                 cancel: threading.Event | None) -> None:
        """One call to every rank: the local ring, and one copy per follower node,
        until ``deadline`` or ``cancel`` is set.
        Once the nodes' copy is queued (``nodes_got[0]`` then True), the leader
        records the call (heartbeats carry the last call number sent, so a node that
        lost calls in a reset connection finds out without a next call) and keeps a
        copy to send again, made while ZeroMQ still sends the caller's buffers."""
        lock = self._leader.xpub_lock if self._leader is not None else None  # heartbeats share it
        if self._leader is not None and size >= COMING_BYTES:  # (no deadline: as long as the call waits)
            self._announced = self._seq
            self._leader.say_coming(self._seq, size, SAY_COMING_S if deadline is None else
                                    max(0.0, deadline - time.monotonic()))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())

        def queued() -> None:
            nodes_got[0] = True
            self._leader.sent(self._seq, frames)

        topic = self._leader.rpc_topic if self._leader is not None else b""
        self._bcast.publish_frames(frames, left, topic, self._drain_ready, cancel, lock,
                                   queued if self._leader is not None else None)

    def _send_cut_short(self, call: Call, got: list[bool], error: BaseException) -> None:
        """A send that raised (``got``: whether the local ring, the nodes, received
        the call; a message the ring began, or the nodes' copy once queued, is
        delivered whole). A call no rank got is forgotten, its number free again;
        one every rank got is answered as any other (a send past its deadline may
        still be delivered). One that only some got fails the executor: its ranks
        would not agree on the calls."""
        if not any(got):  # (no reader read it: see Completer._read_heads)
            if self._pending and self._pending[-1] is call:
                self._pending.pop()
            self._seq = call.seq - 1
            if self._leader is not None and call.seq == self._announced:  # the nodes wait for it
                self._announced = 0
                self._leader.withdraw_coming(call.seq)
            return
        call.sent = True
        ring = self._bcast.ring
        if ring is not None and got[0] and ring.aborted:  # (see RingWriter.send)
            self.failure.fail(ExecutorFailedError(
                f"call {call.seq} could not be finished in this node's ring: its send was cut short "
                f"({type(error).__name__}) and the rest could not be kept"))
            return
        if all(got):
            if self._bcast.ring is not None and self._bcast.ring.pending:
                self._completer.flush_soon()
            return
        self.failure.fail(ExecutorFailedError(
            f"call {call.seq} reached only some ranks: its send was cut short ({type(error).__name__})"))

    def _holds_a_lock(self) -> bool:
        return self._recv_lock.held_here() or self._send_lock.held_here()

    def _drain_ready(self) -> None:
        """Complete the calls whose replies are already here, without blocking: lets
        workers blocked on a full response queue go on while we wait to send. (Their
        futures complete once the send lock is released.)"""
        if not self._recv_lock.acquire(blocking=False):
            return
        try:
            while self._pending:
                head = self._pending[0]
                missing = [r for r in head.reply_ranks if r not in head.replies]
                if missing and not self._receivers[missing[0]].poll(head.seq):
                    return
                try:  # the data is there: a short deadline only guards a torn read
                    self._complete_head(time.monotonic() + 0.05)
                except TimeoutError:
                    return
        finally:
            self._recv_lock.release()

    def _refuse_a_forked_process(self) -> None:
        """A process forked from the driver has copies of the rings' positions: its
        call would go as the parent's next, its reads take the parent's replies."""
        if os.getpid() != self._pid:
            raise ZbusError("this executor belongs to the process that made it; a process forked "
                            "from it cannot call its workers nor wait for their replies")

    def _complete_until(self, call: Call, deadline: float | None) -> None:
        self._refuse_a_forked_process()  # (a future's result, in a child)
        if self._recv_lock.held_here():
            raise ZbusError(CALLBACK_WAITS)
        # In slices: another caller that holds the lock for a later call of its own may
        # settle this one meanwhile (then its replies are in: nothing to wait for).
        while True:
            left = Completer.SLICE_S if deadline is None else min(Completer.SLICE_S,
                                                                  deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("collective_rpc timed out waiting for replies")
            if self._completer.acquire_for_caller(self._recv_lock, left):
                break
            if call.done():
                return
        try:
            while not call.done() and self._pending:
                try:  # in slices: the non-blocking calls queued meanwhile expire on time
                    self._complete_head(_sooner(deadline, time.monotonic() + Completer.SLICE_S))
                except TimeoutError:
                    self._on_wait_slice()  # (which may settle the call: then no TimeoutError)
                    if not call.done() and deadline is not None and time.monotonic() >= deadline:
                        raise
                if self._completions and not call.done():  # earlier calls': not after this one
                    self._completer.complete_soon()
        finally:
            self._recv_lock.release()
            self._run_completions()
        if not call.done():  # no longer pending, never settled: only a shutdown does that
            raise again(self.failure.error or ZbusError("executor is shut down"))

    def _on_wait_slice(self) -> None:
        """A slice of a wait for the head call's replies ended (the recv lock held)."""
        self._expire_due()
        self._settle_on_an_error()

    def _settle_on_an_error(self) -> None:
        """Settle the head call with a rank's error as soon as it is in, while an
        earlier rank is still at work: that one may wait for the failed rank for
        good (in a torch collective, say). The late replies are taken and dropped,
        as after a timeout."""
        head = self._pending[0] if self._pending else None
        if head is None or head.done():
            return
        for rank in head.reply_ranks:
            if rank not in head.replies and self._receivers[rank].poll(head.seq):
                try:  # the data is there: a short deadline only guards a torn read
                    self._take_reply(head, rank, time.monotonic() + 0.05)
                except TimeoutError:
                    break
        error = head.first_error()
        if error is not None:
            head.settle(False, error, complete=False)  # (the completions run once the lock is let go)

    def _expire_due(self) -> None:
        """Fail the futures of non-blocking calls whose deadline has passed (the
        reply lock held)."""
        now = self._expired_at = time.monotonic()
        for pending in list(self._pending):
            if pending.deadline is not None and pending.deadline <= now:
                pending.expire()

    def _complete_head(self, deadline: float | None) -> None:
        head = self._pending[0]
        for rank in head.reply_ranks:
            if rank not in head.replies:
                self._take_reply(head, rank, deadline)
        # Settled while still pending: a failure that settles every pending call
        # meanwhile settles this one first or not at all, and their futures complete
        # in issue order.
        head.finish()  # (unless settled already: by the monitor, or by an early error)
        self._pending.popleft()
        self._answered = head.seq
        if self._leader is not None:  # replies to it from ranks it did not ask are dropped
            self._leader.path.answered = head.seq
        # (heads answered each within a wait's slice end no slice to check the rest)
        if self._pending and time.monotonic() >= self._expired_at + Completer.SLICE_S:
            self._expire_due()

    def _take_reply(self, head: Call, rank: int, deadline: float | None) -> None:
        """Read the reply of ``rank`` to ``head`` and keep it in the call; then its
        receiver lets it go (until then it gives it again: a Ctrl-C between the two
        loses no reply, see ShmReceiver.get)."""
        self._accept(head, rank, self._read_reply(head, rank, deadline))
        self._receivers[rank].taken()

    def _read_reply(self, head: Call, rank: int, deadline: float | None) -> Any:
        try:
            return self._receivers[rank].get(remaining(deadline, "collective_rpc"), want=head.seq)
        except RingClosed:
            raise again(self._replies_ended(rank, deadline)) from None
        except CodecError as e:  # consumed but not decodable here: the caller gets why
            return [rank, head.seq, protocol.RAISED,
                    codec.ExceptionInfo("zbus.errors.CodecError", f"cannot decode the reply: {e}")]

    def _replies_ended(self, rank: int, deadline: float | None) -> Exception:
        """Why the replies of ``rank`` ended: the failure, or a shutdown. Else its worker
        closed its queue on its way out (an exit, SIGTERM) and the monitor's report of
        the exit follows: wait for it, so that the death is the one failure, up to
        ``EXIT_REPORT_S`` after the queue was first seen closed, or the caller's
        deadline if that comes first (TimeoutError: a later caller waits on)."""
        if self.failure.error is None and not self._closed:
            until = self._replies_closed_at.setdefault(rank, time.monotonic()) + EXIT_REPORT_S
            self.failure.cancel.wait(max(0.0, min(until, deadline or until) - time.monotonic()))
            if self.failure.error is None and not self._closed:
                if deadline is not None and deadline < until:
                    return TimeoutError("collective_rpc timed out")
                self.failure.fail(ExecutorFailedError(f"worker rank {rank} closed its replies and has "
                                                      f"not exited {EXIT_REPORT_S} s later"))
        return self.failure.error or ZbusError("executor is shut down")

    def _accept(self, head: Call, rank: int, reply: Any) -> None:
        if not (type(reply) is list and len(reply) == 4 and reply[0] == rank and reply[1] == head.seq):
            error = ExecutorFailedError(f"protocol error: expected the reply to call {head.seq} from "
                                        f"rank {rank}, got {brief(reply)}")
            self.failure.fail(error)
            raise error
        head.replies[rank] = (reply[2], reply[3])

    # --- teardown ------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (asked, then SIGTERM, then SIGKILL) and free every
        segment. Idempotent; pending calls fail. Callers blocked in the API (other
        threads) are woken and get ZbusError before anything they use is closed.
        A shutdown while another runs returns once that one is done, except in a
        callback on that one's thread or on a thread of the executor, which that
        one may be joining. In a process forked from the driver it only closes this
        copy: the workers, rings and nodes are the parent's."""
        if os.getpid() != self._pid:
            self._closed = True
            return
        with self._state_lock:
            first, self._closed = not self._closed, True
            if first:
                self._shutting_down_in = threading.get_ident()
        if not first:
            if threading.get_ident() != self._shutting_down_in and \
                    not threading.current_thread().name.startswith("zbus-") and \
                    not self._shut_down.wait(SHUTDOWN_WAIT_S):
                log.warning("shutdown: another shutdown still runs %.0f s later", SHUTDOWN_WAIT_S)
            return
        try:
            self._shut_down_once()
        finally:
            self._shut_down.set()

    def _shut_down_once(self) -> None:
        self.failure.close()  # exits from now on are expected
        # A failure callback run by a caller that holds a lock shuts down on its thread:
        # it has the lock already (waiting for it would wait out the timeouts below).
        own_send, own_recv = self._send_lock.held_here(), self._recv_lock.held_here()
        sending, stopped = own_send, False
        # Every step runs whatever cuts one short (Ctrl-C in a wait below): a later
        # shutdown returns at once, so this one is the only one.
        try:
            self._completer.stop()
            # Names first (gone already unless the start failed): a driver killed while
            # it waits for its workers below must not leave a name behind.
            self._unlink_names()
            sending = own_send or self._send_lock.acquire(timeout=1.0)
            if not sending:  # a caller is blocked sending: cancel it, it raises ZbusError
                self.failure.cancel_waits()
                sending = self._send_lock.acquire(timeout=5.0)
            # holding the send lock: no new call starts (callers re-check _closed)
            self._stop_workers(sending)
            stopped = True
        finally:
            self._tear_down(unasked=not stopped, own_recv=own_recv, release_send=sending and not own_send)

    def _tear_down(self, unasked: bool, own_recv: bool, release_send: bool) -> None:
        """What a shutdown does once its workers were asked to stop (or it was cut
        short before): every step runs, whatever cuts one short (a second Ctrl-C in
        the kill's wait, say), and the pending calls' futures fail last."""
        workers = self._workers if unasked else None
        receiving = own_recv

        def end_unasked() -> None:
            if workers is not None:
                run_every(workers.kill, workers.close)

        def take_receiving() -> None:
            nonlocal receiving
            receiving = own_recv or self._recv_lock.acquire(timeout=5.0)  # woken callers leave at once

        def release_receiving() -> None:
            if receiving and not own_recv:
                self._recv_lock.release()

        def release_sending() -> None:
            if release_send:
                self._send_lock.release()

        run_every(end_unasked, self._wake_callers, take_receiving, self._free, release_receiving,
                  release_sending, self._run_completions)

    def _fail_pending(self, error: Exception) -> None:
        """Settle every pending call with ``error``; the caller then completes their
        futures (a callback of one may read another, which must be settled by then)."""
        for call in list(self._pending):
            call.settle(False, error, complete=False)

    def _unlink_names(self) -> None:
        if self._bcast is not None and self._bcast.handle is not None:
            shm.unlink(self._bcast.handle.name)
        for h in self._resp_handles:
            shm.unlink(h.name)

    def _stop_workers(self, can_send: bool) -> None:
        workers = self._workers
        if workers is None:
            return
        workers.stopping = True
        if self._leader is not None:  # the nodes still reachable stop cleanly too
            self._leader.announce_stop()
        if can_send:
            try:
                stop = codec.encode([protocol.STOP])
                if self.failure.error is None:
                    self._publish_stop(stop)
                elif self._leader is not None and not self._leader.try_publish_to_nodes(stop, 1.0):
                    log.warning("STOP not sent to the nodes: they end on the leader's 'failed'")
            except (TimeoutError, RingClosed, Cancelled):
                pass
        if self._leader is not None and self.failure.error is None:
            self._leader.say_bye()  # the nodes are done: none waits on our own workers' stop
        for rx in self._receivers[:self.nproc_per_node]:  # no reply is read from now on: a worker
            rx.abort()  # stuck writing one (its call timed out, its ring full) ends instead of waiting
        workers.stop(grace=5.0 if self.failure.error is None else 0.5)

    def _publish_stop(self, stop: list) -> None:
        """STOP to every rank; to the local ones still when a node takes nothing (it
        hears the leader's bye, sent to each node on its own): they end cleanly now,
        not by SIGTERM once their grace is over. Not cancelled by the shutdown's
        own cancel (it wakes the callers blocked on a full node): 1 s bounds it."""
        try:
            self._publish(stop, 0, deadline_of(1.0), [False], None)
        except SendTimeout as e:
            if e.queued or self._bcast.ring is None:
                raise
            self._bcast.ring.send(stop, 1.0)

    def _wake_callers(self) -> None:
        """Fail the pending calls and wake every blocked wait: a send is cancelled,
        a wait for a reply sees its queue aborted; both then raise ZbusError."""
        self._fail_pending(self.failure.error or ZbusError("executor is shut down"))
        self.failure.cancel_waits()
        for rx in self._receivers:
            rx.abort()
        if self._leader is not None:
            self._leader.abort_receivers()

    def _free(self) -> None:
        """Free the queues, the metrics server and the links, each whatever cut the
        one before short (the server's shutdown waits up to 0.5 s for its thread)."""
        run_every(self._free_replies, self._close_metrics_server, self._close_links)

    def _free_replies(self) -> None:
        self._pending.clear()
        for rx in self._receivers[:self.nproc_per_node]:  # the rest are the leader's (aborted)
            rx.close()
        for h in self._resp_handles:
            shm.unlink(h.name)

    def _close_metrics_server(self) -> None:
        server = self._metrics_server[0] if isinstance(self._metrics_server, tuple) else None
        if server is not None:
            run_every(server.shutdown, server.server_close)

    def _close_links(self) -> None:
        if self._leader is not None:
            self._leader.close()
        elif self._bcast is not None:
            self._bcast.close()
