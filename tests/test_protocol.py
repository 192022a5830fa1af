"""The broadcast envelope (zbus/protocol.py): what a worker accepts as a call or a
stop, and how it refuses anything else.

The envelope is plain msgpack: the expected bytes here are written with msgpack
itself, never with zbus's codec.
"""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest

import zbus
from zbus import protocol
from zbus.protocol import CALL, STOP, call_envelope, read_envelope


def packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_call_envelope_is_plain_msgpack_and_reads_back():
    """Sabotage: ``call_envelope`` encoding something else (``codec.encode(None)``)
    or returning a buffer frame instead of the header (``[1]``) → fails."""
    frame = call_envelope(7, "step", -1, 2)
    assert frame == packed([CALL, 7, "step", -1, 2, 0])
    assert read_envelope(frame) == [CALL, 7, "step", -1, 2, 0]
    assert read_envelope(call_envelope(7, "step", -1, 2, 6)) == [CALL, 7, "step", -1, 2, 6]
    assert type(read_envelope(frame)) is list  # a list, as the worker indexes and compares it


def test_stop_and_calls_are_read_as_lists_of_str_and_int():
    """Sabotage: ``msgpack.unpackb(..., raw=True)`` (the method name as bytes),
    ``use_list=False`` (tuples: every call refused), ``envelope == [STOP] and ...``
    or ``... != [STOP] or ...`` (STOP refused or every call refused) → fails."""
    assert read_envelope(packed([STOP])) == [STOP]
    envelope = read_envelope(packed([CALL, 1, "load", 0, 1, 0]))
    assert envelope == [CALL, 1, "load", 0, 1, 0] and type(envelope[2]) is str
    assert read_envelope(memoryview(packed([CALL, 2**40, "x", -1, 0, 3]))) == [CALL, 2**40, "x", -1, 0, 3]


@pytest.mark.parametrize("envelope", [
    [STOP, 1],                      # STOP takes no fields
    [CALL, 1, "m", 0, 1],           # five fields
    [3, 1, "m", 0, 1, 0],           # an unknown kind
    [STOP, 1, "m", 0, 1, 0],        # STOP's kind with a call's fields
    [CALL, True, "m", 0, 1, 0],     # seq a bool (msgpack's true, not an int)
    ["1", 1, "m", 0, 1, 0],         # the kind as text
    [CALL, "1", "m", 0, 1, 0],      # seq not an int
    [CALL, 1.0, "m", 0, 1, 0],      # seq a float
    [CALL, 1, "m", "0", 1, 0],      # reply_rank not an int
    [CALL, 1, "m", None, 1, 0],     # reply_rank None
    [CALL, 1, "m", 0, "1", 0],      # n_payload not an int
    [CALL, 1, "m", 0, [1], 0],      # n_payload a list
    CALL,                           # a bare int
    "call",                         # a bare string
    None,
    [],
    [CALL, 1, "m", 0, 1, "0"],      # answered not an int
])
def test_anything_but_stop_or_a_call_is_refused_by_name(envelope):
    """Sabotage: any of the envelope checks loosened or dropped (``or`` for ``and``,
    ``len != 6`` / ``== 7``, ``envelope[1] == CALL``, ``type(envelope[2])`` or
    ``[5]`` for a checked field, ``is not int``, ``type(None)``) → a refused shape
    passes, or the check itself raises instead of refusing (IndexError on a short
    list, TypeError on ``len`` of an int), or a call is refused. The message names
    the envelope (at most 100 characters of it): ``CodecError(None)`` or
    ``str(None)`` → fails."""
    with pytest.raises(zbus.CodecError) as e:
        read_envelope(packed(envelope))
    assert str(e.value) == f"not a call envelope: {str(envelope)[:100]}"


def test_a_long_refused_envelope_is_named_in_100_characters():
    """Sabotage: ``str(envelope)[:101]`` → fails."""
    envelope = [CALL, 1, "m" * 500, 0, "x", 0]
    with pytest.raises(zbus.CodecError) as e:
        read_envelope(packed(envelope))
    assert str(e.value) == "not a call envelope: " + str(envelope)[:100]
    assert len(str(e.value)) == len("not a call envelope: ") + 100


@pytest.mark.parametrize("frame", [b"", b"\xc1", packed([STOP]) + b"\x00", b"\x95\x01", b"\xd9\x03ab",
                                   packed([CALL, 1, "m", 0, 1, 0, 2]),  # seven fields: past msgpack's limit
                                   packed({"kind": CALL})])  # a map: none is read
def test_bytes_that_are_not_msgpack_are_refused_with_msgpacks_reason(frame):
    """Sabotage: ``envelope = None`` or ``msgpack.unpackb(None, ...)`` (every frame
    refused, or none parsed), ``CodecError(None)`` or ``type(None).__name__`` in the
    message → fails."""
    try:  # (with the limits read_envelope sets: no length past the frame's end)
        n = len(frame)
        msgpack.unpackb(frame, max_str_len=n, max_bin_len=0, max_array_len=6, max_map_len=0, max_ext_len=0)
    except Exception as err:  # noqa: BLE001 - what msgpack says about this frame
        expected = f"cannot decode the envelope: {type(err).__name__}: {err}"
    else:
        pytest.fail(f"msgpack read {frame!r}")
    with pytest.raises(zbus.CodecError) as e:
        read_envelope(frame)
    assert str(e.value) == expected


