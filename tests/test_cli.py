"""The command line: every subcommand's help is complete and names its settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import end_process, next_line, wait_until

HELP = {
    None: ["demo", "follower", "keygen", "status", "bench", "--log-level"],
    "demo": ["--nnodes", "--nproc-per-node", "--master-addr", "--master-port", "--steps", "--metrics-port",
             "ZBUS_MASTER_ADDR", "--secret-file", "--insecure", "ZBUS_INSECURE"],
    "follower": ["--master-addr", "--master-port", "--nproc-per-node", "--node-rank", "--advertise-addr",
                 "--join-timeout", "--allow-import-calls", "--allow-worker", "--curve-dir",
                 "--secret-file", "ZBUS_SECRET", "LWS_LEADER_ADDRESS", "ZBUS_NODE_RANK", "ZBUS_JOIN_TIMEOUT"],
    "keygen": ["--nodes", "DIR/leader"],
    "status": ["--master-addr", "--master-port", "--json", "--timeout", "--curve-dir", "--secret-file"],
    "bench": ["--seconds", "--json", "--plot", "--from-json", "ring, rpc, payload"],
}


@pytest.mark.parametrize("command", list(HELP))
def test_help_is_complete(command):
    argv = [sys.executable, "-m", "zbus.cli", *([command] if command else []), "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    missing = [word for word in HELP[command] if word not in text]
    assert not missing, missing


def test_keygen_makes_the_folders(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zbus.cli", "keygen", str(tmp_path / "k"), "--nodes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == [str(tmp_path / "k" / n)
                                                         for n in ("leader", "node-1", "node-2")]


@pytest.mark.parametrize("argv, says", [
    (["demo", "--steps", "0"], "--steps: '0': expected a whole number of at least 1"),
    (["demo", "--nproc-per-node", "0"], "--nproc-per-node: '0': expected a whole"),
    (["keygen", "{tmp}/k", "--nodes", "-1"], "--nodes: '-1': expected a whole"),
    (["bench", "import", "bogus"], "unknown scenario 'bogus'"),
    (["follower", "--nproc-per-node", "0"], "--nproc-per-node: '0': expected a whole"),
    (["follower", "--master-port", "70000"], "--master-port: '70000': expected a port from 1 to 65534"),
    (["status", "--master-port", "0"], "--master-port: '0': expected a port"),
    (["demo", "--nnodes", "0"], "--nnodes: '0': expected a whole"),
    (["demo", "--metrics-port", "70000"], "--metrics-port: '70000': expected a port from 1 to 65535"),
    (["bench", "--seconds", "inf"], "--seconds: 'inf': expected a positive number of seconds"),
    (["bench", "--from-json", "{tmp}/bad.json"], "bad.json: not the rows of 'zbus bench --json' (JSONDecode"),
    (["bench", "--from-json", "{tmp}/list.json"], "list.json: not the rows of 'zbus bench --json' (TypeE"),
], ids=["demo-steps", "demo-nproc", "keygen-nodes", "bench-scenario", "follower-nproc", "follower-port",
        "status-port", "demo-nnodes", "demo-metrics-port", "bench-seconds", "bench-from-bad-json",
        "bench-from-other-json"])
def test_a_bad_flag_is_refused_before_anything_runs(argv, says, tmp_path):
    """Counts are at least 1 and every scenario name is known before anything runs.
    Before: ``demo --steps 0`` ran a whole cluster, then failed on the median of
    no steps; ``--nproc-per-node 0`` became 2; ``bench import bogus`` ran ``import``
    first. Sabotage: ``type=int`` for ``--steps``, ``--nproc-per-node`` or
    ``--nodes`` -> a traceback, exit 1 (``zbus.demo.run``'s or keygen's own
    ValueError); the scenario check inside the loop of ``zbus.bench.run`` ->
    "running import" first. ``bench --from-json`` of a file that is not JSON, or
    JSON of another shape, was a traceback; sabotage: no ``except`` round
    ``load_rows`` in ``zbus.bench.run``."""
    (tmp_path / "bad.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1]")
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = subprocess.run([sys.executable, "-m", "zbus.cli", *argv], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "running" not in out.stderr and "Traceback" not in out.stderr


SECRET = "0123456789abcdef" * 2


@pytest.mark.parametrize("argv, env, says", [
    (["keygen", "{tmp}"], {}, "is not empty: keygen makes a whole new set"),
    (["status", "--secret-file", "{tmp}/none", "--timeout", "0.2"], {}, "No such file or directory"),
    (["follower", "--master-addr", "127.0.0.1", "--curve-dir", "{tmp}/none"], {}, "missing key file"),
    (["follower", "--master-addr", "127.0.0.1"], {"ZBUS_MASTER_PORT": "70000"}, "master_port 70000 outside"),
    (["status", "--timeout", "1"], {"ZBUS_MASTER_PORT": "abc"}, "ZBUS_MASTER_PORT='abc': expected a whole"),
    (["follower"], {"ZBUS_NNODES": "two"}, "ZBUS_NNODES='two': expected a whole number"),
    (["follower"], {"ZBUS_NODE_RANK": "x"}, "ZBUS_NODE_RANK='x': expected a whole number"),
    (["follower"], {"ZBUS_LIVENESS_S": "fast"}, "ZBUS_LIVENESS_S='fast': expected a number"),
    (["follower"], {"ZBUS_ALLOW_IMPORT_CALLS": "sure"}, "ZBUS_ALLOW_IMPORT_CALLS='sure': expected 1 or 0"),
    (["follower", "--node-rank", "0"], {"ZBUS_SECRET": SECRET}, "node rank 0: a follower's rank is 1 or"),
    (["follower"], {"ZBUS_SECRET": SECRET}, "with a cluster secret this node needs its rank"),
    (["follower", "--node-rank", "-1"], {}, "node rank -1: a follower's rank is 1 or more"),
    (["follower", "--master-addr", "127.0.0.1", "--curve-dir", "{tmp}/bad"], {},
     "node.key_secret is no key file of 'zbus keygen'"),
    (["follower", "--master-addr", "127.0.0.1", "--curve-dir", "{tmp}/short"], {}, "not 40 Z85 characters"),
    (["follower", "--master-addr", "127.0.0.1", "--curve-dir", "{tmp}/cut"], {}, "is no key file of 'zbus"),
    (["follower", "--master-addr", "127.0.0.1", "--curve-dir", "{tmp}/overflow"], {}, "not 40 Z85 character"),
    (["status", "--curve-dir", "{tmp}/bad", "--timeout", "0.2"], {}, "is no key file of 'zbus keygen'"),
    (["status", "--master-addr", "leader..local", "--timeout", "0.2"], {}, "'leader..local' is no host name"),
    (["demo"], {"ZBUS_NPROC_PER_NODE": "zz"}, "ZBUS_NPROC_PER_NODE='zz': expected a whole number"),
    (["demo"], {"ZBUS_NPROC_PER_NODE": "0"}, "nproc_per_node (0) must be at least 1"),
    (["demo", "--nnodes", "2", "--master-port", "1"], {"ZBUS_SECRET": SECRET, "ZBUS_CURVE_DIR": "/none"},
     "give a cluster secret or a key folder"),
    (["demo", "--master-addr", "10.9.9.9"], {}, "with no --nnodes the demo's whole cluster runs here on 127"),
], ids=["keygen-not-empty", "status-no-secret-file", "follower-no-keys", "follower-port-setting",
        "status-port-not-a-number", "nnodes", "node-rank", "liveness", "allow-import-calls", "node-rank-0",
        "secret-no-node-rank",
        "node-rank-below-0", "follower-bad-key-file", "follower-short-key", "follower-key-line-cut",
        "follower-key-past-z85", "status-bad-key-file",
        "status-malformed-host", "demo-nproc", "demo-nproc-0", "demo-secret-and-keys",
        "demo-addr-without-nnodes"])
def test_a_setting_a_command_cannot_use_is_said_in_one_line(argv, env, says, tmp_path):
    """A key folder or secret file that is not there, a folder keygen would
    overwrite, a port setting out of range or not a number: the command says so in
    one line naming it and exits 1. Before, each was a traceback (the command's
    ZbusError, OSError or ValueError let out of ``main``; later ``int()``'s
    "invalid literal" of a ``ZBUS_*`` number, the demo's and the executor's own
    ValueErrors); the flags were plain ints (``--master-port 70000``, ``follower
    --nproc-per-node 0``, ``demo --nnodes 0``: tracebacks from the settings'
    checks) and ``bench --seconds inf`` ran for ever (the cases of the test above).
    A follower with a secret and node rank 0, whose key no leader admits, waited
    out its join timeout (300 s). Sabotage: no ``except`` around ``args.func`` in
    ``zbus.cli.main``; ``int(...)`` back in ``ClusterSettings.resolve``; no rank
    check in ``NodeAgent._keys``.

    A key file that is not one (ZeroMQ's ValueError, or a key ZeroMQ refuses later
    as EINVAL; a line cut short, pyzmq's IndexError; 40 Z85 characters past a
    Z85 value), a host name of an empty label (idna's UnicodeError, where the
    docs promise the resolve error) and a node rank below 1 were tracebacks or a
    whole cluster's failed start (-1 is "any" on the wire); ``zbus status`` asked
    "is the leader running?" of a key or secret it could not read. Sabotage: no
    ``except ValueError, IndexError`` or no decoding check in ``zbus.curve._load``; only
    ``gaierror`` in ``resolve_ip``; no rank check in ``NodeAgent.__init__``; the
    keys loaded inside ``_status``'s ``try``.

    ``zbus demo --master-addr`` with no ``--nnodes`` was ignored: the demo ran on
    loopback. Sabotage: no address check in ``zbus.demo.run_demo``."""
    (tmp_path / "x").touch()
    for folder, text in (("bad", "not a key\n"), ("short", 'curve\n    public-key = "abc"\n'),
                         ("cut", "curve\n    public-key\n"),
                         ("overflow", f'curve\n    public-key = "{"#" * 40}"\n')):
        (tmp_path / folder).mkdir()
        for name in ("node.key_secret", "node.key", "leader.key"):
            (tmp_path / folder / name).write_text(text)
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = subprocess.run([sys.executable, "-m", "zbus.cli", *argv], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, **env))
    assert out.returncode == 1 and f"zbus {argv[0]}: " in out.stderr and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    if argv[0] == "status":  # (the hint is for a leader it cannot reach, not a key it cannot read)
        assert ("Is the leader running" in out.stderr) == ("host name" in says), out.stderr


@pytest.mark.parametrize("taken", ["first", "second"])
@pytest.mark.timeout(120)
def test_a_demo_on_a_port_that_is_taken_says_so_in_one_line(taken):
    """``zbus demo --master-port P`` (a whole cluster here) listens on P and P+1; one
    of them held by another program: exit 1, one line naming the port. Before, the
    port asked for was ignored (the demo ran on a free pair), and on a leader of
    other nodes the taken port was ZeroMQ's traceback (its error no OSError).
    Sabotage: ``free_port_pair`` whatever was asked in ``run_demo`` -> the demo runs
    and exits 0; no ``except`` in ``queues.bind`` -> a traceback."""
    import socket

    from zbus.cluster import free_port_pair

    port = free_port_pair()
    held = port if taken == "first" else port + 1
    with socket.socket() as other:
        other.bind(("127.0.0.1", held))
        other.listen()
        out = subprocess.run([sys.executable, "-m", "zbus.cli", "demo", "--master-port", str(port),
                              "--steps", "1"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"zbus demo: cannot listen on port {held} of 127.0.0.1: Address already in use" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def pending_signals(pid: int) -> int:
    """The mask of the signals sent to process ``pid`` that it has not taken yet."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


