"""The follower node's agent (``zbus follower``): joins the leader, relays each RPC
into this node's shared-memory ring, and supervises this node's workers.

One thread owns both sockets (a SUB to the leader's XPUB, a PUSH to its PULL).
RPC messages are relayed as the bytes they arrived as: the agent never decodes
them. Workers answer the leader directly over their own PUSH sockets.

Exit codes: 0 after the leader's ``bye`` or ``failed`` (the executor failed); 1
when the leader was lost (no message for the liveness limit), this node was
refused, or it could not start; 2 for a command line that does not parse; 143
after SIGTERM (``zbus.cli`` makes it a SystemExit: the agent cleans up and tells
the leader).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import time
from typing import Any

import zmq

from . import codec, protocol, ring, shm
from .cluster import (
    LIVENESS_RANGE_S,
    SLOWEST_LINK_BYTES_S,
    TOPIC_HEARTBEAT,
    TOPIC_RPC,
    ClusterSettings,
    heartbeat_interval,
    new_node_id,
    node_topic,
    probe_topics,
    resolve_ip,
    route_to,
    rpc_topic,
    touch_health,
    typed_setting,
)
from .config import MAX_POLL_S, RingGeometry, WaitPolicy
from .curve import FRAME_SLACK, NodeCurve, curve_dir_from_env, secret_from_env
from .errors import Cancelled, CodecError, RingClosed, SettingError, ZbusError, brief
from .processes import LocalWorkers, with_gloo_ifname
from .queues import bracket, send_message
from .ring import RingWriter

log = logging.getLogger(__name__)
_PLAIN = (str, int, float, bool, type(None), bytes, list, dict, tuple)  # what control messages hold


BACKLOG_MESSAGES = 1024  # read ahead at most this many messages (and BACKLOG_BYTES)
BACKLOG_BYTES = 256 * 2**20  # while the ring is full (and calls held after lost ones)
FULL_SLICE_S = 0.1  # a relay on a full ring reads ahead and heartbeats this often
READ_AHEAD_S = 0.02  # how long one read-ahead may wait for more from the leader
RELAYED = object()  # _next's answer for a call the compiled core put in the ring
DEFAULT_ALLOWED_WORKERS = ("zbus.demo",)
# Worker modules that run only for a leader with keys, whatever --allow-worker says:
# vLLM's workers unpickle what rank 0 (on the leader's node) sends them through
# torch.distributed (its groups' set-up, pipeline parallel's objects, its message
# queues across nodes), so an unauthenticated leader could run any code in them.
KEYED_LEADER_ONLY = ("zbus.vllm",)
# env= from an unauthenticated leader: only tuning knobs pass (an allow-list), and
# none whose name suggests a path, plugin, file, proxy or download source, a
# network address, a key, or the lifting of a safeguard. No VLLM_ variable: too
# many of vLLM's hundreds name what its workers load or fetch (VLLM_LOGGING_STREAM
# "ext://mod.x" imports mod, VLLM_ALLOW_INSECURE_SERIALIZATION turns pickle on, a
# LoRA resolver's repository list downloads); a node sets its own.
SAFE_ENV_PREFIXES = ("OMP_", "MKL_", "CUDA_", "NCCL_", "GLOO_", "ZBUS_TEST_")
SAFE_ENV_NAMES = ("TOKENIZERS_PARALLELISM", "ZBUS_GPUS", "ZBUS_THREADS")
UNSAFE_ENV_WORDS = ("PLUGIN", "FILE", "PATH", "DIR", "HOME", "ROOT", "LIB", "CONF", "CACHE", "ENDPOINT",
                    "URL", "PROXY", "MODULE", "PRELOAD", "CMD", "EXEC", "SCRIPT", "INSECURE", "SERIAL",
                    "ALLOW", "TRUST", "SERVER", "HOST", "ADDR", "PORT", "IFNAME", "NET", "KEY", "TOKEN",
                    "SECRET", "USAGE", "MODELSCOPE", "DOWNLOAD", "REMOTE", "TOOL", "PIPE", "DUMP",
                    "INJECT")


# env= from any leader, keys or not, never sets what this node allows or its keys:
# those are its operator's (a keyed leader's configuration is checked against them).
NODE_OWN_ENV = ("ZBUS_VLLM_ALLOW", "ZBUS_ALLOW_WORKERS", "ZBUS_ALLOW_IMPORT_CALLS", "ZBUS_INSECURE",
                "ZBUS_SECRET", "ZBUS_SECRET_FILE", "ZBUS_CURVE_DIR")


def safe_env_name(name: str) -> bool:
    """Whether an unauthenticated leader may set ``name`` in this node's workers."""
    if name in SAFE_ENV_NAMES:
        return True
    return name.startswith(SAFE_ENV_PREFIXES) and not any(word in name for word in UNSAFE_ENV_WORDS)


MAX_NNODES = 4096
MAX_TEXT = 1024  # longest address or worker path a welcome may carry
MAX_SESSION = 64  # longest leader session a welcome may carry (it is in the calls' topic)
MAX_ENV = 1024  # most env= variables, each name and value at most MAX_TEXT and 64 KiB


