"""What a user would run instead of zbus, for ``zbus bench`` to measure beside it:
multiprocessing pipes, raw pyzmq (ipc or TCP) and vLLM's shared-memory
``MessageQueue``. Each drives ``n`` worker processes with one call shape: send
one payload to all, wait for the reply of worker 0 (or of all).

vLLM is used only when it is importable; ``docs/benchmarks.md`` says how to
install just what its message queue needs, without a CUDA torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any

from .processes import die_with_parent

VLLM_QUEUE = "vllm.distributed.device_communicators.shm_broadcast"
RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM's message queues bind their sockets
REPLY_WAIT_S = 30.0  # the longest a baseline waits for a reply: a worker gone (OOM) ends the bench


def _spawn() -> Any:
    return multiprocessing.get_context("spawn")


def _pipe_worker(conn: Any, reply: bool) -> None:
    die_with_parent()
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            return
        if reply:
            conn.send_bytes(b"ok")


class PipeBaseline:
    """``n`` processes fed by multiprocessing pipes: the plain-Python way."""

    def __init__(self, n: int, all_reply: bool = False):
        ctx = _spawn()
        self.pipes = [ctx.Pipe() for _ in range(n)]
        self.repliers = [c for i, (c, _) in enumerate(self.pipes) if all_reply or i == 0]
        self.procs = [ctx.Process(target=_pipe_worker, args=(w, all_reply or i == 0), daemon=True)
                      for i, (_, w) in enumerate(self.pipes)]
        for p, (_, w) in zip(self.procs, self.pipes):
            p.start()
            w.close()  # the child's end is the child's: its death is EOF here

    def call(self, data: Any = b"noop") -> None:
        for c, _ in self.pipes:
            c.send_bytes(data)
        for c in self.repliers:
            if not c.poll(REPLY_WAIT_S):
                raise TimeoutError(f"no pipe baseline reply in {REPLY_WAIT_S:.0f} s")
            c.recv_bytes()

    def close(self) -> None:
        for c, _ in self.pipes:
            with contextlib.suppress(OSError):  # (a worker gone: its end is closed)
                c.send_bytes(b"stop")
        for p in self.procs:
            p.join(10)


def sub_worker(pub: str, push: str, index: int) -> None:
    """A pyzmq subscriber: answers a message tagged ``probe``, ``all`` or its own
    index; ``stop`` ends it."""
    import zmq

    die_with_parent()
    ctx = zmq.Context()
    sub, out = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    out.connect(push)
    out.send(b"hello")
    while True:
        tag = sub.recv_multipart(copy=False)[0].bytes
        if tag == b"stop":
            break
        if tag in (b"probe", b"all") or tag == str(index).encode():
            out.send(b"ok")
    ctx.destroy(linger=0)


def await_subscribers(pub: Any, pull: Any, n: int) -> None:
    """Wait until ``n`` subscribers said hello and hear the PUB socket (it drops
    what it sends before a subscription lands, so probe until all answer)."""
    for _ in range(n):
        if not pull.poll(60_000):
            raise TimeoutError("baseline subscribers did not start")
        pull.recv()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pub.send(b"probe")
        got = 0
        while pull.poll(300):
            pull.recv()
            got += 1
        if got >= n:
            return
    raise TimeoutError("baseline subscribers do not hear the publisher")


class ZmqBaseline:
    """Raw pyzmq: PUB to ``n`` SUB processes (zero-copy frames), replies on PULL;
    over ``ipc://`` here, or TCP when ``host`` is given."""

    def __init__(self, n: int, host: str | None = None):
        import zmq

        self.ctx = zmq.Context()
        self.pub, self.pull = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.PULL)
        self._files: list[str] = []  # the ipc sockets' files, which closing leaves
        self.procs: list[Any] = []
        try:
            self._start(n, host)
        except BaseException:  # Ctrl-C or a timeout while the subscribers start
            self._end()
            raise

    def _start(self, n: int, host: str | None) -> None:
        import zmq

        if host is None:
            base = f"/tmp/zbus-bench-{os.getpid()}-{id(self)}"
            self._files = [base + "-pub", base + "-pull"]
            self.pub.bind("ipc://" + self._files[0])
            self.pull.bind("ipc://" + self._files[1])
        else:
            self.pub.bind(f"tcp://{host}:*")
            self.pull.bind(f"tcp://{host}:*")
        pub_addr = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        pull_addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.procs = [_spawn().Process(target=sub_worker, args=(pub_addr, pull_addr, i), daemon=True)
                      for i in range(n)]
        for p in self.procs:
            p.start()
        await_subscribers(self.pub, self.pull, n)

    def call(self, payload: Any = b"", all_reply: bool = False) -> None:
        frames = [b"all" if all_reply else b"0"] + ([payload] if len(payload) else [])
        self.pub.send_multipart(frames, copy=len(payload) < 65536)
        for _ in range(len(self.procs) if all_reply else 1):
            if not self.pull.poll(int(REPLY_WAIT_S * 1000)):
                raise TimeoutError(f"no pyzmq baseline reply in {REPLY_WAIT_S:.0f} s: a subscriber gone?")
            self.pull.recv()

    def close(self) -> None:
        try:
            self.pub.send(b"stop")
            for p in self.procs:
                p.join(10)
        finally:
            self._end()

    def _end(self) -> None:
        """Remove the sockets' files (first: a second Ctrl-C below leaves none), kill
        the subscribers still running, close the sockets."""
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self.ctx.destroy(linger=0)


