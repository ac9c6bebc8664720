"""What a search answer carries for a person besides the ranking: each hit's caption, whether
its score reads as a fit, and a refusal for a query the model understood nothing of.

`hits_of` makes the API's hits from the engine's answer with all of it in them, and the
cache keeps the response as served, so a cached answer has them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from math import isfinite
from typing import Any

from app.errors import ValidationFailed
from app.schemas import image_url
from app.work import Answer
from models.fusion import DEFAULT_FUSION_LAMBDA, MATCH_THRESHOLD
from models.shipped import caption_words


def refuse_if_not_understood(model: Any, query: str) -> None:
    """422 when the query has words but the model knows none of them that name something
    ("crimson box", "a pink star", "zzz qqq"): its hits would be the same arbitrary list for
    every such query, at scores as high as true matches'. A model that cannot tell (no
    `content_words`, or None from it) lets every query through.

    Also 422 when the model would not read all of it (`too_long`: the builtin model reads 31
    words): its first words alone would be answered, as confidently, with nothing in the
    answer saying the rest was never read."""
    too_long = getattr(model, "too_long", None)
    why = too_long(query) if callable(too_long) else None
    if why:
        raise ValidationFailed(f"query: {why}", loc=("body", "query"))
    content = getattr(model, "content_words", None)
    unknown = getattr(model, "unknown_words", None)
    missing = list(unknown(query)) if callable(unknown) else []  # emoji too: "🐶 ★"
    if not callable(content) or not (caption_words(query) or missing):
        return  # no words at all: the pipeline's own 422 says what it saw
    if content(query) != []:
        return  # understood something (or cannot tell: None)
    quoted = [f'"{w}"' for w in missing]
    what = (
        "it does not know "
        + " or ".join([", ".join(quoted[:-1]), quoted[-1]] if quoted[:-1] else quoted)
        if quoted
        else "articles, prepositions and 'and' alone name nothing"
    )
    raise ValidationFailed(
        f"query: has no words the model can read: {what}. Name a shape, a colour, a size, a "
        'count or a place it knows, e.g. "a red circle" or "two blue squares left of a '
        'triangle"',
        loc=("body", "query"),
    )


def served_match(plan_reranker: str, fusion: str, lam: float | None, model_name: str) -> bool:
    """Whether `MATCH_THRESHOLD` applies to this answer's scores: it was chosen for duet's own
    cross-encoder fused with the dot product as the service serves by default (ce, add,
    λ = DEFAULT_FUSION_LAMBDA); any other score has another scale."""
    return (
        plan_reranker == "ce"
        and fusion == "add"
        and lam == DEFAULT_FUSION_LAMBDA
        and model_name.startswith("duet-joint:")
        and "+" not in model_name
    )


def best_caption(query: str, captions: Sequence[str]) -> str | None:
    """The caption that shares most words with the query (the shorter on a tie, then the
    first): the one that shows best why the image came up."""
    return _best(frozenset(caption_words(query)), tuple(captions))


def _best(asked: frozenset[str], captions: tuple[str, ...]) -> str | None:
    best, fit = None, None
    for words, shorter, c in _choices(captions):  # five captions an image: no max(key=...)
        f = (len(asked.intersection(words)), shorter)
        if fit is None or f > fit:
            best, fit = c, f
    return best


@lru_cache(maxsize=1 << 14)
def _choices(captions: tuple[str, ...]) -> tuple[tuple[tuple[str, ...], int, str], ...]:
    """An image's captions as `_best` compares them: each one's words (the intersection with
    the query's counts each once), its length negated (the shorter wins a tie) and itself,
    read once: every text search compares its
    hits' captions (ten hits, five captions each) with the query, and the same images come
    up again and again. Bounded (16,384 images' captions, a few tens of MB). Tuples of
    strings and numbers only, which Python's collector stops tracking: a full cache of word
    sets (frozensets are always tracked) was ~180,000 more objects for every full
    collection to walk in each front (`app.heap`)."""
    out = []
    for c in captions:
        words = caption_words(c)
        out.append((tuple(words), -len(words), c))
    return tuple(out)


def hits_of(
    answer: Answer, kind: str, reading: str | None, judged: bool
) -> tuple[list[dict[str, Any]], int]:
    """The engine's answer as the API's hits, and how many were left out.

    Each hit gets its image's URL, its `caption` (a caption hit's own text; an image hit's
    caption nearest what the model read of the query) and its `match` (when `judged`: the
    scores are the default fused ones `MATCH_THRESHOLD` was chosen for), once: copying
    each hit afterwards to add them cost about as much as making it. A hit whose scores
    JSON cannot carry (NaN, infinite: a model or index fault) is left out, the rest ranked
    on. Each hit is a `Hit` as a plain dict, its fields in the model's order (`render`):
    made and checked as models, ten hits and their response took 117 us, as dicts 77."""
    hits: list[dict[str, Any]] = []
    # the query's words, once per search (a cache of them would be a word set per distinct
    # query for the collector to walk, for a few microseconds)
    asked = frozenset(caption_words(reading)) if kind == "text" and reading else frozenset()
    for (_, dot, rr, score), (item_id, meta) in zip(answer.ranked, answer.meta, strict=True):
        if not (isfinite(score) and isfinite(dot) and (rr is None or isfinite(rr))):
            continue
        text = meta.get("text")
        if isinstance(text, str):
            caption: str | None = text
        elif kind == "text" and reading:
            caption = _best(asked, tuple(answer.captions.get(item_id, ())))
        else:
            caption = None
        hits.append(
            {
                "id": item_id,
                "score": float(score),
                "retrieval_score": float(dot),
                "rerank_score": None if rr is None else float(rr),
                "rank": len(hits) + 1,
                "meta": meta,
                "image_url": image_url(item_id if kind == "text" else meta.get("image_id")),
                "caption": caption,
                "match": (score >= MATCH_THRESHOLD) if judged else None,
            }
        )
    return hits, len(answer.ranked) - len(hits)