@pytest.mark.parametrize("signals", ["once", "twice"])
def test_sigterm_ends_the_demo_with_its_followers_and_removes_its_keys(tmp_path, signals):
    """SIGTERM to ``zbus demo`` (a CI job cancelled, ``timeout``, ``docker stop``)
    once its cluster is up: it exits 143, its followers and every worker end, and
    its key folder (the secret keys of the leader and nodes) is gone. Before, the
    signal ended the demo on the spot: the followers ran on until their leader was
    lost and the keys stayed in /tmp. Sabotage: no SIGTERM handler in
    ``zbus.cli.main`` -> exit -15, keys left.

    ``twice``: a second SIGTERM while the demo waits for a follower slow to end (one
    stopped with SIGSTOP) still removes the keys and ends that follower. Before, it
    cut the wait short and the keys stayed. Sabotage: remove the keys after
    ``end_followers`` in ``zbus.demo.run`` -> keys left; no kill in
    ``end_followers``'s ``except BaseException`` -> the stopped follower left."""
    env = dict(os.environ, TMPDIR=str(tmp_path), ZBUS_NPROC_PER_NODE="1")
    procs: list[psutil.Process] = []
    demo = psutil.Popen([sys.executable, "-m", "zbus.cli", "demo", "--steps", "1000000"], env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 90
        while "ready in" not in (line := next_line(demo, deadline)):
            assert line, "the demo ended before its cluster was ready"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("zbus-demo-keys-")]
        procs += demo.children(recursive=True)
        assert len(procs) >= 4  # two followers, a worker each, the leader's own worker
        followers = [p for p in demo.children() if "follower" in p.cmdline()]
        if signals == "twice":
            followers[0].suspend()
        demo.terminate()
        if signals == "twice":  # once the demo waits for the stopped follower to end: it has
            # sent it SIGTERM, which waits until the follower runs again
            wait_until(lambda: pending_signals(followers[0].pid) & 1 << (signal.SIGTERM - 1), 60,
                       "the demo's SIGTERM to the stopped follower")
            demo.terminate()
        assert demo.wait(30) == 143
        assert psutil.wait_procs(procs, timeout=15)[1] == []
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("zbus-demo-keys-")]
    finally:
        for p in [demo, *procs]:  # (on failure: the followers and workers too)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        end_process(demo)


