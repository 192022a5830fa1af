"""Authenticated links and hostile input, on loopback clusters."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import workers
import zmq
from conftest import TEST_PATH, end_process, wait_until
from test_cluster import follower, free_port_pair

import zbus
from zbus import codec, datapath, protocol
from zbus.cluster import rpc_topic
from zbus.curve import keygen

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")


def tree_listeners(root, leave_out=()) -> set:
    """(ip, port) of every TCP socket listening in ``root``'s process tree (the
    process and all its descendants), without the trees of the pids in ``leave_out``."""
    import psutil

    skip = set(leave_out)
    for pid in leave_out:
        try:
            skip |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    found = set()
    for proc in [root, *root.children(recursive=True)]:
        if proc.pid in skip:
            continue
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return found


def test_keygen_writes_one_folder_per_host_with_private_secrets(tmp_path):
    folders = keygen(str(tmp_path), nodes=2)
    assert [os.path.basename(f) for f in folders] == ["leader", "node-1", "node-2"]
    assert sorted(os.listdir(tmp_path / "leader" / "authorized")) == ["node-1.key", "node-2.key"]
    assert sorted(os.listdir(tmp_path / "node-1")) == ["leader.key", "node.key", "node.key_secret"]
    for secret in (tmp_path / "leader" / "leader.key_secret", tmp_path / "node-2" / "node.key_secret"):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    # a node folder holds no other host's secret
    assert not any(n.endswith("_secret") and n != "node.key_secret" for n in os.listdir(tmp_path / "node-1"))
    # only this user enters the folders (the secrets are made readable to all, then chmod 600)
    for folder in ("leader", "leader/authorized", "node-1", "node-2"):
        assert stat.S_IMODE(os.stat(tmp_path / folder).st_mode) == 0o700, folder


def test_keygen_makes_a_whole_new_set_or_nothing(tmp_path):
    """keygen into a folder of an earlier set refuses, and leaves that set as it
    was: it added keys to the old ``authorized/`` (node-1's replaced, node-2's and
    node-3's kept), so a node key of the old set was still let in. Sabotage: no
    check of the folder and ``exist_ok=True`` on its folders (as before) -> no
    error, node-1's key changed."""
    keygen(str(tmp_path / "keys"), nodes=3)
    authorized = tmp_path / "keys" / "leader" / "authorized"
    first = {name: (authorized / name).read_bytes() for name in os.listdir(authorized)}
    with pytest.raises(zbus.ZbusError, match="not empty"):
        keygen(str(tmp_path / "keys"), nodes=1)
    assert {name: (authorized / name).read_bytes() for name in os.listdir(authorized)} == first


def test_a_secret_given_empty_is_refused_not_taken_for_none(tmp_path, monkeypatch):
    """An empty secret file (or ``secret=b""``) fell back to ``ZBUS_SECRET``, or to no
    keys: the follower then waited out its join timeout unkeyed, with no word why.
    White space around a secret is dropped from a file and the environment alike.
    Sabotage: ``value or os.environ.get("ZBUS_SECRET")`` again -> None."""
    from zbus.curve import secret_from_env

    monkeypatch.delenv("ZBUS_SECRET", raising=False)
    monkeypatch.delenv("ZBUS_SECRET_FILE", raising=False)
    empty = tmp_path / "secret"
    empty.write_text("\n")
    for given in ({"path": str(empty)}, {"value": b""}, {"value": "  "}):
        with pytest.raises(zbus.ZbusError, match="the cluster secret is 0 bytes"):
            secret_from_env(**given)
    monkeypatch.setenv("ZBUS_SECRET_FILE", str(empty))
    with pytest.raises(zbus.ZbusError, match="0 bytes"):
        secret_from_env()
    monkeypatch.delenv("ZBUS_SECRET_FILE")
    assert secret_from_env() is None
    monkeypatch.setenv("ZBUS_SECRET", "s" * 16 + "\n")
    assert secret_from_env() == b"s" * 16


def test_a_secret_of_bytes_that_are_not_utf8_is_the_same_from_the_environment_and_a_file(tmp_path,
                                                                                        monkeypatch):
    """The environment holds bytes: Python decodes those that are not UTF-8 as
    surrogates, and ``str.encode()`` raised UnicodeEncodeError on them (a traceback
    out of ``zbus follower``), where a file of the same bytes worked. Sabotage:
    ``value.encode()`` again in ``secret_from_env`` -> UnicodeEncodeError."""
    from zbus.curve import secret_from_env

    raw = bytes(range(0x80, 0xa0))  # 32 bytes, none of them UTF-8 alone
    monkeypatch.delenv("ZBUS_SECRET_FILE", raising=False)
    monkeypatch.setenv("ZBUS_SECRET", os.fsdecode(raw))
    assert secret_from_env() == raw
    (tmp_path / "secret").write_bytes(raw)
    os.chmod(tmp_path / "secret", 0o600)
    assert secret_from_env(path=str(tmp_path / "secret")) == raw


def test_a_secret_file_others_may_read_is_warned_of_and_one_too_long_refused(tmp_path, monkeypatch, caplog):
    """A secret's file that others may read (``cp`` under umask 022) was used without
    a word, and one that was no secret was read whole (``/dev/zero``: for ever).
    Now the first is warned of (as ssh does; Kubernetes mounts secrets 0644, so not
    refused), and a file over 4 KiB refused. Sabotage: no ``warn_if_others_read``
    in ``secret_from_env`` or ``_load``; ``f.read()`` whole -> a 5 KiB file taken
    for the secret."""
    from zbus.curve import NodeCurve, keygen, secret_from_env

    monkeypatch.delenv("ZBUS_SECRET", raising=False)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32 + "\n")
    secret.chmod(0o600)
    with caplog.at_level("WARNING", logger="zbus.curve"):
        assert secret_from_env(path=str(secret)) == b"s" * 32
        assert not caplog.records
        secret.chmod(0o644)
        assert secret_from_env(path=str(secret)) == b"s" * 32
        assert "readable by others (mode 644): chmod 600 it" in caplog.text
    big = tmp_path / "big"
    big.write_bytes(b"s" * 5000)
    big.chmod(0o600)
    with pytest.raises(zbus.ZbusError, match="holds over 4096 bytes"):
        secret_from_env(path=str(big))
    node = keygen(str(tmp_path / "keys"), 1)[1]
    caplog.clear()
    with caplog.at_level("WARNING", logger="zbus.curve"):
        NodeCurve.from_dir(node)
        assert not caplog.records
        os.chmod(os.path.join(node, "node.key_secret"), 0o644)
        NodeCurve.from_dir(node)
        assert "node.key_secret holds a secret and is readable by others" in caplog.text


def test_refused_keys_are_logged_at_most_once_a_second(caplog):
    """A peer that knows the leader's public key may open connections with new
    keys as fast as it likes: each refusal was a WARNING line, written by the ZAP
    thread while the handshakes behind it waited. Now one a second, and a count of
    the rest. Sabotage: no ``_said_at`` check in ``_ZapLog.debug`` -> 40 lines."""
    from zbus.curve import LeaderCurve

    ctx = zmq.Context()
    curve = LeaderCurve.from_secret(ctx, b"k" * 32, 2)
    pull = ctx.socket(zmq.PULL)
    clients = []
    try:
        curve.server(pull)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        with caplog.at_level(logging.WARNING, logger="zbus.curve.zap"):
            start = time.monotonic()
            for _ in range(40):
                push = ctx.socket(zmq.PUSH)
                push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
                push.curve_serverkey = curve.public
                push.connect(f"tcp://127.0.0.1:{port}")
                clients.append(push)
            wait_until(lambda: curve.zap_log.refused >= 40, 20, "40 keys refused")
            took = time.monotonic() - start
        said = [r for r in caplog.records if r.name == "zbus.curve.zap"]
        # one a second, and each with the count of the rest before it
        assert 1 <= len(said) <= 1 + 2 * math.ceil(took) < 40, ([r.getMessage() for r in said], took)
    finally:
        for sock in (*clients, pull):
            sock.close(linger=0)
        curve.close()
        ctx.term()


def test_keyed_cluster_works_and_nodes_without_listed_keys_are_refused(tmp_path, caplog):
    """A listed node joins and serves. A node without keys, and a node that holds the
    right leader key but a node key the leader does not list, stay out: start-up
    fails naming rank 1 while both strangers still wait (they did not crash), and
    the leader's ZAP handler logged the refusal of that very key at WARNING.
    Sabotage: let ZAP admit every key (in LeaderCurve.__init__, replace the certs
    line with self.auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)):
    no refusal is logged and the test fails on it (the unlisted node still does not
    join: the leader's key-to-rank binding drops its join, a second line of defence)."""
    import shutil

    import zmq.auth

    keygen(str(tmp_path / "keys"), nodes=1)
    keygen(str(tmp_path / "other"), nodes=1)
    leader_dir = str(tmp_path / "keys" / "leader")
    # the right leader key, a node key pair the leader does not list
    unlisted = tmp_path / "unlisted"
    unlisted.mkdir()
    for name in ("node.key", "node.key_secret"):
        shutil.copy(tmp_path / "other" / "node-1" / name, unlisted / name)
    shutil.copy(tmp_path / "keys" / "node-1" / "leader.key", unlisted / "leader.key")
    unlisted_key = zmq.auth.load_certificate(str(unlisted / "node.key"))[0].decode()
    port = free_port_pair()
    good = follower(port, "--node-rank", "1", "--curve-dir", str(tmp_path / "keys" / "node-1"))
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                           master_port=port, curve_dir=leader_dir, join_timeout=60) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
        assert good.wait(30) == 0
    finally:
        end_process(good)
    for args in ([], ["--curve-dir", str(unlisted)]):  # no keys; an unlisted node key
        port = free_port_pair()
        stranger = follower(port, "--node-rank", "1", *args)
        caplog.clear()
        try:
            with caplog.at_level(logging.DEBUG, logger="zbus.curve.zap"):
                with pytest.raises(zbus.StartupError, match=r"missing node ranks: \[1\]"):
                    zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                                  master_port=port, curve_dir=leader_dir, join_timeout=4)
            assert stranger.poll() is None  # kept out while trying, not crashed
            refusals = [r.getMessage() for r in caplog.records
                        if r.name == "zbus.curve.zap" and r.levelno == logging.WARNING
                        and r.getMessage().startswith("DENIED")]
            if args:  # the handshake reached ZAP, which refused this key
                assert any(unlisted_key in m for m in refusals), refusals
            else:  # no CURVE at all: the mechanism mismatch fails before ZAP
                assert refusals == []
        finally:
            end_process(stranger, timeout=1)


