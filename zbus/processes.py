"""A node's worker processes: started as fresh interpreters with torchrun's
environment, watched through pidfds, stopped by pid. Used by the driver
(:mod:`zbus.executor`) and by a follower's agent (:mod:`zbus.agent`), which must
not import the driver."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable

from . import shm
from .config import usable_cores

log = logging.getLogger(__name__)
KILL_WAIT_S = 10.0  # how long a SIGKILLed worker is waited for before it is left behind
# Workers learn their node's prefix of shared-memory names here: what they name
# with it, their node removes once they have all ended (even SIGKILLed).
NODE_SHM_PREFIX_ENV = "ZBUS_NODE_SHM_PREFIX"


def node_shm_prefix(master_port: int, node_rank: int) -> str:
    """The shared-memory names of one node's workers in one cluster (its
    rendezvous port). Ends in the text after the last ':' of the rendezvous
    ``tcp://host:port?zbus_node=N`` plus '-', which is how vLLM's CPU all-reduce
    names its segments (see :func:`zbus.vllm.worker.distributed_init_method`)."""
    return f"{int(master_port)}?zbus_node={int(node_rank)}-"


# The GPUs a worker sees (``env=`` of the executor): "own", one each (the default),
# or "node", every GPU of its node, as vLLM's own executor shows them: vLLM names a
# worker's device by its local rank and maps its peers' through that list.
GPUS_ENV = "ZBUS_GPUS"
# The worker's OpenMP threads where the environment does not set OMP_NUM_THREADS
# (``env=``): "one" (the default: OMP_NUM_THREADS=1), or "share", the cores this
# node's parent may use over its workers (as vLLM's own executor gives a GPU
# worker for its start-up); the worker then sees ZBUS_THREADS=shared.
THREADS_ENV = "ZBUS_THREADS"


def _visible_gpus() -> list[str]:
    """GPU ids this process may use, found without importing torch."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    return sorted((n[6:] for n in names if n.startswith("nvidia") and n[6:].isdigit()), key=int)


