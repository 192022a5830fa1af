"""Type families: a library's own types by name (``codec.register_family``), built
on the receiving end by the family's fixed rules, never imported from the wire."""

from __future__ import annotations

import pytest

from zbus import codec
from zbus.errors import CodecError


class Point:  # a plain class: made as pickle makes it, from its instance dict
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return type(other) is Point and vars(other) == vars(self)


class Shapes(codec.TypeFamily):
    name = "shapes"
    built: list[str] = []

    def reduce(self, obj):
        if type(obj) is Point:
            return "Point", dict(vars(obj))
        if type(obj) is set:
            return "set", sorted(obj)
        return None

    def build(self, name, state):
        self.built.append(name)
        if name == "Point":
            p = Point.__new__(Point)
            p.__dict__.update(state)
            return p
        if name == "set":
            return set(state)
        raise CodecError(f"{name!r} is not a shape")


@pytest.fixture(autouse=True)
def shapes():
    family = codec.register_family(Shapes())
    yield family
    codec._families.pop("shapes")


def test_family_objects_round_trip_inside_large_and_deep_messages():
    """Sabotage: a header walker that does not know the object extension (code 7)
    refuses every message larger than its fast path."""
    value = {"points": [Point(i, -i) for i in range(50)], "tags": {1, 2, 3},
             "nested": (Point(1, {"deep": [Point(2, 3)]}),)}
    frames = codec.encode(value)
    assert len(frames[0]) > 200  # the header walker runs on this one
    assert codec.decode(frames) == value


def test_unknown_family_and_refused_names_fail_loudly_and_name_the_type():
    """Sabotage: a decoder that falls back to importing the named class."""
    import msgpack

    body = msgpack.packb(["other:os.system", ["echo"]])
    with pytest.raises(CodecError, match="other:os.system"):
        codec.decode([msgpack.packb(msgpack.ExtType(7, body))])
    body = msgpack.packb(["shapes:Circle", {}])
    with pytest.raises(CodecError, match="Circle"):
        codec.decode([msgpack.packb(msgpack.ExtType(7, body))])


def test_an_unregistered_family_cannot_be_decoded(shapes):
    frames = codec.encode(Point(1, 2))
    codec._families.pop("shapes")
    with pytest.raises(CodecError, match="unknown family"):
        codec.decode(frames)
    codec.register_family(shapes)


def test_objects_outside_every_family_still_fail_to_encode():
    with pytest.raises(CodecError, match="frozenset"):
        codec.encode(frozenset({1}))


def test_a_type_a_family_reduced_goes_as_a_registered_dataclass_once_registered():
    """The encoder remembers which family reduced a type; registering the type (or
    the family leaving) must end that. Sabotage: ``register`` not clearing what
    the encoder remembers -> the dataclass still travels through the family."""
    import dataclasses

    @dataclasses.dataclass
    class Pair:
        a: int
        b: int

    class Pairs(Shapes):
        name = "pairs"

        def reduce(self, obj):
            return ("Pair", dataclasses.asdict(obj)) if type(obj) is Pair else None

    family = codec.register_family(Pairs())
    try:
        assert b"pairs:Pair" in codec.encode(Pair(1, 2))[0]
        codec.register(Pair, "test.Pair")
        frames = codec.encode(Pair(1, 2))
        assert b"pairs:Pair" not in frames[0] and codec.decode(frames) == Pair(1, 2)
    finally:
        codec._families.pop(family.name)
        codec._registry.pop("test.Pair", None)


def test_a_family_that_left_is_not_used_from_memory(shapes):
    """Sabotage: the encoder's memory of reducing families not checking that the
    family is still registered -> a Point still encodes after its family left."""
    codec.encode(Point(1, 2))
    codec._families.pop("shapes")
    with pytest.raises(CodecError, match="Point"):
        codec.encode(Point(1, 2))
    codec.register_family(shapes)


