"""POSIX shared-memory segments owned by a process, and the two primitives that
make them a synchronisation medium: a full memory fence and a futex.

Segments live in ``/dev/shm`` and are named ``zbus-<pid>-<starttime>-<n>``: the
owner's pid and its start time (so a reused pid is not mistaken for the owner).
:func:`sweep_stale` removes the segments whose owner is gone; every zbus process
that creates segments calls it first, so a SIGKILLed owner never fills /dev/shm.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import platform
import threading

from .errors import ShmSpaceError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "zbus-"
_counter = itertools.count()


def _start_time(pid: int) -> str | None:
    """The process start time in clock ticks since boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces, so split after ')'.
    return stat.rsplit(b")", 1)[1].split()[19].decode()


def new_name() -> str:
    """A fresh segment name owned by this process."""
    pid = os.getpid()
    return f"{PREFIX}{pid}-{_start_time(pid)}-{next(_counter)}"


def owner_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` still runs."""
    try:
        pid_s, start, _n = name[len(PREFIX):].split("-")
        pid = int(pid_s)
    except ValueError:
        return True  # not ours to judge
    return _start_time(pid) == start


def sweep_stale() -> list[str]:
    """Unlink every zbus segment whose owner process is gone; return their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(PREFIX) and not owner_alive(name):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    if removed:
        log.info("swept %d stale shared-memory segment(s): %s", len(removed), ", ".join(removed))
    return removed


def unlink(name: str) -> None:
    """Remove a segment's name; mappings stay valid until closed. Idempotent."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


class Segment:
    """A mapped shared-memory segment. ``create`` reserves the memory up front, so
    a full /dev/shm fails here with a clear message instead of a SIGBUS later."""

    def __init__(self, name: str, size: int, fd: int):
        self.name = name
        self.size = size
        self._mmap = mmap.mmap(fd, size)
        os.close(fd)
        self.buf = memoryview(self._mmap)
        # Base address for futex calls; the ctypes view is dropped at once so that
        # it holds no export on the mmap (which would block close()).
        anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(anchor)
        del anchor

    @classmethod
    def create(cls, size: int) -> Segment:
        check_free_space(size)
        name = new_name()
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            unlink(name)
            raise ShmSpaceError(
                f"cannot reserve {size} bytes in {SHM_DIR} for {name}: {e.strerror}; "
                "free space there or lower ZBUS_RING") from e
        return cls(name, size, fd)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        return cls(name, size, fd)

    def close(self) -> None:
        if self._mmap is not None:
            self.buf.release()
            self._mmap.close()
            self._mmap = None

    def unlink(self) -> None:
        unlink(self.name)


def check_free_space(size: int) -> None:
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise ShmSpaceError(
            f"{SHM_DIR} has {free / 2**20:.1f} MiB free but a ring needs {size / 2**20:.1f} MiB; "
            "free space there, enlarge it (docker: shm_size), or lower ZBUS_RING")


# --- fence -------------------------------------------------------------------------
# A lock acquire/release pair executes an atomic read-modify-write (lock cmpxchg on
# x86-64, ldaxr/stlxr with barriers on ARM): a full fence, also for store->load order.
_fence_lock = threading.Lock()


def fence() -> None:
    _fence_lock.acquire()
    _fence_lock.release()


# --- futex -------------------------------------------------------------------------
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL during the call
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the u32 at ``address`` equals ``expected``, at most ``timeout`` s.

    The kernel compares and sleeps atomically, so a wake issued after the word
    changed is never lost. Returns on wake, on timeout, or at once if the word
    already differs; the caller re-checks its condition in every case.
    """
    if _SYS_FUTEX is None:  # pragma: no cover - unknown architecture
        threading.Event().wait(min(timeout, 0.001))
        return
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT,
             ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)


def futex_wake(address: int, n: int = 2**31 - 1) -> None:
    """Wake up to ``n`` processes sleeping on the u32 at ``address``."""
    if _SYS_FUTEX is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, n, None, None, 0)
