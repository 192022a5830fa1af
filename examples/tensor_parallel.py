"""A tensor-parallel MLP driven step by step by a zbus executor.

Each worker holds one shard of a two-layer MLP: the first layer split by columns,
the second by rows (Megatron style), so each rank computes a partial output and
one torch.distributed all-reduce (gloo on CPU) sums them. The driver only sends
the input and gets the result back from one rank.

    python examples/tensor_parallel.py [--nproc 2] [--steps 10]

The worker class is named by import path ("tensor_parallel:MLPShard"): worker
processes import this file as a module, so the code under ``__main__`` runs only
in the driver.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import zbus

DIM, HIDDEN = 32, 128


def full_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(DIM, HIDDEN, generator=g) / DIM**0.5
    return w1, torch.randn(HIDDEN, DIM, generator=g) / HIDDEN**0.5


class MLPShard(zbus.Worker):
    def __init__(self) -> None:
        dist.init_process_group("gloo", init_method="env://")  # RANK, WORLD_SIZE, MASTER_* from zbus
        w1, w2 = full_weights()
        self.w1 = w1.chunk(self.world_size, dim=1)[self.rank].contiguous()
        self.w2 = w2.chunk(self.world_size, dim=0)[self.rank].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.relu(x @ self.w1) @ self.w2
        dist.all_reduce(partial)
        return partial

    def close(self) -> None:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    w1, w2 = full_weights()
    with zbus.Executor("tensor_parallel:MLPShard", nproc_per_node=args.nproc) as ex:
        x = torch.randn(4, DIM)
        for step in range(args.steps):
            y = ex.collective_rpc("forward", args=(x,), unique_reply_rank=ex.output_rank, timeout=30)
            expected = torch.relu(x @ w1) @ w2
            assert torch.allclose(y, expected, atol=1e-5), "sharded result differs from the reference"
            x = torch.tanh(y)
            print(f"step {step}: |y| = {y.norm():.4f} (matches the single-process reference)")
        ex.collective_rpc("close", timeout=30)


if __name__ == "__main__":
    main()
