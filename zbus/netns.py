"""Test clusters without Docker: one network namespace per node (needs root).

Used by the multi-node tests and by ``zbus bench``.

Each node gets its own network namespace (an address on a bridge that lives in a
namespace of its own), its own mount namespace with a private tmpfs on /dev/shm,
its own host name, and an /etc/hosts naming every node, as a compose network
does. A sentinel process holds each node's namespaces; node processes enter them
with nsenter, and the test can look at a node's /dev/shm through the sentinel.
Everything is torn down by pid, bounded in time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import psutil

from .failure import run_every

SUBNET = "10.213.{}.{}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"zbprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Node:
    def __init__(self, cluster: NetnsCluster, index: int):
        self.index = index
        self.name = "leader" if index == 0 else f"node{index}"
        self.ns = f"{cluster.prefix}n{index}"
        self.address = SUBNET.format(cluster.net, 10 + index)
        self.sentinel: subprocess.Popen | None = None
        self.procs: list[psutil.Popen] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> psutil.Popen:
        """Start a process inside this node (all its namespaces)."""
        full_env = dict(os.environ)
        full_env.update(env or {})
        proc = psutil.Popen(["nsenter", "-t", str(self.sentinel.pid), "-m", "-u", "-n", "--", *argv],
                            env=full_env, **kwargs)
        self.procs.append(proc)
        return proc

    def python(self, *args: str, env: dict[str, str] | None = None, **kwargs) -> psutil.Popen:
        return self.start([sys.executable, *args], env=env, **kwargs)

    def shm_segments(self) -> list[str]:
        out = subprocess.run(["nsenter", "-t", str(self.sentinel.pid), "-m", "ls", "/dev/shm"],
                             capture_output=True, text=True, timeout=10, check=True)
        return [n for n in out.stdout.split() if n.startswith("zbus-") or "?zbus_node=" in n]

    def pids(self) -> list[int]:
        """Every process in this node's network namespace, but the sentinel."""
        out = _ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out if int(p) != self.sentinel.pid]

    def tx_bytes(self) -> int:
        stats = json.loads(_ip("-n", self.ns, "-s", "-j", "link", "show", "eth0").stdout)
        return stats[0]["stats64"]["tx"]["bytes"]

    def link(self, up: bool) -> None:
        _ip("-n", self.ns, "link", "set", "eth0", "up" if up else "down")


class NetnsCluster:
    """``with NetnsCluster(3) as c:`` nodes ``c.nodes[0]`` (leader), 1, 2."""

    def __init__(self, n_nodes: int):
        # (padded: pid 1234 at ms 567 must not name what pid 12345 at ms 67 does)
        self.prefix = f"zb{os.getpid() % 100000:05d}{int(time.time() * 1000) % 1000:03d}"
        self.net = os.getpid() % 200 + 20
        self.switch = f"{self.prefix}sw"
        self.nodes = [Node(self, i) for i in range(n_nodes)]

    def __enter__(self) -> NetnsCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in self.nodes)
        for node in self.nodes:
            _ip("netns", "add", node.ns)
            os.makedirs(f"/etc/netns/{node.ns}", exist_ok=True)
            with open(f"/etc/netns/{node.ns}/hosts", "w") as f:
                f.write(hosts)
            with open(f"/etc/netns/{node.ns}/hostname", "w") as f:
                f.write(node.name + "\n")
            peer = f"{self.prefix}v{node.index}"
            _ip("link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", node.ns)
            _ip("link", "set", peer, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", peer, "master", "br0", "up")
            _ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip("-n", node.ns, "link", "set", "eth0", "up")
            _ip("-n", node.ns, "link", "set", "lo", "up")
            # The sentinel lives as long as the cluster: a soak runs for more than an hour.
            node.sentinel = subprocess.Popen(
                ["ip", "netns", "exec", node.ns, "unshare", "--mount", "--uts", "--propagation",
                 "private", "sh", "-c", "mount -t tmpfs -o size=512m zbus-shm /dev/shm && "
                 f"hostname {node.name} && echo ready && exec sleep infinity"],
                stdout=subprocess.PIPE, text=True)
            if node.sentinel.stdout.readline().strip() != "ready":
                raise RuntimeError(f"node {node.name} did not start")

    def close(self) -> None:
        """Kill every process of every node by pid, then delete the namespaces: each
        node's teardown runs whatever cut another short (a timeout, a Ctrl-C)."""
        run_every(*(lambda node=node: self._close_node(node) for node in self.nodes),
                  lambda: _ip("netns", "del", self.switch, check=False))

    @staticmethod
    def _close_node(node: Node) -> None:
        def kill() -> None:
            for proc in node.procs + ([node.sentinel] if node.sentinel else []):
                if proc.poll() is None:
                    proc.kill()
            for pid in _ip("netns", "pids", node.ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass

        def reap() -> None:
            for proc in node.procs + ([node.sentinel] if node.sentinel else []):
                try:
                    proc.wait(10)
                except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
                    pass

        run_every(kill, reap, lambda: _ip("netns", "del", node.ns, check=False),
                  lambda: shutil.rmtree(f"/etc/netns/{node.ns}", ignore_errors=True))