def check_welcome(welcome: Any, nproc: int, node_rank: int | None) -> str | None:
    """Why this node must not start what ``welcome`` asks, or None. A welcome comes
    from the leader, which without keys anyone can pose as: every field must agree
    with this node's own settings (its worker count, its rank when it has one) or
    lie within sane bounds (the liveness limit: no heartbeat may be waited for
    forever)."""
    w = welcome if isinstance(welcome, dict) else {}

    def is_int(key: str, lo: int, hi: int) -> bool:
        return type(w.get(key)) is int and lo <= w[key] <= hi

    def is_text(value: Any) -> bool:  # (a NUL byte fails the workers' start: Popen refuses it)
        return type(value) is str and 0 < len(value) <= MAX_TEXT and "\0" not in value

    # (types before values: == on a numpy array, say, raises)
    if type(w.get("nproc_per_node")) is not int or w["nproc_per_node"] != nproc:
        return f"nproc_per_node {brief(w.get('nproc_per_node'))} is not this node's {nproc}"
    if not is_int("nnodes", 2, MAX_NNODES):
        return f"nnodes {brief(w.get('nnodes'))} outside 2..{MAX_NNODES}"
    if not is_int("node_rank", 1, w["nnodes"] - 1) or node_rank not in (None, w["node_rank"]):
        return f"node_rank {brief(w.get('node_rank'))} is not this node's ({node_rank}) or out of range"
    lo, hi = LIVENESS_RANGE_S
    if type(w.get("liveness_s")) not in (int, float) or not lo <= w["liveness_s"] <= hi:
        return f"liveness_s {brief(w.get('liveness_s'))} outside {lo}..{hi} s"
    if not is_int("torch_port", 1, 65535):
        return f"torch_port {brief(w.get('torch_port'))} outside 1..65535"
    if not is_text(w.get("master_addr")):
        return "master_addr is not a short string"
    session = w.get("session")
    if not (type(session) is str and session.isascii() and session.isalnum() and len(session) <= MAX_SESSION):
        return f"session {brief(session)} is not up to {MAX_SESSION} letters and digits"
    if not is_text(w.get("reply_address")) or not w["reply_address"].startswith("tcp://"):
        return f"reply_address {brief(w.get('reply_address'))} is not a tcp:// address"
    if "max_reply" in w and not is_int("max_reply", 1, codec.MAX_MESSAGE):
        return f"max_reply {brief(w.get('max_reply'))} outside 1..{codec.MAX_MESSAGE}"
    spec = w.get("spec")
    if not isinstance(spec, dict) or not is_text(spec.get("worker")):
        return "spec names no worker class"
    poll = spec.get("poll_s")
    if poll is not None and (type(poll) not in (int, float) or not 0 <= poll <= MAX_POLL_S):
        return f"poll_s {brief(poll)} outside 0..{MAX_POLL_S} s"
    env = w.get("env", {})
    if not isinstance(env, dict) or len(env) > MAX_ENV or not all(
            is_text(k) and "=" not in k and type(v) is str and len(v) <= 65536 and "\0" not in v
            for k, v in env.items()):
        return f"env is not at most {MAX_ENV} short string variables"
    return None


class LeaderLost(ZbusError):
    """No heartbeat from the leader within the liveness limit."""


