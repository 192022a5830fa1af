"""The ``zbus`` command line."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.insecure:  # read by the Executor the demo leads
        os.environ["ZBUS_INSECURE"] = "1"
    if args.secret_file:
        os.environ["ZBUS_SECRET_FILE"] = args.secret_file

    return run_demo(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                    master_addr=args.master_addr, master_port=args.master_port, steps=args.steps,
                    metrics_port=args.metrics_port)


def _follower(args: argparse.Namespace) -> int:
    from .agent import NodeAgent
    from .config import _number, flag

    join_timeout = args.join_timeout or _number("ZBUS_JOIN_TIMEOUT", 300.0, positive=True)
    return NodeAgent(master_addr=args.master_addr, master_port=args.master_port,
                     nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
                     advertise_addr=args.advertise_addr, join_timeout=join_timeout,
                     allow_import_calls=args.allow_import_calls or flag("ZBUS_ALLOW_IMPORT_CALLS"),
                     curve_dir=args.curve_dir,
                     allowed_workers=tuple(args.allow_worker), secret_file=args.secret_file).run()


def _status(args: argparse.Namespace) -> int:
    import json

    from .cluster import ClusterSettings, query_status
    from .curve import NodeCurve, curve_dir_from_env, secret_from_env
    from .errors import ZbusError

    s = ClusterSettings.resolve(master_addr=args.master_addr, master_port=args.master_port)
    # (a key or secret it cannot read is said by main, without the hint below)
    secret = None if args.curve_dir else secret_from_env(path=args.secret_file)
    curve_dir, curve = curve_dir_from_env(args.curve_dir), None
    if secret:  # any node's key may ask: rank 1's
        curve = NodeCurve.from_secret(secret, 1)
    elif curve_dir:
        curve = NodeCurve.from_dir(curve_dir)
    try:
        status = query_status(s.master_addr, s.master_port, args.timeout, curve)
    except (TimeoutError, ZbusError) as e:
        print(f"zbus status: {e}. Is the leader running, and are --master-addr/--master-port "
              "its address and first port?", file=sys.stderr)
        return 1
    try:
        text, failed = json.dumps(status, indent=1) if args.json else format_status(status), status["failed"]
    except (KeyError, TypeError, ValueError, IndexError) as e:  # another version's leader, or none
        print(f"zbus status: the answer at {s.master_addr}:{s.master_port} is no status this version "
              f"reads ({type(e).__name__}: {_shown(e)[:200]})", file=sys.stderr)
        return 1
    print(text)
    return 1 if failed else 0  # (a health check sees a failed executor)


def _seconds(text: str) -> float:
    """A flag's time in seconds: a finite number above 0 (``nan`` would never end)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of seconds")
    return value


def _whole(text: str, most: int, expected: str) -> int:
    """A flag's whole number from 1 to ``most``; else a usage error saying what is
    ``expected``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
    return value


def _count(text: str) -> int:
    return _whole(text, sys.maxsize, "a whole number of at least 1")


def _port(text: str) -> int:
    """A leader's first port (it binds the next one too)."""
    return _whole(text, 65534, "a port from 1 to 65534")


def _any_port(text: str) -> int:
    return _whole(text, 65535, "a port from 1 to 65535")


def format_status(st: dict) -> str:
    us = lambda v: "-" if v is None else f"{v * 1e6:.0f} us"  # noqa: E731
    lat = st["latency_s"]
    lines = [f"world size {st['world_size']}, output rank {st['output_rank']}, "
             f"up {st['uptime_s']:.0f} s" + (f", FAILED: {st['failed']}" if st["failed"] else ""),
             f"rpcs {st['rpcs']}  latency p50 {us(lat['p50'])}  p90 {us(lat['p90'])}  p99 {us(lat['p99'])}"
             f"  bytes sent {st['bytes_sent']}",
             f"errors {st['errors'] or 'none'}  dropped frames {st['dropped_frames']}", "nodes:"]
    for n in st["nodes"]:
        hb = f"  last heartbeat {n['last_heartbeat_s']:.1f} s ago" if "last_heartbeat_s" in n else ""
        core = f"  core {n['core']}" if "core" in n else ""
        ranks = f"ranks {n['ranks'][0]}..{n['ranks'][-1]}"
        lines.append(f"  node {n['node_rank']}  {n['host']!s:<16} {ranks}{core}{hb}")
    return "\n".join(map(_shown, lines))  # (every field: the answer is whoever's listens there)


