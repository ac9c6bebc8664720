"""Partial descriptions: what a caption or query says, and whether a scene fits it.

People describe what they noticed ("a red circle", "two blue squares", "a green cross left
of a diamond"), not every attribute. A `Desc` is such a description; `satisfies` judges a
scene against it, so training never uses an image that fits a caption as that caption's
negative, and evaluation can score a hit by whether its scene fits the query.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from models.shipped import ALIASES, caption_words
from models.world.scenes import (
    COLOURS,
    COUNT_WORDS,
    INVERSE,
    POS_PHRASES,
    REL_ITS,
    REL_WORDS,
    SHAPES,
    SIZE_WORDS,
    Scene,
    Thing,
    perturb,
    sample_scene,
)


@dataclass(frozen=True)
class Part:
    """What a description says of one thing; None = not said, any value fits.

    `count` 1 is a singular noun ("a", "one"), 2 or 3 a number, None a bare plural ("some red
    circles", "red circles"): two or more.
    """

    shape: str
    colour: str | None = None
    size: str | None = None
    count: int | None = 1


@dataclass(frozen=True)
class Desc:
    """A description, full or partial: a thing, or two things with or without a relation
    (without: both are present, "a and b"), and for a single thing maybe its position."""

    a: Part
    b: Part | None = None
    relation: str | None = None  # a <relation> b
    position: str | None = None  # only single-object scenes have one


def full_desc(s: Scene) -> Desc:
    """Everything a full caption of `s` says."""

    def part(t: Thing) -> Part:
        return Part(t.shape, t.colour, t.size, t.count)

    return Desc(part(s.a), part(s.b) if s.b is not None else None, s.relation, s.position)


def _fits(p: Part, t: Thing) -> bool:
    if p.shape != t.shape or p.colour not in (None, t.colour) or p.size not in (None, t.size):
        return False
    return t.count >= 2 if p.count is None else t.count == p.count


def satisfies(desc: Desc | str, scene: Scene) -> bool:
    """Whether `scene` fits the description (a `Desc` or a caption, parsed with `parse`)."""
    d = parse(desc) if isinstance(desc, str) else desc
    if d is None:
        return False
    if d.position is not None and scene.position != d.position:
        return False
    if d.b is None:
        return _fits(d.a, scene.a) or (scene.b is not None and _fits(d.a, scene.b))
    if scene.b is None:
        return False
    forward = _fits(d.a, scene.a) and _fits(d.b, scene.b)
    backward = _fits(d.a, scene.b) and _fits(d.b, scene.a)
    if d.relation is None:
        return forward or backward
    return (forward and d.relation == scene.relation) or (
        backward and d.relation == INVERSE[scene.relation or "above"]
    )


def partial_desc(rng: random.Random, s: Scene) -> Desc:
    """A description of `s` that may leave out the size, the position, a group's count, the
    second thing or the relation (and, beside another thing, a colour); `s` always fits it."""

    def part(t: Thing, may_drop_colour: bool) -> Part:
        colour = None if may_drop_colour and rng.random() < 0.15 else t.colour
        size = t.size if rng.random() < 0.4 else None
        count = t.count if t.count == 1 or rng.random() < 0.6 else None
        return Part(t.shape, colour, size, count)

    if s.b is None:
        return Desc(part(s.a, False), position=s.position if rng.random() < 0.3 else None)
    u = rng.random()
    if u < 0.45:  # one of the two things alone
        return Desc(part(rng.choice((s.a, s.b)), False))
    distinct = s.a.shape != s.b.shape  # else "a circle and a circle" would not say which is which
    a, b = part(s.a, distinct), part(s.b, distinct)
    return Desc(a, b, s.relation if u < 0.85 else None)


def _np(rng: random.Random, p: Part) -> str:
    shape = p.shape if p.count == 1 else p.shape + ("es" if p.shape == "cross" else "s")
    size = rng.choice(SIZE_WORDS[p.size]) if p.size else ""
    words = [w for w in (size, p.colour or "", shape) if w]
    if p.count is None:  # a bare plural; "some" would be a word the shipped vocabulary lacks
        lead = ""
    else:
        lead = rng.choice(COUNT_WORDS[p.count]) if p.count > 1 else rng.choice(("a", "a", "one"))
    return " ".join(([lead] if lead else []) + words)


def describe(rng: random.Random, d: Desc) -> str:
    """A caption that says exactly what `d` says, with the full captions' synonyms."""
    be = "is" if d.a.count == 1 else "are"
    a = _np(rng, d.a)
    if d.b is None:
        if d.position is not None:
            pos = rng.choice(POS_PHRASES[d.position])
            return rng.choice(
                (
                    f"{a} {pos}",
                    f"there {be} {a} {pos}",
                    f"{pos} there {be} {a}",
                    f"a picture of {a} {pos}",
                )
            )
        return rng.choice((a, f"there {be} {a}", f"a picture of {a}", f"you can see {a}"))
    b = _np(rng, d.b)
    if d.relation is None:
        # "with" and no relation words: both are there (the grammar has no "and"; the parser
        # reads one when a person types it)
        return rng.choice(
            (f"{a} with {b}", f"there {be} {a} with {b}", f"a picture of {a} with {b}")
        )
    r, inv = rng.choice(REL_WORDS[d.relation]), rng.choice(REL_WORDS[INVERSE[d.relation]])
    return rng.choice(
        (
            f"{a} {r} {b}",
            f"{b} {inv} {a}",
            f"there {be} {a} {r} {b}",
            f"{b} with {a} {REL_ITS[d.relation]}",
            f"a picture of {a} {r} {b}",
            f"{a} {be} {r} {b}",
        )
    )


def partial_caption(rng: random.Random, s: Scene) -> tuple[str, Desc]:
    """(caption, what it says) of a partial description of `s`."""
    d = partial_desc(rng, s)
    return describe(rng, d), d


def partial_queries(n: int, seed: int) -> list[tuple[str, Desc]]:
    """`n` partial queries, (text, what it says), each describing a scene drawn with `seed`:
    what people type ("a red circle", "two blue squares", "a green cross left of a diamond")."""
    rng = random.Random(seed)
    return [partial_caption(rng, sample_scene(rng)) for _ in range(n)]


_PLURALS = {s + ("es" if s == "cross" else "s"): s for s in SHAPES}
_SIZE_OF = {w: k for k, ws in SIZE_WORDS.items() for w in ws}
_NUMBER = {"two": 2, "2": 2, "three": 3, "3": 3}
_REL_OF = {
    "left": "left of",
    "right": "right of",
    "above": "above",
    "over": "above",
    "below": "below",
    "under": "below",
    "beneath": "below",
}


def _noun_phrases(words: list[str]) -> list[tuple[int, int, Part]]:
    """(first word, noun word, what it says) of every noun phrase, left to right."""
    out = []
    for i, w in enumerate(words):
        shape = w if w in SHAPES else _PLURALS.get(w)
        if shape is None:
            continue
        colour = size = None
        j = i - 1
        while j >= 0 and (words[j] in COLOURS or words[j] in _SIZE_OF):
            if words[j] in COLOURS:
                colour = colour or words[j]
            else:
                size = size or _SIZE_OF[words[j]]
            j -= 1
        count: int | None = 1
        if w in _PLURALS:
            count = None
            if j >= 0 and words[j] in _NUMBER:
                count, j = _NUMBER[words[j]], j - 1
            elif j >= 1 and words[j - 1 : j + 1] == ["pair", "of"]:
                count, j = 2, j - 2
        out.append((j + 1, i, Part(shape, colour, size, count)))
    return out


def _position(words: list[str]) -> str | None:
    vert = (
        "top"
        if {"top", "upper"} & set(words)
        else "bottom"
        if {"bottom", "lower"} & set(words)
        else None
    )
    horiz = "left" if "left" in words else "right" if "right" in words else None
    if vert and horiz:
        return f"{vert} {horiz}"
    if vert or horiz:
        return vert or horiz
    return "center" if {"center", "middle", "centre"} & set(words) else None


def parse(text: str) -> Desc | None:
    """What a caption or query says, read back with the world's grammar; None when it names
    no shape or more than two. Words people type for the grammar's own (`ALIASES`: "and" for
    "with") are read as the tokenizer reads them."""
    return _parse([ALIASES.get(w, w) for w in caption_words(text)])[0]


def _parse(words: list[str]) -> tuple[Desc | None, list[tuple[int, int, Part]], bool]:
    """(`parse`'s answer, the noun phrases, whether the second one is the description's a)."""
    nps = _noun_phrases(words)
    if not nps or len(nps) > 2:
        return None, nps, False
    if len(nps) == 1:
        start, noun, p = nps[0]
        return Desc(p, position=_position(words[:start] + words[noun + 1 :])), nps, False
    (_s1, n1, p1), (s2, n2, p2) = nps
    between, after = words[n1 + 1 : s2], words[n2 + 1 :]
    rel = next((_REL_OF[w] for w in between if w in _REL_OF), None)
    if rel is not None:
        return Desc(p1, p2, rel), nps, False
    its = next((_REL_OF[w] for w in after if w in _REL_OF), None)
    if "with" in between and its is not None:  # "b with a to its left": a left of b
        return Desc(p2, p1, its), nps, True
    return Desc(p1, p2), nps, False


def typed(text: str) -> str:
    """`text` as people type it: without the article "a" ("green square and red triangle"; a
    singular noun still says one, and "a pair of" stays) and with "and" for "with" (which the
    tokenizer and `parse` read as "with"). It says what `text` says."""
    words = text.split()
    kept = [w for i, w in enumerate(words) if w != "a" or words[i + 1 : i + 2] == ["pair"]]
    return " ".join("and" if w == "with" else w for w in kept)


def typed_at(rng: random.Random, text: str, share: float) -> str:
    """`typed(text)` with probability `share`, else `text` (drawing nothing when `share` is 0)."""
    return typed(text) if share > 0 and rng.random() < share else text


def negative_scene(
    rng: random.Random, s: Scene, desc: Desc, binding: float = 0.6, tries: int = 20
) -> Scene:
    """A scene close to `s` (`perturb`ed once) that does not fit `desc`: a hard negative for a
    caption of `s` must differ in something the caption says. When no single perturbation
    breaks `desc` within `tries`, every thing gets a shape the description does not name."""
    for _ in range(tries):
        w = perturb(rng, s, binding)
        if not satisfies(desc, w):
            return w
    named = {desc.a.shape} | ({desc.b.shape} if desc.b is not None else set())
    others = [x for x in SHAPES if x not in named]
    a = replace(s.a, shape=rng.choice(others))
    if s.b is None:
        return replace(s, a=a)
    b = replace(s.b, shape=rng.choice([x for x in others if x != a.shape] or others))
    return replace(s, a=a, b=b)
