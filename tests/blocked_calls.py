"""Callers blocked in an executor's API while another thread shuts it down."""

from __future__ import annotations

import sys
import threading

from conftest import wait_until

import zbus
from zbus import ring


def errors_of_callers_blocked_at_shutdown(ex: zbus.Executor) -> dict[str, BaseException | None]:
    """Block three callers (one waiting for a reply of a worker that sleeps deaf
    to SIGTERM, so nothing but the executor can wake the callers; one
    sending into a full ring, one waiting behind it), shut ``ex`` down from this
    thread, and return what each caller raised."""
    errors: dict[str, BaseException | None] = {}

    def call(name: str, *args, **kwargs) -> threading.Thread:
        def run():
            try:
                ex.collective_rpc(*args, timeout=120, **kwargs)
                errors[name] = None
            except BaseException as e:  # noqa: BLE001 - the test checks the type
                errors[name] = e
        t = threading.Thread(target=run, name=name)
        t.start()
        return t

    threads = [call("receiving", "stubborn_sleep", args=(60,))]
    wait_until(lambda: len(ex._pending) == 1, 30, "the sleep sent")
    big = bytes(3 * ex._bcast.ring.chunk_bytes * ex._bcast.ring.n_chunks)
    threads.append(call("sending", "echo", args=(big,)))
    wait_until(lambda: ex._bcast.ring._i[ring._I_WWAIT] == 1, 30, "the sender blocked on the full ring")
    threads.append(call("queued", "noop"))
    wait_until(lambda: waits_for_the_send_lock(threads[-1]), 30, "the third caller waited to send")
    ex.shutdown()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), f"caller {t.name} still blocked after shutdown"
    return errors


def waits_for_the_send_lock(t: threading.Thread, where: str = "collective_rpc") -> bool:
    """Whether ``t`` is in the function ``where``, waiting for the executor's send lock."""
    frame = sys._current_frames().get(t.ident)
    return (frame is not None and frame.f_code.co_name == "acquire" and frame.f_back is not None
            and frame.f_back.f_code.co_name == where)
