"""``zbus demo``: a tensor-parallel transformer block driven step by step.

Each worker holds a shard of a small transformer block (attention heads and the
MLP's hidden units split across ranks, Megatron style); partial outputs are summed
with a torch.distributed all-reduce (gloo on CPU, NCCL on GPUs). The driver sends
each step's activations with ``collective_rpc`` and checks the result against the
same block computed whole in one process.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from .worker import Worker

DIM, HEADS, HIDDEN, SEQ = 64, 8, 256, 16


def _full_weights(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g) / shape[0] ** 0.5  # noqa: E731
    return {"wq": w(DIM, DIM), "wk": w(DIM, DIM), "wv": w(DIM, DIM), "wo": w(DIM, DIM),
            "w1": w(DIM, HIDDEN), "w2": w(HIDDEN, DIM)}


def block(x: Any, p: dict[str, Any], heads: int, reduce: Any = lambda t: t) -> Any:
    """One pre-norm transformer block on (the shard ``p`` of) the weights; ``reduce``
    sums the partial outputs across shards."""
    import torch

    h = torch.nn.functional.layer_norm(x, (DIM,))
    q, k, v = (h @ p[n] for n in ("wq", "wk", "wv"))
    split = lambda t: t.view(SEQ, heads, DIM // HEADS).transpose(0, 1)  # noqa: E731
    att = torch.softmax(split(q) @ split(k).transpose(1, 2) / (DIM // HEADS) ** 0.5, -1) @ split(v)
    x = x + reduce(att.transpose(0, 1).reshape(SEQ, -1) @ p["wo"])
    h = torch.nn.functional.layer_norm(x, (DIM,))
    return x + reduce(torch.relu(h @ p["w1"]) @ p["w2"])


class TransformerShardWorker(Worker):
    """Holds rank's shard of the block; ``step`` runs it with an all-reduce."""

    def __init__(self, seed: int = 0):
        import torch
        import torch.distributed as dist

        if HEADS % self.world_size or HIDDEN % self.world_size:
            raise ValueError(f"world size {self.world_size} must divide {HEADS} heads and {HIDDEN}")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method="env://")
        full, r, n = _full_weights(seed), self.rank, self.world_size
        cols = lambda t: t.chunk(n, dim=1)[r].contiguous()  # noqa: E731
        rows = lambda t: t.chunk(n, dim=0)[r].contiguous()  # noqa: E731
        self.p = {"wq": cols(full["wq"]), "wk": cols(full["wk"]), "wv": cols(full["wv"]),
                  "wo": rows(full["wo"]), "w1": cols(full["w1"]), "w2": rows(full["w2"])}
        self.heads = HEADS // n

    def step(self, x: Any) -> Any:
        import torch.distributed as dist

        def all_reduce(t: Any) -> Any:
            dist.all_reduce(t)
            return t

        return block(x, self.p, self.heads, all_reduce)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_demo(nproc_per_node: int = 2, steps: int = 200, out: Any = sys.stdout) -> int:
    import torch

    from .executor import Executor

    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    say(f"zbus demo: {nproc_per_node} workers, transformer block dim {DIM}, {HEADS} heads")
    t0 = time.perf_counter()
    with Executor(TransformerShardWorker, nproc_per_node=nproc_per_node) as ex:
        say(f"cluster ready in {time.perf_counter() - t0:.2f} s")
        full = _full_weights(0)
        x = torch.randn(SEQ, DIM, generator=torch.Generator().manual_seed(1))
        ref = x.clone()
        lat, moved = [], 0
        start = time.perf_counter()
        for i in range(steps):
            t = time.perf_counter()
            x = ex.collective_rpc("step", args=(x,), unique_reply_rank=ex.output_rank, timeout=30)
            lat.append(time.perf_counter() - t)
            moved += 2 * x.numel() * x.element_size()
            ref = block(ref, full, HEADS)
            if (i + 1) % max(1, steps // 10) == 0:
                say(f"  step {i + 1}/{steps}")
        wall = time.perf_counter() - start
        ex.collective_rpc("close", timeout=30)
    err = (x - ref).abs().max().item()
    lat.sort()
    say(f"steps/s           {steps / wall:10.1f}")
    say(f"step median       {statistics.median(lat) * 1e6:10.0f} us")
    say(f"step p99          {lat[int(0.99 * (len(lat) - 1))] * 1e6:10.0f} us")
    say(f"bytes moved       {moved:10d}")
    ok = err < 1e-3
    say(f"matches reference {'yes' if ok else 'NO'} (max abs error {err:.2e})")
    return 0 if ok else 1