def test_unauthenticated_leader_warns_once_and_binds_only_its_address(caplog):
    """Every TCP listener of the leader's process tree (the driver and its workers,
    the follower's tree left out) is one of exactly two: master_port and
    master_port + 1 on 127.0.0.1, no wildcard, no third port.
    Sabotage: bind the PULL socket to "0.0.0.0" instead of self.bind_ip in
    Leader.__init__ (zbus/leader.py), or have a worker listen on a port of its own
    (socket.create_server(("127.0.0.1", 0)) in Worker's start-up)."""
    import psutil

    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with caplog.at_level(logging.WARNING, logger="zbus.leader"):
            with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                               master_port=port, join_timeout=60) as ex:
                ex.collective_rpc("noop", timeout=30)
                driver = psutil.Process()
                local_workers = [c for c in driver.children(recursive=True) if c.pid != proc.pid
                                 and proc.pid not in {p.pid for p in c.parents()}]
                assert local_workers  # the leader's own worker runs now
                assert tree_listeners(driver, leave_out=[proc.pid]) == {("127.0.0.1", port),
                                                                        ("127.0.0.1", port + 1)}
        warnings = [r for r in caplog.records if "not authenticated" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        end_process(proc)


def raw(*items) -> bytes:
    """A msgpack header written without the codec (which would refuse to write it)."""
    return msgpack.packb(list(items), use_bin_type=True)


def ext(code: int, *body) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(list(body), use_bin_type=True))


UNKNOWN = "no-such-kind"  # what each crafted message below says it is, once decoded
# Well-formed msgpack that the codec must refuse, each with the reason it gives:
# decoded anyway, each would be an unknown control message ("unknown-kind").
CRAFTED = {
    "a frame referenced twice": (r"buffer index 0 used twice", [
        [raw(UNKNOWN, ext(codec._BYTES, 0, 0), ext(codec._BYTES, 0, 0)), b"d" * 100],
        [raw(UNKNOWN, [ext(codec._BYTES, 0, 0)] * 64), os.urandom(2**20)]]),
    "deep plain nesting": (r"nested deeper than 64", [
        [b"\x92" + msgpack.packb(UNKNOWN) + b"\x91" * 500 + b"\x90"],  # [kind, [[[...[]]]]]: 500 arrays
        [b"\x92" + msgpack.packb(UNKNOWN) + b"\x81\xa1a" * 500 + b"\xc0"]]),  # [kind, {"a": {"a": ...}}]
    "oversized declared tensors": (r"without data|does not match its shape", [
        [raw(UNKNOWN, ext(codec._NDARRAY, "|u1", [2**27], None))],  # 128 MiB from 40 bytes
        [raw(UNKNOWN, ext(codec._NDARRAY, "<f4", [2**20, 2**20], 0)), b"x" * 16],
        [raw(UNKNOWN, ext(codec._TENSOR, "float32", [2**31], [1], 0)), b"x" * 64],
        [raw(UNKNOWN, ext(codec._TENSOR, "float32", [2**40], None, None))]]),
}


def members_of(ex: zbus.Executor) -> dict:
    """The leader's members as they are now (copies: a member's record is changed
    in place), less when each was last heard."""
    return {r: dataclasses.replace(n, last_seen=0.0) for r, n in ex._leader.nodes.items()}


def test_hostile_input_is_dropped_counted_and_the_cluster_keeps_serving():
    """Hostile input in batches, one kind each, on the leader's PULL port: every
    message is accounted for, exactly, under its reason (``Leader.dropped_by``),
    and the cluster serves on with its members unchanged. Each batch ends with a
    marker (a "refused" from no node: ``stray-refused``), which the I/O thread
    drops only after the reading thread has read, and dropped or queued, all
    that came before it on this connection; so once the marker counts, the batch
    is all counted and nothing of it may come later. The crafted msgpack (a frame
    referenced twice, 500-deep nesting, tensors that declare more than they carry)
    is first checked to fail the codec for that very reason, so each refusal is
    the guard's, not an accident of the crafting.
    Sabotage (the codec checks above skipped, to reach the leader): drop the
    ``if index in self.used`` check in ``_Decoder.frame`` (zbus/codec.py) → fails
    (one "unknown-kind" where "undecodable" was due; the 64 references to 1 MiB
    still hit the byte budget); set ``MAX_DEPTH = 10**6`` → fails (both nested
    messages "unknown-kind"). (The tensors' and arrays' checks are the replies':
    a message that is no reply is decoded as plain data, which refuses both; see
    ``test_a_malformed_error_reply_fails_its_call_not_the_executor``.) With the
    codec checks in place each of these fails earlier, at ``codec.decode``. Count no drop for a CodecError in
    ``DataPath._checked_message`` → fails on the first batch (the old
    ``dropped >= 5000`` passed on the flood alone)."""
    for why, messages in CRAFTED.values():
        for frames in messages:
            with pytest.raises(zbus.CodecError, match=why):
                codec.decode(frames)
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    ctx = zmq.Context()
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                           master_port=port, join_timeout=60) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
            members = members_of(ex)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://127.0.0.1:{port + 1}")
            marker = codec.encode(["refused", "no-such-node", "a marker"])
            total = {}

            def batch(what: str, messages: list, expected: dict) -> None:
                before = ex._leader.dropped_by
                for msg in messages:
                    push.send_multipart(msg)
                push.send_multipart(marker)
                want = {**expected, "stray-refused": expected.get("stray-refused", 0) + 1}
                want = {k: before.get(k, 0) + want.get(k, 0) for k in {*before, *want}}
                deadline = time.monotonic() + 30
                while (ex._leader.dropped_by.get("stray-refused", 0) < want["stray-refused"]
                       and time.monotonic() < deadline):
                    time.sleep(0.02)
                assert ex._leader.dropped_by == want, what
                for k, n in expected.items():
                    total[k] = total.get(k, 0) + n
                total["stray-refused"] = total.get("stray-refused", 0) + 1

            header = codec.encode(["hb", 1])[0]
            batch("garbage", [[b"\xc1garbage"], [header[:-1]], [b"\x93\x01\x02"],  # invalid, truncated x2
                              [b"\x92\xd4\x63\x00\x01"],  # an unknown extension type
                              [b"\x92\xa4join\xd6\xff\x00\x00\x00\x01"],  # msgpack's timestamp
                              [b"x" * 100, b"y"]],  # trailing bytes after the first item
                  {"undecodable": 6})
            batch("not a non-empty list", [codec.encode({"not": "a list"}), codec.encode([]),
                                           codec.encode(5)], {"shape": 3})
            session = ex._leader.path.session
            batch("replies for no remote rank", [codec.encode([session, 7, 1, 0, None])],  # rank 0 is local
                  {"unknown-rank": 1})
            batch("replies of the wrong shape", [codec.encode([session, 1, 1, 0]),
                                                 codec.encode([session, 1, 1, "0", None])], {"shape": 2})
            batch("unknown kinds", [codec.encode(["died", 99, session, 1, 0]), codec.encode([UNKNOWN]),
                                    codec.encode(["hb", 1, session, 2, 3])], {"unknown-kind": 3})
            # a member's messages of another leader's node (or that name no session)
            batch("other sessions", [codec.encode(["leaving", 1, "0" * 16, "an orphan"]),
                                     codec.encode(["died", 1, None, 1, 9]), codec.encode(["hb", 1]),
                                     codec.encode(["gap", 1, [session], 1, 2]),
                                     codec.encode([1, 1, 0, None]), codec.encode(["f" * 16, 1, 1, 0, None])],
                  {"other-session": 6})
            # a node's control message holds plain data: a tensor, array or registered type
            # in one is refused unbuilt (an array token was taken for a bad status, and an
            # array head, whose == has no truth value, broke its handler)
            batch("typed values", [codec.encode(["status", np.array([1, 2])]),
                                   codec.encode([np.array([1, 2]), 0]),
                                   [raw("status", ext(codec._TENSOR, "float32", [1], None, None))],
                                   [raw("died", 1, session, ext(codec._DATACLASS, "x", {}), 0)],
                                   [raw("leaving", 1, session, ext(codec._OBJECT, "vllm:X", None))]],
                  {"undecodable": 5})
            # a well-formed join once formed is refused with an answer, and counted; an id
            # not of hex digits is malformed: a member's id + "R*" would have its answer
            # reach that member as a call in parts (a topic is a prefix)
            batch("joins", [codec.encode(["join", "a" * 16, {"version": "evil"}]),
                            codec.encode(["join", 5, "x"]), codec.encode(["join", "a" * 16 + "R*", {}])],
                  {"bad-join": 2, "late-join": 1})
            batch("status", [codec.encode(["status", ""]), codec.encode(["status", "x" * 65])],
                  {"bad-status": 2})
            for name, (_, messages) in CRAFTED.items():
                # over 64 KiB and no reply: dropped unread (test_leader_memory.py)
                big = sum(sum(map(len, m)) > datapath.MAX_CONTROL_MESSAGE for m in messages)
                counts = {"undecodable": len(messages) - big, "too-big": big}
                batch(name, messages, {k: n for k, n in counts.items() if n})
            batch("a flood", [[b"\xc1flood"]] * 5000, {"undecodable": 5000})
            assert ex._leader.dropped_by == total and ex._leader.dropped == sum(total.values())
            # Raw bytes that are not ZeroMQ, on both ports, last: libzmq takes a peer whose
            # first byte is not 0xFF for ZMTP 1.0 and reads length-prefixed messages out of
            # the noise (how many depends on libzmq), on a connection of their own, so no
            # marker orders them: whatever of them reaches the leader is merely undecodable
            # or of the wrong shape (XPUB takes them for subscriptions, which count nothing).
            noise = random.Random(3)
            for p in (port, port + 1):
                with socket.create_connection(("127.0.0.1", p), timeout=5) as conn:
                    conn.sendall(noise.randbytes(4096))
            assert ex.collective_rpc("rank_value", args=(2,), timeout=30) == [20, 21]
            ex.check_health()
            assert members_of(ex) == members
            noise_drops = {k: n - total.get(k, 0) for k, n in ex._leader.dropped_by.items()
                           if n != total.get(k, 0)}
            print(f"raw bytes: {noise_drops} dropped")
            assert set(noise_drops) <= {"undecodable", "shape"}, noise_drops
            push.close()
        assert proc.wait(30) == 0
    finally:
        ctx.destroy(linger=0)
        end_process(proc)


