"""vLLM on zbus: ``LLM(..., distributed_executor_backend="zbus.vllm.ZbusExecutor")``.

The engine's process is the zbus leader; each step's scheduler output goes to the
workers once per node, and the output rank's result comes back, as typed msgpack
(:mod:`zbus.vllm.wire`). Across nodes the layout comes from zbus's settings
(``ZBUS_NNODES``, ``ZBUS_MASTER_ADDR``, ``ZBUS_MASTER_PORT``); every other host runs
``zbus follower`` with the leader's keys (one ``ZBUS_SECRET``): a follower starts
vLLM's workers only for a leader with keys.
``import zbus`` does not import this module, nor vLLM.
"""

from .executor import ZbusExecutor

__all__ = ["ZbusExecutor"]