def _shown(what: object) -> str:
    """``what`` as the terminal may print it: no escape or control character (a
    leader's answer names what peers said)."""
    from .errors import said

    text = str(what)
    return said(text, len(text))


def _keygen(args: argparse.Namespace) -> int:
    from .curve import keygen

    for folder in keygen(args.dir, args.nodes):
        print(folder)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import DEFAULT_SCENARIOS, run

    scenarios = args.scenarios or list(DEFAULT_SCENARIOS)
    if args.compare and "compare" not in scenarios:
        scenarios.append("compare")
    return run(scenarios, args.seconds, args.json, plot_path=args.plot,
               from_json=args.from_json, markdown=args.markdown)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zbus", description=(
        "zbus: collective RPC for multi-node GPU programs over shared memory and ZeroMQ."))
    parser.add_argument("--log-level", default=None, type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="DEBUG, INFO, WARNING, ERROR, CRITICAL (default: $ZBUS_LOG_LEVEL or WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run a tensor-parallel model on a cluster", description=(
        "With no --nnodes: start a whole cluster here (this process leads, two follower "
        "node agents join it over TCP on loopback), run a sharded transformer block step "
        "by step, check it against a single-process reference, and shut down. With "
        "--nnodes N: lead a cluster whose N-1 followers run 'zbus follower' elsewhere."))
    demo.add_argument("--nnodes", type=_count, default=None,
                      help="lead a cluster of N nodes whose followers run elsewhere")
    demo.add_argument("--nproc-per-node", type=_count, default=None,
                      help="workers per node (ZBUS_NPROC_PER_NODE, default 2)")
    demo.add_argument("--master-addr", default=None,
                      help="this leader's address, which followers dial (ZBUS_MASTER_ADDR); with no "
                      "--nnodes always 127.0.0.1")
    demo.add_argument("--master-port", type=_port, default=None,
                      help="first of the leader's two ports (ZBUS_MASTER_PORT, default 29650); with no "
                      "--nnodes this one, else a free pair")
    demo.add_argument("--steps", type=_count, default=200, help="decode-like steps (default 200)")
    demo.add_argument("--metrics-port", type=_any_port, default=None,
                      help="serve Prometheus metrics on this port (ZBUS_METRICS_PORT; needs "
                      "prometheus-client)")
    demo.add_argument("--secret-file", default=None, help="a file holding the cluster secret "
                      "(ZBUS_SECRET_FILE, or the secret itself in ZBUS_SECRET): keyed links")
    demo.add_argument("--insecure", action="store_true", help="lead nodes on a non-loopback address "
                      "without keys (ZBUS_INSECURE=1): anyone reaching the ports can join or forge")
    demo.set_defaults(func=_demo)

    fol = sub.add_parser("follower", help="run this host as a follower node of a cluster", description=(
        "Join the leader at --master-addr, start this node's workers, relay every RPC "
        "into this node's shared memory, and exit when the leader says bye (0) or is "
        "lost (1). Every flag also reads ZBUS_<FLAG> (e.g. ZBUS_MASTER_ADDR), and "
        "Kubernetes LeaderWorkerSet's LWS_LEADER_ADDRESS and LWS_WORKER_INDEX."))
    fol.add_argument("--master-addr", default=None, help="the leader's host name or address "
                     "(ZBUS_MASTER_ADDR, LWS_LEADER_ADDRESS)")
    fol.add_argument("--master-port", type=_port, default=None,
                     help="the leader's first port; it also uses the next one (ZBUS_MASTER_PORT, "
                     "default 29650)")
    fol.add_argument("--nproc-per-node", type=_count, default=None,
                     help="workers on this node (ZBUS_NPROC_PER_NODE, default 1)")
    fol.add_argument("--node-rank", type=int, default=None,
                     help="this node's rank, 1..nnodes-1 (ZBUS_NODE_RANK, LWS_WORKER_INDEX; "
                     "default: given in join order)")
    fol.add_argument("--advertise-addr", default=None,
                     help="the address to report (default: the one that routes to the leader)")
    fol.add_argument("--join-timeout", type=_seconds, default=None,
                     help="seconds to wait for the leader (ZBUS_JOIN_TIMEOUT, default 300)")
    fol.add_argument("--allow-import-calls", action="store_true",
                     help="let the leader call functions by import path 'pkg.mod:func' on this "
                     "node (ZBUS_ALLOW_IMPORT_CALLS=1); off by default")
    fol.add_argument("--allow-worker", action="append", default=[], metavar="MODULE[:CLASS]",
                     help="a worker class (or module) an unauthenticated leader may start here; "
                     "repeatable; also ZBUS_ALLOW_WORKERS=a,b (zbus.demo is always allowed, zbus.vllm never; "
                     "with keys the authenticated leader may start any)")
    fol.add_argument("--curve-dir", default=None,
                     help="this node's key folder from 'zbus keygen' (ZBUS_CURVE_DIR): "
                     "authenticated, encrypted links")
    fol.add_argument("--secret-file", default=None,
                     help="a file holding the cluster secret (ZBUS_SECRET_FILE, or the secret itself "
                     "in ZBUS_SECRET): this node's keys are derived from it for its --node-rank")
    fol.set_defaults(func=_follower)

    keys = sub.add_parser("keygen", help="make CurveZMQ keys for a leader and its nodes", description=(
        "Write DIR/leader (the leader's key pair and the public keys allowed to join) and "
        "DIR/node-<i> (a node's key pair and the leader's public key). Give each host its "
        "folder: the leader's Executor(curve_dir=...) or ZBUS_CURVE_DIR, each follower's "
        "--curve-dir."))
    keys.add_argument("dir", help="where to write the key folders")
    keys.add_argument("--nodes", type=_count, default=1, help="how many follower nodes (default 1)")
    keys.set_defaults(func=_keygen)

    status = sub.add_parser("status", help="ask a running leader for its nodes, ranks and RPC figures",
                            description="Print a running leader's world size, nodes and their ranks, "
                            "uptime, RPC count, latency percentiles, errors and dropped frames.")
    status.add_argument("--master-addr", default=None, help="the leader (ZBUS_MASTER_ADDR)")
    status.add_argument("--master-port", type=_port, default=None,
                        help="the leader's first port (ZBUS_MASTER_PORT, default 29650)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait (default 10)")
    status.add_argument("--curve-dir", default=None, help="a node key folder, when the leader uses keys")
    status.add_argument("--secret-file", default=None, help="the cluster secret's file (ZBUS_SECRET_FILE, "
                        "ZBUS_SECRET), when the leader uses one")
    status.set_defaults(func=_status)

    bench = sub.add_parser("bench", help="measure zbus beside baselines, in one run", description=(
        "Run the benchmark suite and print medians, p99 and the ratio to a baseline "
        "measured in the same run (alternating blocks). Scenarios: ring, rpc, payload, "
        "nodes, curve, idle, import (default: all of these), and compare (with --compare)."))
    bench.add_argument("scenarios", nargs="*", help="which scenarios (default: all)")
    bench.add_argument("--seconds", type=_seconds, default=2.0,
                       help="measuring time per pair of figures (default 2)")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write every row as JSON")
    bench.add_argument("--plot", default=None, metavar="SVG",
                       help="also draw latency against payload size (needs the payload scenario)")
    bench.add_argument("--from-json", default=None, metavar="PATH",
                       help="run nothing: print (and --plot) the rows of an earlier --json")
    bench.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    bench.add_argument("--compare", action="store_true", help=(
        "also run the same shapes through raw pyzmq (ipc, TCP), multiprocessing pipes and, "
        "when it imports, vLLM's MessageQueue"))
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .logs import setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level:  # also for the processes this one starts
        os.environ["ZBUS_LOG_LEVEL"] = args.log_level.upper()
    setup_logging(args.command or "cli", args.log_level)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _exit_on_sigterm()
    from .errors import ZbusError

    try:
        return args.func(args)
    except (ZbusError, OSError) as e:  # a setting, a key, a file or a port: said plainly
        logging.getLogger("zbus.cli").debug("%s failed", args.command, exc_info=True)
        print(f"zbus {args.command}: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        print(f"zbus {args.command}: needs torch, which zbus itself does not install "
              "(pip install 'zbus[torch]')", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: each command cleaned up as it ended; no traceback
        return 128 + signal.SIGINT


def _exit_on_sigterm() -> None:
    """SIGTERM (``docker stop``, a pod's deletion, ``timeout``) raises SystemExit, so
    that each command cleans up as it does on Ctrl-C: a follower ends its workers
    and tells its leader, the demo ends its followers and removes its keys. As PID
    1 of a container a process without a handler would not see SIGTERM at all."""
    def exit_143(signum: int, frame: object) -> None:
        raise SystemExit(128 + signal.SIGTERM)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, exit_143)


if __name__ == "__main__":
    sys.exit(main())
