"""``zbus demo``: a tensor-parallel transformer block on a real cluster, driven
step by step.

Each worker holds a shard of a small transformer block (attention heads and the
MLP's hidden units split across ranks, Megatron style); partial outputs are summed
with a torch.distributed all-reduce (gloo on CPU, NCCL on GPUs). The driver sends
each step's activations with ``collective_rpc`` and checks the result against the
same block computed whole in one process.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from .processes import end_followers
from .worker import Worker

DIM, HEADS, HIDDEN, SEQ = 96, 12, 384, 16  # 12 heads: shardable over 1, 2, 3, 4, 6 or 12 ranks


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

    def ping(self) -> None:
        return None

    def step(self, x: Any) -> Any:
        import torch.distributed as dist

        def all_reduce(t: Any) -> Any:
            dist.all_reduce(t)
            return t

        return block(x, self.p, self.heads, all_reduce)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class _Progress:
    """A one-line progress bar on a terminal; plain lines elsewhere."""

    def __init__(self, out: Any, label: str, total: int):
        self.out, self.label, self.total = out, label, total
        self.tty = getattr(out, "isatty", lambda: False)()
        self.last = -1

    def update(self, done: int, note: str = "") -> None:
        if self.tty:
            width = 30
            fill = int(width * done / max(1, self.total))
            print(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} {note}",
                  end="", file=self.out, flush=True)
            if done >= self.total:
                print(file=self.out)
        elif done * 10 // max(1, self.total) != self.last:
            self.last = done * 10 // max(1, self.total)
            print(f"{self.label}: {done}/{self.total} {note}", file=self.out, flush=True)


def _start_local_followers(followers: list[Any], nnodes: int, nproc: int, port: int,
                           keys: str | None) -> None:
    """Start ``zbus follower`` for node ranks 1..nnodes-1 into ``followers`` (each
    there as soon as it started: the caller ends them however this ends)."""
    import subprocess

    env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(port),
               ZBUS_NPROC_PER_NODE=str(nproc))
    env.pop("ZBUS_CURVE_DIR", None)
    key_args = lambda r: ["--curve-dir", os.path.join(keys, f"node-{r}")] if keys else []  # noqa: E731
    for r in range(1, nnodes):
        followers.append(subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--node-rank",
                                           str(r), *key_args(r)], env=env, stdin=subprocess.DEVNULL))


def run_demo(nnodes: int | None = None, nproc_per_node: int | None = None, master_addr: str | None = None,
             master_port: int | None = None, steps: int = 200, out: Any = sys.stdout,
             metrics_port: int | None = None) -> int:
    """Run the demo. With no ``nnodes``, a whole cluster on this machine: this
    process leads, and two ``zbus follower`` processes join it over TCP on
    loopback. With ``nnodes``, lead a cluster whose followers run elsewhere."""
    import torch

    from .cluster import free_port_pair, typed_setting
    from .errors import SettingError
    from .executor import Executor

    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    # (an explicit 0 is refused, not replaced)
    nproc_per_node = typed_setting(int, "--nproc-per-node", nproc_per_node, 2, "ZBUS_NPROC_PER_NODE")
    if steps < 1 or nproc_per_node < 1:
        raise SettingError(f"steps ({steps}) and nproc_per_node ({nproc_per_node}) must be at least 1")
    local = nnodes is None
    followers: list[Any] = []
    keys = curve_dir = None
    try:  # (Ctrl-C or SIGTERM anywhere: the followers end, the keys go)
        if local:  # a whole cluster here, its links keyed with fresh CurveZMQ keys
            import tempfile

            import zmq

            if master_addr not in (None, "127.0.0.1", "localhost"):
                raise SettingError(f"--master-addr {master_addr}: with no --nnodes the demo's whole cluster "
                                   "runs here on 127.0.0.1 (give --nnodes to lead followers elsewhere)")
            nnodes, master_addr = 3, "127.0.0.1"
            master_port = master_port or free_port_pair(master_addr)  # (the one asked for, if any)
            if zmq.has("curve"):
                from .curve import keygen

                keys = tempfile.mkdtemp(prefix="zbus-demo-keys-")
                keygen(keys, nnodes - 1)
                curve_dir = os.path.join(keys, "leader")
            _start_local_followers(followers, nnodes, nproc_per_node, master_port, keys)
        say(f"zbus demo: {nnodes} nodes x {nproc_per_node} workers, a transformer block "
            f"(dim {DIM}, {HEADS} heads) sharded over {nnodes * nproc_per_node} ranks")
        t0 = time.perf_counter()
        forming = _Progress(out, "nodes joined", nnodes)
        with Executor(TransformerShardWorker, on_join=lambda joined, total: forming.update(joined),
                      nnodes=nnodes, nproc_per_node=nproc_per_node,
                      master_addr=master_addr, master_port=master_port, metrics_port=metrics_port,
                      **({"curve_dir": curve_dir} if curve_dir else {})) as ex:
            say(f"cluster of {ex.world_size} ranks ready in {time.perf_counter() - t0:.2f} s"
                + (" (links keyed with fresh CurveZMQ keys)" if curve_dir else ""))
            ok = _drive(ex, steps, say, _Progress(out, "steps", steps), torch)
        for f in followers:
            f.wait(30)
        return 0 if ok else 1
    finally:  # the keys first: a second Ctrl-C may cut the wait for the followers short
        if keys:
            import shutil

            shutil.rmtree(keys, ignore_errors=True)
        end_followers(followers)


def _drive(ex: Any, steps: int, say: Any, progress: _Progress, torch: Any) -> bool:
    full = _full_weights(0)
    x = torch.randn(SEQ, DIM, generator=torch.Generator().manual_seed(1))
    ref = x.clone()
    lat, moved = [], 0
    start = time.perf_counter()
    for i in range(steps):
        t = time.perf_counter()
        x = ex.collective_rpc("step", args=(x,), unique_reply_rank=ex.output_rank, timeout=60)
        lat.append(time.perf_counter() - t)
        moved += 2 * x.numel() * x.element_size()
        ref = block(ref, full, HEADS)
        progress.update(i + 1)
    wall = time.perf_counter() - start
    noop = []
    for _ in range(200):
        t = time.perf_counter()
        ex.collective_rpc("ping", timeout=30)
        noop.append(time.perf_counter() - t)
    ex.collective_rpc("close", timeout=30)
    err = (x - ref).abs().max().item()
    lat.sort()
    noop.sort()
    ok = err < 1e-3
    say(f"{'steps/s':<28}{steps / wall:12.1f}")
    say(f"{'step median / p99':<28}{statistics.median(lat) * 1e6:9.0f} us / {_p99(lat) * 1e6:.0f} us")
    say(f"{'collective_rpc no-op median':<28}{statistics.median(noop) * 1e6:9.0f} us "
        f"(p99 {_p99(noop) * 1e6:.0f} us, all {ex.world_size} ranks reply)")
    say(f"{'activations moved':<28}{moved / 2**20:9.2f} MiB")
    say(f"{'matches the reference':<28}{'yes' if ok else 'NO':>12} (max abs error {err:.1e})")
    return ok


def _p99(sorted_values: list[float]) -> float:
    return sorted_values[int(0.99 * (len(sorted_values) - 1))]
