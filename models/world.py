"""The synthetic compositional world duet trains and tests on.

Scenes hold 1-3 coloured shapes. Captions come from a small grammar with
paraphrases and always bind every attribute to its object, so "a small red
circle left of a blue square" and "a small blue circle left of a red square"
describe different images: a global embedding tends to confuse them, a
cross-encoder that reads both sides together should not.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from models.shipped import caption_words

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


# ---------------------------------------------------------------- captions


def _noun(t: Thing, size_word: str, lead: str | None) -> str:
    shape = t.shape + ("es" if t.shape == "cross" else "s") if t.count > 1 else t.shape
    det = lead if lead is not None else "a"
    return f"{det} {size_word} {t.colour} {shape}"


def _phrase(rng: random.Random, t: Thing) -> str:
    size_word = rng.choice(SIZE_WORDS[t.size])
    if t.count > 1:
        return _noun(t, size_word, rng.choice(COUNT_WORDS[t.count]))
    return _noun(t, size_word, rng.choice(("a", "a", "one")))


def _caption_variants(rng: random.Random, s: Scene) -> list[str]:
    """Every paraphrase template, each filled with its own random synonyms."""
    if s.kind == "single":
        single = (
            "{a} {pos}",
            "there is {a} {pos}",
            "{pos} there is {a}",
            "a picture of {a} {pos}",
            "{a} placed {pos}",
            "{pos} you can see {a}",
        )
        return [
            t.format(a=_phrase(rng, s.a), pos=rng.choice(POS_PHRASES[s.position or "center"]))
            for t in single
        ]
    assert s.b is not None and s.relation is not None
    be = "are" if s.a.count > 1 else "is"
    pair = (
        "{a} {r} {b}",
        "{b} {inv} {a}",
        "there " + be + " {a} {r} {b}",
        "{b} with {a} {its}",
        "a picture of {a} {r} {b}",
        "{a} " + be + " {r} {b}",
    )
    return [
        t.format(
            a=_phrase(rng, s.a),
            b=_phrase(rng, s.b),
            r=rng.choice(REL_WORDS[s.relation]),
            inv=rng.choice(REL_WORDS[INVERSE[s.relation]]),
            its=REL_ITS[s.relation],
        )
        for t in pair
    ]


def captions(rng: random.Random, s: Scene, n: int) -> list[str]:
    """`n` different captions of the scene (n <= 6)."""
    variants = _caption_variants(rng, s)
    rng.shuffle(variants)
    return variants[:n]


def grounding(caption: str, scene: Scene) -> list[tuple[int, str]]:
    """(word index, "a" | "b") of each shape noun in `caption` that names one of the scene's
    things unambiguously. Words are the tokenizer's ([a-z]+ or digits). A relation fixes which
    noun is which thing; otherwise a noun names the one thing its words fit (a partial noun
    such as "a circle" beside two circles names neither, and is left out)."""
    d, nps, swapped = _parse(caption_words(caption))
    if d is None:
        return []
    if scene.b is None:
        return [(noun, "a") for _start, noun, p in nps if _fits(p, scene.a)]
    things = {"a": scene.a, "b": scene.b}
    if d.b is not None and d.relation is not None and satisfies(d, scene):
        forward = _fits(d.a, scene.a) and _fits(d.b, scene.b) and d.relation == scene.relation
        order = ["a", "b"] if forward != swapped else ["b", "a"]
        return [(noun, which) for (_s, noun, _p), which in zip(nps, order, strict=True)]
    out = []
    for _start, noun, p in nps:
        fit = [k for k, t in things.items() if _fits(p, t)]
        if len(fit) == 1:
            out.append((noun, fit[0]))
    return out


def centre(layout: Layout, thing: Thing) -> tuple[float, float]:
    """Mean centre of the drawn shapes of `thing` (a group's members), in [0, 1] image units."""
    xs = [(x, y) for t, x, y, _r in layout if t == thing]
    return (
        sum(x for x, _ in xs) / len(xs) / IMAGE_SIZE,
        sum(y for _, y in xs) / len(xs) / IMAGE_SIZE,
    )


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
    if s.a.count > 1 and s.a.size == "small":  # three large shapes would not fit
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
        return replace(s, a=replace(s.a, count=5 - s.a.count))  # 2 <-> 3
    if rng.random() < 0.5 and not (choice == "size" and s.a.count == 3):
        return replace(s, a=_change(rng, s.a, choice))
    return replace(s, b=_change(rng, s.b, choice))


def _change(rng: random.Random, t: Thing, what: str) -> Thing:
    if what == "colour":
        return replace(t, colour=rng.choice([c for c in COLOURS if c != t.colour]))
    if what == "shape":
        return replace(t, shape=rng.choice([c for c in SHAPES if c != t.shape]))
    return replace(t, size="large" if t.size == "small" else "small")


# ---------------------------------------------------------------- rendering


def _place(rng: random.Random, s: Scene) -> list[tuple[Thing, float, float, float]]:
    """Centres and radii for every drawn shape, honouring position and relation."""
    lo = 2.0
    hi = IMAGE_SIZE - 2.0

    def radius(t: Thing) -> float:
        low, high = SIZES[t.size]
        return float(rng.randint(low, high))

    if s.kind == "single":
        col, row = POSITIONS[s.position or "center"]
        r = radius(s.a)
        cell = IMAGE_SIZE / 3
        cx = min(max(cell * (col + 0.5) + rng.uniform(-3, 3), lo + r), hi - r)
        cy = min(max(cell * (row + 0.5) + rng.uniform(-3, 3), lo + r), hi - r)
        return [(s.a, cx, cy, r)]
    assert s.b is not None
    for _ in range(10_000):
        ra = radius(s.a)
        rb = radius(s.b)
        b_xy = (rng.uniform(lo + rb, hi - rb), rng.uniform(lo + rb, hi - rb))
        placed: list[tuple[Thing, float, float, float]] = [(s.b, b_xy[0], b_xy[1], rb)]
        ok = True
        for _i in range(s.a.count):
            x, y = rng.uniform(lo + ra, hi - ra), rng.uniform(lo + ra, hi - ra)
            if not _relation_holds(s.relation or "", (x, y), b_xy, ra + rb, s.a.count > 1):
                ok = False
                break
            if any((x - px) ** 2 + (y - py) ** 2 < (ra + pr + 2) ** 2 for _t, px, py, pr in placed):
                ok = False
                break
            placed.append((s.a, x, y, ra))
        if ok:
            return placed
    raise RuntimeError(f"could not place scene {s}")  # pragma: no cover - sizes always fit


def _relation_holds(
    rel: str, a: tuple[float, float], b: tuple[float, float], gap: float, group: bool
) -> bool:
    dx, dy = a[0] - b[0], a[1] - b[1]
    main, other = {
        "left of": (-dx, dy),
        "right of": (dx, dy),
        "above": (-dy, dx),
        "below": (dy, dx),
    }[rel]
    # clearly on that side: beyond touching distance and mostly along that axis
    return main > gap + 2 and abs(other) < (0.9 if group else 0.6) * main


Layout = list[tuple[Thing, float, float, float]]  # (thing, centre x, centre y, radius) per shape


def render(rng: random.Random, s: Scene) -> Image.Image:
    """Draw the scene on a plain dark background."""
    return render_layout(rng, s)[0]


def render_layout(rng: random.Random, s: Scene) -> tuple[Image.Image, Layout]:
    """Draw the scene and say where each shape went (the trainer's patch supervision)."""
    grey = rng.randint(35, 85)
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (grey, grey, grey))
    draw = ImageDraw.Draw(img)
    placed = _place(rng, s)
    for t, x, y, r in placed:
        _draw_shape(draw, t.shape, COLOURS[t.colour], x, y, r)
    return img, placed


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, fill: tuple[int, int, int], x: float, y: float, r: float
) -> None:
    if shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif shape == "square":
        k = r * 0.85
        draw.rectangle((x - k, y - k, x + k, y + k), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x, y - r), (x + r, y + r * 0.8), (x - r, y + r * 0.8)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=fill)
    elif shape == "cross":
        w = max(r * 0.35, 1.5)
        draw.rectangle((x - r, y - w, x + r, y + w), fill=fill)
        draw.rectangle((x - w, y - r, x + w, y + r), fill=fill)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(shape)