def test_a_control_message_holding_a_tensor_makes_the_leader_load_nothing():
    """A 17-byte status request whose token is a tensor made the thread reading
    the leader's PULL socket import torch (seconds, with the socket held, on a
    leader that had not loaded it) before the tensor was judged. A node's control
    message is decoded as plain data now, and the tensor refused unbuilt. The
    leader runs in a process of its own, without torch. Sabotage: decode control
    messages with ``plain=False`` in ``DataPath._checked_message`` -> torch loaded."""
    script = f"""
import json, sys, time, zmq, msgpack
sys.path[:0] = {TEST_PATH.split(os.pathsep)!r}
from test_cluster import bare_leader
lead, port = bare_leader(nnodes=2)
lead.start()
push = zmq.Context.instance().socket(zmq.PUSH)
push.connect(f"tcp://127.0.0.1:{{port + 1}}")
tensor = msgpack.ExtType(2, msgpack.packb(["float32", [1], None, None]))
push.send(msgpack.packb(["status", tensor]))
end = time.monotonic() + 20
while lead.dropped_by.get("undecodable", 0) < 1 and time.monotonic() < end:
    time.sleep(0.02)
print(json.dumps({{"dropped": lead.dropped_by, "torch": "torch" in sys.modules}}))
push.close(linger=0)
lead.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"dropped": {"undecodable": 1}, "torch": False}, (got, out.stderr[-2000:])


def test_a_leaders_control_message_holding_a_tensor_makes_the_agent_load_nothing():
    """A heartbeat whose last item holds a tensor (a leader posing on a cluster
    without keys sends it) made the follower's agent import torch and build the
    tensor, before the plain-items check passed it (a dict). After its join, the
    agent decodes the leader's messages as plain data: the message is dropped, and
    nothing loaded. The agent's decode runs in a process of its own, without torch.
    Sabotage: ``plain=False`` as ``NodeAgent._decode``'s default -> torch loaded.

    While it joined, the agent decoded every message in full (the welcome holds
    the worker's arguments): such a heartbeat, on the heartbeat topic before any
    welcome, loaded torch too. Only the node's own topic is decoded in full now;
    a welcome of plain data still comes through. Sabotage: ``plain=False`` in
    ``NodeAgent._recv`` -> torch loaded."""
    script = """
import json, sys, msgpack, zmq
from zbus.agent import NodeAgent
from zbus.cluster import TOPIC_HEARTBEAT, node_topic
tensor = msgpack.ExtType(2, msgpack.packb(["float32", [1], [1], 0]))
hb = msgpack.packb(["hb", 1, "session", {"x": tensor}])
msg = NodeAgent._decode(None, [hb, bytearray(4)])
out = {"dropped": msg is None, "torch": "torch" in sys.modules}
ctx = zmq.Context()
agent = NodeAgent.__new__(NodeAgent)  # (no join: its receive alone, from a real socket)
agent.node_id, agent.sub = "n1", ctx.socket(zmq.PAIR)
agent.sub.bind("inproc://leader")
leader = ctx.socket(zmq.PAIR)
leader.connect("inproc://leader")
leader.send_multipart([TOPIC_HEARTBEAT, hb, bytes(4)])
out["joining"] = agent._recv()[1] is None
out["joining torch"] = "torch" in sys.modules
leader.send_multipart([node_topic("n1"), msgpack.packb(["welcome", {"rank": 1}])])
out["welcome"] = agent._recv()[1]
leader.close(0)
agent.sub.close(0)
ctx.term()
print(json.dumps(out))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=TEST_PATH))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "dropped": True, "torch": False, "joining": True, "joining torch": False,
        "welcome": ["welcome", {"rank": 1}]}, out.stderr[-2000:]


def test_the_metrics_server_drops_a_silent_client_and_answers_a_bad_header_without_a_traceback(
        monkeypatch, capfd):
    """The metrics port takes no key: a client that connects and sends nothing is
    dropped after ``METRICS_IDLE_S`` (1 s here), and one whose ``Accept`` header
    prometheus-client cannot parse gets 400, with nothing on the driver's stderr;
    a scrape after both is answered. Before (prometheus-client's own server), the
    silent client held its connection and a thread for good (the socket's 30 s
    wait here timed out), and the header printed a traceback on every request.
    Sabotage: no ``timeout`` on ``metrics._serve``'s handler, or no ``except``
    in its ``app``."""
    import urllib.error
    import urllib.request

    from zbus import metrics

    monkeypatch.setattr(metrics, "METRICS_IDLE_S", 1.0)
    port = free_port_pair()
    server, _ = metrics.serve_prometheus(metrics.Metrics(), port, "127.0.0.1")
    silent = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        assert silent.recv(1) == b""  # closed by the server
        url = f"http://127.0.0.1:{port}/metrics"
        bad = urllib.request.Request(url, headers={"Accept": "text/plain; version=x"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, timeout=10)
        assert e.value.code == 400
        assert b"zbus_rpcs_total 0" in urllib.request.urlopen(url, timeout=10).read()
        assert "Traceback" not in capfd.readouterr().err
    finally:
        silent.close()
        server.shutdown()
        server.server_close()


def test_the_metrics_server_holds_no_thread_for_a_trickled_request_nor_for_many_clients(monkeypatch):
    """A client that sends its request a byte every 0.2 s is closed once
    ``METRICS_IDLE_S`` (1 s here) is over, not when it stops. Of 30 clients that
    connect and send nothing (to a server that waits 30 s for a request),
    ``METRICS_CLIENTS`` (4 here) are served and the rest closed at once, so no
    more threads are started; a scrape is answered once they are gone. Before,
    the limit was per byte received (a trickle held its thread for as long as it
    went on) and each connection started a thread. Sabotage: no
    ``_request_head`` in the handler's ``setup`` -> the trickle is served for its
    whole 20 s; ``acquire`` always True in ``process_request`` -> none closed."""
    import urllib.request

    from zbus import metrics

    def closed(sock: socket.socket) -> bool:
        sock.setblocking(False)  # (a socket with a timeout waits for data first)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False

    monkeypatch.setattr(metrics, "METRICS_IDLE_S", 1.0)
    monkeypatch.setattr(metrics, "METRICS_CLIENTS", 4)
    port = free_port_pair()
    server, _ = metrics.serve_prometheus(metrics.Metrics(), port, "127.0.0.1")
    stop = threading.Event()
    trickle = socket.create_connection(("127.0.0.1", port), timeout=30)

    def send_slowly() -> None:
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x" * 4:  # 20 s of it, never whole
            if stop.wait(0.2):
                return
            try:
                trickle.send(bytes([byte]))
            except OSError:  # closed by the server
                return
    sender = threading.Thread(target=send_slowly)
    sender.start()
    try:
        start = time.monotonic()
        assert trickle.recv(1) == b""
        assert time.monotonic() - start < 5
    finally:
        stop.set()
        sender.join(10)
        trickle.close()
        server.shutdown()
        server.server_close()

    monkeypatch.setattr(metrics, "METRICS_IDLE_S", 30.0)
    port = free_port_pair()
    server, _ = metrics.serve_prometheus(metrics.Metrics(), port, "127.0.0.1")
    threads = threading.active_count()
    silent = []
    try:
        silent += [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(30)]
        wait_until(lambda: sum(map(closed, silent)) == 26, 10, "all but 4 clients closed")
        assert threading.active_count() - threads == 4
        for sock in silent:
            sock.close()
        wait_until(lambda: threading.active_count() == threads, 10, "the served clients' threads ended")
        url = f"http://127.0.0.1:{port}/metrics"
        assert b"zbus_rpcs_total 0" in urllib.request.urlopen(url, timeout=10).read()
    finally:
        for sock in silent:
            sock.close()
        server.shutdown()
        server.server_close()


def status_from_a_posing_leader(answer: list) -> subprocess.CompletedProcess:
    """``zbus status`` (3 s) against a peer on two free ports that answers each
    status request with ``answer``, as a leader of another version or one posing
    as it would."""
    port = free_port_pair()
    ctx = zmq.Context()
    xpub, pull = ctx.socket(zmq.XPUB), ctx.socket(zmq.PULL)
    done = threading.Event()

    def answer_each() -> None:
        while not done.is_set():
            if pull.poll(100):
                asked = codec.decode(pull.recv_multipart())
                xpub.send_multipart([b"S" + asked[1].encode(), *codec.encode(answer)])

    answering = threading.Thread(target=answer_each, daemon=True)
    try:
        xpub.bind(f"tcp://127.0.0.1:{port}")
        pull.bind(f"tcp://127.0.0.1:{port + 1}")
        answering.start()
        return subprocess.run([sys.executable, "-m", "zbus.cli", "status", "--master-port", str(port),
                               "--timeout", "3"], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=TEST_PATH))
    finally:
        done.set()
        answering.join(5)
        xpub.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_zbus_status_says_in_one_line_what_it_cannot_read_and_prints_no_escape():
    """``zbus status`` reads the answer of whoever listens on the leader's ports: an
    answer of the wrong shape is not one (no leader answered), a status without a
    field this version reads is said in one line, and what peers named (a host,
    the failure) is printed without its escapes. Before, the first two were
    tracebacks (TypeError, KeyError) and the escape reached the operator's
    terminal (until 2026-12-07, from every field but the host and the failure).
    Sabotage: no ``type(msg[1]) is dict`` in ``query_status``, no ``except`` round
    the formatting in ``cli._status``, or no ``_shown`` of the lines."""
    status = {"world_size": "\x1b]52;c;b3duZWQ=\x07", "output_rank": 0, "uptime_s": 1.0,
              "failed": "lost \x1b[2J", "rpcs": "\x1b[31m",
              "latency_s": {"p50": None, "p90": None, "p99": None}, "bytes_sent": 0, "errors": "\x1b[8m",
              "dropped_frames": 0,
              "nodes": [{"node_rank": "\x1b[2J", "host": "\x1b]0;owned\x07", "ranks": ["\x1b[5m"],
                         "core": "\x1b[1m"}]}
    wrong = status_from_a_posing_leader(["status", [1, 2]])
    assert wrong.returncode == 1 and "no leader answered" in wrong.stderr, wrong.stderr[-2000:]
    old = status_from_a_posing_leader(["status", {k: v for k, v in status.items() if k != "output_rank"}])
    assert old.returncode == 1 and "no status this version reads (KeyError" in old.stderr, old.stderr[-2000:]
    shown = status_from_a_posing_leader(["status", status])
    assert shown.returncode == 1 and "FAILED: lost ?[2J" in shown.stdout and "?]0;owned?" in shown.stdout
    assert "\x1b" not in shown.stdout and "Traceback" not in wrong.stderr + old.stderr + shown.stderr


@pytest.mark.timeout(60)
def test_zbus_status_lets_go_of_an_answer_of_too_many_frames_as_it_reads_it():
    """A peer on the leader's ports answers ``zbus status`` with a good status and
    500 000 frames of 2 bytes after it (about 2 MiB on the wire): no leader
    answered, and what the frames held was let go as they were read (0.2 MiB of
    peak memory). Before, ``recv_multipart`` kept a bytes object for each (ZeroMQ
    bounds a frame's size, not their number) and the codec a view of each: 177 MiB
    of peak memory for the one answer, which was taken (the frames no header names
    are not read). Sabotage: ``sub.recv_multipart()`` in ``query_status`` as
    before -> the answer is taken."""
    import tracemalloc

    from zbus.cluster import query_status

    port = free_port_pair()
    ctx = zmq.Context()
    xpub, pull = ctx.socket(zmq.XPUB), ctx.socket(zmq.PULL)
    xpub.sndhwm = 0
    # (made before the count starts, and sent part by part: this thread's own lists
    # would count; not b"" nor one byte: CPython makes no new object for those)
    answer = [b"", *codec.encode(["status", {"world_size": 2, "output_rank": 0}]), *[b"xy"] * 500_000]
    answered = threading.Event()

    def answer_once() -> None:
        if pull.poll(10_000):
            answer[0] = b"S" + codec.decode(pull.recv_multipart())[1].encode()
            for i in range(len(answer) - 1):
                xpub.send(answer[i], zmq.SNDMORE)
            xpub.send(answer[-1])
            answered.set()

    answering = threading.Thread(target=answer_once, daemon=True)
    try:
        xpub.bind(f"tcp://127.0.0.1:{port}")
        pull.bind(f"tcp://127.0.0.1:{port + 1}")
        answering.start()
        tracemalloc.start()
        try:
            with pytest.raises(TimeoutError, match="no leader answered"):
                query_status("127.0.0.1", port, timeout=6)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        answering.join(30)
        assert answered.is_set()
        assert peak < 5 * 2**20, f"{peak / 2**20:.1f} MiB"
    finally:
        answering.join(15)
        xpub.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_a_metrics_port_without_prometheus_client_is_an_import_error_said_in_one_line(monkeypatch):
    """Without ``prometheus-client`` the metrics server is refused with an error
    that is an ImportError (as documented before) and a ZbusError (the CLI says
    it in one line). Sabotage: a plain SettingError -> no ImportError."""
    from zbus import metrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (import fails)
    with pytest.raises(ImportError, match="needs prometheus-client") as e:
        metrics.serve_prometheus(metrics.Metrics(), free_port_pair(), "127.0.0.1")
    assert isinstance(e.value, zbus.ZbusError)


