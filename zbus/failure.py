"""The one failure state of an executor and its leader.

Every error path (a worker's death, a node lost or refused, the leader's I/O
failing, a protocol error, the completer failing) goes through :meth:`Failure.fail`,
so that the first error is the one every caller, future, callback and node sees.
The executor makes it and hands it to its :class:`zbus.leader.Leader`: there is
nothing to propagate between them.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

Callback = Callable[[Exception], None]


class Failure:
    """The first error, an event for blocked waits, and what to run once failed.

    ``cancel`` is set by the failure, or by a shutdown that must wake its blocked
    callers (:meth:`cancel_waits`): it is what every blocked wait watches, so it
    alone does not mean failed; ``error`` does. Once :meth:`close` is called
    (shutting down: workers exiting is expected) nothing fails any more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callback] = []
        self._closed = False
        self.error: Exception | None = None
        self.cancel = threading.Event()

    def fail(self, error: Exception) -> bool:
        """Fail with ``error`` unless failed or closed already (the first error wins);
        whether this call did. Sets ``cancel``, then runs each callback once, in
        the order they came, outside the lock (a callback may call back in)."""
        mine, callbacks = False, []
        try:
            with self._lock:
                if self.error is not None or self._closed:
                    return False
                self.error, mine = error, True  # (no step between them where a handler runs)
                callbacks, self._callbacks = self._callbacks, []
            log.error("executor failed: %s", error)
        finally:  # (a Ctrl-C as it logs, say: the failure still takes its whole path)
            if mine:
                try:
                    self.cancel.set()
                finally:
                    _run(callbacks, error)
        return True

    def on_failure(self, callback: Callback) -> None:
        """Run ``callback(error)`` once on failure: at once (in this thread) if failed."""
        with self._lock:
            if self.error is None:
                self._callbacks.append(callback)
                return
        _run([callback], self.error)

    def close(self) -> None:
        """Shutting down: no error fails from now on (the callbacks never run)."""
        with self._lock:
            self._closed = True
            self._callbacks = []

    def cancel_waits(self) -> None:
        """Wake every blocked wait (they raise), failed or not: a shutdown's last word."""
        self.cancel.set()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise again(self.error)


def again(error: BaseException) -> BaseException:
    """``error`` without its traceback, to raise once more: the one failure is
    raised by every later call, and each raise would add its frames (and so their
    locals, a caller's tensors say) to what the error keeps for good."""
    return error.with_traceback(None)


def _run(callbacks: list[Callback], error: Exception) -> None:
    escaped: BaseException | None = None
    for callback in callbacks:
        try:
            callback(error)
        except Exception:  # noqa: BLE001 - one callback's bug must not stop the others
            log.exception("failure callback raised")
        except BaseException as e:  # noqa: BLE001 - SystemExit, Ctrl-C: the rest run first
            escaped = escaped or e
    raise_if_callers(escaped, "a failure callback")


def raise_if_callers(escaped: BaseException | None, what: str) -> None:
    """Raise what a callback let out (``SystemExit``, Ctrl-C) once the others ran,
    on a caller's thread; on one of zbus's own, whose work must go on, log it."""
    if escaped is None:
        return
    if not threading.current_thread().name.startswith("zbus-"):
        raise escaped
    log.error("%s raised %r in %s: ignored", what, escaped, threading.current_thread().name)


def run_every(*steps: Callable[[], object]) -> None:
    """Run every step of a teardown, whatever cuts one short (a second Ctrl-C in
    one's wait, an error), then raise the first exception one raised: the steps
    after a wait free what nothing else would."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - the other steps still run
            first = first or e
    if first is not None:
        raise first