def worker_env(place: dict, master_addr: str, master_port: int, extra: dict[str, str]) -> dict:
    """The environment of a worker process: torchrun's variables, one GPU each."""
    env = dict(os.environ)
    env.pop("ZBUS_SECRET", None)  # (the cluster's key: a node's workers get their node's key pair)
    env.update(extra)
    env.update({
        "RANK": str(place["rank"]), "LOCAL_RANK": str(place["local_rank"]),
        "WORLD_SIZE": str(place["world_size"]), "LOCAL_WORLD_SIZE": str(place["local_world_size"]),
        "NODE_RANK": str(place["node_rank"]), "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        NODE_SHM_PREFIX_ENV: node_shm_prefix(master_port, place["node_rank"]),
    })
    if "OMP_NUM_THREADS" not in env:
        share = extra.get(THREADS_ENV) == "share"
        cores = usable_cores() if share else 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // place["local_world_size"]))
        env[THREADS_ENV] = "shared" if share else "one"
    gpus = _visible_gpus()
    one_each = extra.get(GPUS_ENV, "own") != "node"
    if one_each and len(gpus) >= place["local_world_size"] and "CUDA_VISIBLE_DEVICES" not in extra:
        env["CUDA_VISIBLE_DEVICES"] = gpus[place["local_rank"]]
    # The worker imports the user's modules the way the driver does.
    paths = [p for p in (sys.path[0], env.get("PYTHONPATH", "")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def with_gloo_ifname(env: dict[str, str], ifname: str | None) -> dict[str, str]:
    """``env`` with ``GLOO_SOCKET_IFNAME`` set to ``ifname`` (the interface that
    routes to the leader) unless this process's environment or ``env`` sets it:
    gloo would otherwise use the address of the host's name."""
    if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
    return env


# The workers of this process. A child it forks (multiprocessing's fork start
# method, a DataLoader's workers) would inherit the write end of their death pipe,
# and they would outlive a SIGKILL of this process for as long as that child lives.
_alive: weakref.WeakSet[LocalWorkers] = weakref.WeakSet()


def _forget_death_pipes() -> None:
    """In a forked child: close the inherited write ends of the death pipes."""
    for workers in list(_alive):
        if workers._death_w >= 0:
            os.close(workers._death_w)
            workers._death_w = -1


os.register_at_fork(after_in_child=_forget_death_pipes)


def end_own_group() -> None:
    """SIGKILL the other processes of the group this process leads (a worker: see
    :class:`LocalWorkers`), as its executor would: an orphaned worker ends them
    itself. Found in /proc (``killpg`` would end this process first)."""
    me = os.getpid()
    if os.getpgrp() != me:
        return
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the name: state, ppid, pgrp
            if int(fields[2]) == me:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            pass


class LocalWorkers:
    """Worker processes of one node: started as fresh interpreters (no fork),
    watched through pidfds, ended by pid. ``on_death(local_rank, exitcode)`` runs
    in the watcher thread when one exits unexpectedly. Once stopped or killed,
    the shared memory named with the node's prefix (:func:`node_shm_prefix`) is
    removed: a worker killed in a native loop cannot remove its own. Stopping is
    safe from several threads (a failure and a shutdown may both stop them)."""

    def __init__(self, places: list[dict], bcast: dict, responses: list[dict], segments: list[str],
                 master_addr: str, master_port: int, extra_env: dict[str, str],
                 on_death: Callable[[int, int | None], None]):
        death_r, self._death_w = os.pipe()
        _alive.add(self)  # (at once: a fork while the workers start must not keep the write end)
        self._stop_r, self._stop_w = os.pipe()
        self.procs: list[subprocess.Popen] = []
        self._on_death = on_death
        self.stopping = False
        self._shm_prefix = node_shm_prefix(master_port, places[0]["node_rank"])
        self._close_lock = threading.Lock()
        self._closing = False
        self._reap_lock = threading.RLock()  # a worker is signalled, or reaped, under it
        pidfds: list[int] = []
        try:
            for place, resp in zip(places, responses):
                info = dict(place, bcast=bcast, resp=resp, death_fd=death_r, segments=segments)
                env = worker_env(place, master_addr, master_port, extra_env)
                env["ZBUS_WORKER"] = json.dumps(info)
                # each leads a process group of its own: see _reap
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", "from zbus.worker import main; main()"], env=env,
                    pass_fds=(death_r,), stdin=subprocess.DEVNULL, start_new_session=True))
                # here, not in the watcher: a kernel or seccomp profile without pidfds
                # fails the start, instead of a watcher that dies and reports no death
                pidfds.append(os.pidfd_open(self.procs[-1].pid))
            # (in here: a thread that cannot start, at a pids limit, ends the workers)
            self._thread = threading.Thread(target=self._watch, args=(pidfds,),
                                            name="zbus-worker-monitor", daemon=True)
            self._thread.start()
        except BaseException:
            os.close(death_r)
            self.kill()
            death_w, self._death_w = self._death_w, -1  # (first: a fork now must not close it again)
            for fd in (*pidfds, death_w, self._stop_r, self._stop_w):
                os.close(fd)
            raise
        os.close(death_r)

    def _watch(self, pidfds: list[int]) -> None:
        poller = select.poll()
        fds = {}
        for i, fd in enumerate(pidfds):
            fds[fd] = i
            poller.register(fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        try:
            while fds:
                for fd, _ in poller.poll():
                    if fd == self._stop_r:
                        return
                    i = fds.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    code = self._reap(self.procs[i])
                    if not self.stopping:
                        self._on_death(i, code)
        finally:
            for fd in fds:
                os.close(fd)

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if self._reap(p) is None]

    def wait(self, timeout: float) -> bool:
        """Wait for every worker to exit (reaped); whether they all did."""
        deadline = time.monotonic() + timeout
        while any(self._reap(p) is None for p in self.procs):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.01, left))
        return True

    def stop(self, grace: float = 5.0, term_s: float = 2.0) -> None:
        """Workers were asked to stop: wait ``grace``, then SIGTERM and ``term_s``,
        then SIGKILL; cut short (Ctrl-C), SIGKILL at once."""
        self.stopping = True
        try:
            if not self.wait(grace):
                log.warning("workers %s still running %.1f s after they were asked to stop: SIGTERM",
                            [self.procs[i].pid for i in self.alive()], grace)
                for p in self.procs:
                    self._signal(p, signal.SIGTERM)
                if not self.wait(term_s):
                    self.kill()
        except BaseException:
            self.kill()
            raise
        finally:
            try:
                self.close()
            finally:
                shm.unlink_prefixed(self._shm_prefix)

    def kill(self) -> None:
        self.stopping = True
        for p in self.procs:
            self._signal(p, signal.SIGKILL, group=True)
        # for them all: a hung driver hangs every worker (a process in uninterruptible
        # sleep outlives SIGKILL)
        try:
            if not self.wait(KILL_WAIT_S):
                for i in self.alive():
                    log.error("worker pid %d did not end %.0f s after SIGKILL: left to the system",
                              self.procs[i].pid, KILL_WAIT_S)
        finally:  # (a second Ctrl-C in the wait, while a GPU process takes its time to die)
            shm.unlink_prefixed(self._shm_prefix)

    def _reap(self, p: subprocess.Popen) -> int | None:
        """Worker ``p``'s exit code once it exited (None before), reaped here. First
        SIGKILL what is left in its process group: processes its methods started (a
        compile helper, a library's server) would run on, holding memory or a GPU.
        (Until the worker is reaped, its pid, the group's id, cannot be another's.
        A process that made a session of its own is not in the group.)"""
        with self._reap_lock:
            if p.returncode is None:
                try:
                    if os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
                        return None
                except ChildProcessError:  # reaped by another wait of this process
                    return p.wait()
                self._signal(p, signal.SIGKILL, group=True)
                p.wait()
            return p.returncode

    def _signal(self, p: subprocess.Popen, sig: int, group: bool = False) -> None:
        """Send ``sig`` to worker ``p`` (``group``: to its process group) unless it
        was reaped: then its pid may be another process's."""
        with self._reap_lock:
            if p.returncode is None:
                try:
                    if group:
                        os.killpg(p.pid, sig)
                    else:
                        os.kill(p.pid, sig)
                except OSError:  # gone (ESRCH)
                    pass

    def close(self) -> None:
        with self._close_lock:  # the first caller closes, the others return at once:
            if self._closing:  # it may be joining the watcher thread that calls here
                return
            self._closing = True
        os.write(self._stop_w, b"x")
        if hasattr(self, "_thread") and self._thread is not threading.current_thread():
            self._thread.join(5)  # (a failure callback may call shutdown on this thread)
        for fd in (self._death_w, self._stop_r, self._stop_w):
            if fd >= 0:  # (a forked child closed its death pipe's end at once)
                os.close(fd)
        self._death_w = -1