def test_follower_exposes_no_port():
    """After the join, with its workers running and serving calls, no process of the
    follower's tree (the agent and its workers) listens on any TCP port.
    Sabotage: have the agent listen (self._sabotage = socket.create_server(("127.0.0.1", 0))
    at the start of NodeAgent.run in zbus/agent.py), or a worker."""
    import psutil

    port = free_port_pair()
    proc = follower(port, "--node-rank", "1", nproc=2)
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=2, master_addr="127.0.0.1",
                           master_port=port, join_timeout=60) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11, 12, 13]
            agent = psutil.Process(proc.pid)
            assert len(agent.children(recursive=True)) >= 2  # its two workers run now
            assert tree_listeners(agent) == set()
            assert ex.collective_rpc("rank_value", args=(2,), timeout=30) == [20, 21, 22, 23]
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


class LeaderThread(threading.Thread):
    """A 2-node leader on ``port``, started in a thread (its start returns once the
    cluster formed): ``ex`` once formed, else ``error``."""

    def __init__(self, port: int, join_timeout: float) -> None:
        super().__init__(daemon=True)
        self.port, self.join_timeout = port, join_timeout
        self.ex: zbus.Executor | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.ex = zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                                    master_port=self.port, join_timeout=self.join_timeout)
        except BaseException as e:  # noqa: BLE001 - the test fails on it
            self.error = e

    def close(self) -> None:
        self.join(90)
        if self.ex is not None:
            self.ex.shutdown()


def test_fuzzed_join_traffic_during_formation_leaves_the_leader_able_to_form():
    """Random messages of every shape (joins with random fields among them) on the
    leader's PULL port while it waits for its node: none may crash or block it,
    and the real node still joins. The fuzz must have run the whole time (a fuzz
    thread that died fails the test) and reached the leader (undecodable ones were
    counted); no message may have broken a handler or the I/O loop (each would be
    counted as "handler" or "io-loop"); and rank 1 is the real node, not a
    fuzzed join. Sabotage: drop ``if type(node_id) is str`` in
    ``Membership._on_refused`` → fails (143 "handler" drops: an unhashable node id
    breaks it; the node still joins, so the old test passed); drop the type
    checks at the top of ``Membership._on_join`` → fails (a join with a non-str id
    breaks every later welcome: the node never joins); have ``codec.encode``
    raise TypeError instead of CodecError for what it cannot encode, and fuzz a
    set → fails (the fuzz thread died after 8 messages; it was only a warning)."""
    rng = random.Random(11)

    def junk(depth=0):
        kinds = [lambda: rng.randint(-2**63, 2**63 - 1), lambda: rng.random(), lambda: None,
                 lambda: rng.randbytes(rng.randint(0, 40)), lambda: "x" * rng.randint(0, 40)]
        if depth < 3:
            kinds += [lambda: [junk(depth + 1) for _ in range(rng.randint(0, 4))],
                      lambda: {str(rng.randint(0, 9)): junk(depth + 1) for _ in range(rng.randint(0, 4))}]
        return rng.choice(kinds)()

    def message():
        # Replies for a real rank are left out: without keys a peer that forges those is
        # believed (security.md says so); everything else must be shrugged off.
        kind = rng.choice(["join", "hb", "died", "subscribed", "refused", "status", 7, -3, junk()])
        body = [kind, *[junk() for _ in range(rng.randint(0, 3))]]
        if kind == "join" and rng.random() < 0.5:
            fields = ("version", "nproc", "host", "address", "node_rank", "pid")
            body = ["join", rng.randbytes(8).hex(), {k: junk() for k in fields}]
        return codec.encode(body) if rng.random() < 0.9 else [rng.randbytes(rng.randint(0, 64))]

    port = free_port_pair()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port + 1}")
    stop = threading.Event()
    fuzz = {"tries": 0, "sent": 0, "error": None}

    def run_fuzz():
        try:
            while not stop.is_set():
                fuzz["tries"] += 1
                try:
                    push.send_multipart(message(), zmq.NOBLOCK)
                    fuzz["sent"] += 1
                except zmq.Again:
                    time.sleep(0.001)  # the leader is not there yet, or is busy
        except BaseException as e:  # noqa: BLE001 - the test fails on it below
            fuzz["error"] = e

    # the node starts only once the fuzz reaches the leader's port, so that it joins
    # during the fuzz (a connection still retrying at formation tested nothing)
    connected = push.get_monitor_socket(zmq.EVENT_CONNECTED)
    t = threading.Thread(target=run_fuzz)
    t.start()
    leading = LeaderThread(port, join_timeout=60)
    proc = None
    try:
        wait_until(lambda: fuzz["tries"] > 0 or fuzz["error"], 30, "the fuzz thread sending")
        leading.start()
        assert connected.poll(30_000), "the fuzz never reached the leader's port"
        proc = follower(port, "--node-rank", "1")
        leading.join(90)
        assert leading.ex is not None, leading.error
        with leading.ex as ex:
            stop.set()
            t.join(5)
            assert not t.is_alive() and fuzz["error"] is None, fuzz
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
            drops = ex._leader.dropped_by
            print(f"{fuzz['sent']} fuzzed messages; dropped: {drops}")
            assert fuzz["sent"] >= 200, fuzz
            assert drops.get("undecodable", 0) > 0, drops
            assert not {"handler", "io-loop"} & set(drops), drops
            assert ex._leader.nodes[1].pid == proc.pid
    finally:
        stop.set()
        t.join(5)
        if leading.is_alive() or leading.ex is not None:
            leading.close()
        push.disable_monitor()
        connected.close(linger=0)
        ctx.destroy(linger=0)
        if proc is not None:
            end_process(proc)


def test_a_flood_of_node_topics_during_formation_keeps_no_real_node_out(monkeypatch):
    """A peer on the leader's broadcast port subscribes to 5000 node topics of
    nodes that never join, then a real node joins. Before, the leader took the
    first 4096 node topics it saw and ignored the rest for good: the real node's
    subscription was never seen, its joins never welcomed, and start-up timed out.
    Now, at 4096, the oldest topic no join waits for is forgotten (counted as
    ``subscription-flood``). The leader's Membership is only observed (its
    constructor recorded). Sabotage: the old cap (``len(self._subscribed) < 4096``
    in ``_read_subscriptions``, no eviction) -> the executor's start times out."""
    from zbus.membership import Membership

    made = []
    init = Membership.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Membership, "__init__", recorded)
    port = free_port_pair()
    ctx = zmq.Context()
    flood = ctx.socket(zmq.SUB)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)  # (else libzmq sends it only the first 1000 topics)
    for i in range(5000):
        flood.setsockopt(zmq.SUBSCRIBE, b"Nflood%05d" % i)
    leading = LeaderThread(port, join_timeout=30)
    leading.start()
    proc = None
    try:
        flood.connect(f"tcp://127.0.0.1:{port}")
        wait_until(lambda: made and len(made[0]._subscribed) >= 4096, 30, "the flood's topics read")
        proc = follower(port, "--node-rank", "1")
        leading.join(60)
        assert leading.ex is not None, leading.error
        with leading.ex as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
            assert ex._leader.nodes[1].pid == proc.pid
            assert ex._leader.dropped_by.get("subscription-flood", 0) >= 5000 - 4096, ex._leader.dropped_by
    finally:
        if leading.is_alive() or leading.ex is not None:
            leading.close()
        ctx.destroy(linger=0)
        if proc is not None:
            end_process(proc)


def test_a_join_whose_rank_no_comparison_can_judge_does_not_stop_formation():
    """During formation a peer joins as node "evil" with a numpy array for its rank,
    and subscribes to its node topic so that the join is up for a welcome: it is
    dropped, and the real node joins after it. Since 2026-12-07 a node's control
    message is decoded as plain data, and the array refused (``undecodable``);
    before, ``Membership._join_types`` dropped it as ``bad-join``. Sabotage: both
    gone (``plain=False`` in ``DataPath._checked_message``, no ``_join_types`` check
    in ``Membership._on_join``): every welcome check raises on ``rank in (None,
    -1)``, the poisoned join is never removed, and the real node is never welcomed
    (the executor's start times out)."""
    port = free_port_pair()
    ctx = zmq.Context()
    leading = LeaderThread(port, join_timeout=25)
    leading.start()
    proc = None
    try:
        sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
        for sock in (sub, push):
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"Nevil")
        connected = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(f"tcp://127.0.0.1:{port}")
        push.setsockopt(zmq.IMMEDIATE, 1)  # the send waits for the leader's port
        push.setsockopt(zmq.SNDTIMEO, 30_000)
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        assert connected.poll(30_000), "the leader's broadcast port never came"
        info = {"version": 2, "nproc": 1, "host": "evil", "address": "127.0.0.1", "pid": 1,
                "node_rank": np.zeros(2, np.int8)}
        push.send_multipart(codec.encode(["join", "evil", info]))
        sub.disable_monitor()
        connected.close(linger=0)
        # (on loopback both arrive long before the node's interpreter has started)
        proc = follower(port, "--node-rank", "1")
        leading.join(60)
        assert leading.ex is not None, leading.error
        with leading.ex as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
            assert ex._leader.dropped_by.get("undecodable") == 1, ex._leader.dropped_by
            assert "handler" not in ex._leader.dropped_by
    finally:
        leading.close()
        ctx.destroy(linger=0)
        if proc is not None:
            end_process(proc)


def good_welcome(**changes):
    welcome = {"node_rank": 1, "nnodes": 2, "nproc_per_node": 2, "master_addr": "10.0.0.1",
               "liveness_s": 10.0, "reply_address": "tcp://10.0.0.1:29651", "torch_port": 29700,
               "spec": {"worker": "zbus.demo:DemoWorker", "kwargs": {}}, "env": {"OMP_NUM_THREADS": "1"},
               "session": "s1"}
    welcome.update(changes)
    return welcome


