"""Structure-aware hostile msgpack: to ``zbus.codec.decode``, and to both ports of a
live leader that has a follower, with and without keys.

Classes of hostile message, each a hypothesis strategy built from a few drawn
numbers (so big messages cost hypothesis nothing): one buffer frame named many
times, nesting far past MAX_DEPTH, tensors, arrays and containers that declare
gigabytes over a few bytes, bad dtypes, shapes and strides, headers of many small
objects, and random bytes.

- Decoding runs in a process of its own (``DECODER``), which reports its peak RSS
  (``ru_maxrss``, which only grows) after each message: the peak over the one it
  had after start-up stays within 64 MiB plus the largest message, and the
  process lives on (a C stack overflow would kill it).
- The leader runs in a process of its own too (``tests/fuzz_leader.py``), with a
  follower. Each hostile message goes to its PULL port as node 1's reply to a call
  never sent, as a ``died`` report, and as it is (unless it starts as an array:
  a list the leader might act on), and each must be counted once in
  ``Leader.dropped``; its peak RSS stays within 64 MiB plus the largest message;
  its I/O thread lives; node 1's heartbeats keep coming (and the follower, which
  leaves after the 2 s liveness limit without the leader's, stays); it answers a
  call after each test. With keys the messages come over node 1's key: what a
  compromised node can send. Its XPUB port gets hostile subscribers, and both
  ports raw bytes that are not ZeroMQ.

Examples are few and derandomized, with no database, so a run is reproducible and
the module takes about 35 s. Each test names the sabotage that fails it, as
measured."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import pytest
import zmq
from conftest import TEST_PATH, end_process, wait_until
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st
from test_cluster import free_port_pair

from zbus import codec

MiB = 2**20
GROWTH = 64 * MiB
SECRET = "zbus-fuzz-secret-0123456789abcdef"  # a test-only value
TUPLE, TENSOR, NDARRAY, BYTES = 1, 2, 3, 4


def fuzz(n: int, shrink: bool = True):
    """Settings of a reproducible run: ``n`` examples, derandomized, no database. A
    test of the live leader does not shrink a failure (each example costs a round
    trip, and a wrong count waits for its drops): it reports the first one."""
    phases = list(Phase) if shrink else [Phase.explicit, Phase.generate]
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=phases,
                    report_multiple_bugs=False, suppress_health_check=list(HealthCheck))


def ext(code: int, body) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(body, use_bin_type=True))


def header(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# --- the hostile classes: each draws a list of frames, header first ----------------

REF_KINDS = ("bytes", "bytearray", "memoryview", "tensor", "ndarray")


@st.composite
def frame_reuse(draw) -> list[bytes]:
    """Up to 4096 references to one buffer frame of up to 1 MiB: 4 GiB of copies or
    of aliased tensors if each reference were taken."""
    refs = draw(st.integers(2, 4096))
    size = draw(st.sampled_from([64, 4096, 2**16, MiB]))
    kind = draw(st.sampled_from([*REF_KINDS, "mixed"]))
    bodies = {"bytes": ext(BYTES, [0, 0]), "bytearray": ext(BYTES, [1, 0]), "memoryview": ext(BYTES, [2, 0]),
              "tensor": ext(TENSOR, ["uint8", [size], [1], 0]), "ndarray": ext(NDARRAY, ["|u1", [size], 0])}
    items = [bodies[REF_KINDS[i % 5] if kind == "mixed" else kind] for i in range(refs)]
    return [header(items), bytes(size)]


OPENERS = {"array": b"\x91", "map": b"\x81\xa1k", "array16": b"\xdc\x00\x01",
           "map32": b"\xdf\x00\x00\x00\x01\xa1k", "array32": b"\xdd\x00\x00\x00\x01"}


@st.composite
def deep_nesting(draw) -> list[bytes]:
    """Plain maps and arrays, or tuples (an extension type, which msgpack unpacks
    by a nested call on the C stack), nested 65 to 2000 deep."""
    depth = draw(st.integers(codec.MAX_DEPTH + 1, 2000))
    form = draw(st.sampled_from([*OPENERS, "mixed", "tuples"]))
    if form == "tuples":
        return _deep_tuples(depth)
    if form == "mixed":
        names = list(OPENERS)
        seed = draw(st.integers(0, 2**32))
        return [b"".join(OPENERS[names[(seed >> (i % 29)) % 5]] for i in range(depth)) + b"\xc0"]
    return [OPENERS[form] * depth + b"\xc0"]


TENSOR_DTYPES = [(n, s) for n, s in [("uint8", 1), ("bool", 1), ("int16", 2), ("bfloat16", 2),
                                     ("float32", 4), ("int64", 8), ("complex128", 16)]]
NP_DTYPES = [("|u1", 1), ("|b1", 1), ("<i2", 2), ("<f4", 4), (">i8", 8), ("<c16", 16)]


@st.composite
def huge_declared(draw) -> list[bytes]:
    """Tensors and arrays whose shape and dtype declare 1 GiB to 2^64 bytes over at
    most 64 bytes of data, or over none; containers and strings that declare 2^31
    to 2^32 - 1 items or bytes over a few."""
    form = draw(st.sampled_from(["tensor", "tensor-no-data", "ndarray", "ndarray-no-data", "containers"]))
    if form == "containers":
        opener = draw(st.sampled_from([b"\xdd", b"\xdf", b"\xc6", b"\xdb", b"\xc9"]))
        count = draw(st.integers(2**31, 2**32 - 1)).to_bytes(4, "big")
        tail = b"\x01" if opener == b"\xc9" else b""  # an extension's type code
        return [opener + count + tail + draw(st.binary(max_size=64))]
    dtype, itemsize = draw(st.sampled_from(NP_DTYPES if form.startswith("ndarray") else TENSOR_DTYPES))
    dims = draw(st.lists(st.integers(2**8, 2**20), min_size=1, max_size=3))
    while math.prod(dims) * itemsize < 2**30:
        dims[0] *= 2**8
    data = draw(st.binary(max_size=64))
    if form.startswith("ndarray"):
        body = [dtype, dims, None if form.endswith("no-data") else 0]
        return [header(ext(NDARRAY, body)), *([] if form.endswith("no-data") else [data])]
    strides, acc = [], 1
    for size in reversed(dims):
        strides.insert(0, acc)
        acc *= size
    index = None if form.endswith("no-data") else 0
    return [header(ext(TENSOR, [dtype, dims, strides, index])), *([] if index is None else [data])]


BAD_DTYPES = ["object", "O", "|O", "V8", "|V8", "<U4", "|S3", "M8[s]", "<M8[ns]", "<m8[s]", "f4", "float",
              "float4_e2m1fn_x2", "uint1", "qint8", "complex32", "bits8", "os.system", "__import__", "",
              "<f4 ", "torch.float32", "numpy.float32", "<f3", "<i16", ">f8,<i4", "[('a','<f4')]",
              "(2,)<f4", "<f4\x00", "|u1" * 100]
BAD_DIMS = [-1, -(2**63), 1.5, True, None, "4", [2]]


@st.composite
def bad_dtype_shape(draw) -> list[bytes]:
    """A tensor or array that is valid but for one thing: a dtype outside the table
    (aliases, object, strings, records, sub-byte, quantized, text that names code),
    a shape with a negative, fractional, boolean, huge or non-number dimension or
    more than 64 dimensions, or strides that overlap, leave gaps or miss a dimension."""
    target = draw(st.sampled_from(["tensor", "ndarray"]))
    broken = draw(st.sampled_from(["dtype", "shape", "rank", "strides"] if target == "tensor"
                                  else ["dtype", "shape", "rank"]))
    dtype, itemsize = draw(st.sampled_from(TENSOR_DTYPES if target == "tensor" else NP_DTYPES))
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    strides, acc = [], 1
    for size in reversed(shape):
        strides.insert(0, acc)
        acc *= size
    data = bytes(acc * itemsize)
    if broken == "dtype":
        dtype = draw(st.sampled_from(BAD_DTYPES) | st.text(max_size=12).filter(
            lambda t: t not in codec.TENSOR_DTYPES and not codec._NP_DTYPE.fullmatch(t)))
        try:  # data of the length that dtype would need, so that only the dtype is wrong
            data = bytes(acc * np.dtype(dtype).itemsize)
        except Exception:  # noqa: BLE001 - numpy cannot even parse it
            pass
    elif broken == "shape":
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from(BAD_DIMS))
    elif broken == "rank":
        shape = [1] * draw(st.integers(65, 300))
        strides = [1] * len(shape)
    else:
        strides = draw(st.sampled_from([[0] * len(shape), [s * 2 for s in strides], strides[1:],
                                        [-1] * len(shape)]))
        assume(not codec._dense(shape, strides) or len(strides) != len(shape) or min(strides) < 0)
        assume(acc > 1 or len(strides) != len(shape) or min(strides) < 0)
    body = [dtype, shape, strides, 0] if target == "tensor" else [dtype, shape, 0]
    return [header(ext(TENSOR if target == "tensor" else NDARRAY, body)), data]


WIDE_ITEMS = [b"\x80", b"\x90", b"\x81\x00\x00", b"\x91\x90", b"\xe0", b"\xa2ab", b"\x92\x01\x02", b"\xc0",
              b"\xcb" + bytes(8)]


@st.composite
def wide(draw) -> list[bytes]:
    """One array of up to 1 MiB of one small item: empty or one-entry maps, empty
    arrays, ints Python makes anew, short strings, pairs, floats. One byte can
    become a 64-byte dict."""
    item = draw(st.sampled_from(WIDE_ITEMS))
    n = draw(st.sampled_from([2**12, 2**16, 2**18, MiB])) // len(item)
    return [b"\xdd" + n.to_bytes(4, "big") + item * n]


@st.composite
def random_frames(draw) -> list[bytes]:
    """Random bytes: one to four frames of up to 4 KiB."""
    return draw(st.lists(st.binary(min_size=0, max_size=4096), min_size=1, max_size=4))


WORST_WIDE = [b"\xdd" + MiB.to_bytes(4, "big") + b"\x80" * MiB]  # 1 MiB of empty maps: 72 MiB of dicts


def _deep_tuples(depth: int) -> list[bytes]:
    inner = header(None)
    for _ in range(depth):
        inner = header(msgpack.ExtType(TUPLE, b"\x91" + inner))
    return [inner]


DEEP_TUPLES = _deep_tuples(1000)  # each level a nested msgpack call: past the C stack


def size_of(frames: list[bytes]) -> int:
    return sum(len(f) for f in frames)


# --- (a) the codec, in a process of its own -----------------------------------------

DECODER = r"""
import gc, resource, struct, sys
import numpy, torch
from zbus import codec

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def read(n):
    data = sys.stdin.buffer.read(n)
    if len(data) != n:
        sys.exit(0)
    return data

