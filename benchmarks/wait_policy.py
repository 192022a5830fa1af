"""Benchmark: the wait policy (``ZBUS_YIELD_US``) on back-to-back no-op calls, beside
vLLM's MessageQueue, each in a process of its own, with no other traffic between.

    python benchmarks/wait_policy.py [--seconds S] [--rounds N] [--yield-us 200,0]

Each round runs, one after the other, zbus with each ``ZBUS_YIELD_US`` given and
vLLM's MessageQueue (when it imports): no-op `collective_rpc` to 2 local workers,
reply from rank 0, for S seconds after 500 untimed calls. Prints the median round
trip and the CPU per call of the driver and of each worker. `zbus bench compare`
times the same shapes in alternating blocks instead, with vLLM's 1 s of spinning
let out between them. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def timed(call, procs: list, seconds: float) -> dict:
    for _ in range(500):
        call()
    before = [sum(p.cpu_times()[:2]) for p in procs]
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    cpu = [(sum(p.cpu_times()[:2]) - b) / len(times) * 1e6 for p, b in zip(procs, before)]
    return {"median_us": statistics.median(times) * 1e6, "cpu_us": cpu, "calls": len(times)}


def child(setting: str, seconds: float) -> dict:
    import psutil

    me = psutil.Process()
    if setting == "vllm":
        from zbus.baselines import VllmBaseline

        base = VllmBaseline(2)
        try:
            return timed(lambda: base.call(b"noop"), [me, *(psutil.Process(p.pid) for p in base.procs)],
                         seconds)
        finally:
            base.close()
    from zbus.bench import BenchWorker
    from zbus.executor import Executor

    with Executor(BenchWorker, nproc_per_node=2) as ex:
        procs = [me, *(psutil.Process(p.pid) for p in ex._workers.procs)]
        return timed(lambda: ex.collective_rpc("noop", unique_reply_rank=0), procs, seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--yield-us", default="200,0", help="ZBUS_YIELD_US values, comma-separated")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seconds)))
        return
    from zbus.baselines import vllm_available

    settings = args.yield_us.split(",")
    why = vllm_available()  # (why it does not import; empty: it does)
    settings += [] if why else ["vllm"]
    for r in range(args.rounds):
        for setting in settings:
            env = dict(os.environ) if setting == "vllm" else dict(os.environ, ZBUS_YIELD_US=setting)
            argv = [sys.executable, __file__, "--child", setting, "--seconds", str(args.seconds)]
            out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.seconds + 120)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if not lines:
                print(f"round {r + 1} {setting}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            res = json.loads(lines[-1])
            name = "vLLM MessageQueue" if setting == "vllm" else f"zbus ZBUS_YIELD_US={setting}"
            cpu = " + ".join(f"{c:.0f}" for c in res["cpu_us"])
            print(f"round {r + 1}  {name:<24} median {res['median_us']:6.1f} us  "
                  f"CPU/call {sum(res['cpu_us']):6.1f} us ({cpu})  {res['calls']} calls")


if __name__ == "__main__":
    main()
