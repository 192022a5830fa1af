"""POSIX shared-memory segments owned by a process, and the two primitives that
make them a synchronisation medium: a full memory fence and a doorbell.

Segments live in ``/dev/shm`` and are named ``zbus-<pidns>-<pid>-<starttime>-<n>x<random>``:
the owner's pid namespace, pid and start time (so a reused pid, or a process of
another container sharing /dev/shm, is not mistaken for the owner), a counter and
8 random hex digits.
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
import secrets
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable

from .config import flag
from .errors import ShmSpaceError

log = logging.getLogger(__name__)


def _load_core() -> Any:
    """The compiled core (``zbus._core``), or None: not built, or ``ZBUS_PURE_PYTHON``."""
    if flag("ZBUS_PURE_PYTHON"):
        return None
    try:
        from . import _core
    except ImportError:
        return None
    return _core


core = _load_core()

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


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").rsplit("[", 1)[1].rstrip("]")
    except (OSError, IndexError):
        return "0"


def new_name() -> str:
    """A fresh segment name owned by this process. It ends with a random part:
    another local user who made the name first (all the rest can be read in /proc)
    would make the segment's creation fail (``O_EXCL``)."""
    pid = os.getpid()
    return f"{PREFIX}{_pid_namespace()}-{pid}-{_start_time(pid)}-{next(_counter)}x{secrets.token_hex(4)}"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it runs, as another user
    return True