def die_with_parent() -> None:
    """End this process (SIGKILL) when its parent does: a helper that only serves
    its parent (a benchmark's reader or subscriber) must not wait for good on one
    that is gone (SIGKILLed, say), holding its shared memory."""
    import ctypes
    import multiprocessing

    started_by = multiprocessing.parent_process()  # (its pid from before this process ran)
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != (started_by.pid if started_by is not None else os.getppid()):
        os._exit(1)  # gone before the call


def end_followers(followers: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """End ``zbus follower`` processes this one started: SIGTERM (each ends its
    workers and tells its leader), then SIGKILL what is left ``grace_s`` later."""
    try:
        for f in followers:
            if f.poll() is None:
                f.terminate()
        until = time.monotonic() + grace_s  # one grace for all: not one after another
        for f in followers:
            try:
                f.wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                f.kill()
                try:
                    f.wait(KILL_WAIT_S)
                except subprocess.TimeoutExpired:  # (uninterruptible sleep outlives SIGKILL)
                    log.error("follower pid %d did not end %.0f s after SIGKILL: left to the system",
                              f.pid, KILL_WAIT_S)
    except BaseException:  # a second Ctrl-C or SIGTERM: no more grace for any
        for f in followers:
            if f.poll() is None:
                f.kill()
        raise
