"""The world's scenes: the vocabulary of things (shapes, colours, sizes, relations,
positions), the `Thing` and `Scene` records, random scenes, and one-detail perturbations of a
scene (the raw material of hard negatives)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from typing import Any

IMAGE_SIZE = 64

SHAPES = ("circle", "square", "triangle", "diamond", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
    "purple": (160, 60, 200),
    "orange": (245, 140, 30),
}
SIZES = {"small": (6, 7), "large": (10, 12)}
SIZE_WORDS = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
RELATIONS = ("left of", "right of", "above", "below")
INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
REL_WORDS = {
    "left of": ("left of", "to the left of", "on the left of"),
    "right of": ("right of", "to the right of", "on the right of"),
    "above": ("above", "over"),
    "below": ("below", "under", "beneath"),
}
REL_ITS = {
    "left of": "to its left",
    "right of": "to its right",
    "above": "above it",
    "below": "below it",
}
# 3x3 grid cells: name -> (column, row)
POSITIONS = {
    "top left": (0, 0),
    "top": (1, 0),
    "top right": (2, 0),
    "left": (0, 1),
    "center": (1, 1),
    "right": (2, 1),
    "bottom left": (0, 2),
    "bottom": (1, 2),
    "bottom right": (2, 2),
}
POS_PHRASES = {
    "top left": ("in the top left", "in the upper left corner"),
    "top": ("at the top", "near the top"),
    "top right": ("in the top right", "in the upper right corner"),
    "left": ("on the left", "at the left side"),
    "center": ("in the center", "in the middle"),
    "right": ("on the right", "at the right side"),
    "bottom left": ("in the bottom left", "in the lower left corner"),
    "bottom": ("at the bottom", "near the bottom"),
    "bottom right": ("in the bottom right", "in the lower right corner"),
}
COUNT_WORDS = {2: ("two", "2", "a pair of"), 3: ("three", "3")}


@dataclass(frozen=True)
class Thing:
    """One object kind in a scene (a group of `count` identical shapes)."""

    shape: str
    colour: str
    size: str
    count: int = 1


@dataclass(frozen=True)
class Scene:
    """A scene: a single thing at a position, or a thing related to another."""

    kind: str  # "single" | "pair"
    a: Thing
    b: Thing | None = None
    relation: str | None = None  # a <relation> b
    position: str | None = None  # for "single"

    def to_json(self) -> dict[str, object]:
        """The scene as plain JSON data (what `from_json` reads back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Scene:
        """The scene `to_json` wrote (what a demo corpus's meta stores)."""
        b = data.get("b")
        return cls(
            data["kind"],
            Thing(**data["a"]),
            Thing(**b) if b else None,
            data.get("relation"),
            data.get("position"),
        )


# ---------------------------------------------------------------- sampling


def _thing(rng: random.Random, count: int = 1) -> Thing:
    return Thing(rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(SIZES)), count)


def sample_scene(rng: random.Random) -> Scene:
    """Draw a random scene: a single object, a related pair, or a group related to an object."""
    u = rng.random()
    if u < 0.15:
        return Scene("single", _thing(rng), position=rng.choice(list(POSITIONS)))
    a = _thing(rng, count=1 if u < 0.7 else rng.choice((2, 2, 3)))
    if a.count == 3:  # three large shapes do not fit beside another on 64 px
        a = replace(a, size="small")
    b = _thing(rng)
    while b == replace(a, count=1):  # two identical things would make relations ambiguous
        b = _thing(rng)
    return Scene("pair", a, b, relation=rng.choice(RELATIONS))


# ---------------------------------------------------------------- perturbation


def perturb(rng: random.Random, s: Scene, binding: float = 0.6) -> Scene:
    """A scene that differs from `s` in one detail; its captions and image are hard negatives.

    With probability `binding` (when the scene allows it) the change keeps every word and
    breaks only the binding: a flipped relation, or two objects' colours or shapes swapped.
    """
    if s.kind == "single":
        choice = rng.choice(("colour", "shape", "size", "position"))
        if choice == "position":
            return replace(s, position=rng.choice([p for p in POSITIONS if p != s.position]))
        return replace(s, a=_change(rng, s.a, choice))
    assert s.b is not None
    options = ["flip", "colour", "shape", "size"]
    if s.a.colour != s.b.colour:
        options.append("swap_colour")
    if s.a.shape != s.b.shape:
        options.append("swap_shape")
    if recountable(s):
        options.append("count")
    swaps = [o for o in options if o in ("flip", "swap_colour", "swap_shape")]
    choice = rng.choice(swaps if rng.random() < binding else options)
    if choice == "flip":
        return replace(s, relation=INVERSE[s.relation or "above"])
    if choice == "swap_colour":
        return replace(s, a=replace(s.a, colour=s.b.colour), b=replace(s.b, colour=s.a.colour))
    if choice == "swap_shape":
        return replace(s, a=replace(s.a, shape=s.b.shape), b=replace(s.b, shape=s.a.shape))
    if choice == "count":
        return recount(s)
    if rng.random() < 0.5 and not (choice == "size" and s.a.count == 3):
        return replace(s, a=_change(rng, s.a, choice))
    return replace(s, b=_change(rng, s.b, choice))


def recountable(s: Scene) -> bool:
    """Whether `recount` may change `s`: a group of small things (three large would not fit)."""
    return s.b is not None and s.a.count > 1 and s.a.size == "small"


def recount(s: Scene) -> Scene:
    """`s` with two things in its group instead of three, or three instead of two."""
    return replace(s, a=replace(s.a, count=5 - s.a.count))


def other_counts(t: Thing) -> tuple[int, ...]:
    """The counts another drawing of `t` may have: 1 to 3 but its own, three only of small
    things (three large ones do not fit beside another thing in 64 pixels)."""
    return tuple(c for c in (1, 2, 3) if c != t.count and (c < 3 or t.size == "small"))


def count_twin(rng: random.Random, s: Scene) -> Scene:
    """The two-thing scene `s` with its first thing's count changed to one of `other_counts`:
    one against two or three, two against three (`recount` only swaps two and three)."""
    return replace(s, a=replace(s.a, count=rng.choice(other_counts(s.a))))


def _change(rng: random.Random, t: Thing, what: str) -> Thing:
    if what == "colour":
        return replace(t, colour=rng.choice([c for c in COLOURS if c != t.colour]))
    if what == "shape":
        return replace(t, shape=rng.choice([c for c in SHAPES if c != t.shape]))
    return replace(t, size="large" if t.size == "small" else "small")