def owner_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` still runs. Segments of
    another pid namespace count as alive: their owners cannot be seen from here.
    Without a start time (no /proc, in the name or now) the pid alone decides: a
    reused pid keeps a stale segment, but a live owner never loses its own."""
    try:
        pidns, pid_s, start, _n = name[len(PREFIX):].split("-")
        pid = int(pid_s)
    except ValueError:
        return True  # not ours to judge
    if pidns != _pid_namespace():
        return True
    now = _start_time(pid)
    if start == "None" or now is None:
        return _pid_exists(pid)
    return now == start


def sweep_stale() -> list[str]:
    """Unlink every zbus segment of ours (this uid) whose owner process is gone;
    return their names. Other users' segments are theirs to sweep (/dev/shm is
    sticky: unlinking them fails), and no error here may stop a start-up."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != uid or owner_alive(name):
                continue
            os.unlink(path)
            removed.append(name)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                log.debug("cannot sweep %s: %s", name, e)
    if removed:
        log.info("swept %d stale shared-memory segment(s): %s", len(removed), ", ".join(removed))
    return removed


def unlink(name: str) -> None:
    """Remove a segment's name; mappings stay valid until closed. Idempotent."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def unlink_prefixed(prefix: str) -> None:
    """Remove every name in /dev/shm that starts with ``prefix`` (those in use stay
    mapped where they are)."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


class Segment:
    """A mapped shared-memory segment. ``create`` reserves the memory up front, so
    a full /dev/shm fails here with a clear message instead of a SIGBUS later."""

    def __init__(self, name: str, size: int, fd: int):
        self.name = name
        self.size = size
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int) -> Segment:
        check_free_space(size)
        name = new_name()
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except BaseException as e:  # (a signal's exception too: the reservation takes a while)
            os.close(fd)
            unlink(name)
            if not isinstance(e, OSError):
                raise
            raise ShmSpaceError(
                f"cannot reserve {size} bytes in {SHM_DIR} for {name}: {e.strerror}; "
                "free space there or lower ZBUS_RING") from e
        try:
            return cls(name, size, fd)  # closes fd, mapped or not
        except BaseException:
            unlink(name)  # nobody else knows the name yet
            raise

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


# --- copy-on-write loans of a segment's pages ----------------------------------------

_PROT_RW, _MAP_PRIVATE, _MAP_FIXED = 3, 0x02, 0x10
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc_calls() -> tuple | None:
    """libc's mmap and madvise through ctypes (Linux), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, madvise = libc.mmap, libc.madvise
    except (OSError, AttributeError):
        return None
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return mmap_, madvise


_libc = _libc_calls() if platform.system() == "Linux" else None
_lending: bool | None = None


def can_lend() -> bool:
    """Whether loans work here: Linux with ``MADV_POPULATE_WRITE`` (5.14), which
    gives a kept loan's pages to its reader alone. Tried once, on a page of a
    memfd."""
    global _lending
    if _lending is None:
        _lending = False
        if _libc is not None and hasattr(os, "memfd_create"):
            try:
                fd = os.memfd_create("zbus-probe")
            except OSError:
                return False
            try:
                os.ftruncate(fd, mmap.PAGESIZE)
                with mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE) as m:
                    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
                    _lending = _libc[1](address, mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0
            except OSError:
                pass
            finally:
                os.close(fd)
    return _lending


def _mapped(address: int | None, what: str) -> int:
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return address


class Loan:
    """Pieces of a segment mapped back to back, private and copy-on-write, so that a
    reader decodes a message where it lies: no copy is made, and a write to a
    decoded tensor makes a private copy of that page alone (other readers and the
    ring never see it).

    The span is reserved by a :class:`mmap.mmap` (anonymous, never touched) that the
    pieces are then mapped over: every view of the message holds it, and it refuses
    to close while one exists, which is how :meth:`end` knows. Until ``end``, the
    pieces must not change (the ring does not reuse them). Make one only where
    :func:`can_lend`.

    A process forked while a loan is open inherits the mapping, whose pages not
    yet written would follow the segment once the loan ends: so before a fork
    every open loan's pages are made this process's own (:meth:`own`), and the
    child keeps the message's bytes. Loans are made and ended under a lock that
    a fork holds, so none is half made or missed then.
    """

    def __init__(self, fd: int, pieces: list[tuple[int, int]], nbytes: int):
        self.size = sum(n for _, n in pieces)
        self.nbytes = nbytes
        self._owned = False  # the message's pages are this process's own
        with _loans_lock:
            self._map: mmap.mmap | None = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE)
            self.address = at = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            try:
                for offset, n in pieces:
                    _mapped(_libc[0](at, n, _PROT_RW, _MAP_PRIVATE | _MAP_FIXED, fd, offset),
                            "mapping a message")
                    at += n
            except BaseException:
                self._map.close()
                raise
            _open_loans.add(self)

    def view(self) -> memoryview:
        """The message's bytes: every view of them keeps the loan's pages mapped."""
        return memoryview(self._map)[:self.nbytes]

    def end(self) -> bool:
        """Give the pieces back: unmap them, or, when a view of them is still alive
        (the reader kept an argument), make the message's pages the reader's own
        first (:meth:`own`), so the views keep their bytes at the same address
        whatever the segment holds next; the mapping goes with the last view.
        Whether a view was alive. Threads writing to a view meanwhile lose
        nothing: each page is copied by the kernel at once. On OSError (no
        memory) the pieces are still the loan's, and ``end`` may be called again."""
        with _loans_lock:
            if self._map is None:
                return False
            try:
                self._map.close()
                kept = False
            except BufferError:  # "exported pointers exist": a view is alive
                self.own()
                kept = True  # the views hold the mapping
            self._map = None
            _open_loans.discard(self)
            return kept

    def own(self) -> None:
        """Make the message's pages this process's own, once: the kernel copies
        those not yet written, at the same address (the rest of the last chunk is
        left: no view reaches it). Once private they stay so, through forks too.
        OSError (no memory) if it cannot."""
        if self._owned:
            return
        length = min(self.size, -(-self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        if length and _libc[1](self.address, length, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"copying a kept message: {os.strerror(err)}")
        self._owned = True


_open_loans: weakref.WeakSet[Loan] = weakref.WeakSet()
_loans_lock = threading.Lock()  # held to make or end a loan, and through a fork


def _before_fork() -> None:
    """The child must not inherit pages that follow the segment."""
    _loans_lock.acquire()
    for loan in list(_open_loans):
        try:
            loan.own()
        except OSError as e:
            log.warning("fork during a lent message: %s; the child may see later messages' bytes", e)


def _after_fork_in_child() -> None:
    global _loans_lock
    _loans_lock = threading.Lock()  # the parent's other threads do not exist here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=lambda: _loans_lock.release(),
                        after_in_child=_after_fork_in_child)


def check_free_space(size: int) -> None:
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise ShmSpaceError(
            f"{SHM_DIR} has {free / 2**20:.1f} MiB free but a ring needs {size / 2**20:.1f} MiB; "
            "free space there, enlarge it (docker: shm_size), or lower ZBUS_RING")


# --- fence -------------------------------------------------------------------------
# The ring's protocol needs a full barrier (store->load order included) between
# plain loads and stores of shared memory. Python has none, so zbus maps the two
# instructions of one: ``mfence; ret`` on x86-64, ``dmb ish; ret`` on AArch64, and
# calls them through ctypes. A lock acquire/release pair is not enough on ARM
# (acquire- and release-ordered atomics do not order an earlier store before a
# later load), and is only used where no code is known or executable pages are
# refused (then a warning says so).
_FENCE_CODE = {
    "x86_64": bytes.fromhex("0faef0c3"),  # mfence; ret
    "amd64": bytes.fromhex("0faef0c3"),
    "aarch64": bytes.fromhex("bf3b03d5c0035fd6"),  # dmb ish; ret
    "arm64": bytes.fromhex("bf3b03d5c0035fd6"),
}


def _machine_fence() -> Callable[[], None] | None:
    code = _FENCE_CODE.get(platform.machine().lower())
    if code is None:
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError):
        return None
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    if code == _FENCE_CODE["aarch64"]:
        # An ARM core may fetch stale instructions from a page just written as data
        # (the zeros the kernel synced when it mapped it: SIGILL) until the
        # instruction cache is synced, as libffi does for its own trampolines.
        try:
            ctypes.CDLL("libgcc_s.so.1").__clear_cache(ctypes.c_void_p(address),
                                                       ctypes.c_void_p(address + len(code)))
        except (OSError, AttributeError):
            return None
    func = ctypes.CFUNCTYPE(None)(address)
    func._zbus_page = page  # keep the page mapped as long as the function lives
    return func


_fence_lock = threading.Lock()


def _lock_fence() -> None:
    _fence_lock.acquire()
    _fence_lock.release()


fence: Callable[[], None] = _machine_fence() or _lock_fence
if fence is _lock_fence:
    log.warning("no machine fence on %s: using a lock as fence (full barrier on x86-64 only)",
                platform.machine())


# --- doorbell ----------------------------------------------------------------------


class Doorbell:
    """A wake-up primitive that one process waits on and any process of the machine
    rings: an abstract Unix datagram socket (no file, gone with its process).

    A ring is a queued datagram, so a ring that comes between the waiter's last
    check and its sleep is not lost: the sleep returns at once. Unix sockets wake
    the receiver as a *synchronous* wake-up, which lets the scheduler run it on
    the ringer's CPU instead of interrupting an idle one: on virtual machines
    that is several times faster than a futex wake (see docs/benchmarks.md).
    """

    def __init__(self, name: str, role: str = "this end"):
        self.address = bell_address(name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(self.address)
        except OSError as e:
            self.sock.close()
            raise OSError(e.errno, f"doorbell {name} is taken: is {role} of this ring "
                                   "attached twice?") from e
        # Blocking whatever socket.setdefaulttimeout() says (with a default, Python
        # polls for that long instead and ignores SO_RCVTIMEO; with 0, never sleeps).
        self.sock.settimeout(None)
        self._timeout_us = 0
        self._timeout_s: float | None = None

    def wait(self, timeout: float) -> None:
        """Sleep until rung or ``timeout`` s; consumes one ring. A signal does not
        lengthen the sleep: its handlers run, and the sleep goes on for what is left.
        Compiled core: one recv with SO_RCVTIMEO, no poll; else Python's socket
        timeout (a poll, then the recv)."""
        if core is None:
            if timeout != self._timeout_s:
                self.sock.settimeout(max(1e-6, timeout))
                self._timeout_s = timeout
            try:
                self.sock.recv(16)
            except (BlockingIOError, TimeoutError):
                pass
            return
        end = time.monotonic() + timeout
        while True:
            usec = max(1, int(timeout * 1e6))
            if usec != self._timeout_us:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                     struct.pack("ll", usec // 1_000_000, usec % 1_000_000))
                self._timeout_us = usec
            if core.bell_recv(self.sock.fileno()) is not None:
                return
            timeout = end - time.monotonic()  # a signal came
            if timeout <= 0:
                return

    def close(self) -> None:
        self.sock.close()


def bell_address(name: str) -> bytes:
    return b"\0" + name.encode()


class Ringer:
    """Rings one doorbell, through a socket of its own. Each queued ring is charged
    to its sender until read, so a socket shared by every doorbell fills with
    rings left at other doorbells and then fails (EAGAIN) to ring an idle one,
    whose waiter sleeps a full slice. Here EAGAIN means this doorbell's queue
    still holds our rings: it is rung, and ignoring the error is right."""

    def __init__(self, address: bytes):
        self.address = address
        self._sock: socket.socket | None = None
        self._closed = False

    def connect(self) -> None:
        """Make the socket now: an end makes those it rings at attach, so that no ring
        fails later for want of a file descriptor (a reader rings after giving
        chunks back: it could not raise then without losing the message)."""
        if self._sock is None and not self._closed:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            self._sock = sock

    def ring(self) -> None:
        """Ring; a full queue (already rung), a missing waiter or a closed end is fine,
        and so is a socket that cannot be made (the waiter wakes at its slice's end)."""
        try:
            self.connect()
            if self._sock is not None:
                self._sock.sendto(b"!", self.address)
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
