"""zbus: the control plane of a multi-node GPU program.

One driver calls a method on every worker process of a cluster and gets the
answers back: over a shared-memory ring on each node, and one ZeroMQ copy per
follower node across the network. ``import zbus`` does not import torch.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    Cancelled,
    CodecError,
    ExecutorFailedError,
    NodeLostError,
    RemoteError,
    RingClosed,
    SettingError,
    ShmSpaceError,
    WorkerDiedError,
    ZbusError,
)
from .protocol import PROTOCOL_VERSION
from .worker import Worker

if TYPE_CHECKING:
    from .executor import Executor, RpcFuture, StartupError

# The driver's names load on first use: a follower's agent (zbus.agent) imports
# this package but never the driver.
_DRIVER_NAMES = ("Executor", "RpcFuture", "StartupError")


def __getattr__(name: str) -> Any:
    if name in _DRIVER_NAMES:
        from . import executor

        return getattr(executor, name)
    raise AttributeError(f"module 'zbus' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_DRIVER_NAMES])


__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION", "Cancelled", "CodecError", "Executor", "ExecutorFailedError", "NodeLostError",
    "RemoteError",
    "RingClosed", "RpcFuture", "SettingError", "ShmSpaceError", "StartupError", "Worker", "WorkerDiedError",
    "ZbusError", "__version__",
]