class NodeEnded(Exception):
    """The leader ended this node (``bye``, ``failed``) while a relay waited for
    room in the ring: ``run()`` returns ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class NodeAgent:
    """Runs one follower node. ``run()`` returns the process exit code."""

    def __init__(self, master_addr: str | None = None, master_port: int | None = None,
                 nproc_per_node: int | None = None, node_rank: int | None = None,
                 advertise_addr: str | None = None, join_timeout: float = 300.0,
                 allow_import_calls: bool = False, curve_dir: str | None = None,
                 allowed_workers: tuple[str, ...] | None = None, secret: bytes | str | None = None,
                 secret_file: str | None = None):
        self.settings = ClusterSettings.resolve(None, nproc_per_node, master_addr, master_port)
        self.node_rank = typed_setting(int, "--node-rank", node_rank, None, "ZBUS_NODE_RANK",
                                       "LWS_WORKER_INDEX")
        if self.node_rank is not None and self.node_rank < 1:  # (-1 on the wire is "any": the leader
            # would give it a rank this node then refuses, failing the whole cluster's start)
            raise SettingError(f"node rank {self.node_rank}: a follower's rank is 1 or more (0 is the "
                               "leader's; leave it unset to be given one in join order)")
        self.advertise_addr = advertise_addr or os.environ.get("ZBUS_ADVERTISE_ADDR")
        self.join_timeout = join_timeout
        self.allow_import_calls = allow_import_calls
        listed = os.environ.get("ZBUS_ALLOW_WORKERS", "").split(",")
        env_allowed = tuple(p for p in map(str.strip, listed) if p)
        self.allowed_workers = DEFAULT_ALLOWED_WORKERS + tuple(allowed_workers or ()) + env_allowed
        explicit_dir = curve_dir and not (secret or secret_file)  # an argument beats ZBUS_SECRET
        self.curve = self._keys(curve_dir_from_env(curve_dir),
                                None if explicit_dir else secret_from_env(secret, secret_file))
        self.node_id = new_node_id()
        self.ctx = zmq.Context()
        self.sub: zmq.Socket | None = None
        self.push: zmq.Socket | None = None
        self.ring: RingWriter | None = None
        self.workers: LocalWorkers | None = None
        self._deaths: list[tuple[int, int | None]] = []
        self._dead: dict[int, int | None] = {}  # rank -> exit code, reported to the leader
        self._backlog: collections.deque = collections.deque()
        self._backlog_bytes = 0
        self._held_hb = False  # the last message in the backlog is a heartbeat
        self._last_seq = 0  # calls start at 1, once every node joined
        self._writing: int | None = None  # the call being written into the ring
        self._ring_unnamed = False
        self._gap: dict | None = None  # calls lost in a reset connection, being sent again
        self._probes_seen: set[bytes] = set()
        self._subscribed = False  # told the leader so: a member from then on
        self._death_r, self._death_w = os.pipe()
        self._last_leader = time.monotonic()
        self._coming: tuple[int, float] | None = None  # a large call announced: (its number, its time)
        self._call_topics: tuple[bytes, ...] = ()  # (from the welcome)
        self._next_hb = 0.0
        self._stop_grace = 2.0  # how long workers get to end by themselves at close
        self._poll_s = 0.0  # the executor's poll_after_call_s (from the welcome)
        self._leader_session: str | None = None  # the welcoming leader's (its heartbeats name it)
        self._rpc_topic = self._probe_topics = None  # its calls' topic and probes' (from the welcome)
        self._poll_until = 0.0
        core = ring._core  # the compiled relay, if the core is built and finds libzmq
        self._relay_one = core.relay_one if core is not None and core.relay_ready() else None
        self.liveness_s = self.settings.liveness_s

    def _keys(self, curve_dir: str | None, secret: bytes | None) -> NodeCurve | None:
        """This node's key pair: from the cluster secret (derived for this node's
        rank, which it must then know) or from a key folder; None without keys."""
        if secret and curve_dir:
            raise ZbusError("give a cluster secret or a key folder (--curve-dir), not both")
        if secret:
            if self.node_rank is None:
                raise ZbusError(f"with a cluster secret this node needs its rank, 1 or more (--node-rank, "
                                f"ZBUS_NODE_RANK; got {self.node_rank}): its key is derived for that rank")
            return NodeCurve.from_secret(secret, self.node_rank)
        return NodeCurve.from_dir(curve_dir) if curve_dir else None

    # --- lifecycle -----------------------------------------------------------------

    def run(self) -> int:
        shm.sweep_stale()
        welcomed = False
        try:
            welcome = self._join()
            welcomed = True
            self._start_workers(welcome)
            return self._serve()
        except NodeEnded as e:
            return e.code
        except LeaderLost as e:
            log.error("%s: ending this node's workers", e)
            self._stop_grace = 0.2  # no leader to answer: free the GPUs at once
            if welcomed:  # (a leader alive that we no longer hear learns why at once)
                self._tell_leader(str(e)[:500])
            return 1
        except Exception as e:  # noqa: BLE001 - a ZbusError, or a defect: the leader learns either
            known = isinstance(e, ZbusError)
            why = str(e) if known else f"the node agent failed: {type(e).__name__}: {e}"
            log.error("%s", why, exc_info=not known)
            if welcomed:  # the leader learns why now, not at a liveness or join limit
                self._tell_leader(why[:500])
            return 1
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM (see zbus.cli)
            if welcomed:
                self._tell_leader("the node agent was stopped (SIGTERM or Ctrl-C)")
            raise
        finally:
            self._close()

    def _connect(self, deadline: float) -> str:
        s = self.settings
        while True:  # the leader's name may not resolve before its container starts
            try:
                master_ip = resolve_ip(s.master_addr)
                break
            except SettingError:
                raise
            except ZbusError as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s; retrying", e)
                touch_health()  # waiting for the leader is healthy: no probe may restart us
                time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
        self.sub = self.ctx.socket(zmq.SUB)
        self.push = self.ctx.socket(zmq.PUSH)
        for sock in (self.sub, self.push):
            if self.curve is not None:
                self.curve.client(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, ":" in master_ip)  # (else ZeroMQ retries a v6 address for ever)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sub.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE + FRAME_SLACK)
        self.sub.setsockopt(zmq.RCVHWM, 64)  # backpressure reaches the leader, not our memory
        self.push.setsockopt(zmq.SNDHWM, 1000)
        # The leader welcomes us on our node topic; we then subscribe to its calls'
        # topic, and it probes that and the heartbeat topic until we answer: so we
        # miss no RPC (see zbus.cluster).
        for topic in (TOPIC_HEARTBEAT, node_topic(self.node_id)):
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://{bracket(master_ip)}:{s.master_port}")
        self.push.connect(f"tcp://{bracket(master_ip)}:{s.master_port + 1}")
        return master_ip

    def _join(self) -> dict:
        deadline = time.monotonic() + self.join_timeout  # (one limit: to resolve, reach and be welcomed)
        master_ip = self._connect(deadline)
        address, ifname = route_to(master_ip)
        self.ifname = ifname
        info = {"version": protocol.PROTOCOL_VERSION, "nproc": self.settings.nproc_per_node,
                "host": socket.gethostname(), "address": self.advertise_addr or address,
                "node_rank": -1 if self.node_rank is None else self.node_rank, "pid": os.getpid(),
                "core": ring.CORE, "max_message": codec.MAX_MESSAGE}
        log.info("joining leader %s:%d as %s (%s via %s)", self.settings.master_addr,
                 self.settings.master_port, info["host"], info["address"], ifname)
        next_try, tries = 0.0, 0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_try:
                touch_health()  # waiting to join is healthy (a liveness probe checks the file)
                if tries:
                    log.warning("waiting for the leader at %s:%d (%.0f s left)", self.settings.master_addr,
                                self.settings.master_port, deadline - time.monotonic())
                self._send_to_leader(["join", self.node_id, info], timeout=1.0)
                next_try, tries = time.monotonic() + 2.0, tries + 1
            if not self.sub.poll(200, zmq.POLLIN):
                continue
            try:
                topic, msg = self._recv()
            except CodecError as e:  # on this node's own topic: a welcome whose arguments it cannot build
                why = f"cannot decode the leader's welcome: {e}"
                self._tell_leader(why[:500])  # (start-up fails at once, naming this node)
                raise ZbusError(why) from None
            if topic == node_topic(self.node_id) and type(msg) is list and len(msg) == 2:
                if msg[0] == "welcome" and type(msg[1]) is dict:
                    return msg[1]
                if msg[0] == "reject":
                    raise ZbusError(f"the leader refused this node: {brief(msg[1])}")
        raise ZbusError(f"no leader answered at {self.settings.master_addr}:{self.settings.master_port} "
                        f"within {self.join_timeout} s")

    def _tell_leader(self, why: str) -> None:
        """Tell the leader why this node ends: a member leaves (its callers get a
        ``NodeLostError``); a node still joining refuses to start (start-up fails
        naming it: the leader takes nothing else from a node not yet a member)."""
        if self._subscribed:
            self._tell_as_member("leaving", why, timeout=0.2)
        else:
            self._send_to_leader(["refused", self.node_id, why], timeout=1.0)

    def _start_workers(self, welcome: dict) -> None:
        problem = check_welcome(welcome, self.settings.nproc_per_node, self.node_rank)
        if problem is not None:
            raise ZbusError(f"refused the leader's welcome: {problem}")
        n = welcome["nproc_per_node"]
        self.node_rank = welcome["node_rank"]
        self.liveness_s = welcome["liveness_s"]
        session = self._leader_session = welcome["session"]
        self._rpc_topic, self._probe_topics = rpc_topic(session), probe_topics(session)
        self.sub.setsockopt(zmq.SUBSCRIBE, self._rpc_topic)  # this leader's calls, not another's
        self._poll_s = float(welcome["spec"].get("poll_s") or 0.0)
        from .logs import setup_logging

        setup_logging(f"node {self.node_rank}", logging.getLevelName(logging.getLogger().level))
        policy = WaitPolicy.from_env(waiters=n + 1)  # the node's workers and this agent
        policy = dataclasses.replace(policy, slice_s=min(policy.slice_s, FULL_SLICE_S))
        self.ring = RingWriter.create(n, RingGeometry.from_env(calls=True), policy=policy)
        world = welcome["nnodes"] * n
        places = [{"rank": self.node_rank * n + i, "local_rank": i, "world_size": world,
                   "local_world_size": n, "node_rank": self.node_rank} for i in range(n)]
        spec = dict(welcome["spec"], allow_import=self.allow_import_calls)
        self._check_worker(spec.get("worker"))
        env = self._worker_env(welcome.get("env") or {})  # the driver's Executor(env=...)
        self.workers = LocalWorkers(places, self.ring.handle.to_dict(),
                                    [{"push": welcome["reply_address"], "session": session,
                                      "heartbeat_s": heartbeat_interval(self.liveness_s),
                                      "curve": self.curve.to_dict() if self.curve else None,
                                      "max_reply": welcome.get("max_reply")}] * n,
                                    [self.ring.name],
                                    welcome["master_addr"], welcome["torch_port"], env, self._on_death)
        self.ring.send(codec.encode(spec), timeout=30)
        self._last_leader = time.monotonic()
        log.info("node %d: %d workers started (ranks %d..%d)", self.node_rank, n,
                 places[0]["rank"], places[-1]["rank"])

    def _check_worker(self, worker: Any) -> None:
        """A leader without CurveZMQ keys is not authenticated: it may only start
        the worker classes this node's operator allowed (imported by name), and
        none of :data:`KEYED_LEADER_ONLY`."""
        if self.curve is not None:
            return
        module = worker.partition(":")[0] if isinstance(worker, str) else ""
        if any(module == p or module.startswith(p + ".") for p in KEYED_LEADER_ONLY):
            raise ZbusError(f"worker class {worker!r} runs only for a leader with keys: its workers "
                            "unpickle what the leader's rank 0 sends them through torch.distributed, so "
                            "an unauthenticated leader could run any code on this node (one ZBUS_SECRET "
                            "on every host, or zbus keygen)")
        if not any(worker == p or module == p or module.startswith(p + ".") for p in self.allowed_workers):
            reason = (f"worker class {worker!r} is not allowed on this node: an unauthenticated "
                      "leader may only start the classes allowed with --allow-worker "
                      f"(now: {', '.join(self.allowed_workers)}); or trust the leader with keys "
                      "(zbus keygen)")
            raise ZbusError(reason)

    def _worker_env(self, env: dict) -> dict:
        """The driver's env for this node's workers, without what this node's
        operator sets (``NODE_OWN_ENV``); from an unauthenticated leader also
        without the variables that change what a process loads or runs."""
        env = {str(k): str(v) for k, v in env.items()}
        own = [k for k in env if k in NODE_OWN_ENV]
        risky = [k for k in env if k not in own and self.curve is None and not safe_env_name(k)]
        for k in own + risky:
            del env[k]
        if own:
            log.warning("ignored %s from the leader: this node's own settings", ", ".join(sorted(own)))
        if risky:
            log.warning("ignored %s from an unauthenticated leader", ", ".join(sorted(risky)))
        return with_gloo_ifname(env, self.ifname)

    def _serve(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self._death_r, zmq.POLLIN)
        call_topics = self._call_topics = (self._rpc_topic, node_topic(self.node_id) + TOPIC_RPC)
        while True:
            self._tick()
            # wake for the next heartbeat, the moment the leader would be lost, and
            # (lost calls) the next ask for them and the moment to give up, if to come
            now = time.monotonic()
            gap = [t for t in (self._gap["ask"], self._gap["until"]) if t > now] if self._gap else []
            wake = min(self._next_hb, self._leader_lost_at(), *gap)
            events = self._poll(poller, wake)
            if self._death_r in events:
                os.read(self._death_r, 64)
                self._report_deaths()
            if self.sub in events or self._backlog:
                while True:
                    self._tick()  # a sustained stream must not starve the heartbeats
                    frames = self._next()
                    if frames is None:
                        break
                    if frames is RELAYED:
                        continue
                    topic = bytes(frames[0])
                    if topic.removesuffix(protocol.PARTS) in call_topics:  # (node topic: sent again)
                        if len(frames) > 1:
                            self._relay(self._call_frames(topic, frames[1:]))
                        else:
                            log.warning("dropped a call message with nothing in it")
                    elif topic in self._probe_topics:
                        self._on_probe(topic, self._decode(frames[1:]))
                    elif _is_heartbeat(msg := self._leader_word(topic, frames)):
                        self._check_leader(msg[2])
                        self._check_sent(msg[1])
                    elif msg is not None and self._ends(msg):
                        return 0

    def _leader_word(self, topic: bytes, frames: list) -> Any:
        """A heartbeat or the leader's word for this node, decoded (None if
        undecodable); None for any other message. (Heartbeats come on the node topic
        too while another node stalls broadcasts.)"""
        if topic == TOPIC_HEARTBEAT or topic == node_topic(self.node_id):
            return self._decode(frames[1:])
        return None

    def _check_leader(self, session: Any) -> None:
        """A heartbeat of another leader at this leader's address (one started there
        since: the leader this node joined is gone, its calls with it)."""
        if session != self._leader_session:
            raise LeaderLost(f"another leader at {self.settings.master_addr} (restarted?): the "
                             "one this node joined is gone")

    def _ends(self, msg: Any) -> bool:
        """Act on the leader's word for this node; whether the node ends now."""
        if type(msg) is list and msg[:1] == ["dropped"]:  # too slow to join
            self._subscribed = False  # no member: its "leaving" would name a rank another may hold
            raise ZbusError(f"the leader dropped this node: {str(msg[1:])[:200]}")
        kind = msg[0] if type(msg) is list and msg else None
        if kind == "coming":
            self._on_coming(msg)
            return False
        if kind in ("stopping", "bye", "failed"):  # (an orphan's new leader at this address: not ours)
            self._check_leader(msg[1] if len(msg) > 1 else None)
        if kind == "stopping":
            self.workers.stopping = True
        elif kind == "bye":
            log.info("leader said bye: stopping")
            if self.ring is not None:  # no call comes after it: the workers read what is there
                self.ring.end()  # (STOP too, if it came), then end (its broadcast may have timed out)
            self.workers.stop(grace=5.0)
            return True
        elif kind == "failed":
            log.error("the executor failed (%s): ending this node's workers", str(msg[2:])[:200])
            self.workers.stopping = True  # their exits are no news
            self._stop_grace = 0.2  # nobody waits for their results
            return True
        return False

    def _on_coming(self, msg: list) -> None:
        """``["coming", session, call number, bytes]``: a large call follows (the
        bytes the leader sends for it, a copy per node), and the heartbeats queued
        behind it come only once it is in (``cluster.COMING_BYTES``); 0 bytes: it
        will not come (its send timed out before it went)."""
        if len(msg) == 4 and msg[1] == self._leader_session and type(msg[2]) is int \
                and type(msg[3]) is int and 0 <= msg[3] <= codec.MAX_MESSAGE * MAX_NNODES:
            self._coming = (msg[2], msg[3] / SLOWEST_LINK_BYTES_S) if msg[3] and msg[2] > self._last_seq \
                else None

    def _heard_call(self, topic: bytes, frames: list) -> None:
        """A message read ahead: the call announced, in (its envelope is the first
        frame, or in parts its first part, whole: an envelope is under 1 MiB)."""
        if self._coming is not None and topic.removesuffix(protocol.PARTS) in self._call_topics \
                and len(frames) > 2:
            seq = _call_seq(frames[2] if topic.endswith(protocol.PARTS) else frames[1])
            if seq is not None and seq >= self._coming[0]:
                self._coming = None

    def _leader_lost_at(self) -> float:
        """When the leader counts as lost: its liveness limit after it was last
        heard, and while an announced call has not come, the time it takes on the
        slowest link more."""
        if self._coming is not None and self._last_seq >= self._coming[0]:  # (relayed in the core)
            self._coming = None
        return self._last_leader + self.liveness_s + (self._coming[1] if self._coming is not None else 0.0)

    def _poll(self, poller: zmq.Poller, wake: float) -> dict:
        """Wait for the leader (or a worker's death) until ``wake``. Within the
        executor's ``poll_after_call_s`` of the last call, poll instead of sleeping,
        yielding the core: the next call then needs no wake-up of this thread."""
        while (left := min(self._poll_until, wake) - time.monotonic()) > 0:
            if ring._core.wait_readable(self.sub.underlying, left) if self._relay_one is not None \
                    else self.sub.poll(0, zmq.POLLIN):  # (compiled: yields without the GIL)
                return {self.sub: zmq.POLLIN}
            os.sched_yield()
        return dict(poller.poll(int(max(0.0, wake - time.monotonic()) * 1000) + 1))

    def _on_probe(self, topic: bytes, msg: Any) -> None:
        """Answer ``subscribed`` each time probes for this node came on both topics:
        the leader probes until an answer arrives (one may be lost)."""
        if msg == ["probe", self.node_id]:
            self._probes_seen.add(topic)
            if len(self._probes_seen) == len(self._probe_topics):
                self._subscribed |= self._send_to_leader(["subscribed", self.node_id], timeout=1.0)
                self._probes_seen = set()

    def _read(self) -> list:
        frames = [f.buffer for f in self.sub.recv_multipart(copy=False)]
        self._last_leader = time.monotonic()
        return frames

    def _next(self) -> list | object | None:
        """The next message to handle (its frames); None when none is there. A call
        in number order that fits a free chunk goes from the socket straight into the
        ring, in the compiled core without the GIL: RELAYED."""
        if self._backlog:
            return self._take()
        at = self.ring.free_chunk() if self._relay_one is not None and self._gap is None else None
        if at is None:
            return self._read() if self.sub.poll(0, zmq.POLLIN) else None
        got = self._relay_one(self.sub.underlying, self.ring.mapping, at, self.ring.chunk_bytes,
                              self._rpc_topic, self._last_seq + 1)
        if got is None:
            return None
        self._last_leader = time.monotonic()
        if type(got) is list:
            return got
        self.ring.publish_written()
        self._last_seq += 1
        self._poll_until = self._last_leader + self._poll_s
        return RELAYED

    def _check_sent(self, sent: Any) -> None:
        """A heartbeat names the last call the leader sent, and comes after it:
        a higher number than we saw means calls were lost with no next call to
        show it (a reset connection); their callers would wait forever."""
        if type(sent) is int and sent > self._last_seq and self._gap is None:
            self._start_gap(sent + 1)

    def _start_gap(self, upto: int) -> None:
        """Calls after ``_last_seq`` and before ``upto`` never arrived (ZeroMQ drops
        what a reset connection held): ask the leader to send them again on our
        node topic, holding the later calls meanwhile; give up after the limit."""
        now = time.monotonic()
        self._gap = {"upto": upto, "held": collections.deque(), "bytes": 0, "until": now + self.liveness_s,
                     "ask": now}
        log.warning("calls %d..%d never arrived (a reset connection?): asking for them again",
                    self._last_seq + 1, upto - 1)
        self._ask_again()

    def _ask_again(self) -> None:
        """(Again, every 0.5 s: the request or the answer may be lost too.) Only
        while the next call is missing and no write waits: slow workers are no
        sign of lost calls."""
        gap, now = self._gap, time.monotonic()
        first = self._last_seq + 1
        upto = gap["held"][0][0] if gap["held"] else gap["upto"]  # the next one in hand, or known sent
        if self._writing is not None or first >= upto:
            # Nothing is missing, or a write waits for the workers: what it reads
            # ahead meanwhile may hold the missing calls (they are asked for after it).
            gap["until"], gap["ask"] = now + self.liveness_s, now
            return
        if now > gap["until"]:
            raise ZbusError(f"calls {first}..{upto - 1} never arrived (a reset "
                            "connection?): leaving the cluster")
        if now >= gap["ask"]:
            self._tell_as_member("gap", first, upto, timeout=0.1)
            gap["ask"] = now + 0.5

    def _take(self) -> list:
        if not self._backlog:
            return self._read()
        frames = self._backlog.popleft()
        self._backlog_bytes -= sum(len(f) for f in frames)
        self._held_hb = self._held_hb and bool(self._backlog)
        return frames

    def _read_ahead(self) -> None:
        """While a relay waits for slow workers, keep reading what the leader sends
        (bounded), so its heartbeats are seen and this node is not given up. The
        leader's word for this node counts at once (``failed``, ``bye``: workers
        stuck in a call must not hold their GPUs until the backlog is full), and so
        does a heartbeat's session; the rest waits its turn (a heartbeat names calls
        read ahead). A heartbeat held right after another replaces it (it says all
        that one said): a long call's heartbeats alone never fill the backlog."""
        end = time.monotonic() + READ_AHEAD_S
        # A short wait: ZeroMQ refills the socket's queue (64 messages) meanwhile. At most
        # a backlog's worth a turn: heartbeats that replace each other fill none.
        for _ in range(BACKLOG_MESSAGES):
            if not self.sub.poll(max(0, int((end - time.monotonic()) * 1000)), zmq.POLLIN):
                return
            if len(self._backlog) >= BACKLOG_MESSAGES or self._backlog_bytes >= BACKLOG_BYTES:
                return  # unread messages prove nothing: a dead leader's socket stays readable
            frames = self._read()
            self._heard_call(bytes(frames[0]), frames)
            msg = self._leader_word(bytes(frames[0]), frames)
            heartbeat = _is_heartbeat(msg)
            if heartbeat:
                self._check_leader(msg[2])
                if self._held_hb:
                    self._backlog_bytes -= sum(len(f) for f in self._backlog.pop())
            elif msg is not None and self._ends(msg):  # the calls waiting for this relay are moot
                raise NodeEnded(0)
            self._held_hb = heartbeat
            self._backlog_bytes += sum(len(f) for f in frames)
            self._backlog.append(frames)

    @staticmethod
    def _call_frames(topic: bytes, frames: list) -> list:
        if not topic.endswith(protocol.PARTS):
            return frames
        try:
            return protocol.from_parts(frames[0], frames[1:])
        except CodecError as e:  # only the leader can send here (it is keyed): a defect
            raise ZbusError(f"a malformed call from the leader: {e}") from None

    def _relay(self, frames: list) -> None:
        """Relay calls in number order: a call sent again that we have is dropped;
        one after a gap waits until the gap is filled."""
        self._poll_until = time.monotonic() + self._poll_s
        seq = _call_seq(frames[0])
        if self._coming is not None and seq is not None and seq >= self._coming[0]:
            self._coming = None  # it came: the leader's silence is its own again
        if seq is not None and seq <= self._last_seq:
            return
        if seq is not None and seq != self._last_seq + 1:
            if self._gap is None:
                self._start_gap(seq)
            gap = self._gap  # bounded as the read-ahead is: in count and in bytes
            if len(gap["held"]) >= BACKLOG_MESSAGES or gap["bytes"] >= BACKLOG_BYTES:
                raise ZbusError("too many calls held while lost ones are sent again: leaving the cluster")
            gap["held"].append((seq, frames))
            gap["bytes"] += _call_bytes(frames)
            return
        self._write(frames, seq)
        self._release_held()

    def _release_held(self) -> None:
        gap = self._gap
        while gap is not None and gap["held"] and gap["held"][0][0] <= self._last_seq + 1:
            seq, frames = gap["held"].popleft()
            gap["bytes"] -= _call_bytes(frames)
            if seq == self._last_seq + 1:
                self._write(frames, seq)
        if gap is not None and not gap["held"] and self._last_seq >= gap["upto"] - 1:
            log.warning("the lost calls arrived again: going on")
            self._gap = None

    def _write(self, frames: list, seq: int | None) -> None:
        """Write call ``seq`` into the ring, waiting for room; then it is the last
        relayed."""
        self._writing = seq
        try:
            self.ring.send(frames, on_full=self._on_ring_full)
        except (RingClosed, Cancelled) as e:
            raise ZbusError(f"relay failed: {e}") from e
        finally:
            self._writing = None
        if seq is not None:
            self._last_seq = seq

    def _on_ring_full(self) -> None:
        if self._deaths:  # a dead reader never frees the ring: report it and give up
            self._report_deaths()
            raise ZbusError("a worker died while a call was relayed to it")
        self._read_ahead()
        self._tick()

    def _tick(self) -> None:
        """Heartbeat the leader and check that it is alive; runs from the main loop
        and while a relay waits for slow workers."""
        if self._gap is not None:
            self._ask_again()
        now = time.monotonic()
        if now > self._leader_lost_at():
            raise LeaderLost(f"leader {self.settings.master_addr} lost: no heartbeat for "
                             f"{now - self._last_leader:.1f} s")
        if now >= self._next_hb:
            if self._last_seq and not self._ring_unnamed:
                # Call 1 came after every worker of the cluster was ready: this node's
                # have mapped the ring, so its name can go, and no end (a SIGKILL of
                # every process of the node included) leaves it in /dev/shm.
                shm.unlink(self.ring.name)
                self._ring_unnamed = True
            if self.node_rank is not None:
                # with the last call relayed: the leader may forget its copies up to it
                self._tell_as_member("hb", self._last_seq, timeout=0.1)
                for rank, code in self._dead.items():  # a report lost in a reset connection
                    self._tell_as_member("died", rank, code, timeout=0.1)
                touch_health()
            self._next_hb = now + heartbeat_interval(self.liveness_s)

    def _on_death(self, local_rank: int, exitcode: int | None) -> None:  # monitor thread
        self._deaths.append((local_rank, exitcode))
        os.write(self._death_w, b"d")

    def _report_deaths(self) -> None:
        n = self.settings.nproc_per_node
        while self._deaths:
            local, code = self._deaths.pop(0)
            rank = self.node_rank * n + local
            log.error("worker rank %d exited (%s)", rank, code)
            self._dead[rank] = code  # and again with each heartbeat, until the leader fails
            self._tell_as_member("died", rank, code, timeout=1.0)

    # --- plumbing ------------------------------------------------------------------

    def _tell_as_member(self, kind: str, *rest: Any, timeout: float) -> bool:
        """Send a member's message: it names this node's rank and its leader's
        session, so a leader started since at the same address drops it (a node
        of its own may hold that rank)."""
        return self._send_to_leader([kind, self.node_rank, self._leader_session, *rest], timeout)

    def _send_to_leader(self, msg: Any, timeout: float) -> bool:
        """Whether ``msg`` was queued within ``timeout``."""
        if send_message(self.push, msg, timeout, "send to leader"):
            return True
        log.warning("leader not taking messages (%s not sent)", msg[0])
        return False

    def _recv(self) -> tuple[bytes, Any]:
        """A message while joining: decoded in full on this node's own topic alone
        (the welcome holds the worker's arguments: tensors or registered types, say),
        CodecError if it cannot be; a heartbeat, whoever sent it, as plain data."""
        frames = self.sub.recv_multipart(copy=False)
        topic = frames[0].bytes
        own = topic == node_topic(self.node_id)
        return topic, self._decode([f.buffer for f in frames[1:]], plain=not own, raising=own)

    def _decode(self, frames: list, plain: bool = True, raising: bool = False) -> list | None:
        """A control message (a list of plain items), or None. The leader sends no
        arrays or tensors here, and one would fail the comparisons that read the
        message (their ``==`` has no truth value); decoded ``plain``, nothing is
        loaded or built for one (the welcome alone may hold them). ``raising``:
        CodecError for one that cannot be decoded."""
        try:
            msg = codec.decode(frames, plain=plain)
        except CodecError as e:
            if raising:
                raise
            log.warning("dropped a malformed control message: %s", e)
            return None
        if type(msg) is not list or not all(type(x) in _PLAIN for x in msg):
            log.warning("dropped a control message that is not a list of plain items: %s", brief(msg))
            return None
        return msg

    def _close(self) -> None:
        # The ring's name first: a SIGTERM or Ctrl-C that cuts the wait for the
        # workers short (``zbus demo`` ends its followers so) must not leave it.
        if self.ring is not None and not self._ring_unnamed:
            shm.unlink(self.ring.name)
            self._ring_unnamed = True
        try:
            if self.workers is not None:
                if self.ring is not None:
                    self.ring.abort()  # workers blocked on the ring see it closed at once
                self.workers.stop(grace=self._stop_grace, term_s=min(2.0, self._stop_grace * 2))
        finally:
            if self.ring is not None:
                self.ring.close()
            for sock in (self.sub, self.push):
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
            os.close(self._death_r)
            os.close(self._death_w)


def _is_heartbeat(msg: Any) -> bool:
    """Whether ``msg`` is a leader's heartbeat: ``["hb", last call sent, session]``."""
    return type(msg) is list and len(msg) == 3 and msg[0] == "hb"


def _call_bytes(frames: list) -> int:
    """The bytes of a call's frames (one cut in parts is a tuple of them)."""
    return sum(memoryview(p).nbytes for f in frames for p in (f if type(f) is tuple else (f,)))


def _call_seq(envelope: Any) -> int | None:
    """A call's number, or None for anything else (the workers judge it)."""
    try:
        head = protocol.read_envelope(envelope)
    except CodecError:
        return None
    return head[1] if head[0] == protocol.CALL else None


def run_follower(**kwargs: Any) -> int:
    return NodeAgent(**kwargs).run()

