"""Worker classes and functions the tests call by import path."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import signal
import threading
import time

import zbus
import zbus.executor
import zbus.worker


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this error cannot be put in words")


class EchoWorker(zbus.Worker):
    def __init__(self, tag: str = "w", fail_rank: int | None = None):
        if fail_rank == self.rank:
            raise RuntimeError(f"start-up failure on rank {self.rank}")
        self.tag = tag
        self.calls = 0

    def echo(self, *args, **kwargs):
        self.calls += 1
        return args, kwargs

    def whoami(self):
        return {"rank": self.rank, "local_rank": self.local_rank, "world_size": self.world_size,
                "env": {k: os.environ.get(k) for k in (
                    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")},
                "pid": os.getpid(), "tag": self.tag}

    def noop(self):
        return None

    def crc(self, seq, payload, delay=0.0, echo=False):
        """(seq, crc32 of payload), after ``delay`` s (keeps calls in flight longer);
        with ``echo`` the payload too."""
        import zlib

        time.sleep(delay)
        return (seq, zlib.crc32(payload), payload) if echo else (seq, zlib.crc32(payload))

    def env_of(self, names):
        return {n: os.environ.get(n) for n in names}

    def rank_value(self, x):
        return x * 10 + self.rank

    def unprintable(self):
        raise Unprintable()

    def cancelled(self):
        raise asyncio.CancelledError("the task was cancelled")  # a BaseException, not an Exception

    def boom(self, msg="boom"):
        raise ValueError(msg)

    def boom_undecodable(self):
        raise ValueError("cannot load " + os.fsdecode(b"model-\xff"))  # (a lone surrogate)

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def sleep_on_node(self, node_rank, seconds):
        """Sleep on one node's workers only; the others answer at once."""
        if self.node_rank == node_rank:
            time.sleep(seconds)
        return self.rank

    def sleep_marked(self, path, seconds):
        """Make ``path.<rank>`` (so a test sees the call has begun), then sleep."""
        with open(f"{path}.{self.rank}", "w"):
            pass
        time.sleep(seconds)
        return self.rank

    def mark(self, path, payload=b""):
        """Make ``path.<rank>``; the payload's size."""
        with open(f"{path}.{self.rank}", "w"):
            pass
        return len(payload)

    def boom_on(self, rank, path, seconds):
        """Raise on ``rank``; the others wait ``seconds`` (as for the failed rank in a
        collective of their own), then make ``path.<rank>``."""
        if self.rank == rank:
            raise ValueError(f"rank {rank} failed")
        time.sleep(seconds)
        with open(f"{path}.{self.rank}", "w"):
            pass
        return self.rank

    def mark_at_exit(self, path):
        """Make ``path.<rank>`` when this process runs its ``atexit`` hooks."""
        atexit.register(lambda: open(f"{path}.{self.rank}", "w").close())

    def mark_on_exit(self, path, hang_at_exit=True):
        """Make ``path.<rank>`` by ``zbus.worker.on_exit``, behind an ``atexit`` hook
        that hangs (as one waiting on a peer gone with the driver)."""
        zbus.worker.on_exit(lambda: open(f"{path}.{self.rank}", "w").close())
        if hang_at_exit:
            atexit.register(time.sleep, 60)

    def start_a_process(self, path):
        """Start a process that outlives this call (60 s), its pid in ``path.<rank>``
        (a compile helper, a server a library starts)."""
        import subprocess

        child = subprocess.Popen(["sleep", "60"])
        with open(f"{path}.{self.rank}", "w") as f:
            f.write(str(child.pid))

    def hang_in_on_exit(self, seconds):
        """A clean-up named by ``zbus.worker.on_exit`` that hangs (on a peer gone with
        the driver)."""
        zbus.worker.on_exit(lambda: time.sleep(seconds))

    def exit_in_on_exit(self, code):
        """A clean-up at exit interrupted as by SIGTERM's handler (SystemExit)."""
        def interrupted():
            raise SystemExit(code)
        zbus.worker.on_exit(interrupted)

    def never(self):
        """A Future no one completes (an answer that never comes)."""
        return concurrent.futures.Future()

    def zeros(self, n):
        return bytes(n)

    def refuse_threads(self, *names):
        """From now on, starts of threads of these names fail in this process, as at
        a pids limit."""
        start = threading.Thread.start

        def refusing(thread):
            if thread.name in names:
                raise RuntimeError("can't start new thread")
            start(thread)
        threading.Thread.start = refusing

    def count_at_exit(self, path, seconds):
        """An ``atexit`` hook that adds a line to ``path.<rank>``, then takes ``seconds``."""
        def hook():
            with open(f"{path}.{self.rank}", "a") as f:
                f.write("ran\n")
            time.sleep(seconds)
        atexit.register(hook)

    def stubborn_sleep(self, seconds):
        """Sleep deaf to SIGTERM, as a worker stuck in native code: it ends by SIGKILL,
        without closing its rings."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(seconds)
        return self.rank

    def stubborn_node_shm(self, name, seconds):
        """Name shared memory with this node's prefix (as vLLM's CPU all-reduce
        does), then sleep deaf to SIGTERM (as in that all-reduce's native spin)."""
        open(f"/dev/shm/{os.environ['ZBUS_NODE_SHM_PREFIX']}{name}", "w").close()
        return self.stubborn_sleep(seconds)

    def stubborn_sleep_marked(self, path, seconds):
        """``stubborn_sleep``, once ``path.<rank>`` is made (deaf to SIGTERM by then)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(f"{path}.{self.rank}", "w").close()
        return self.stubborn_sleep(seconds)

    def die(self, rank=None, how="kill", linger=0.5):
        if rank is None or rank == self.rank:
            if how == "abort":
                os.abort()
            if how == "exit":  # the worker closes its queues, then exits `linger` s later
                atexit.register(time.sleep, linger)
                raise SystemExit(7)
            if how == "exit_thread":  # ... with a thread (not a daemon) that runs for `linger` s
                threading.Thread(target=time.sleep, args=(linger,)).start()
                raise SystemExit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    def later(self, value, delay):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        threading.Timer(delay, fut.set_result, args=(value,)).start()
        return fut

    def tensor_len(self, data):
        return len(data)

    def tensor_sum(self, t):
        return t.sum().item()

    def tensor_back(self, t):
        return t * 2 if self.rank == 0 else t

    def keep(self, t):
        """Keep an argument past the call (a lent one gets pages of its own)."""
        self.__dict__.setdefault("kept", []).append(t)

    def kept_sums(self):
        """The sums of what ``keep`` kept, which is then dropped."""
        sums = [t.sum().item() for t in self.__dict__.pop("kept", [])]
        return sums

    def add_one_then_sum(self, t, delay):
        """Rank 0 writes to its argument; the others sum theirs ``delay`` s later."""
        if self.rank == 0:
            t.add_(1)
        else:
            time.sleep(delay)
        return t.sum().item()

    def fail_with(self, t):
        """Raise, holding the argument in this frame (which the traceback keeps)."""
        raise ValueError(f"failed with {t.numel()} elements")

    def mapping_of_argument(self, t):
        """The file mapped where the argument's bytes lie ("" for anonymous memory)."""
        address = t.data_ptr()
        with open("/proc/self/maps") as f:
            for line in f:
                span, *rest = line.split()
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= address < hi:
                    return rest[4] if len(rest) > 4 else ""
        return None

    def keep_with_a_read_only_page(self, t, seconds):
        """Keep ``t`` with one of its pages read-only for ``seconds``: until then the
        kernel refuses to make a lent ``t`` this worker's own (EINVAL), as it would
        with no memory, so the next receive fails and is tried again."""
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = (t.data_ptr() // mmap.PAGESIZE + 4) * mmap.PAGESIZE
        assert libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ) == 0
        writable = (page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)
        threading.Timer(seconds, libc.mprotect, writable).start()
        self.keep(t)
        return os.getpid()

    def fork_a_child_that(self, how):
        """Fork a child that, once it was rank 0's, returns from this call ("return")
        or calls ``sys.exit(0)`` ("exit") instead of ending with ``os._exit``. The
        parent returns the child's exit status, or "running" if it still runs 5 s
        later (then it is killed)."""
        import sys

        child = os.fork() if self.rank == 0 else None
        if child == 0:
            if how == "exit":
                sys.exit(0)
            return "the child's reply"
        if child is None:
            return None
        for _ in range(500):
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        return "running"

    def _private(self):
        return "secret"


def add_rank(worker, x, y=0):
    return x + y + worker.rank


class DistWorker(zbus.Worker):
    """Joins a torch.distributed (gloo) group from the torchrun variables."""

    def __init__(self):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")

    def all_reduce(self, value):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return t.item()

    def all_reduce_unless(self, rank, value):
        """All-reduce on every rank but ``rank``, which raises: the others wait for it
        in gloo (30 minutes by default)."""
        if self.rank == rank:
            raise ValueError(f"rank {rank} failed before the all-reduce")
        return self.all_reduce(value)

    def close(self):
        import torch.distributed as dist

        dist.destroy_process_group()


class SlowExitWorker(EchoWorker):
    """Slow to end: an ``atexit`` hook that makes ``path.<rank>``, then sleeps."""

    def __init__(self, path: str, seconds: float):
        super().__init__()
        atexit.register(lambda: (open(f"{path}.{self.rank}", "w").close(), time.sleep(seconds)))


class NotAWorker:
    pass


class UndecodableStartWorker(zbus.Worker):
    def __init__(self):
        raise ValueError("cannot load " + os.fsdecode(b"model-\xff"))


class SlowStartWorker(zbus.Worker):
    """A start that hangs, as a worker stuck loading something."""

    def __init__(self, seconds: float = 60.0):
        time.sleep(seconds)


class BrokenImportWorker(zbus.Worker):
    def __init__(self):
        import zbus_module_that_does_not_exist  # noqa: F401


class FollowerLacksAModuleWorker(zbus.Worker):
    """Starts on the leader's node; on a follower a module it needs is missing."""

    def __init__(self):
        if os.environ["NODE_RANK"] != "0":
            import zbus_module_that_does_not_exist  # noqa: F401


class CustomExecutor(zbus.executor.MultiprocExecutor):
    """A user backend: counts calls."""

    calls = 0

    def collective_rpc(self, method, *args, **kwargs):
        CustomExecutor.calls += 1
        return super().collective_rpc(method, *args, **kwargs)
