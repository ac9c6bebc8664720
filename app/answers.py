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
from app.schemas import Hit, image_url
from app.work import Answer
from models.fusion import DEFAULT_FUSION_LAMBDA, MATCH_THRESHOLD
from models.shipped import caption_words


def refuse_if_not_understood(model: Any, query: str) -> None:
    """422 when the query has words but the model knows none of them that name something
    ("crimson box", "a pink star", "zzz qqq"): its hits would be the same arbitrary list for
    every such query, at scores as high as true matches'. A model that cannot tell (no
    `content_words`, or None from it) lets every query through."""
    content = getattr(model, "content_words", None)
    if not callable(content) or not caption_words(query):
        return  # no words at all: the pipeline's own 422 says what it saw
    if content(query) != []:
        return  # understood something (or cannot tell: None)
    unknown = getattr(model, "unknown_words", None)
    missing = list(unknown(query)) if callable(unknown) else []
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
        'triangle"'
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
    asked = _caption_words(query)[0]  # the same query for each of a search's hits
    best, fit = None, None
    for c in captions:  # a loop, not max(key=...): fifty captions a search, no call each
        words, length = _caption_words(c)
        f = (len(asked & words), -length)
        if fit is None or f > fit:
            best, fit = c, f
    return best


@lru_cache(maxsize=1 << 16)
def _caption_words(caption: str) -> tuple[frozenset[str], int]:
    """A stored caption's distinct words and its length in words, read once: every text
    search compares its hits' captions (ten hits, five captions each) with the query, and the
    same images come up again and again. Bounded (a few tens of MB at 65,536 captions)."""
    words = caption_words(caption)
    return frozenset(words), len(words)


def hits_of(answer: Answer, kind: str, reading: str | None, judged: bool) -> tuple[list[Hit], int]:
    """The engine's answer as the API's hits, and how many were left out.

    Each hit gets its image's URL, its `caption` (a caption hit's own text; an image hit's
    caption nearest what the model read of the query) and its `match` (when `judged`: the
    scores are the default fused ones `MATCH_THRESHOLD` was chosen for), once: copying
    each hit afterwards to add them cost about as much as making it. A hit whose scores
    JSON cannot carry (NaN, infinite: a model or index fault) is left out, the rest ranked
    on."""
    hits: list[Hit] = []
    for (_, dot, rr, score), (item_id, meta) in zip(answer.ranked, answer.meta, strict=True):
        if not (isfinite(score) and isfinite(dot) and (rr is None or isfinite(rr))):
            continue
        text = meta.get("text")
        if isinstance(text, str):
            caption: str | None = text
        elif kind == "text" and reading:
            caption = best_caption(reading, answer.captions.get(item_id, ()))
        else:
            caption = None
        hits.append(
            Hit(
                id=item_id,
                score=score,
                retrieval_score=dot,
                rerank_score=rr,
                rank=len(hits) + 1,
                meta=meta,
                image_url=image_url(item_id if kind == "text" else meta.get("image_id")),
                caption=caption,
                match=(score >= MATCH_THRESHOLD) if judged else None,
            )
        )
    return hits, len(answer.ranked) - len(hits)