def test_followers_deaf_to_sigterm_share_one_grace_before_sigkill():
    """``end_followers`` (the demo's, the bench's) waited ``grace_s`` for each
    follower in turn: the second of two that ignore SIGTERM (stopped, stuck) was
    killed only after two graces, the k-th after k. Sabotage: ``f.wait(grace_s)``
    again -> about 2 s for two."""
    from zbus.processes import end_followers

    deaf = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        t0 = time.monotonic()
        end_followers(procs, grace_s=1.0)
        took = time.monotonic() - t0
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
        assert took < 1.7, f"two deaf followers took {took:.2f} s to end with a grace of 1 s"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            p.stdout.close()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_a_follower_that_is_pid_1_of_its_container_ends_on_sigterm(tmp_path):
    """A follower run as a container's command is PID 1 of its PID namespace, which
    the kernel sends no signal it has no handler for: without one, ``docker stop``
    waited out its grace period and SIGKILLed it. Sabotage: no SIGTERM handler in
    ``zbus.cli.main`` -> still running 10 s after SIGTERM."""
    from zbus.cluster import free_port_pair

    health = tmp_path / "health"  # touched at each try to join: its handler is in place by then
    env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(free_port_pair()),
               ZBUS_HEALTH_FILE=str(health))
    outer = psutil.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "zbus.cli",
                          "follower", "--join-timeout", "60"], env=env, stderr=subprocess.DEVNULL)
    try:
        agent = wait_until(lambda: outer.children(), 10, "the follower started")[0]
        wait_until(health.exists, 30, "the follower trying to join")
        agent.terminate()
        assert outer.wait(15) == 143  # (unshare exits with its child's status)
    finally:
        if outer.poll() is None:
            outer.kill()
        end_process(outer)