def test_no_args_is_the_encoding_of_empty_arguments():
    assert zbus.codec.decode([protocol.NO_ARGS]) == ((), {})


def test_in_parts_judges_frames_by_their_bytes_and_leaves_small_calls_alone():
    """Sizes are checked before any view is made; a frame's size is its bytes,
    not its items. Sabotage: compare ``len(frame)`` for every frame in
    ``protocol._nbytes`` -> the float64 array of just over a part is not cut."""
    import numpy as np

    small = [b"envelope", bytearray(100), memoryview(b"x" * protocol.PART_BYTES)]
    assert protocol.in_parts(small) == (b"", small) and protocol.in_parts(small)[1] is small
    over = np.zeros(protocol.PART_BYTES // 8 + 1)  # len() counts items: 131 073
    counts, parts = protocol.in_parts([b"envelope", over])
    assert msgpack.unpackb(counts) == [1, 2] and [memoryview(p).nbytes for p in parts[1:]] == [
        protocol.PART_BYTES, 8]


@pytest.mark.parametrize("sizes", [
    [protocol.PART_BYTES + 1],                          # just over: 2 parts, the last of 1 byte
    [3 * protocol.PART_BYTES, 0, 5],                     # exact multiple; empty and small frames stay whole
    [protocol.PART_BYTES, 2 * protocol.PART_BYTES - 1],  # at the limit: whole; one under two parts
])
def test_frames_cut_in_parts_come_back_byte_for_byte(sizes):
    """``from_parts(*in_parts(frames))`` gives each frame again: a frame of one
    part as that part, a cut one as the tuple of its parts in order, each part
    ``PART_BYTES`` but the last; the envelope stays whole however big. Sabotage:
    an off-by-one in the part count or slice bounds, parts taken from the wrong
    offset, or a cut frame returned as a list (the ring writes tuples back to
    back) -> a frame differs."""
    envelope = b"E" * (protocol.PART_BYTES + 7)  # never cut
    frames = [envelope, *(bytes((i + j) % 251 for j in range(n)) for i, n in enumerate(sizes))]
    counts, parts = protocol.in_parts(frames)
    want = [1] + [max(1, -(-n // protocol.PART_BYTES)) for n in sizes]
    assert msgpack.unpackb(counts) == want and len(parts) == sum(want)
    back = protocol.from_parts(counts, parts)
    assert len(back) == len(frames)
    for frame, n, got in zip(frames, want, back):
        if n == 1:
            assert not isinstance(got, tuple) and bytes(got) == frame
        else:
            assert type(got) is tuple and len(got) == n
            assert [memoryview(p).nbytes for p in got] == [protocol.PART_BYTES] * (n - 1) + [
                len(frame) - (n - 1) * protocol.PART_BYTES]
            assert b"".join(bytes(p) for p in got) == frame


def test_an_envelope_that_declares_long_arrays_is_refused_without_allocating_them():
    """Arrays nested a thousand deep, each declaring 65 535 items, in one 64 KiB
    frame (what a leader, or anyone on an unkeyed link, may send every worker and
    agent): refused within 1 MiB. Before: msgpack allocated each declared array
    (up to the frame's length) before reading it, 78 MiB for the frame. Sabotage:
    ``max_array_len=n`` again -> about 78 MiB."""
    frame = (b"\xdc\xff\xff" * 1500).ljust(protocol.MAX_ENVELOPE, b"\x00")
    tracemalloc.start()
    try:
        with pytest.raises(zbus.CodecError, match="cannot decode the envelope"):
            read_envelope(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak / 2**20:.1f} MiB"


UNDECODABLE, UNFIT = "cannot decode the part counts", "do not fit"


@pytest.mark.parametrize("counts, nparts, why", [
    (b"\xc1", 2, UNDECODABLE),               # not msgpack
    (packed([1] * 5), 4, UNDECODABLE),       # more counts than parts: msgpack's limit, before any list
    (packed({"a": 1}), 2, UNDECODABLE),      # not a list: no map, str, bytes or extension is read
    (packed([]), 0, UNFIT),                  # no frame
    (packed([1, 0, 2]), 3, UNFIT),           # a frame of no part (the sum fits)
    (packed([1, -1, 3]), 3, UNFIT),          # a negative count (the sum fits)
    (packed([1, 1.0]), 2, UNFIT),            # not an int
    (packed([1, True]), 2, UNFIT),           # a bool is not a count
    (packed([1, 2]), 2, UNFIT),              # more parts counted than sent
    (packed([1, 1]), 3, UNFIT),              # fewer
    (b"\x91" * 1000 + b"\x01", 1, UNFIT),    # nested 1000 deep: named in a bounded repr
])
def test_part_counts_that_do_not_fit_are_refused(counts, nparts, why):
    """A node's relay is given counts from the network: whatever they are, the
    answer is the frames or a :class:`CodecError`, never a wrong split or another
    exception. Sabotage: drop a clause of the fit check (``n > 0``, ``type(n) is
    int``, the sum) or the ``max_array_len`` bound -> the matching case passes or
    raises something else; name the counts with ``str`` -> the deep case raises
    RecursionError (which the agent did not catch)."""
    with pytest.raises(zbus.CodecError, match=why):
        protocol.from_parts(counts, [b"p"] * nparts)