# ---------------------------------------------------------------- corpora


@dataclass
class Sample:
    """One rendered scene with its captions."""

    scene: Scene
    image: Image.Image
    captions: list[str]
    layout: Layout


def generate(n_images: int, seed: int, n_captions: int = 5) -> Iterator[Sample]:
    """Yield `n_images` samples; the same seed always yields the same samples."""
    rng = random.Random(seed)
    for _ in range(n_images):
        scene = sample_scene(rng)
        image, layout = render_layout(rng, scene)
        yield Sample(scene, image, captions(rng, scene, n_captions), layout)


def png_bytes(img: Image.Image) -> bytes:
    """Encode deterministically (no timestamps or text chunks in the PNG)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def write_corpus(
    out: Path, n_images: int, seed: int, n_captions: int = 5, progress: bool = True
) -> Path:
    """Write `out/manifest.jsonl` and `out/images/*.png`; return the manifest path."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    manifest = out / "manifest.jsonl"
    width = max(4, len(str(n_images - 1)))
    with manifest.open("w", encoding="utf-8") as fh:
        samples = generate(n_images, seed, n_captions)
        for i, sample in enumerate(
            tqdm(samples, total=n_images, desc="rendering", unit="img", disable=not progress)
        ):
            name = f"{i:0{width}d}"
            rel = f"images/{name}.png"
            (out / rel).write_bytes(png_bytes(sample.image))
            line = {
                "id": f"img-{name}",
                "image": rel,
                "captions": sample.captions,
                "meta": {"scene": sample.scene.to_json(), "seed": seed},
            }
            fh.write(json.dumps(line, sort_keys=True) + "\n")
    return manifest


def vocabulary() -> list[str]:
    """Every word the grammar can produce, sorted."""
    plurals = {s + ("es" if s == "cross" else "s") for s in SHAPES}
    words: set[str] = set(SHAPES) | plurals | set(COLOURS)
    for group in (
        *SIZE_WORDS.values(),
        *REL_WORDS.values(),
        REL_ITS.values(),
        *POS_PHRASES.values(),
        *COUNT_WORDS.values(),
    ):
        for phrase in group:
            words.update(phrase.split())
    words.update(
        [
            "a",
            "one",
            "there",
            "is",
            "are",
            "with",
            "picture",
            "of",
            "placed",
            "you",
            "can",
            "see",
            "it",
        ]
    )
    return sorted(words)


# ---------------------------------------------------------------- partial descriptions
#
# People describe what they noticed ("a red circle", "two blue squares", "a green cross left
# of a diamond"), not every attribute. A `Desc` is such a description; `satisfies` judges a
# scene against it, so training never uses an image that fits a caption as that caption's
# negative, and evaluation can score a hit by whether its scene fits the query.


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
    no shape or more than two."""
    return _parse(caption_words(text))[0]


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