@pytest.mark.parametrize("changes,why", [
    ({"nproc_per_node": 10000}, "nproc_per_node"), ({"nproc_per_node": 2.0}, "nproc_per_node"),
    ({"liveness_s": 1e12}, "liveness_s"), ({"liveness_s": 0.01}, "liveness_s"),
    ({"liveness_s": float("nan")}, "liveness_s"), ({"node_rank": 3}, "node_rank"),
    ({"nnodes": 10**9}, "nnodes"), ({"torch_port": 0}, "torch_port"), ({"session": None}, "session"),
    ({"session": "s1*"}, "session"), ({"session": "s" * 65}, "session"), ({"session": "é1"}, "session"),
    ({"master_addr": "x" * 5000}, "master_addr"), ({"reply_address": "ipc:///tmp/x"}, "reply_address"),
    ({"spec": {"worker": None}}, "spec"), ({"env": {"A": "x" * 100000}}, "env"),
    ({"env": {str(i): "" for i in range(2000)}}, "env"),
    ({"env": {"A": "x\0y"}}, "env"), ({"env": {"A=B": "1"}}, "env"), ({"env": {"A\0": "1"}}, "env"),
    ({"master_addr": "10.0.0.1\0"}, "master_addr"),
    ({"spec": {"worker": "zbus.demo:DemoWorker", "poll_s": 3600.0}}, "poll_s"),
    ({"spec": {"worker": "zbus.demo:DemoWorker", "poll_s": "1"}}, "poll_s"),
    ({"max_reply": 0}, "max_reply"), ({"max_reply": "1"}, "max_reply"),
    ({"nproc_per_node": np.array([2, 2])}, "nproc_per_node"), ({"node_rank": np.array([1, 1])}, "node_rank")])
def test_a_follower_checks_every_welcome_field(changes, why):
    """Sabotage: make check_welcome return None (the old code checked nothing).
    Compare ``nproc_per_node`` before its type (as before): a numpy array raises."""
    from zbus.agent import check_welcome

    assert check_welcome(good_welcome(), nproc=2, node_rank=1) is None
    assert check_welcome(good_welcome(), nproc=2, node_rank=None) is None
    assert why in check_welcome(good_welcome(**changes), nproc=2, node_rank=1)
    assert "node_rank" in check_welcome(good_welcome(node_rank=2, nnodes=3), nproc=2, node_rank=1)


def test_a_follower_refuses_a_welcome_that_turns_off_leader_loss_detection():
    """One posing as a leader (a real leader refuses a liveness limit outside
    0.5..600 s itself) welcomes with liveness_s=1000: the follower refuses, tells
    the leader why and exits 1. Sabotage: skip the check_welcome call in
    NodeAgent._start_workers."""
    leading = PosingLeader()
    try:
        leading.welcome(liveness_s=1000.0)
        said = []
        wait_until(lambda: said.append(leading.receive(100)) or (said[-1] or [None])[0] == "refused", 30,
                   "the follower's refusal")
        assert "liveness_s 1000" in said[-1][2]
        assert leading.proc.wait(30) == 1
        assert "liveness_s 1000" in leading.proc.stderr.read()
    finally:
        leading.close()


SECRET = "zbus-test-secret-0123456789abcdef"  # a test-only value


@contextlib.contextmanager
def keyed_cluster(monkeypatch, **kwargs):
    """A leader keyed by ``SECRET`` and one follower (node rank 1), one EchoWorker
    each; yields the executor and its port, and checks the follower exits 0."""
    monkeypatch.setenv("ZBUS_SECRET", SECRET)
    monkeypatch.delenv("ZBUS_CURVE_DIR", raising=False)
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                           master_port=port, join_timeout=60, **kwargs) as ex:
            yield ex, port
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_a_keyed_leaders_env_sets_nothing_a_follower_allows_for_itself(monkeypatch):
    """A keyed driver passes ``env=`` naming a follower's own settings (the vLLM
    allow-list its workers check the leader's configuration against, its worker
    allow-list): the follower's worker gets neither, the leader's own local
    worker both. Before, a keyed leader's variables all passed: one
    ``ZBUS_VLLM_ALLOW=trust_remote_code`` undid what the follower's operator
    allowed, past the check ``update_environment_variables`` is refused for.
    Sabotage: no ``NODE_OWN_ENV`` in ``NodeAgent._worker_env`` -> the follower's
    worker has them."""
    names = ["ZBUS_VLLM_ALLOW", "ZBUS_ALLOW_WORKERS", "OMP_NUM_THREADS"]
    monkeypatch.delenv("ZBUS_VLLM_ALLOW", raising=False)
    set_by_leader = {"ZBUS_VLLM_ALLOW": "trust_remote_code", "ZBUS_ALLOW_WORKERS": "evil",
                     "OMP_NUM_THREADS": "1"}
    with keyed_cluster(monkeypatch, env=set_by_leader) as (ex, _):
        leaders, followers = ex.collective_rpc("env_of", args=(names,), timeout=30)
    assert leaders == set_by_leader
    assert followers["ZBUS_VLLM_ALLOW"] is None and followers["OMP_NUM_THREADS"] == "1", followers
    assert followers["ZBUS_ALLOW_WORKERS"] == "workers", followers  # (the follower's own: see follower())


def forge(port: int, curve, messages: list) -> None:
    """Send ``messages`` to the leader's PULL port over a connection keyed by ``curve``."""
    from zbus.queues import send_frames

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        curve.client(push)
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        for msg in messages:  # (bytes: a header as is)
            frames = [msg] if type(msg) is bytes else codec.encode(msg)
            send_frames(push, frames, time.monotonic() + 10, "forge")
    finally:
        push.close(linger=10000)  # term() returns once they have left (10 s at most)
        ctx.term()


def wait_dropped(ex, at_least: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while ex._leader.dropped < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return ex._leader.dropped


def status_of_a_keyed_leader(port: int, *flags: str) -> dict:
    """``zbus status --json`` of the leader on ``port``, asked with a node's key:
    from ``flags`` (``--curve-dir``), else the cluster secret in the environment."""
    out = subprocess.run([sys.executable, "-m", "zbus.cli", "status", "--master-port", str(port), "--json",
                          "--timeout", "20", *flags], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=TEST_PATH))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@contextlib.contextmanager
def keyed_cluster_of_key_folders(tmp_path):
    """A leader and followers 1 and 2, keyed by the folders of ``zbus keygen``,
    one worker each, that answered a call: (executor, port, the followers' exit
    codes, filled once the executor is shut down and they ended by themselves);
    each follower ended by pid after."""
    keygen(str(tmp_path), nodes=2)
    port = free_port_pair()
    procs = [follower(port, "--node-rank", str(r), "--curve-dir", str(tmp_path / f"node-{r}"))
             for r in (1, 2)]
    exits: list = []
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=3, nproc_per_node=1, master_addr="127.0.0.1",
                           master_port=port, curve_dir=str(tmp_path / "leader"), join_timeout=60) as ex:
            assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11, 12]
            yield ex, port, exits
        exits += [p.wait(30) for p in procs]
    finally:
        for p in procs:
            end_process(p)


def test_a_node_key_cannot_speak_for_another_nodes_ranks(tmp_path):
    """Node 2's key sends a reply, a death notice, a heartbeat, a gap report and a
    leaving notice for node 1 (rank 1), and a reply for rank 1 that cannot be
    decoded (which would become an error reply for that call): all dropped and
    counted as ``not-owner``; its own heartbeat, sent after them, is not (a stray
    ``refused`` sent last marks when the leader has read them all: one
    connection's messages are read in order); the cluster serves on. Sabotage:
    make DataPath._sent_by_owner return True: fails (nothing counted as
    ``not-owner``; the forged "died" fails the executor with WorkerDiedError).
    Return an undecodable reply before the key's check in
    ``DataPath._checked_message`` (as before): it counts as ``unexpected-reply``."""
    from zbus.curve import NodeCurve

    with keyed_cluster_of_key_folders(tmp_path) as (ex, port, exits):
        before, session = ex._leader.dropped_by, ex._leader.path.session
        forge(port, NodeCurve.from_dir(str(tmp_path / "node-2")),
              [[session, 1, 10**6, 0, "forged"],  # and [session, 1, 10**6, 0, invalid]:
               b"\x95" + msgpack.packb(session) + bytes.fromhex("01ce000f424000c1"),
               ["died", 1, session, 1, 9], ["hb", 1, session], ["gap", 1, session, 1, 5],
               ["leaving", 1, session, "forged"], ["hb", 2, session],
               ["refused", "no-such-node", "a marker"]])
        wait_until(lambda: ex._leader.dropped_by.get("stray-refused", 0) > before.get("stray-refused", 0),
                   20, "the marker after the forged messages counted")
        after = ex._leader.dropped_by
        assert {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)} == {
            "not-owner": 6, "stray-refused": 1}, after  # node 2's own heartbeat was taken
        ex.check_health()
        assert ex.collective_rpc("rank_value", args=(2,), timeout=30) == [20, 21, 22]
    assert exits == [0, 0]


def test_a_nodes_reason_reaches_the_driver_without_its_escapes(tmp_path):
    """Node 2's key says its node leaves, for a reason holding terminal escapes (a
    clipboard write, a screen clear): the executor fails with that reason, its
    escapes shown as "?" (the error reaches the driver's terminal in a traceback).
    Sabotage: the reason as sent in ``Membership``'s ``leaving`` (as before) ->
    the escapes are in the error."""
    from zbus.curve import NodeCurve

    with keyed_cluster_of_key_folders(tmp_path) as (ex, port, _):
        assert status_of_a_keyed_leader(port, "--curve-dir", str(tmp_path / "node-2"))["world_size"] == 3
        forge(port, NodeCurve.from_dir(str(tmp_path / "node-2")),
              [["leaving", 2, ex._leader.path.session, "\x1b]52;c;b3duZWQ=\x07gone\x1b[2J"]])
        wait_until(lambda: ex.failure.error is not None, 20, "the executor failed")
        assert isinstance(ex.failure.error, zbus.NodeLostError)
        assert str(ex.failure.error).endswith("it left: ?]52;c;b3duZWQ=?gone?[2J"), str(ex.failure.error)


