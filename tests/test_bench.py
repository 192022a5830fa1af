"""The benchmark tool itself (its figures are not tested: speed is measured in
benchmarks, never in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TEST_PATH

from zbus import netns, shm
from zbus.bench import Row, format_table, plot_svg


def test_bench_writes_json_and_redraws_a_plot(tmp_path):
    """Sabotage: the core not named in the output or the JSON → fails."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=TEST_PATH, ZBUS_PURE_PYTHON="1")
    r = subprocess.run([sys.executable, "-m", "zbus.cli", "bench", "import", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "zbus core: python" in r.stdout
    data = json.loads(out.read_text())
    assert data["machine"]["core"] == "python"
    assert data["machine"]["cpus"] >= 1 and data["rows"][0]["case"] == "import zbus"
    assert data["rows"][0]["extra"]["torch imported"] is False
    rows = [Row("payload", f"{n} {u} tensor to 2 workers", t, t * 2, "pyzmq ipc", t * 1.5,
                {"memcpy GB/s": 10.0} if u == "MiB" and n >= 16 else {})
            for n, u, t in ((1, "KiB", 100.0), (1, "MiB", 900.0), (16, "MiB", 5000.0))]
    plot_svg(rows, str(tmp_path / "p.svg"))
    svg = (tmp_path / "p.svg").read_text()
    # zbus, pyzmq ipc and memcpy, in the latency panel and the bandwidth panel
    assert svg.startswith("<svg") and svg.count("<polyline") == 6 and "16 MiB" in svg
    table = format_table(rows)
    assert "ratio" in table and table.count("0.67") == 3  # zbus / baseline, row by row


def test_compare_runs_the_same_shapes_through_every_baseline(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=TEST_PATH)
    r = subprocess.run([sys.executable, "-m", "zbus.cli", "bench", "--compare", "import", "--seconds", "0.05",
                        "--json", str(out), "--plot", str(tmp_path / "p.svg")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    rows = [row for row in json.loads(out.read_text())["rows"] if row["scenario"] == "compare"]
    shapes = ["no-op", "1 KiB tensor", "1 MiB tensor", "16 MiB tensor", "64 MiB tensor"]
    expected = ["pyzmq ipc", "pyzmq TCP", "multiprocessing pipes"]
    from zbus.baselines import vllm_available

    why = vllm_available()
    if why:
        assert "vLLM's MessageQueue does not import" in r.stderr
    else:
        expected.append("vLLM MessageQueue")
    assert [(row["baseline"], row["case"]) for row in rows] == [
        (b, f"{s} to 2 workers") for b in expected for s in shapes]
    assert all(row["ratio"] > 0 for row in rows)
    assert all(row["extra"]["baseline CPU us/call"] > 0 for row in rows if row["case"].startswith("no-op"))
    assert (tmp_path / "p.svg").read_text().count("<polyline") == 2 * (len(expected) + 2)


@pytest.mark.netns
@pytest.mark.skipif(netns.unavailable() is not None, reason=f"no namespaces: {netns.unavailable()}")
def test_nodes_runs_across_namespace_hosts():
    """The `nodes` scenario leads its namespace nodes without keys, as asked for (the
    `curve` scenario measures keys). Sabotage: the leader started without
    ZBUS_INSECURE → it refuses to lead on a non-loopback address and the run fails.
    Its egress rows count each broadcast whole: one payload per follower node for
    zbus, one per remote worker for direct fan-out. (They read the counter once the
    leader's own rank answered: 0.67 and 2.33.)"""
    from zbus.bench import _run_nodes

    rows = _run_nodes(2, 0.2, use_netns=True)
    cases = {(r.case, r.baseline) for r in rows}
    assert ("2 nodes, no-op, reply from rank 3", "pyzmq relay per node") in cases
    egress = [(r.case, r.extra["payloads per broadcast"]) for r in rows if r.scenario == "egress"]
    assert [case for case, _ in egress] == ["2 nodes x 2 workers: zbus relay",
                                            "2 nodes x 2 workers: direct fan-out"]
    # one copy per follower node, against one per remote worker (headers: a few %)
    assert 1.0 <= egress[0][1] < 1.1 and 2.0 <= egress[1][1] < 2.2, egress
    assert all(r.median_us > 0 for r in rows)


def last_json_line_of(code: str, timeout: float):
    """Run ``code`` in a Python process of its own (multiprocessing's resource
    tracker outlives a baseline); what its last line of output says, as JSON."""
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=TEST_PATH),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_pyzmq_baseline_leaves_no_socket_file():
    """Closing ZeroMQ's sockets left their ipc files in /tmp (two per bench run).
    In a process of its own (multiprocessing's resource tracker outlives the
    baseline). Sabotage: no unlinking in ``ZmqBaseline.close`` -> both files stay."""
    code = ("import json, os\n"
            "from zbus.baselines import ZmqBaseline\n"
            "zb = ZmqBaseline(1)\n"
            "zb.call()\n"
            "files, made = zb._files, all(os.path.exists(f) for f in zb._files)\n"
            "zb.close()\n"
            "print(json.dumps([made, files]))\n")
    made, files = last_json_line_of(code, 120)
    assert made and len(files) == 2
    assert not [f for f in files if os.path.exists(f)]


def test_a_pyzmq_baseline_cut_short_in_its_start_leaves_no_file_and_no_process():
    """Ctrl-C while the pyzmq baseline waits for its subscribers (``zbus bench``
    interrupted at its start): its ipc files are removed and its subscribers
    ended. Injected: the wait raises KeyboardInterrupt, as Ctrl-C there does.
    Before, both files stayed in /tmp (nothing sweeps them) and the subscribers
    ran on until the process exited. Sabotage: no ``self._end()`` on a failed start
    in ``ZmqBaseline.__init__`` -> 2 files and 2 processes."""
    code = ("import glob, json, multiprocessing, os\n"
            "from zbus import baselines\n"
            "def interrupted(*args):\n"
            "    raise KeyboardInterrupt\n"
            "baselines.await_subscribers = interrupted\n"
            "try:\n"
            "    baselines.ZmqBaseline(2)\n"
            "except KeyboardInterrupt:\n"
            "    pass\n"
            "print(json.dumps([glob.glob(f'/tmp/zbus-bench-{os.getpid()}-*'),\n"
            "                  [p.pid for p in multiprocessing.active_children()]]))\n")
    files, children = last_json_line_of(code, 120)
    assert files == [] and children == []


def test_a_ring_bench_cut_short_twice_leaves_no_ring():
    """``zbus bench ring`` interrupted, then interrupted again while it waits for
    its readers to end: its two rings' names are gone all the same. Injected: the
    baseline's start raises KeyboardInterrupt, then the readers' join does.
    Before, the second one skipped the rings' close, and their names stayed in
    /dev/shm until the next zbus start's sweep. Sabotage: no ``shm.unlink`` of the
    names first in ``bench._end_ring_bench`` -> 2 names left."""
    code = ("import json, multiprocessing.process as mpp, os\n"
            "from zbus import bench\n"
            "def interrupted(*args, **kwargs):\n"
            "    raise KeyboardInterrupt\n"
            "bench.ZmqBaseline, join = interrupted, mpp.BaseProcess.join\n"
            "mpp.BaseProcess.join = interrupted\n"
            "try:\n"
            "    bench.bench_ring(1.0)\n"
            "except KeyboardInterrupt:\n"
            "    pass\n"
            "mpp.BaseProcess.join = join\n"
            "print(json.dumps([n for n in os.listdir('/dev/shm') if f'-{os.getpid()}-' in n]))\n")
    try:
        assert last_json_line_of(code, 120) == []
    finally:
        shm.sweep_stale()  # (what a failure left, for the next test's check)


@pytest.mark.parametrize("baseline", ["pipes", "pyzmq"])
def test_a_baseline_whose_worker_is_gone_raises_instead_of_waiting(baseline):
    """A baseline's worker dies (the OOM killer during the 64 MiB payloads): the
    next call raises within ``REPLY_WAIT_S`` (2 s here; pipes at once, EOF), and
    ``zbus bench`` ends. Before, the reply was waited for without a bound: the
    pipe's other end stayed open in the bench itself (no EOF), and the PULL socket
    had no timeout. Sabotage: no ``w.close()`` after start and no ``poll`` in
    ``PipeBaseline.call``, or no ``poll`` in ``ZmqBaseline.call`` -> the process
    is still waiting at 60 s."""
    make = "PipeBaseline(1)" if baseline == "pipes" else "ZmqBaseline(1)"
    code = ("import json, time\n"
            "from zbus import baselines\n"
            "baselines.REPLY_WAIT_S = 2.0\n"
            f"b = baselines.{make}\n"
            "b.call()\n"
            "b.procs[0].kill(); b.procs[0].join(10)\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    b.call()\n"
            "except (TimeoutError, EOFError, OSError) as e:\n"
            "    print(json.dumps([type(e).__name__, time.monotonic() - t]))\n"
            "b.close()\n")
    kind, waited = last_json_line_of(code, 60)
    assert waited < 10, (kind, waited)


def test_paired_times_no_call_while_the_baselines_processes_may_still_spin():
    """With ``gap`` (vLLM's readers spin 1 s after their last message), ``a`` is
    timed only ``gap`` seconds after ``b``'s last call, its warm-up included.
    Before, ``a``'s first block followed ``b``'s warm-up at once. Sabotage: no
    ``rest()`` after the warm-up in ``paired`` -> ``a``'s first timed call 0 s
    after ``b``'s warm-up."""
    import time

    from zbus.bench import paired

    calls: list[tuple[str, float]] = []
    paired(lambda: calls.append(("a", time.monotonic())), lambda: calls.append(("b", time.monotonic())),
           0.3, block=4, gap=0.2)
    # a's warm-up (3 calls), b's (3), then the untimed quarter block of a (1 call), then timed ones
    assert [side for side, _ in calls[:7]] == ["a"] * 3 + ["b"] * 3 + ["a"]
    last_b = 0.0
    for i, (side, t) in enumerate(calls):
        if side == "b":
            last_b = t
        elif i >= 6 and calls[i - 1][0] == "b":  # the first of a's calls after b's
            assert t - last_b >= 0.2, (i, t - last_b)


def test_a_bench_keeps_its_own_topology_whatever_the_environment_says(tmp_path):
    """A compose service's ``ZBUS_NNODES=3`` (and a ``ZBUS_SECRET``) in the
    environment: the ``rpc`` scenario still runs its local executors and ends.
    Before, each executor read them and led a 3-node cluster, waiting out its join
    timeout (300 s) for nodes that never came. And ``--plot`` without a scenario
    it draws is refused before anything runs (exit 2): it failed after every
    scenario had run. Sabotage: no ``CLUSTER_SETTINGS`` popped in ``bench.run``."""
    from zbus.cluster import free_port_pair

    env = dict(os.environ, PYTHONPATH=TEST_PATH, ZBUS_NNODES="3", ZBUS_SECRET="0123456789abcdef" * 2,
               ZBUS_METRICS_PORT=str(free_port_pair()))  # (curve's two leaders would both bind it)
    r = subprocess.run([sys.executable, "-m", "zbus.cli", "bench", "rpc", "curve", "--seconds", "0.1"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "rpc" in r.stdout and "CurveZMQ" in r.stdout, r.stderr[-2000:]
    plot = ["--plot", str(tmp_path / "p.svg")]
    r = subprocess.run([sys.executable, "-m", "zbus.cli", "bench", "import", *plot], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--plot draws" in r.stderr and "running" not in r.stderr, r.stderr


def test_paired_ratio_and_its_interval():
    """Block by block, so a slow stretch that hits both sides cancels. Sabotage: the
    ratio of the medians instead (0.37 here: the machine slowed 3x from the baseline's
    third block on), or an interval that does not hold the ratio → fails."""
    from zbus.bench import paired_ratio

    a = [1.1, 1.1, 1.1, 3.3, 3.3]
    b = [1.0, 1.0, 3.0, 3.0, 3.0]
    ratio, low, high = paired_ratio(a, b)
    assert round(ratio, 9) == 1.1 and low <= ratio <= high
    a = [1.0, 1.2, 0.9, 1.1, 1.3, 1.0, 0.95, 1.05]
    ratio, low, high = paired_ratio(a, [1.0] * 8)
    assert low <= ratio <= high and low >= 0.9 and high <= 1.3 and low < high
    assert paired_ratio(a, [1.0] * 8) == (ratio, low, high)  # seeded


def test_a_failed_benchmark_run_says_why_from_both_streams():
    """vLLM logs its errors to stdout: a failed run's message carries them.
    Sabotage: stderr's tail alone (the root cause of an engine's death is lost)."""
    from zbus.bench import _parse_rows

    out = subprocess.CompletedProcess(["x"], 1, stdout="(EngineCore) ERROR 12-04 boom: the cause\nnoise\n",
                                      stderr="EngineDeadError: see above")
    with pytest.raises(RuntimeError) as e:
        _parse_rows(out)
    assert "boom: the cause" in str(e.value) and "EngineDeadError" in str(e.value)
    assert "noise" not in str(e.value)


def test_a_nodes_benchmark_that_fails_to_start_ends_every_process_it_started(tmp_path):
    """The nodes scenario's driver starts its baselines' subscribers and relays,
    then waits for them to subscribe; when that fails (here at once) it ends them
    all. Before, they were started outside its ``try``: the subscribers waited
    for a message and the relays relayed for good. Sabotage: start them before
    the ``try`` in ``nodes_driver`` again -> processes left. The baselines have
    zbus's topology, the leader's node's 2 workers among them (they were left
    out, so zbus's 6 ranks were measured against 4: sabotage, subscribers for
    the follower nodes only -> waits for 2, not 4)."""
    import psutil

    code = ("import zbus.bench as b\n"
            "def fail(pub, pull, n):\n"
            "    raise TimeoutError(f'no subscriber of {n}')\n"
            "b.await_subscribers = fail\n"
            "b.nodes_driver(2, 0.1, '127.0.0.1', [], 'lo')\n")

    tag = f"ZBUS_TEST_BENCH={os.getpid()}"  # (its processes, and no other on this machine)

    def baselines() -> list:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if "zbus.baselines import" in " ".join(p.info["cmdline"] or []) and tag in \
                        "\0".join(f"{k}={v}" for k, v in p.environ().items()):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    err = tmp_path / "stderr"  # (a file: processes left behind would hold a pipe open)
    try:
        with open(err, "w") as f:
            code = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=f,
                                  timeout=90, env=dict(os.environ, PYTHONPATH=TEST_PATH,
                                                       ZBUS_TEST_BENCH=str(os.getpid()))).returncode
        # zbus's topology: 2 nodes x 2 workers, the leader's own among them
        assert code == 1 and "no subscriber of 4" in err.read_text(), err.read_text()[-2000:]
        assert baselines() == []
    finally:
        for p in baselines():
            p.kill()


def test_a_bench_killed_leaves_no_reader_or_subscriber_waiting():
    """``zbus bench ring`` SIGKILLed mid-run (a cancelled job, the OOM killer): its
    ring readers and pyzmq subscribers end with it. Before, nothing told them: they
    waited for good for a message that would never come, holding their mappings of
    the ring. Sabotage: no ``die_with_parent`` in ``_ring_echo`` and ``sub_worker``
    -> four processes left."""
    import psutil
    from conftest import wait_until

    bench = psutil.Popen([sys.executable, "-m", "zbus.cli", "bench", "ring", "--seconds", "60"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, PYTHONPATH=TEST_PATH))
    helpers: list = []
    try:
        def started() -> bool:  # each helper past its start: readers map the ring, subscribers
            readers = subscribers = 0  # hold their ipc sockets
            for p in bench.children():
                try:
                    with open(f"/proc/{p.pid}/maps") as f:
                        reader = "/dev/shm/zbus-" in f.read()
                    readers += reader  # (whose doorbell is a Unix socket too: not a subscriber)
                    subscribers += not reader and "resource_tracker" not in " ".join(p.cmdline()) and bool(
                        p.net_connections(kind="unix"))
                except (psutil.Error, OSError):
                    pass
            return readers >= 2 and subscribers >= 2
        wait_until(started, 60, "the bench's two ring readers and two subscribers")
        helpers = bench.children(recursive=True)
        bench.kill()
        bench.wait(10)
        gone, alive = psutil.wait_procs(helpers, timeout=10)
        assert alive == [], [p.pid for p in alive]
    finally:
        from zbus import shm

        shm.sweep_stale()  # the rings' names a SIGKILLed process leaves: the next start's sweep
        for name in os.listdir("/tmp"):  # and its pyzmq baseline's socket files
            if name.startswith(f"zbus-bench-{bench.pid}-"):
                os.unlink(os.path.join("/tmp", name))
        for p in [bench, *helpers]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_the_curve_bench_picks_port_pairs_that_do_not_overlap():
    """Each pair is free when picked, and the next pick may be its neighbour: the
    curve scenario's second leader then found its first port taken by the first
    leader's second ("Address already in use", a CI run). Sabotage: keep every
    pick in ``bench.disjoint_port_pairs``."""
    from zbus.bench import disjoint_port_pairs

    picks = iter([40000, 40001, 39999, 40000, 40002])
    assert disjoint_port_pairs(2, lambda: next(picks)) == [40000, 40002]