codec.decode(codec.encode([torch.ones(2), numpy.ones(2), (b"x" * 20000,)]))  # the lazy imports
gc.collect()
print("ready", peak(), flush=True)
while True:
    count, writable = struct.unpack("<IB", read(5))
    frames = []
    for i in range(count):  # each frame read once: the only copy of the input
        n = struct.unpack("<I", read(4))[0]
        frame = bytearray(n) if writable and i else None
        if frame is not None:
            sys.stdin.buffer.readinto(frame)
        frames.append(frame if frame is not None else read(n))
    try:
        value = codec.decode(frames)
        outcome = "decoded"
    except codec.CodecError:
        outcome = "refused"
    except BaseException as e:
        outcome = "escaped:" + type(e).__name__
    value = frames = None
    print(outcome, peak(), flush=True)
"""


class Decoder:
    """The decoding process: ``decode(frames)`` returns its outcome (``decoded``,
    ``refused``, or ``escaped:<type>`` for an exception other than CodecError)
    and checks that it lived and its peak RSS stayed within GROWTH plus the
    largest message sent so far. A process that died is started again for the
    next message (so hypothesis can shrink to the message that kills it)."""

    def __init__(self):
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", DECODER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=TEST_PATH))
        word, base = self.proc.stdout.readline().split()
        assert word == b"ready"
        self.base, self.largest, self.peak = int(base), 0, int(base)

    def decode(self, frames: list[bytes], writable: bool = True) -> str:
        self.largest = max(self.largest, size_of(frames))
        try:
            self.proc.stdin.write(struct.pack("<IB", len(frames), writable)
                                  + b"".join(struct.pack("<I", len(f)) + f for f in frames))
            self.proc.stdin.flush()
            line = self.proc.stdout.readline().split()
        except BrokenPipeError:
            line = []
        if not line:
            code = self.proc.wait(10)
            self.start()
            raise AssertionError(f"the decoding process died: exit code {code}")
        self.peak = int(line[1])
        growth = self.peak - self.base
        assert growth <= GROWTH + self.largest, \
            f"peak RSS grew {growth / MiB:.1f} MiB decoding {self.largest / MiB:.2f} MiB"
        return line[0].decode()

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0
        print(f"decoder: peak RSS growth {(self.peak - self.base) / MiB:.1f} MiB, "
              f"largest message {self.largest / MiB:.2f} MiB")


@pytest.fixture(scope="module")
def decoder():
    d = Decoder()
    yield d
    d.close()


@pytest.mark.timeout(120)
@fuzz(40)
@given(frame_reuse(), st.booleans())
def test_decode_refuses_a_frame_named_twice(decoder, frames, writable):
    """Sabotage: drop the "used twice" test from _Decoder.frame in zbus/codec.py
    (two references to one 64-byte frame then decode; tensors, arrays and
    memoryviews over one writable frame would alias it)."""
    assert decoder.decode(frames, writable) == "refused"


@pytest.mark.timeout(120)
@fuzz(40)
@given(deep_nesting())
def test_decode_refuses_deep_nesting_and_lives(decoder, frames):
    """Sabotage: drop the MAX_DEPTH test from codec._walk (plain nesting up to
    msgpack's own 1024 then decodes; tuples nested a few hundred deep overflow
    the C stack: the process dies with SIGSEGV)."""
    assert decoder.decode(frames) == "refused"


@pytest.mark.timeout(120)
@fuzz(40)
@given(huge_declared())
def test_decode_refuses_sizes_declared_past_the_data(decoder, frames):
    """Sabotage: drop the "tensor without data" and "ndarray without data" tests
    from _Decoder._tensor and _Decoder._ndarray in zbus/codec.py (a uint8 tensor of
    shape [2**32] and no data then decodes: 4 GiB allocated, never filled)."""
    assert decoder.decode(frames) == "refused"


@pytest.mark.timeout(120)
@fuzz(60)
@given(bad_dtype_shape())
def test_decode_refuses_bad_dtypes_shapes_and_strides(decoder, frames):
    """Sabotage: drop the _NP_DTYPE and dtype.kind tests from _Decoder._ndarray
    (arrays of strings, records, datetimes or raw void then decode: first a "V8")."""
    assert decoder.decode(frames) == "refused"


@pytest.mark.timeout(120)
@fuzz(25)
@given(wide())
@example(WORST_WIDE)
def test_decode_of_many_small_objects_stays_within_its_memory_bound(decoder, frames):
    """Decoded or refused, never more than 64 MiB of growth (refused when its
    objects would pass 32 MiB + 32x the header).
    Sabotage: drop the two ``spent > budget`` tests from codec._walk (1 MiB of empty
    maps then decodes into 72 MiB of dicts: peak growth 73.7 MiB)."""
    assert decoder.decode(frames) in ("decoded", "refused")


@pytest.mark.timeout(120)
@fuzz(150)
@given(random_frames(), st.booleans())
def test_decode_of_random_bytes_is_a_value_or_a_codec_error(decoder, frames, writable):
    """Sabotage: drop codec.decode's ``except Exception`` clause (msgpack's own
    errors then escape: a ValueError for an empty frame first)."""
    assert decoder.decode(frames, writable) in ("decoded", "refused")


# --- (b) a live leader's two ports --------------------------------------------------


class LiveCluster:
    """The leader process (tests/fuzz_leader.py) and its follower; ``push`` is a
    PUSH socket to its PULL port, over node 1's key when keyed."""

    def __init__(self, keyed: bool):
        self.keyed = keyed
        self.port = free_port_pair()
        env = dict(os.environ, PYTHONPATH=TEST_PATH)
        env.pop("ZBUS_SECRET", None)
        if keyed:
            env["ZBUS_SECRET"] = SECRET
        self.log = tempfile.TemporaryFile("w+")  # the follower's log (a pipe could fill and block it)
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "zbus.cli", "follower", "--join-timeout", "60", "--node-rank", "1"],
            env=dict(env, ZBUS_MASTER_ADDR="127.0.0.1", ZBUS_MASTER_PORT=str(self.port),
                     ZBUS_NPROC_PER_NODE="1", ZBUS_ALLOW_WORKERS="workers"),
            stderr=self.log, text=True)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_leader.py")
        self.leader = subprocess.Popen([sys.executable, script, str(self.port)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env, text=True)
        self.ctx = None
        try:
            ready = json.loads(self.leader.stdout.readline() or "{}")
            assert "ready" in ready, "the leader did not start"
        except BaseException:
            self.leader.kill()
            self.follower.terminate()  # (it removes its segments as it ends)
            self.end()
            raise
        self.base = self.peak = ready["ready"]["maxrss"]
        self.expected = ready["ready"]["dropped"]
        self.session = ready["ready"]["session"]  # (what node 1's replies name)
        self.largest = 0
        self.ctx = zmq.Context()
        self.push = self.socket(zmq.PUSH, self.port + 1)

    def socket(self, kind: int, port: int, key: bool = True) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keyed and key:
            from zbus.curve import NodeCurve

            NodeCurve.from_secret(SECRET.encode(), 1).client(sock)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    def ask(self, **cmd) -> dict:
        self.leader.stdin.write(json.dumps(cmd) + "\n")
        self.leader.stdin.flush()
        line = self.leader.stdout.readline()
        assert line, f"the leader process died: exit code {self.leader.wait(10)}"
        return json.loads(line)

    def check(self, stats: dict) -> None:
        """The leader lives, its I/O thread too, nothing failed it, its memory is bounded."""
        assert stats["io_alive"] and stats["failure"] is None, stats
        self.peak = stats["maxrss"]
        growth = stats["maxrss"] - self.base
        assert growth <= GROWTH + self.largest, \
            f"the leader's peak RSS grew {growth / MiB:.1f} MiB; largest message {self.largest / MiB:.2f} MiB"

    def send(self, messages: list[list[bytes]]) -> dict:
        """Send messages that must each be dropped once; wait for the count."""
        for msg in messages:
            self.largest = max(self.largest, size_of(msg))
            self.push.send_multipart(msg, copy=False)
        self.expected += len(messages)
        stats = self.ask(op="wait_dropped", n=self.expected)
        assert stats["dropped"] == self.expected, f"dropped {stats['dropped']}, expected {self.expected}"
        self.check(stats)
        return stats

    def follower_log(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def finish(self) -> None:
        """The cluster ends cleanly: the follower exits 0, never having lost its leader."""
        self.ask_quit()
        assert self.follower.wait(30) == 0, self.follower_log()[-2000:]
        assert "leader lost" not in self.follower_log().lower()

    def ask_quit(self) -> None:
        self.leader.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.leader.stdin.flush()
        assert self.leader.wait(30) == 0

    def end(self) -> None:
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        for proc in (self.leader, self.follower):
            end_process(proc)
        self.log.close()


@pytest.fixture(scope="module", params=[False, True], ids=["unkeyed", "keyed"])
def live(request):
    c = LiveCluster(request.param)
    try:
        yield c
        c.finish()
        print(f"leader ({'keyed' if c.keyed else 'unkeyed'}): peak RSS growth "
              f"{(c.peak - c.base) / MiB:.1f} MiB, largest message {c.largest / MiB:.2f} MiB, "
              f"{c.expected} dropped")
    finally:
        c.end()


@pytest.fixture
def leader(live):
    """The module's cluster, checked after each test: heartbeats, a call, memory."""
    first = live.ask(op="stats")
    yield live
    wait_until(lambda: live.ask(op="stats")["heartbeats"] > first["heartbeats"], 10,
               "node 1's heartbeats go on")
    done = live.ask(op="call", x=2)
    assert done["result"] == [20, 21]
    assert done["heartbeats"] > first["heartbeats"], "node 1's heartbeats stopped"
    assert done["dropped"] == live.expected
    live.check(done)
    assert live.follower.poll() is None, "the follower left: " + live.follower_log()[-2000:]


FUTURE = 10**9  # a call number never sent: a reply to it is not expected


ARRAY_TYPE_BYTES = frozenset([*range(0x90, 0xa0), 0xdc, 0xdd])


def envelopes(frames: list[bytes], i: int, session: str) -> list[list[bytes]]:
    """``frames`` as node 1's reply to a call never sent (of the leader's
    ``session``), and as a ``died`` report
    (the hostile header is spliced in as the last item: whatever it holds, the
    whole is one message, dropped once); and as it is, unless its header starts as
    an array (a list the leader might act on, such as a reply it would deliver:
    what is not a list it drops, decoded or not). Nothing is decoded here: under a
    sabotage, that could crash this process rather than the leader's."""
    head, *buffers = frames
    reply = b"\x95" + header(session) + b"\x01" + header(FUTURE + i) + b"\x00" + head
    out = [[reply, *buffers], [b"\x92\xa4died" + head, *buffers]]
    if not head or head[0] not in ARRAY_TYPE_BYTES:
        out.append(frames)
    return out


CALL = st.integers(0, 10**6)


@pytest.mark.timeout(240)
@fuzz(30, shrink=False)
@given(frames=st.one_of(frame_reuse(), huge_declared(), bad_dtype_shape()), i=CALL)
def test_leader_drops_each_message_the_codec_refuses_once(leader, frames, i):
    """Frames named twice, sizes declared past the data, bad dtypes, shapes and
    strides: each envelope is refused by the codec and counted once.
    Sabotage: drop the ``self.drop`` call of DataPath._checked_message's CodecError
    branch (what has no reply head goes uncounted), or make RemoteReceiver.expects
    return True (the error reply to a call never sent is queued, uncounted, and
    fails the executor's next call with a protocol error). Each: 2 of 4 counted."""
    leader.send(envelopes(frames, i, leader.session))


@pytest.mark.timeout(240)
@fuzz(15, shrink=False)
@given(frames=deep_nesting(), i=CALL)
@example(frames=DEEP_TUPLES, i=0)
def test_leader_survives_deep_nesting(leader, frames, i):
    """Sabotage: drop the MAX_DEPTH test from codec._walk (tuples nested a few
    hundred deep overflow the C stack of the leader's reading thread: its process
    dies with SIGSEGV)."""
    leader.send(envelopes(frames, i, leader.session))


@pytest.mark.timeout(240)
@fuzz(12, shrink=False)
@given(frames=wide(), i=CALL)
@example(frames=WORST_WIDE, i=0)
@example(frames=[b"\xdd" + MiB.to_bytes(4, "big") + b"\xe0" * MiB], i=1)
def test_leader_memory_stays_bounded_under_many_small_objects(leader, frames, i):
    """1 MiB of empty maps (refused), and 1 MiB of -32s (decoded into 40 MiB of
    ints), among others, in each envelope.
    Sabotage: drop the two ``spent > budget`` tests from codec._walk (the leader's
    peak grows 76 MiB, decoding the ``died`` report)."""
    leader.send(envelopes(frames, i, leader.session))


@pytest.mark.timeout(240)
@fuzz(40, shrink=False)
@given(frames=random_frames(), i=CALL)
def test_leader_drops_random_bytes(leader, frames, i):
    """Some of these decode (``["died", 1]``), most do not; each is counted once.
    Sabotage: no ``self.path.drop`` for ``other-session`` in Membership.handle (a
    ``died`` report that names no session: the first that decodes goes
    uncounted)."""
    leader.send(envelopes(frames, i, leader.session))


OVERSIZE_SUBSCRIPTION = b"\x01" + bytes(range(256)) * 4096  # 1 MiB of topic


@st.composite
def xsub_traffic(draw) -> list[bytes]:
    """What a peer on the XPUB port can send: subscriptions and cancellations of
    random topics (up to 4000 bytes), messages that are neither, and a
    subscription of 1 MiB."""
    kinds = st.one_of(
        st.binary(min_size=1, max_size=4000).map(lambda t: b"\x01" + t),
        st.binary(min_size=1, max_size=64).map(lambda t: b"\x00" + t),
        st.binary(min_size=0, max_size=4096),
        st.just(OVERSIZE_SUBSCRIPTION))
    return draw(st.lists(kinds, min_size=1, max_size=24))


def zmtp_frame(body: bytes) -> bytes:
    """One frame, the last of its message: a short one, or a long one (8-byte size)."""
    size = bytes([len(body)]) if len(body) < 256 else struct.pack(">Q", len(body))
    return (b"\x00" if len(body) < 256 else b"\x02") + size + body


def zmtp_subscriber(port: int) -> socket.socket:
    """A SUB peer written by hand (ZMTP 3.0, no keys): libzmq's own XSUB keeps what
    it subscribes to in a trie it walks recursively, and a 1 MiB topic overflows
    the stack of the sending process when it reconnects."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
    sock.sendall(b"\x04" + bytes([len(ready)]) + ready)
    got = b""
    while len(got) < 64 + 2 or len(got) < 64 + 2 + got[65]:  # the leader's greeting and READY
        chunk = sock.recv(4096)
        assert chunk, "the leader closed the connection during the handshake"
        got += chunk
    return sock


@pytest.mark.timeout(240)
@fuzz(12, shrink=False)
@given(messages=xsub_traffic(), garbage=st.binary(min_size=1, max_size=2**16))
@example(messages=[OVERSIZE_SUBSCRIPTION], garbage=b"\x00")
def test_leader_xpub_port_and_raw_tcp_bytes(leader, messages, garbage):
    """The XPUB port: a peer subscribes to random topics, cancels, sends messages
    that are neither and a 1 MiB subscription, then leaves (keyed: an XSUB over
    node 1's key, without the 1 MiB one); raw bytes that are not ZeroMQ go to both
    ports; keyed, a PUSH with no key sends to the PULL port. None is counted
    (ZeroMQ refuses them, or zbus reads and ignores them), the leader's peak stays
    bounded and it serves on. ZeroMQ keeps each distinct topic in a trie, about 80
    bytes of memory per byte (docs/security.md): here at most 24 topics of 4000
    bytes at a time.
    Sabotage: raise the XPUB socket's MAXMSGSIZE (4096, in Broadcaster) to
    codec.MAX_MESSAGE (the 1 MiB subscription then enters the leader's trie: peak
    growth 117 MiB)."""
    if leader.keyed:
        xsub = leader.socket(zmq.XSUB, leader.port)
        for msg in messages:
            if msg is not OVERSIZE_SUBSCRIPTION:
                leader.largest = max(leader.largest, len(msg))
                xsub.send(msg)
        time.sleep(0.05)
        xsub.close(linger=2000)
        stranger = leader.socket(zmq.PUSH, leader.port + 1, key=False)
        stranger.setsockopt(zmq.SNDTIMEO, 2000)  # (no peer between its failed handshakes: a send waits)
        with contextlib.suppress(zmq.Again):
            stranger.send_multipart([b"\xc1"])  # never reaches the leader: no handshake without a key
        stranger.close(linger=500)
    else:
        sub = zmtp_subscriber(leader.port)
        try:
            for msg in messages:
                leader.largest = max(leader.largest, len(msg))
                sub.sendall(zmtp_frame(msg))
            time.sleep(0.05)
        except OSError:
            pass  # the leader dropped the connection at the 1 MiB subscription
        finally:
            sub.close()
    for port in (leader.port, leader.port + 1):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(garbage)
    time.sleep(0.2)  # none may be counted: the time a wrong count would take to show
    stats = leader.ask(op="stats")
    assert stats["dropped"] == leader.expected
    leader.check(stats)
