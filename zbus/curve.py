"""CurveZMQ on every TCP socket: authenticated, encrypted links.

``zbus keygen DIR --nodes N`` writes one folder per host, each with only the
secrets that host needs::

    DIR/leader/leader.key, leader.key_secret   the leader's key pair
    DIR/leader/authorized/node-<i>.key         public keys allowed to join
    DIR/node-<i>/leader.key                    the leader's public key
    DIR/node-<i>/node.key, node.key_secret     that node's key pair

The leader (``curve_dir=`` / ``ZBUS_CURVE_DIR``) makes its sockets Curve servers
and lets a ZAP handler admit only the public keys in ``authorized/``; a follower
(``--curve-dir``) and its workers use the node's key pair and the leader's
public key. A node without a listed key fails the handshake: ZeroMQ drops the
connection before a single message of it is read.

Or one shared secret (``ZBUS_SECRET``, ``ZBUS_SECRET_FILE``, ``--secret-file``):
every key pair is derived from it with HKDF-SHA256 (RFC 5869; salt
``zbus-curve-v1``, info ``leader`` or ``node-<rank>``), a curve25519 secret key
being any 32 bytes. Each node rank still has its own key pair.

Either way each node key is bound to one node rank (``node-<i>.key`` to rank i):
the leader drops what a key sends for another node's ranks (see
``zbus.datapath.DataPath``), using the ZAP User-Id, the z85 public key, that libzmq
attaches to every message received over an authenticated connection.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import shutil
import struct
import threading
import time
from typing import Any

import zmq
import zmq.utils.z85

from .errors import ZbusError

# zmq.auth (and the asyncio it pulls in) loads only when keys are used.

log = logging.getLogger(__name__)


MIN_SECRET_BYTES = 16
MAX_SECRET_FILE = 4096  # bytes: a secret file is a line (a path to /dev/zero must not hang a start)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
MONITOR_BATCH = 1000  # handshake events read at a time
# CurveZMQ boxes each frame in 33 more bytes (its MESSAGE command's name, nonce, MAC
# and flags), and ZeroMQ holds the boxed frame to MAXMSGSIZE: a reader's limit
# leaves this much over what it takes, or a frame within it drops the connection.
FRAME_SLACK = 64
NODE_KEY = re.compile(r"node-([1-9][0-9]*)\.key")


def curve_dir_from_env(value: str | None = None) -> str | None:
    return value or os.environ.get("ZBUS_CURVE_DIR") or None


def secret_from_env(value: str | bytes | None = None, path: str | None = None) -> bytes | None:
    """The cluster secret: ``value``, else the file at ``path`` or named by
    ``ZBUS_SECRET_FILE``, else ``ZBUS_SECRET``, each without the white space around
    it; None if none is set. One given but empty is refused, not taken for none: a
    node would run without keys."""
    path = path or (None if value is not None else os.environ.get("ZBUS_SECRET_FILE") or None)
    if value is None and path:
        with open(path, "rb") as f:
            warn_if_others_read(f.fileno(), path)
            value = f.read(MAX_SECRET_FILE + 1)
        if len(value) > MAX_SECRET_FILE:
            raise ZbusError(f"the cluster secret file {path} holds over {MAX_SECRET_FILE} bytes: "
                            "is it the secret?")
    if value is None:
        value = os.environ.get("ZBUS_SECRET") or None  # (empty: unset)
    if value is None:
        return None
    # (os.fsencode: the bytes of the variable as set, UTF-8 or not, as a file gives them)
    secret = (os.fsencode(value) if isinstance(value, str) else bytes(value)).strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ZbusError(f"the cluster secret is {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES} "
                        "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def warn_if_others_read(fd: int, path: str) -> None:
    """Warn when a secret's file may be read by others than its owner (as ssh does;
    a warning, not a refusal: Kubernetes mounts its secrets 0644 by default)."""
    mode = os.fstat(fd).st_mode & 0o777
    if mode & 0o077:
        log.warning("%s holds a secret and is readable by others (mode %o): chmod 600 it", path, mode)


def derive_key(secret: bytes, name: str) -> tuple[bytes, bytes]:
    """The key pair (z85 public, z85 secret) named ``name`` ("leader", "node-<r>")
    of a cluster secret: HKDF-SHA256, one 32-byte output block."""
    prk = hmac.new(b"zbus-curve-v1", secret, hashlib.sha256).digest()
    key = zmq.utils.z85.encode(hmac.new(prk, name.encode() + b"\x01", hashlib.sha256).digest())
    return zmq.curve_public(key), key


def keygen(directory: str, nodes: int) -> list[str]:
    """Create the key folders for a leader and ``nodes`` followers; return them."""
    import zmq.auth

    if not zmq.has("curve"):
        raise ZbusError("this libzmq has no CurveZMQ support (needs libsodium)")
    if nodes < 1:
        raise ValueError(f"keygen needs at least 1 node, got {nodes}")
    if os.path.isdir(directory) and os.listdir(directory):  # an old node key would stay authorized
        raise ZbusError(f"{directory} is not empty: keygen makes a whole new set of keys in a new "
                        "folder (or remove this one)")
    # (folders only this user enters: the secret files are made readable to all, then chmod)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        return _make_keys(directory, nodes)
    except BaseException:  # (a full disk, Ctrl-C): no half set, and the folder free for a retry
        for name in os.listdir(directory):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        raise


def _make_keys(directory: str, nodes: int) -> list[str]:
    import zmq.auth

    leader = os.path.join(directory, "leader")
    authorized = os.path.join(leader, "authorized")
    os.makedirs(authorized, mode=0o700)
    os.chmod(leader, 0o700)
    leader_public, _ = zmq.auth.create_certificates(leader, "leader")
    made = [leader]
    for i in range(1, nodes + 1):
        node = os.path.join(directory, f"node-{i}")
        os.makedirs(node, mode=0o700)
        public, _ = zmq.auth.create_certificates(node, "node")
        shutil.copy(public, os.path.join(authorized, f"node-{i}.key"))
        shutil.copy(leader_public, os.path.join(node, "leader.key"))
        made.append(node)
    for folder in made:
        for name in os.listdir(folder):
            if name.endswith("_secret"):
                os.chmod(os.path.join(folder, name), 0o600)
    return made


def _load(path: str, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth
    from zmq.utils import z85

    if not os.path.exists(path):
        raise ZbusError(f"missing key file {path} (make keys with 'zbus keygen')")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, IndexError) as e:  # (no key, a line cut short, not text: said in one line)
        raise ZbusError(f"{path} is no key file of 'zbus keygen': {type(e).__name__}: {e}") from None
    for key in (public, secret_key):  # (else ZeroMQ refuses it later, as a bare EINVAL)
        try:
            whole = key is None or len(z85.decode(key)) == 32
        except (ValueError, KeyError, struct.error):  # (a character, or a value, no Z85 has)
            whole = False
        if not whole:
            raise ZbusError(f"{path} holds a key that is not 40 Z85 characters (make keys: 'zbus keygen')")
    if secret and secret_key is None:
        raise ZbusError(f"{path} holds no secret key")
    if secret:
        with open(path, "rb") as f:
            warn_if_others_read(f.fileno(), path)
    return public, secret_key


class _ZapLog(logging.LoggerAdapter):
    """pyzmq logs each ZAP decision at DEBUG; a refused key deserves a warning, at
    most one a second (a peer may open connections with new keys as fast as it
    likes: the ZAP thread writes each line while the handshakes behind it wait)."""

    refused = 0  # keys refused in all
    _said_at = -1.0
    _unsaid = 0

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not (str(msg).startswith("DENIED") or (args and args[0] == "DENIED")):
            return super().debug(msg, *args, **kwargs)
        self.refused += 1
        now = time.monotonic()
        if now - self._said_at < 1.0:
            self._unsaid += 1
            return
        self.say_unsaid()
        self._said_at = now
        self.warning(msg, *args, **kwargs)

    def say_unsaid(self) -> None:
        """The count of the refusals not logged since the last one that was."""
        if self._unsaid:
            self.warning("ZAP refused %d more keys since the last one logged", self._unsaid)
            self._unsaid = 0


class LeaderCurve:
    """The leader's keys and its ZAP handler, which admits only listed keys; each
    listed key belongs to one node rank (``rank_of``)."""

    def __init__(self, ctx: zmq.Context, public: bytes, secret: bytes, ranks: dict[str, int]):
        self.public, self.secret, self.ranks = public, secret, ranks
        from zmq.auth.thread import ThreadAuthenticator

        self.zap_log = _ZapLog(logging.getLogger("zbus.curve.zap"), {})
        self.auth = ThreadAuthenticator(ctx, log=self.zap_log)
        self.auth.certs["*"] = {key.encode(): True for key in ranks}  # as configure_curve loads them
        self.auth.start()
        self._monitors: list[zmq.Socket] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def from_dir(cls, ctx: zmq.Context, directory: str) -> LeaderCurve:
        public, secret = _load(os.path.join(directory, "leader.key_secret"), secret=True)
        authorized = os.path.join(directory, "authorized")
        names = os.listdir(authorized) if os.path.isdir(authorized) else []
        if not names:
            raise ZbusError(f"{authorized} lists no node keys: no node could join")
        ranks = {}
        for name in names:
            match = NODE_KEY.fullmatch(name)
            if match is None:  # the file name binds the key to its node rank
                raise ZbusError(f"{authorized}/{name}: node keys must be named node-<rank>.key")
            ranks[_load(os.path.join(authorized, name), secret=False)[0].decode()] = int(match[1])
        return cls(ctx, public, secret, ranks)

    @classmethod
    def from_secret(cls, ctx: zmq.Context, secret: bytes, nnodes: int) -> LeaderCurve:
        ranks = {derive_key(secret, f"node-{r}")[0].decode(): r for r in range(1, nnodes)}
        return cls(ctx, *derive_key(secret, "leader"), ranks)

    def rank_of(self, user_id: str) -> int | None:
        """The node rank whose key authenticated a message (its ZAP User-Id)."""
        return self.ranks.get(user_id)

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a Curve server; call before bind. Failed handshakes on it are
        logged: a key from another set (another secret) fails before ZAP sees it."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        self._monitors.append(sock.get_monitor_socket(HANDSHAKE_FAILED))
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="zbus-curve-monitor", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """Read every event as it comes: ZeroMQ's I/O thread, which carries every
        link of the leader, blocks once 2000 wait unread, and a peer with no key
        makes one per TCP connection it opens and closes."""
        from zmq.utils.monitor import recv_monitor_message

        last_log = 0.0
        while not self._stop.is_set():
            poller = zmq.Poller()
            for sock in list(self._monitors):  # (the second socket's comes after this starts)
                poller.register(sock, zmq.POLLIN)
            for sock, _ in poller.poll(100):
                for _ in range(MONITOR_BATCH):  # then a look at the stop flag
                    try:
                        event = recv_monitor_message(sock, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if event["event"] & HANDSHAKE_FAILED and time.monotonic() - last_log >= 1.0:
                        last_log = time.monotonic()  # at most once a second under a flood
                        log.warning("a peer failed the CurveZMQ handshake on %s (a key of another set "
                                    "or secret?)", event["endpoint"].decode(errors="replace"))

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(2)
        for sock in self._monitors:
            sock.close(linger=0)
        self.auth.stop()
        self.zap_log.say_unsaid()


class NodeCurve:
    """A follower's (and its workers') keys: the node's pair, the leader's public."""

    def __init__(self, public: bytes | str, secret: bytes | str, server: bytes | str):
        def raw(key: bytes | str) -> bytes:
            return key.encode() if isinstance(key, str) else key

        self.public, self.secret, self.server_key = raw(public), raw(secret), raw(server)

    @classmethod
    def from_dir(cls, directory: str) -> NodeCurve:
        public, secret = _load(os.path.join(directory, "node.key_secret"), secret=True)
        return cls(public, secret, _load(os.path.join(directory, "leader.key"), secret=False)[0])

    @classmethod
    def from_secret(cls, secret: bytes, node_rank: int) -> NodeCurve:
        return cls(*derive_key(secret, f"node-{node_rank}"), derive_key(secret, "leader")[0])

    def to_dict(self) -> dict:
        """For this node's workers (they get it in their private environment)."""
        return {"public": self.public.decode(), "secret": self.secret.decode(),
                "server": self.server_key.decode()}

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a Curve client of the leader; call before connect."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_key


def describe(curve: Any) -> str:
    return "CurveZMQ: authenticated and encrypted" if curve else "not authenticated (no CurveZMQ keys)"