def test_ctrl_c_ends_a_follower_with_130_and_no_traceback(tmp_path):
    """Ctrl-C to a follower waiting for its leader: it cleans up and exits 130,
    quietly. Before, ``zbus.cli.main`` let the KeyboardInterrupt out: a traceback
    (three from ``zbus demo``, whose followers share its terminal), exit -2.
    Sabotage: no ``except KeyboardInterrupt`` in ``zbus.cli.main``."""
    from zbus.cluster import free_port_pair

    health = tmp_path / "health"  # touched at each try to join: its handlers are in place by then
    env = dict(os.environ, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(free_port_pair()),
               ZBUS_HEALTH_FILE=str(health))
    proc = subprocess.Popen([sys.executable, "-m", "zbus.cli", "follower", "--join-timeout", "60"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(health.exists, 30, "the follower trying to join")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 130
        said = proc.stderr.read()
        assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    finally:
        end_process(proc)


def test_bench_from_json_prints_the_rows_before_a_plot_they_cannot_make(tmp_path):
    """Rows of no payload scenario with ``--plot``: the table, then the plot's own
    reason (exit 2). A first version called the file "not the rows of 'zbus bench
    --json'" and printed nothing; a second, a row the plot cannot read (a case
    that is no text) was a traceback. Sabotage: ``plot_svg`` inside the ``try``
    round ``load_rows`` in ``zbus.bench.run``; ValueError alone caught round it."""
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"rows": [{"scenario": "import", "case": "import zbus", "median_us": 9.0,
                                          "p99_us": 12.0}]}))
    out = subprocess.run([sys.executable, "-m", "zbus.cli", "bench", "--from-json", str(rows), "--plot",
                          str(tmp_path / "x.svg")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "import zbus" in out.stdout, (out.stdout, out.stderr)
    assert "--plot: ValueError: no payload rows to plot" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    odd = {"scenario": "payload", "case": 7, "median_us": 9.0, "p99_us": 12.0}  # (a case it cannot read)
    rows.write_text(json.dumps({"rows": [odd]}))
    out = subprocess.run([sys.executable, "-m", "zbus.cli", "bench", "--from-json", str(rows), "--plot",
                          str(tmp_path / "x.svg")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--plot: AttributeError" in out.stderr, out.stderr


def test_a_command_that_needs_torch_says_so_in_one_line():
    """torch is an extra (``zbus[torch]``): ``zbus demo`` without it was a
    ModuleNotFoundError traceback. Sabotage: no ``except ModuleNotFoundError`` in
    ``zbus.cli.main``."""
    code = "import sys; sys.modules['torch'] = None; from zbus.cli import main; sys.exit(main(['demo']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "zbus demo: needs torch" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_settings_left_empty_count_as_unset_and_bad_flags_are_usage_errors():
    """An empty ``ZBUS_*`` counts as unset (as the docs say): ``ZBUS_JOIN_TIMEOUT=""``
    made every command, ``--help`` included, a ValueError traceback, and empty
    ring or wait settings refused. ``--join-timeout nan`` (a join retried for
    ever) and a misspelt ``--log-level`` are usage errors (exit 2); a misspelt
    ``ZBUS_LOG_LEVEL`` a warning. Sabotage: the join timeout's default parsed
    from the environment when the parser is built -> exit 1. Message size limits
    take a K/M/G suffix and are at least 64K (before: ``ZBUS_MAX_MESSAGE=0`` made
    the leader drop every join, ``-1`` lifted ZeroMQ's size limit on its sockets,
    ``4G`` failed ``import zbus``). Sabotage: ``int()`` the variable again."""
    empty = {n: "" for n in ("ZBUS_JOIN_TIMEOUT", "ZBUS_RING", "ZBUS_SPIN_US", "ZBUS_YIELD_US",
                             "ZBUS_WAIT_SLICE", "ZBUS_MAX_MESSAGE", "ZBUS_MAX_REPLY")}
    env = dict(os.environ, **empty)
    out = subprocess.run([sys.executable, "-m", "zbus.cli", "status", "--help"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-c", "from zbus import cluster, codec, config; "
                          "print(config.RingGeometry.from_env(True), config.WaitPolicy.from_env().slice_s, "
                          "codec.MAX_MESSAGE, cluster.max_reply())"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.split() == [
        "RingGeometry(chunk_bytes=1048576,", "n_chunks=32)", "0.5", str(4 * 2**30), str(256 * 2**20)], out
    sizes = "from zbus import cluster, codec; print(codec.MAX_MESSAGE, cluster.max_reply())"
    out = subprocess.run([sys.executable, "-c", sizes], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, ZBUS_MAX_MESSAGE="4G", ZBUS_MAX_REPLY="1M"))
    assert out.stdout.split() == [str(4 * 2**30), str(2**20)], out.stderr
    for name, bad in [("ZBUS_MAX_MESSAGE", "0"), ("ZBUS_MAX_MESSAGE", "-1"), ("ZBUS_MAX_MESSAGE", "lots"),
                      ("ZBUS_MAX_REPLY", "100")]:  # (0 dropped every join; -1 lifted ZeroMQ's limit)
        out = subprocess.run([sys.executable, "-c", sizes], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, **{name: bad}))
        assert out.returncode == 1 and f"SettingError: {name}={bad!r}: expected a size" in out.stderr, out
    for flags in (["follower", "--join-timeout", "nan"], ["--log-level", "verbose", "status"]):
        out = subprocess.run([sys.executable, "-m", "zbus.cli", *flags], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (flags, out.stderr)
    out = subprocess.run([sys.executable, "-m", "zbus.cli", "status", "--master-port", "1", "--timeout",
                          "0.2"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, ZBUS_LOG_LEVEL="verbose"))
    assert out.returncode == 1 and "log level 'VERBOSE' unknown" in out.stderr, out.stderr


@pytest.mark.parametrize("name, value, says", [
    ("ZBUS_PORT_RANGE", "0-100", "ZBUS_PORT_RANGE='0-100': expected lo-hi, 1 <= lo <= hi <= 65535"),
    ("ZBUS_PORT_RANGE", "70000-70010", "expected lo-hi"),
    ("ZBUS_PORT_RANGE", "9000", "expected lo-hi"),
    ("ZBUS_METRICS_PORT", "70000", "metrics_port 70000 outside 1..65535"),
    ("ZBUS_METRICS_PORT", "9090x", "ZBUS_METRICS_PORT='9090x': expected a whole number"),
])
def test_port_settings_out_of_their_range_are_refused_by_name(name, value, says, monkeypatch):
    """A port range from 0 bound a random port outside the firewall's range, one
    past 65535 raised OverflowError, one without a dash a bare int() error; a
    metrics port past 65535 failed only once every node had joined. Each is
    refused by its name, before anything starts. Sabotage: drop the range check
    from ``cluster.port_range``, the port check from ``Executor.__init__``."""
    from workers import EchoWorker

    import zbus
    from zbus.cluster import port_range

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(says)):
        if name == "ZBUS_PORT_RANGE":
            port_range()
        else:
            zbus.Executor(EchoWorker)