def test_one_secret_keys_a_cluster_and_binds_each_derived_key_to_its_rank(monkeypatch, caplog):
    """ZBUS_SECRET alone keys a 3-node cluster; rank 2's derived key claiming rank 1
    (a join, a reply, a death notice) is dropped. No worker has the secret in its
    environment (from it the leader's key is derived; each follower's workers
    get their node's key pair alone). Sabotage: make DataPath._sent_by_owner return
    True: the forged "died" then fails the executor; no ``ZBUS_SECRET`` dropped in
    ``processes.worker_env`` (as before) -> every worker has it."""
    from zbus.curve import NodeCurve

    monkeypatch.setenv("ZBUS_SECRET", SECRET)
    monkeypatch.delenv("ZBUS_CURVE_DIR", raising=False)
    port = free_port_pair()
    procs = [follower(port, "--node-rank", str(r)) for r in (1, 2)]
    try:
        with caplog.at_level(logging.INFO, logger="zbus.leader"):
            with zbus.Executor(workers.EchoWorker, nnodes=3, nproc_per_node=1, master_addr="127.0.0.1",
                               master_port=port, join_timeout=60) as ex:
                assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11, 12]
                assert ex.collective_rpc("env_of", args=(["ZBUS_SECRET"],), timeout=30) == [
                    {"ZBUS_SECRET": None}] * 3
                before = ex._leader.dropped
                info = {"version": 1, "nproc": 1, "host": "h", "address": "a", "node_rank": 1, "pid": 1}
                forge(port, NodeCurve.from_secret(SECRET.encode(), 2),
                      [["join", "f" * 16, info], [ex._leader.path.session, 1, 10**6, 0, "forged"],
                       ["died", 1, ex._leader.path.session, 1, 9]])
                assert wait_dropped(ex, before + 3) == before + 3
                ex.check_health()
                assert ex.collective_rpc("rank_value", args=(2,), timeout=30) == [20, 21, 22]
                assert status_of_a_keyed_leader(port)["world_size"] == 3  # (the secret's key for rank 1)
        assert any("links are CurveZMQ" in r.getMessage() for r in caplog.records)
        assert [p.wait(30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            end_process(p)


def test_connections_that_never_handshake_stall_no_keyed_leader(monkeypatch):
    """Keyed, the leader watches its two sockets for failed handshakes, and a peer
    with no key that opens and closes TCP connections (not one ZeroMQ byte) makes an
    event each. ZeroMQ's I/O thread blocks once 2000 wait unread, and the watcher
    read one per socket every 0.1 s: 5000 such connections stopped every link of
    the leader (heartbeats, calls, replies). Sabotage: read one event per socket
    and pass again -> the call times out, or the node is lost."""
    with keyed_cluster(monkeypatch, liveness_s=2.0) as (ex, port):
        for i in range(5000):
            socket.create_connection(("127.0.0.1", port + i % 2), timeout=5).close()
        until = time.monotonic() + 3 * 2.0  # past the liveness limit
        while time.monotonic() < until:
            assert ex.collective_rpc("later", args=("x", 0.1), timeout=10) == ["x", "x"]
        ex.check_health()


def test_a_reply_just_under_the_limit_reaches_a_keyed_leader(monkeypatch):
    """Replies of sizes up to the leader's ``ZBUS_MAX_REPLY`` and just past it, on
    keyed links: each one is answered or refused with the reason. CurveZMQ boxes
    each frame in 33 more bytes, and ZeroMQ holds a frame to the limit before it
    decrypts it. Before, a reply within the limit whose frame came within 33 bytes
    of it was dropped by the leader's ZeroMQ with its connection; the worker sent
    it again on every reconnection, and its caller waited. Sabotage: the leader's
    ``MAXMSGSIZE`` at the limit itself (no ``FRAME_SLACK``) -> a call times out."""
    limit = 2**20
    monkeypatch.setenv("ZBUS_SECRET", SECRET)
    monkeypatch.setenv("ZBUS_MAX_REPLY", str(limit))
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                           master_port=port, join_timeout=60) as ex:
            answered = refused = 0
            for n in range(limit - 48, limit - 16):
                try:
                    assert ex.collective_rpc("zeros", args=(n,), unique_reply_rank=1, timeout=10) == bytes(n)
                    answered += 1
                except zbus.RemoteError as e:
                    assert "over the" in str(e), e
                    refused += 1
            assert answered and refused, (answered, refused)
    finally:
        end_process(proc)


def test_a_node_with_another_secret_is_refused_at_the_handshake(tmp_path, monkeypatch, caplog):
    """The node's keys (and the leader's public key it expects) differ: the handshake
    fails before ZAP, and the leader logs it. Sabotage: derive keys without the
    secret (hmac.new(b"zbus-curve-v1", b"", ...) in derive_key): the node joins."""
    monkeypatch.setenv("ZBUS_SECRET", SECRET)
    other = tmp_path / "other-secret"
    other.write_text("another-secret-0123456789abcdef\n")
    port = free_port_pair()
    stranger = follower(port, "--node-rank", "1", "--secret-file", str(other))
    try:
        with caplog.at_level(logging.WARNING, logger="zbus.curve"):
            with pytest.raises(zbus.StartupError, match=r"missing node ranks: \[1\]"):
                zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                              master_port=port, join_timeout=4)
        assert any("failed the CurveZMQ handshake" in r.getMessage() for r in caplog.records)
    finally:
        end_process(stranger, timeout=1)


def non_loopback_ip() -> str | None:
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def test_check_exposure_refuses_an_unkeyed_leader_off_loopback(caplog):
    """Sabotage: make check_exposure return at once."""
    from zbus.cluster import check_exposure

    for ip in ("127.0.0.1", "::1"):
        check_exposure(ip, keyed=False, insecure=False)
    check_exposure("10.0.0.1", keyed=True, insecure=False)
    with pytest.raises(zbus.ZbusError, match="without keys.*ZBUS_SECRET.*ZBUS_INSECURE=1"):
        check_exposure("10.0.0.1", keyed=False, insecure=False)
    with caplog.at_level(logging.WARNING, logger="zbus.cluster"):
        check_exposure("10.0.0.1", keyed=False, insecure=True)
    assert any("insecure" in r.getMessage() for r in caplog.records)


def test_an_unkeyed_leader_on_a_non_loopback_address_starts_only_when_insecure(monkeypatch, caplog):
    """Refused at once without keys; ZBUS_INSECURE=1 lets it lead, with a warning.
    Sabotage: remove the check_exposure call from Leader.__init__."""
    ip = non_loopback_ip()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address here")
    monkeypatch.delenv("ZBUS_SECRET", raising=False)
    monkeypatch.delenv("ZBUS_INSECURE", raising=False)
    port = free_port_pair(ip)
    t0 = time.monotonic()
    with pytest.raises(zbus.ZbusError, match="without keys"):
        zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr=ip, master_port=port,
                      join_timeout=30)
    assert time.monotonic() - t0 < 10  # at start, not after the join timeout
    monkeypatch.setenv("ZBUS_INSECURE", "1")
    proc = follower(port, "--node-rank", "1", "--master-addr", ip)
    try:
        with caplog.at_level(logging.WARNING, logger="zbus.cluster"):
            with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr=ip,
                               master_port=port, join_timeout=60) as ex:
                assert ex.collective_rpc("rank_value", args=(1,), timeout=30) == [10, 11]
        assert any("insecure: leading nodes" in r.getMessage() for r in caplog.records)
        assert proc.wait(30) == 0
    finally:
        end_process(proc)


def test_a_keyed_link_carries_large_frames_in_parts_and_the_workers_get_them_whole(monkeypatch):
    """CurveZMQ costs less on 1 MiB parts than on one 16 MiB part: on a keyed link
    the leader cuts large frames, and the node's agent writes the parts back to
    back into its ring. Sabotage: ``from_parts`` joining the parts in another
    order, or dropping one -> the remote worker's checksum differs (or the call
    fails); ``wire`` not cutting, or the send not using it -> the parts check
    fails (it counts the frames of the calls the leader sends)."""
    import zlib

    with keyed_cluster(monkeypatch) as (ex, _):
        bcast, sent = ex._leader.bcast, []
        wire = bcast.wire

        def counted(topic, frames):
            out = wire(topic, frames)
            sent.append((len(frames), len(out)))
            return out

        monkeypatch.setattr(bcast, "wire", counted)
        for size in (protocol.PART_BYTES, 3 * protocol.PART_BYTES + 12345):
            payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
            sent.clear()
            got = ex.collective_rpc("crc", args=(7, payload), timeout=30)
            assert got == [(7, zlib.crc32(payload))] * 2
            assert sent and all((out > n + 1) == (size > protocol.PART_BYTES) for n, out in sent), sent


def test_part_counts_that_do_not_fit_their_parts_are_refused():
    """Sabotage: a ``from_parts`` that trusts the counts -> an IndexError or a
    frame made of too few parts instead of a CodecError."""
    parts = [b"a", b"b", b"c"]
    assert protocol.from_parts(msgpack.packb([1, 2]), parts) == [b"a", (b"b", b"c")]
    for counts in ([1, 1], [1, 3], [0, 3], [3, -0], [], {"a": 1}, [1.0, 2], [2**64 - 1]):
        with pytest.raises(zbus.CodecError):
            protocol.from_parts(msgpack.packb(counts), parts)
    with pytest.raises(zbus.CodecError):
        protocol.from_parts(b"\xc1", parts)
    counts, cut = protocol.in_parts([b"e" * (2 * protocol.PART_BYTES), b"x" * (protocol.PART_BYTES + 1)])
    assert msgpack.unpackb(counts) == [1, 2] and [len(p) for p in cut] == [
        2 * protocol.PART_BYTES, protocol.PART_BYTES, 1]


def test_a_malformed_error_reply_fails_its_call_not_the_executor():
    """A peer on the leader's open reply port sends, for a pending call, an error
    reply whose value is not an error (``[rank, seq, RAISED, None]``): that call
    fails with a ZbusError that says so, and the executor serves on. Sabotage:
    read ``value.type_name`` of any error reply in ``Call.finish`` (as before):
    AttributeError in the thread completing the call, the executor fails with
    "completing calls failed". A reply whose status is no int (a float, equal to
    OK) is dropped as ``shape`` and its call gets the real replies (one whose
    status is a numpy array, whose ``==`` has no truth value, failed the
    executor; it is undecodable now, as a message that is no reply holds plain
    data alone). Sabotage: no ``shape`` drop of a message that names this
    leader's session in ``DataPath._checked_message`` -> ``unknown-kind``, and the
    wait for the drop fails. A refusal whose reason is a 64 KiB tensor fails
    its call with a short error. Sabotage: ``str`` of the reason (as before) -> an
    error of 1 MB, made under the reply lock."""
    port = free_port_pair()
    proc = follower(port, "--node-rank", "1")
    ctx = zmq.Context()
    try:
        with zbus.Executor(workers.EchoWorker, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1",
                           master_port=port, join_timeout=60) as ex:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://127.0.0.1:{port + 1}")
            slow = ex.collective_rpc("later", args=("x", 1.0), non_block=True)
            session = ex._leader.path.session
            # before rank 1's own
            push.send_multipart(codec.encode([session, 1, slow.seq, protocol.RAISED, None]))
            error = slow.exception(timeout=30)
            assert isinstance(error, zbus.ZbusError) and "malformed reply" in str(error), repr(error)
            assert "rank 1" in str(error)
            # a status that is no int: dropped, the call completes
            later = ex.collective_rpc("later", args=("y", 1.0), non_block=True)
            before = ex._leader.dropped_by.get("shape", 0)
            push.send_multipart(codec.encode([session, 1, later.seq, 0.0, "forged"]))
            wait_until(lambda: ex._leader.dropped_by.get("shape", 0) > before, 20, "the forged reply dropped")
            assert later.result(30) == ["y", "y"]
            # a refusal whose reason is a tensor: named, not printed (MiBs, seconds)
            third = ex.collective_rpc("later", args=("z", 1.0), non_block=True)
            push.send_multipart(codec.encode([session, 1, third.seq, protocol.REFUSED,
                                              torch.zeros([2] * 16, dtype=torch.uint8)]))
            error = third.exception(timeout=30)
            assert isinstance(error, zbus.ZbusError) and "Tensor of shape" in str(error), repr(error)[:200]
            assert len(str(error)) < 1000
            # a value declaring an array of 128 MiB that it does not carry: refused as
            # its caller decodes it, nothing allocated. Sabotage: no "ndarray without
            # data" check in ``_Decoder._ndarray`` -> the call's value is the array.
            fourth = ex.collective_rpc("later", args=("w", 1.0), non_block=True)
            dataless = msgpack.ExtType(codec._NDARRAY, msgpack.packb(["|u1", [2**27], None]))
            push.send_multipart([msgpack.packb([session, 1, fourth.seq, protocol.OK, dataless])])
            error = fourth.exception(timeout=30)
            assert isinstance(error, zbus.ZbusError) and "ndarray without data" in str(error), repr(error)
            ex.check_health()
            assert ex.collective_rpc("rank_value", args=(3,), timeout=30) == [30, 31]
            push.close()
        assert proc.wait(30) == 0
    finally:
        ctx.destroy(linger=0)
        end_process(proc)


