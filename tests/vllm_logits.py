"""A logits processor that changes nothing, for the vLLM tests: one the engine is
given as a class (vLLM's own executor pickles it; zbus sends its name)."""

from __future__ import annotations

from vllm.v1.sample.logits_processor import LogitsProcessor


class KeepLogits(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        return logits
