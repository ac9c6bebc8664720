"""Full captions: the paraphrase grammar that names every attribute of every thing, the
words it can produce, and which thing each shape noun of a caption names."""

from __future__ import annotations

import random

from models.shipped import caption_words
from models.world.descriptions import _fits, _parse, satisfies
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
)


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
