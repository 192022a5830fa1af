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
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import zmq

from .errors import ZbusError

# zmq.auth (and the asyncio it pulls in) loads only when keys are used.

log = logging.getLogger(__name__)


def curve_dir_from_env(value: str | None = None) -> str | None:
    return value or os.environ.get("ZBUS_CURVE_DIR") or None


def keygen(directory: str, nodes: int) -> list[str]:
    """Create the key folders for a leader and ``nodes`` followers; return them."""
    import zmq.auth

    if not zmq.has("curve"):
        raise ZbusError("this libzmq has no CurveZMQ support (needs libsodium)")
    os.makedirs(directory, exist_ok=True)
    leader = os.path.join(directory, "leader")
    authorized = os.path.join(leader, "authorized")
    os.makedirs(authorized, exist_ok=True)
    leader_public, _ = zmq.auth.create_certificates(leader, "leader")
    made = [leader]
    for i in range(1, nodes + 1):
        node = os.path.join(directory, f"node-{i}")
        os.makedirs(node, exist_ok=True)
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

    if not os.path.exists(path):
        raise ZbusError(f"missing key file {path} (make keys with 'zbus keygen')")
    public, secret_key = zmq.auth.load_certificate(path)
    if secret and secret_key is None:
        raise ZbusError(f"{path} holds no secret key")
    return public, secret_key


class LeaderCurve:
    """The leader's keys and its ZAP handler, which admits only listed keys."""

    def __init__(self, ctx: zmq.Context, directory: str):
        self.public, self.secret = _load(os.path.join(directory, "leader.key_secret"), secret=True)
        authorized = os.path.join(directory, "authorized")
        if not os.path.isdir(authorized) or not os.listdir(authorized):
            raise ZbusError(f"{authorized} lists no node keys: no node could join")
        from zmq.auth.thread import ThreadAuthenticator

        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("zbus.curve.zap"))
        self.auth.start()
        self.auth.configure_curve(domain="*", location=authorized)

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a Curve server; call before bind."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def close(self) -> None:
        self.auth.stop()


class NodeCurve:
    """A follower's (and its workers') keys: the node's pair, the leader's public."""

    def __init__(self, directory: str):
        self.directory = directory
        self.public, self.secret = _load(os.path.join(directory, "node.key_secret"), secret=True)
        self.server_key, _ = _load(os.path.join(directory, "leader.key"), secret=False)

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a Curve client of the leader; call before connect."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_key


def describe(curve: Any) -> str:
    return "CurveZMQ: authenticated and encrypted" if curve else "not authenticated (no CurveZMQ keys)"