def test_a_family_needs_a_name_without_a_colon():
    """Names travel as ``family:name``, split at the first colon. Sabotage:
    ``not family.name and ":" in family.name`` or ``"XX:XX" in family.name`` → a
    family named ``a:b`` (or no name) is registered; ``ValueError(None)`` → fails."""
    for name in ("", "a:b", ":"):
        family = Shapes()
        family.name = name
        with pytest.raises(ValueError) as e:
            codec.register_family(family)
        assert str(e.value) == "a type family needs a name without ':'"
        assert name not in codec._families


class Label(Point):
    pass


class Qualified(codec.TypeFamily):
    """A family whose names hold colons themselves (``module:QualName``, as the vLLM
    family's do)."""

    name = "qualified"

    def reduce(self, obj):
        return (f"{__name__}:Label", dict(vars(obj))) if type(obj) is Label else None

    def build(self, name, state):
        if name != f"{__name__}:Label":
            raise KeyError(name)
        label = Label.__new__(Label)
        label.__dict__.update(state)
        return label


def test_names_with_colons_reach_their_family_whole():
    """Sabotage: ``body[0].rpartition(":")`` → the family is looked up as
    ``qualified:<module>`` and the object is refused as of an unknown family."""
    family = codec.register_family(Qualified())
    try:
        frames = codec.encode([Label(1, 2)])
        assert f"qualified:{__name__}:Label".encode() in frames[0]
        [label] = codec.decode(frames)
        assert type(label) is Label and vars(label) == {"x": 1, "y": 2}
    finally:
        codec._families.pop(family.name)


def test_a_family_that_fails_to_build_is_named_with_its_error():
    """A family's own exception (not a CodecError) becomes a CodecError naming the
    type and the error (the first 200 characters of each). Sabotage: ``CodecError(None)``,
    ``body[1]`` for the name, ``[:201]``, ``type(None).__name__`` → fails."""
    import msgpack

    family = codec.register_family(Qualified())
    try:
        for name in ("Circle", "C" * 300):
            body = msgpack.packb([f"qualified:{name}", {"x": 1}])
            with pytest.raises(CodecError) as e:
                codec.decode([msgpack.packb(msgpack.ExtType(7, body))])
            assert str(e.value) == (f"cannot build {f'qualified:{name}'[:200]}: KeyError: "
                                    f"{str(KeyError(name))[:200]}")
            assert isinstance(e.value.__cause__, KeyError)
    finally:
        codec._families.pop(family.name)


class Counting(Shapes):
    """Shapes that counts the objects it is asked to reduce."""

    name = "counting"

    def __init__(self) -> None:
        self.asked: list = []

    def reduce(self, obj):
        self.asked.append(obj)
        if type(obj) is Point and obj.x < 0:
            return None  # this family reduces only points with x >= 0
        return super().reduce(obj)


def test_a_type_goes_straight_to_the_family_that_reduced_it():
    """The encoder remembers which family reduced a type and asks it alone next
    time; a family that declines one object of that type is not asked for another
    family's answer. Sabotage: the memory skipped (``family = None``,
    ``_family_of.get(None)``, ``_families.get(None) is family``, ``reduced = None``,
    ``family.reduce(None)``) → the other family is asked every time;
    ``if reduced is None`` → a declined object fails to encode with a TypeError."""
    first, second = Counting(), Counting()
    first.name, second.name = "first", "second"
    codec._families.pop("shapes")  # only the two counting families
    codec.register_family(first)
    codec.register_family(second)
    try:
        first.reduce = lambda obj: first.asked.append(obj)  # declines everything
        assert codec.decode(codec.encode(Point(1, 2))) == Point(1, 2)
        assert len(first.asked) == 1 and len(second.asked) == 1
        for i in range(5):
            assert codec.decode(codec.encode(Point(i, 2))) == Point(i, 2)
        assert len(first.asked) == 1 and len(second.asked) == 6  # straight to the second
        with pytest.raises(CodecError) as e:
            codec.encode(Point(-1, 2))  # declined by both
        assert str(e.value).startswith(f"cannot encode {__name__}.Point: not a supported type")
    finally:
        codec._families.pop("first")
        codec._families.pop("second")
        codec.register_family(Shapes())
