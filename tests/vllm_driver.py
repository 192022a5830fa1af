"""A vLLM engine on a tiny model made here (seeded random weights, no download),
for the vLLM tests. Prints one JSON line per event.

    python vllm_driver.py BACKEND --model DIR --tp N [--pp N] [--tokens N] [--prompts N] [--hold] [--hybrid]
                                   [--logits-processor MODULE:CLASS] [--seed N]

``--hold`` keeps generating until the engine fails (a test kills a worker) and
reports the error and when it came.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [9, 10, 11, 12, 13, 14], [700, 3]]


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--hybrid", action="store_true", help="a hybrid model (attention and linear attention)")
    ap.add_argument("--logits-processor", help="module:Class, given to the engine as the class")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", required=True, help="an empty folder: the tiny model is made in it")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from zbus.vllm.bench import TINY_HYBRID, TINY_LLAMA, tiny_model

    backend = a.backend
    if "." in backend:  # a class: vLLM asks a class, not its name, whether it supports PP
        module, _, name = backend.rpartition(".")
        backend = getattr(__import__(module, fromlist=[name]), name)
    model = tiny_model(a.model, TINY_HYBRID if a.hybrid else TINY_LLAMA)
    extra = {}
    if a.logits_processor:
        module, _, name = a.logits_processor.partition(":")
        extra["logits_processors"] = [getattr(__import__(module), name)]
    started = time.monotonic()
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, seed=a.seed, enforce_eager=True,
              tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp, max_model_len=256,
              distributed_executor_backend=backend, **extra)
    say(event="ready", start_s=round(time.monotonic() - started, 2),
        block_size=llm.llm_engine.vllm_config.cache_config.block_size)
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:a.prompts]]
    try:
        while True:
            t0 = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            say(event="tokens", tokens=[list(o.outputs[0].token_ids) for o in outs],
                gen_s=round(time.monotonic() - t0, 3))
            if not a.hold:
                break
    except Exception as e:  # noqa: BLE001 - the test reads it
        say(event="error", type=type(e).__name__, error=str(e)[:500], at=time.time())
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    say(event="done")


if __name__ == "__main__":
    main()
