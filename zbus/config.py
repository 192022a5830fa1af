"""Settings read from the environment, in one place.

``ZBUS_RING``  ring geometry of every shared-memory queue, ``"<chunk>x<count>"``
               with an optional K/M suffix on the chunk size; default ``1Mx32``
               for the rings that carry calls to workers (32 MiB of /dev/shm
               each: a call of up to 32 MiB is decoded where it lies, without
               a copy) and ``1Mx8`` for each worker's reply queue.
``ZBUS_SPIN_US``  how long a waiter spins before it yields; default: 50 us with
               more than 2 usable cores and a core for each waiting process of
               the node, else 0 (spinning steals the core the other side needs).
``ZBUS_YIELD_US`` how long a waiter then calls sched_yield, which runs whatever
               else is ready on its core, before it sleeps on its doorbell;
               default 200 us where each process of the node that waits on
               zbus's rings (its workers, and the driver or node agent) has a
               usable core, else 0. A reply that lands in that window needs no
               wake-up at all; with more waiters than cores, a yielding process
               takes the CPU that the one it waits for needs (measured:
               docs/benchmarks.md).
``ZBUS_WAIT_SLICE`` longest single doorbell sleep in seconds (default 0.5). Wake-ups
               do not depend on it; it bounds how late a cancel event or a third
               party's abort is seen. From 0.001 to 3600; the others from 0 to
               1e6 (else ValueError).
``ZBUS_MAX_MESSAGE``, ``ZBUS_MAX_REPLY``  message size limits (``size_setting``):
               bytes with an optional K/M/G suffix, at least 64K (else ValueError).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import SettingError

_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def usable_cores() -> int:
    """The cores this process may use: its affinity, capped by its cgroup's CPU quota
    (``cpu.max``: a pod's CPU limit on a larger host)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return max(1, count)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1] if text and text[-1] in "KMG" else ""
    return int(text[: len(text) - len(unit)]) * _SUFFIX[unit]


DEFAULT_MAX_MESSAGE = 4 * 2**30  # ZBUS_MAX_MESSAGE unset
MIN_SIZE_LIMIT = 64 * 2**10  # the smallest message limit: joins and welcomes fit well within


def size_setting(name: str, default: int) -> int:
    """The message size limit ``name``, in bytes with an optional K/M/G suffix, at
    least ``MIN_SIZE_LIMIT``; an empty variable counts as unset."""
    text = os.environ.get(name) or None
    try:
        value = default if text is None else parse_size(text)
    except (ValueError, KeyError):
        value = -1
    if value < MIN_SIZE_LIMIT:
        raise SettingError(f"{name}={text!r}: expected a size of at least 64K, e.g. '256M' or '4G'")
    return value


@dataclass(frozen=True)
class RingGeometry:
    chunk_bytes: int
    n_chunks: int

    def __post_init__(self) -> None:
        # (both cores' chunk offsets stay 64-byte aligned; one chunk could hold no message
        # while another is read)
        if self.chunk_bytes < 256 or self.chunk_bytes % 64 or self.n_chunks < 2:
            raise SettingError(f"a ring of {self.n_chunks} chunks of {self.chunk_bytes} bytes: a chunk "
                               "must be a multiple of 64 bytes >= 256 and count >= 2")

    @classmethod
    def from_env(cls, calls: bool = False) -> RingGeometry:
        """``ZBUS_RING``, else the default of a ring of calls (``calls``) or of replies."""
        text = os.environ.get("ZBUS_RING") or ("1Mx32" if calls else "1Mx8")  # (empty: unset)
        try:
            chunk, count = text.lower().split("x")
            chunk_bytes, n_chunks = parse_size(chunk), int(count)
        except (ValueError, KeyError):
            raise SettingError(f"ZBUS_RING={text!r}: expected '<chunk>x<count>', e.g. '1Mx8'") from None
        try:
            return cls(chunk_bytes, n_chunks)
        except SettingError:
            raise SettingError(f"ZBUS_RING={text!r}: chunk must be a multiple of 64 bytes >= 256 "
                               "and count >= 2") from None


# The longest an executor may ask its workers and nodes to poll after each call
# (Executor(poll_after_call_s=)): polling is for calls in quick succession.
MAX_POLL_S = 1.0


@dataclass(frozen=True)
class WaitPolicy:
    spin_s: float
    yield_s: float
    slice_s: float

    @classmethod
    def from_env(cls, waiters: int = 1) -> WaitPolicy:
        """The settings, with defaults for a node where ``waiters`` processes wait on
        zbus's rings: they poll before sleeping only if each has a core of its own."""
        cores = usable_cores()
        polls = waiters <= cores
        spin = _number("ZBUS_SPIN_US", 50 if polls and cores > 2 else 0, within=(0, 1e6)) / 1e6
        yld = _number("ZBUS_YIELD_US", 200 if polls else 0, within=(0, 1e6)) / 1e6
        # (a slice under a millisecond makes each sleep a busy loop; one over an hour,
        # a cancel or abort seen that late: tests set 600 s to prove no wake-up is lost)
        return cls(spin, yld, _number("ZBUS_WAIT_SLICE", 0.5, within=(0.001, 3600.0)))


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """The on/off setting ``name``: 1, true, yes or on; 0, false, no, off, empty or
    unset (any case). Anything else is refused: ``ZBUS_PURE_PYTHON=false`` must not
    turn it on, nor ``ZBUS_ALLOW_IMPORT_CALLS=true`` leave it off unsaid."""
    text = os.environ.get(name, "")
    value = text.strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise SettingError(f"{name}={text!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def _number(name: str, default: float, positive: bool = False,
            within: tuple[float, float] | None = None) -> float:
    """The number setting ``name``: finite, at least 0 (``positive``: above 0), and
    ``within`` its bounds when given; an empty variable counts as unset."""
    text = os.environ.get(name) or None
    try:
        value = default if text is None else float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise SettingError(f"{name}={text!r}: expected a {'positive' if positive else 'non-negative'} number")
    if within is not None and not within[0] <= value <= within[1]:
        raise SettingError(f"{name}={text!r}: expected a number from {within[0]:g} to {within[1]:g}")
    return value