def relay(pub: str, local: str) -> None:
    """A node relay in raw pyzmq: subscribe to the leader's PUB and republish every
    message on this node's ``local`` PUB, inside libzmq (``zmq.proxy``): the
    shape of zbus's node agent with no Python on the hop. Ends with its process."""
    import zmq

    ctx = zmq.Context()
    sub, out = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    out.bind(local)
    zmq.proxy(sub, out)


def rep_worker(address: str) -> None:
    """A pyzmq REP socket answering ``ok`` until ``stop``."""
    import zmq

    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.connect(address)
    while True:
        frames = rep.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            rep.send(b"bye")
            break
        rep.send(b"ok")
    ctx.destroy(linger=0)


# --- vLLM ---------------------------------------------------------------------------


def vllm_available() -> str | None:
    """None when vLLM's MessageQueue imports, else why it does not."""
    import importlib

    try:
        importlib.import_module(VLLM_QUEUE)
    except Exception as e:  # noqa: BLE001 - any failure means: not comparable here
        return f"vLLM's MessageQueue does not import ({type(e).__name__}: {e})"
    return None


def _vllm_worker(handle: Any, rank: int, conn: Any) -> None:
    """One vLLM-style worker: dequeue (method, args, kwargs, output_rank) from the
    broadcast queue, run it, and enqueue (status, result) on its own response
    queue when it is the output rank, as vLLM's ``WorkerProc`` does."""
    import importlib

    die_with_parent()
    mq = importlib.import_module(VLLM_QUEUE).MessageQueue
    bcast = mq.create_from_handle(handle, rank)
    resp = mq(1, 1)
    conn.send(resp.export_handle())
    bcast.wait_until_ready()
    resp.wait_until_ready()
    while True:
        method, args, _, output_rank = bcast.dequeue(indefinite=True)
        if method == "stop":
            break
        value = None if method == "noop" else int(getattr(args[0], "nbytes", 0) or len(args[0]))
        if output_rank is None or output_rank == rank:
            resp.enqueue(("ok", value))
    del bcast, resp


class VllmBaseline:
    """vLLM's shared-memory ``MessageQueue`` wired as its multiprocess executor
    wires it: one broadcast queue of 16 MiB chunks to ``n`` local workers, one
    response queue per worker (its defaults), the reply from worker 0."""

    def __init__(self, n: int):
        # vLLM binds each queue's sockets as files in VLLM_RPC_BASE_PATH and leaves them
        # there: here in a folder of this baseline's (its workers inherit it), removed
        # with it
        self._folder = tempfile.mkdtemp(prefix="zbus-bench-vllm-")
        self.procs: list[Any] = []
        previous = os.environ.get(RPC_PATH_ENV)
        os.environ[RPC_PATH_ENV] = self._folder
        try:
            self._start(n)
        except BaseException:  # Ctrl-C or a timeout while the workers start
            self._end()
            raise
        finally:
            if previous is None:
                os.environ.pop(RPC_PATH_ENV, None)
            else:
                os.environ[RPC_PATH_ENV] = previous

    def _start(self, n: int) -> None:
        import importlib

        mq = importlib.import_module(VLLM_QUEUE).MessageQueue
        ctx = _spawn()
        self.bcast = mq(n, n, max_chunk_bytes=16 * 2**20)
        pipes = [ctx.Pipe() for _ in range(n)]
        self.procs = [ctx.Process(target=_vllm_worker, args=(self.bcast.export_handle(), i, w), daemon=True)
                      for i, (_, w) in enumerate(pipes)]
        for p in self.procs:
            p.start()
        handles = []
        for r, _ in pipes:
            if not r.poll(120):
                raise TimeoutError("vLLM baseline workers did not start")
            handles.append(r.recv())
        self.responses = [mq.create_from_handle(h, 0) for h in handles]
        self.bcast.wait_until_ready()
        for q in self.responses:
            q.wait_until_ready()

    def call(self, payload: Any = None) -> None:
        args = () if payload is None else (payload,)
        self.bcast.enqueue(("noop" if payload is None else "size", args, {}, 0), timeout=60)
        status, _ = self.responses[0].dequeue(timeout=60)
        assert status == "ok"

    def close(self) -> None:
        try:
            self.bcast.enqueue(("stop", (), {}, None), timeout=10)
            for p in self.procs:
                p.join(10)
        finally:
            self._end()

    def _end(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        shutil.rmtree(self._folder, ignore_errors=True)