class PosingLeader:
    """A leader's two sockets, held by the test, and a follower (node rank 1, one
    EchoWorker) that joins them: what a leader, or one posing as it without keys,
    may send a follower."""

    def __init__(self, env: dict | None = None, first: str = "") -> None:
        port = free_port_pair()
        self.ctx = zmq.Context()
        self.xpub, self.pull = self.ctx.socket(zmq.XPUB), self.ctx.socket(zmq.PULL)
        self.xpub.bind(f"tcp://127.0.0.1:{port}")
        self.pull.bind(f"tcp://127.0.0.1:{port + 1}")
        self.reply_address = f"tcp://127.0.0.1:{port + 1}"
        self.proc = follower(port, "--node-rank", "1", env=env, first=first)

    def join(self) -> None:
        """Take the follower's join, and wait until its node topic is subscribed."""
        from zbus.cluster import node_topic

        assert self.pull.poll(30_000), "no join"
        self.node_id = codec.decode(self.pull.recv_multipart())[1]
        self.topic = node_topic(self.node_id)
        wait_until(lambda: self.xpub.poll(100) and self.xpub.recv() == b"\x01" + self.topic, 30,
                   "the node topic subscribed")

    def welcome(self, **changes) -> None:
        """Take the follower's join and welcome it on its node topic."""
        self.join()
        welcome = good_welcome(nproc_per_node=1, master_addr="127.0.0.1", env={},
                               reply_address=self.reply_address,
                               spec={"worker": "workers:EchoWorker", "kwargs": {}}, **changes)
        self.session = welcome["session"]
        self.rpc_topic, self._calls_heard = rpc_topic(str(self.session)), False
        self.xpub.send_multipart([self.topic, *codec.encode(["welcome", welcome])])

    def await_calls_heard(self) -> None:
        """Wait until the follower subscribed to our calls (once its welcome is taken):
        a call sent before would be lost, as a leader's probes make sure none is."""
        if not self._calls_heard:
            wait_until(lambda: self.xpub.poll(100) and self.xpub.recv() == b"\x01" + self.rpc_topic, 30,
                       "the calls' topic subscribed")
            self._calls_heard = True

    def call(self, seq: int, method: str, *args, again: bool = False) -> None:
        """Send call ``seq`` to every rank; ``again``: on the node's topic, as a call
        sent again after a gap."""
        self.await_calls_heard()
        payload = codec.encode((args, {}))
        self.xpub.send_multipart([self.topic + b"R" if again else self.rpc_topic,
                                  protocol.call_envelope(seq, method, -1, len(payload)), *payload])

    def receive(self, timeout_ms: int) -> list | None:
        """The follower's next message; a worker's reply ``[rank, seq, status, value]``
        without the session it names first."""
        msg = codec.decode(self.pull.recv_multipart()) if self.pull.poll(timeout_ms) else None
        is_reply = type(msg) is list and len(msg) == 5 and msg[0] == getattr(self, "session", None)
        return msg[1:] if is_reply else msg

    def bye(self) -> str:
        """Say bye; the follower's log once it exited 0."""
        self.xpub.send_multipart([self.topic, *codec.encode(["bye", self.session])])
        assert self.proc.wait(30) == 0, self.proc.stderr.read()[-2000:]
        return self.proc.stderr.read()

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        end_process(self.proc)


def test_a_follower_that_cannot_decode_its_welcome_refuses_at_once_saying_why():
    """The leader welcomes a follower with worker arguments of a type the node does
    not have (a registered dataclass of the driver's: the agent imports no user
    module): the follower tells the leader it refuses, naming why, and exits 1 at
    once. Before, it dropped the welcome as a malformed message and joined again
    every 2 s, the leader welcoming it each time, until the driver's join timeout
    ("missing node ranks") and its own ("no leader answered", though one had).
    Sabotage: ``raising=False`` for the node's own topic in ``NodeAgent._recv``
    -> only joins, no refusal."""
    leading = PosingLeader()
    try:
        leading.join()
        unknown = msgpack.ExtType(codec._DATACLASS, msgpack.packb(["driver.only.Settings", {"n": 1}]))
        welcome = good_welcome(nproc_per_node=1, master_addr="127.0.0.1", env={},
                               reply_address=leading.reply_address,
                               spec={"worker": "workers:EchoWorker", "kwargs": {"settings": unknown}})
        leading.xpub.send_multipart([leading.topic, msgpack.packb(["welcome", welcome])])
        said = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (said and said[-1][0] == "refused"):
            msg = leading.receive(500)
            if msg is not None:
                said.append(msg)
        assert said and said[-1][:2] == ["refused", leading.node_id], said
        assert "cannot decode the leader's welcome" in said[-1][2] and "driver.only.Settings" in said[-1][2]
        assert leading.proc.wait(30) == 1
        assert "cannot decode the leader's welcome" in leading.proc.stderr.read()
    finally:
        leading.close()


def test_a_serving_follower_ignores_messages_of_the_wrong_shape():
    """A leader (or one posing as it, without keys) welcomes a follower, then sends
    a call with nothing in it and control messages that are no list (an array's
    ``==`` has no truth value): the follower drops them, heartbeats on, and ends
    cleanly at ``bye``. Sabotage: relay the empty call (IndexError), or let
    ``NodeAgent._decode`` pass what is no list (ValueError): the agent leaves the
    cluster ("the node agent failed", its traceback logged) and exits 1."""
    leading = PosingLeader()
    try:
        leading.welcome()
        leading.await_calls_heard()
        topic, calls, array = leading.topic, leading.rpc_topic, codec.encode(np.array([1, 2]))
        for bad in ([calls], [calls + b"*"], [topic + b"R"], [b"H", *array], [topic, *array],
                    [calls + b"P", *array], [b"HP", *codec.encode({"probe": 1})]):
            leading.xpub.send_multipart(bad)

        def heartbeat() -> bool:  # the follower's, read after the bad messages; ours keep it alive
            leading.xpub.send_multipart([b"H", *codec.encode(["hb", 0, "s1"])])
            while (msg := leading.receive(200)) is not None:
                if msg[:2] == ["hb", 1]:
                    return True
            return leading.proc.poll() is not None
        for _ in range(3):  # (one sent before the bad messages were read would prove nothing)
            wait_until(heartbeat, 30, "a heartbeat of the follower")
        assert leading.proc.poll() is None, leading.proc.stderr.read()[-2000:]
        err = leading.bye()
        assert "Traceback" not in err and err.count("dropped a") == 7, err[-3000:]
    finally:
        leading.close()


def test_a_follower_takes_a_new_leader_at_its_leaders_address_for_a_stranger():
    """The leader a follower joined dies (SIGKILL, OOM) and another starts on the same
    address within the liveness limit: ZeroMQ reconnects the follower to it, and its
    heartbeats kept the follower's leader "alive". The follower then never left (its
    workers held their GPUs), the new leader's start-up failed for want of a node
    that heard its every word, and its ``bye`` ended the follower with exit 0. A
    leader's heartbeats now name its session, which its welcome gave: another one
    is a stranger, and the follower exits 1 at once. Sabotage: no
    ``_check_leader`` in ``NodeAgent._serve`` -> still running after 10 s."""
    leading = PosingLeader()
    try:
        leading.welcome()
        wait_until(lambda: (leading.receive(100) or [])[:2] == [1, protocol.READY], 30,
                   "the follower's worker up")
        leading.xpub.send_multipart([b"H", *codec.encode(["hb", 0, "s1"])])
        start = time.monotonic()
        while time.monotonic() - start < 10 and leading.proc.poll() is None:
            leading.xpub.send_multipart([b"H", *codec.encode(["hb", 0, "s2"])])  # another leader
            time.sleep(0.2)
        assert leading.proc.poll() == 1, "the follower took the other leader's heartbeats for its own"
        assert "another leader at 127.0.0.1" in leading.proc.stderr.read()
    finally:
        leading.close()


def test_a_follower_never_runs_a_call_of_another_leader_at_its_leaders_address():
    """The leader a follower joined dies and another binds its address: ZeroMQ
    reconnects the follower to it, and that leader's calls may come before its
    first heartbeat, which shows the follower a stranger. They ran on the
    follower's workers, numbered on from the calls it had (here a call 1, the
    first). A leader's calls now go on the topic of its session, which its
    welcome named, and a follower subscribes to its own leader's alone. Sabotage:
    ``cluster.rpc_topic`` ignoring the session -> the stranger's call is answered."""
    leading = PosingLeader()
    try:
        leading.welcome()
        wait_until(lambda: (leading.receive(100) or [])[:2] == [1, protocol.READY], 30,
                   "the follower's worker up")
        leading.await_calls_heard()  # (the follower serves: it hears its own leader's calls)
        payload = codec.encode((("stranger",), {}))
        leading.xpub.send_multipart([rpc_topic("s2"), protocol.call_envelope(1, "echo", -1, len(payload)),
                                     *payload])  # (another leader's session)

        def replies(seconds: float) -> list:
            got, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                msg = leading.receive(100)
                if msg is not None and type(msg[0]) is int:  # a rank's reply, not a heartbeat
                    got.append(msg)
            return got
        assert replies(2.0) == []
        leading.call(1, "echo", "own")  # its own leader's call 1 runs
        got = replies(5.0)
        assert [m[:3] for m in got] == [[1, 1, protocol.OK]] and "own" in str(got[0][3])
        leading.bye()
    finally:
        leading.close()


def test_a_follower_answers_the_probes_until_its_answer_arrives():
    """The leader probes a welcomed node on the call and heartbeat topics until the
    node's ``subscribed`` arrives, and drops it after the liveness limit. The
    follower answered the first pair of probes only: an answer lost (a reset
    connection, a full control backlog) lost the node. It now answers every pair.
    Sabotage: ``self._probes_seen = None`` after the answer in
    ``NodeAgent._on_probe`` -> one answer in 10 s."""
    from zbus.cluster import probe_topics

    leading = PosingLeader()
    try:
        leading.welcome()
        answers, deadline = 0, time.monotonic() + 10
        while answers < 2 and time.monotonic() < deadline:  # the first answer is "lost"
            for topic in probe_topics(leading.session):
                leading.xpub.send_multipart([topic, *codec.encode(["probe", leading.node_id])])
            while (msg := leading.receive(50)) is not None:
                answers += msg == ["subscribed", leading.node_id]
        assert answers >= 2
        leading.bye()
    finally:
        leading.close()


