"""zbus: the control plane of a multi-node GPU program.

One driver calls a method on every worker process of a cluster and gets the
answers back: over a shared-memory ring on each node, and one ZeroMQ copy per
follower node across the network. ``import zbus`` does not import torch.
"""

from .errors import (
    Cancelled,
    CodecError,
    ExecutorFailedError,
    NodeLostError,
    RemoteError,
    RingClosed,
    ShmSpaceError,
    WorkerDiedError,
    ZbusError,
)
from .executor import Executor, RpcFuture, StartupError
from .worker import Worker

__version__ = "0.1.0"
PROTOCOL_VERSION = 2

__all__ = [
    "Cancelled", "CodecError", "Executor", "ExecutorFailedError", "NodeLostError", "RemoteError",
    "RingClosed", "RpcFuture", "ShmSpaceError", "StartupError", "Worker", "WorkerDiedError",
    "ZbusError", "__version__",
]