@pytest.mark.parametrize("lost", [[6], [6, 8]], ids=["one_lost", "two_lost"])
def test_a_follower_writing_lost_calls_to_slow_workers_waits_for_them(lost):
    """Call 6 is lost (a reset connection), and with it 8: the next call shows the
    gap, the follower asks for each lost call once, and the leader sends it again;
    writing them and the held ones waits for workers that take 1.5 s a call,
    longer than the 1 s liveness limit. The follower asked again every 0.5 s for
    calls it held, and gave up the gap's limit after it started though the calls
    were in hand ("never arrived": it left the cluster). It now asks, and counts
    down, only while the next call is missing and no write waits for the workers
    (what it reads ahead meanwhile may hold it). Sabotage: no ``_writing`` check
    in ``NodeAgent._ask_again`` -> ``leaving`` (the call sent again was read
    ahead while another was written); the gap's first ``upto`` in place of the next call held -> 8
    is never asked for (two_lost); the code before the fix: ``leaving`` after two
    ``gap`` requests."""
    leading = PosingLeader(env={"ZBUS_RING": "64Kx4"})
    last = lost[-1] + 1
    try:
        leading.welcome(liveness_s=1.0)
        for seq in range(1, 6):  # the worker's queue: longer than the liveness limit
            leading.call(seq, "sleep", 1.5)
        for seq in range(7, last + 1):
            if seq not in lost:
                leading.call(seq, "noop")
        replies, asked, leaving, next_hb, deadline = set(), [], [], 0.0, time.monotonic() + 30
        while len(replies) < last and not leaving and time.monotonic() < deadline:
            if time.monotonic() >= next_hb:  # ours, so that the follower keeps its leader
                leading.xpub.send_multipart([b"H", *codec.encode(["hb", 0, "s1"])])
                next_hb = time.monotonic() + 0.2
            if (msg := leading.receive(50)) is None:
                continue
            if msg[0] == "gap":  # ["gap", node rank, session, first, upto]
                asked.append(msg[3:])
                if msg[3] in lost:
                    leading.call(msg[3], "noop", again=True)
            leaving += [msg] if msg[0] in ("leaving", "refused") else []  # (refused: no member yet)
            if msg[0] == 1 and msg[1] != protocol.READY:  # (rank 1's replies)
                replies.add(msg[1])
        ended = leading.proc.poll()
        assert not leaving and replies == set(range(1, last + 1)), \
            (leaving, replies, ended, leading.proc.stderr.read()[-3000:] if ended is not None else "")
        assert asked == [[n, n + 1] for n in lost], asked
        leading.bye()
    finally:
        leading.close()


def test_an_idle_follower_asks_for_lost_calls_every_half_second():
    """Call 2 is lost (a reset connection) and no call follows: the leader's
    heartbeat (every 2 s at a 10 s liveness limit) says call 2 was sent. The idle
    follower asks for it every 0.5 s, as it does while calls come. Before, its
    wait for the leader woke only for the next heartbeat: one ask per 2 s, so a
    lost ask or answer cost 2 s, and it gave up up to a heartbeat late. Sabotage:
    ``wake`` without the gap's times in ``NodeAgent._serve`` -> 2 asks in 3 s."""
    leading = PosingLeader()
    try:
        leading.welcome(liveness_s=10.0)
        leading.await_calls_heard()
        leading.call(1, "noop")
        asked, next_hb, end = 0, 0.0, None
        deadline = time.monotonic() + 30
        while time.monotonic() < (end or deadline):
            if time.monotonic() >= next_hb:  # the leader's heartbeat: call 2 was sent
                leading.xpub.send_multipart([b"H", *codec.encode(["hb", 2, leading.session])])
                next_hb = time.monotonic() + 2.0
            msg = leading.receive(50)
            if msg is not None and msg[0] == "gap":  # ["gap", node rank, session, first, upto]
                assert msg[3:] == [2, 3], msg
                asked += 1
                end = end or time.monotonic() + 3.0  # count the asks of 3 s from the first
        assert asked >= 5, f"{asked} asks in 3 s"
        leading.bye()
    finally:
        leading.close()


def relay_waiting_on_a_long_call(leading: PosingLeader, seconds: float) -> None:
    """Call 1 sleeps ``seconds`` on the follower's worker, and calls 2 to 9 follow,
    more than its ring (64Kx4) holds: its agent waits for room, reading ahead."""
    leading.call(1, "sleep", seconds)
    for seq in range(2, 10):
        leading.call(seq, "noop")


@pytest.mark.parametrize("word", [["bye"], ["failed", "an error"], ["stopping"]], ids=lambda w: w[0])
def test_a_follower_takes_another_leaders_bye_failed_or_stopping_for_its_leader_lost(word):
    """A node of a leader that died reconnects to one started since at the same
    address, and hears its broadcasts until it sees its heartbeat. That leader's
    ``bye`` made it exit 0 (an orchestrator reads "done" and restarts nothing), its
    ``failed`` ended it as this cluster's failure, its ``stopping`` made it keep
    its own workers' deaths to itself. Each now names its leader's session, and
    another session's is another leader: the node ends as its leader lost (exit
    1, saying so) at once. (Its own leader's ``bye``: ``PosingLeader.bye``, exit
    0.) Sabotage: no ``_check_leader`` for them in ``NodeAgent._ends`` -> exit 0,
    a failure logged as this cluster's, or nothing until the 5 s liveness limit."""
    leading = PosingLeader()
    try:
        leading.welcome(liveness_s=5.0)
        leading.await_calls_heard()
        leading.xpub.send_multipart([b"H", *codec.encode([word[0], "another", *word[1:]])])
        assert leading.proc.wait(30) == 1
        said = leading.proc.stderr.read()
        assert "another leader at 127.0.0.1" in said and "no heartbeat" not in said, said[-2000:]
    finally:
        leading.close()


def test_a_follower_that_takes_its_leader_for_lost_says_so():
    """The leader's heartbeats stop reaching a follower (a partition one way, or an
    agent that stopped reading behind a long call): it ends its workers and exits
    1, and tells the leader why, as a node that gives up for any other reason does:
    the leader fails it at once, naming the reason, not a liveness limit later for
    "no heartbeat". Sabotage: no ``_tell_leader`` on ``LeaderLost`` in
    ``NodeAgent.run`` -> nothing said."""
    leading = PosingLeader()
    try:
        leading.welcome(liveness_s=1.0)
        said, deadline = None, time.monotonic() + 30
        while said is None and time.monotonic() < deadline:  # (no heartbeat sent)
            msg = leading.receive(100)
            if type(msg) is list and msg[:1] in (["leaving"], ["refused"]):
                said = msg
        assert said is not None and "lost: no heartbeat for" in said[-1], said
        assert leading.proc.wait(30) == 1
    finally:
        leading.close()


def test_a_relay_waiting_on_a_long_call_keeps_its_leader_on_heartbeats_alone():
    """The follower's relay waits for room behind a 4 s call, and only the leader's
    heartbeats come (every 0.1 s, liveness 1 s): they took a place each in what the
    agent reads ahead, which filled (8 here, 1024 by default: 34 minutes of
    heartbeats at the default limit); the agent then stopped reading and took its
    live leader for lost. A heartbeat held right after another now replaces it.
    Sabotage: no ``if self._held_hb`` replacement in ``NodeAgent._read_ahead`` ->
    the follower exits 1 ("no heartbeat") before call 1 is answered."""
    leading = PosingLeader(env={"ZBUS_RING": "64Kx4"},
                           first="import zbus.agent\nzbus.agent.BACKLOG_MESSAGES = 8")
    try:
        leading.welcome(liveness_s=1.0)
        relay_waiting_on_a_long_call(leading, 4.0)
        replies, next_hb, deadline = set(), 0.0, time.monotonic() + 30
        while len(replies) < 9 and leading.proc.poll() is None and time.monotonic() < deadline:
            if time.monotonic() >= next_hb:
                leading.xpub.send_multipart([b"H", *codec.encode(["hb", 9, "s1"])])
                next_hb = time.monotonic() + 0.1
            msg = leading.receive(50) or [None]
            if msg[0] == 1 and msg[1] != protocol.READY:
                replies.add(msg[1])
        assert leading.proc.poll() is None, leading.proc.stderr.read()[-3000:]
        assert replies == set(range(1, 10)), replies
        leading.bye()
    finally:
        leading.close()


def test_a_relay_waiting_on_a_long_call_sees_another_leaders_heartbeat_at_once():
    """The follower's relay waits for room behind a 30 s call when a heartbeat of
    another leader (one restarted at its leader's address) comes: it waited its
    turn behind the calls read ahead, and every message read counted as its
    leader alive, so the node held its GPUs for the whole call. Its session is
    checked as it is read now: the follower exits 1 at once. Sabotage: no
    ``self._check_leader(msg[2])`` in ``NodeAgent._read_ahead`` -> still running
    after 8 s."""
    leading = PosingLeader(env={"ZBUS_RING": "64Kx4"})
    try:
        leading.welcome()
        relay_waiting_on_a_long_call(leading, 30.0)

        def relay_waiting() -> bool:  # its heartbeats name the last call relayed (every 2 s)
            leading.xpub.send_multipart([b"H", *codec.encode(["hb", 9, "s1"])])
            msg = leading.receive(200) or [None]
            return msg[0] == "hb" and msg[3] >= 5
        wait_until(relay_waiting, 20, "the relay waiting for room in the ring")
        leading.xpub.send_multipart([b"H", *codec.encode(["hb", 1, "s2"])])
        assert leading.proc.wait(8) == 1
        assert "another leader at 127.0.0.1" in leading.proc.stderr.read()
    finally:
        leading.close()


def test_a_follower_ignores_answers_to_its_join_of_the_wrong_shape():
    """A leader (or one posing as it, without keys) answers a join on the node's
    topic with messages of the wrong shape: the follower ignores them, waits on,
    and takes the proper answer after them (here a refusal). Sabotage: index
    ``msg[0]``, ``msg[1]`` in ``NodeAgent._join`` without the shape check: the
    follower dies of an IndexError or KeyError; drop the plain-items check in
    ``NodeAgent._decode``: a ValueError (the array's ``==``)."""
    leading = PosingLeader()
    try:
        leading.join()
        topic = leading.topic
        for bad in (["welcome"], {"welcome": 1}, [], ["reject"], "welcome", [5, 6], ["welcome", [1]],
                    [np.array([1, 2]), {}]):  # an array's == has no truth value
            leading.xpub.send_multipart([topic, *codec.encode(bad)])
        leading.xpub.send_multipart([topic, *codec.encode(["reject", "the test is over"])])
        assert leading.proc.wait(30) == 1
        err = leading.proc.stderr.read()
        crashes = ("IndexError", "KeyError", "ValueError")
        assert "the test is over" in err and not any(e in err for e in crashes), err[-2000:]
    finally:
        leading.close()
