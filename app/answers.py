"""What a search answer carries for a person besides the ranking: each hit's caption, whether
its score reads as a fit, and a refusal for a query the model understood nothing of.

These read the pipeline's answer after the fact (a cached answer gets them too), so the
pipeline and its cache stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from app.errors import ValidationFailed
from app.schemas import Hit, SearchResponse
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
    if not captions:
        return None
    asked = _caption_words(query)[0]  # the same query for each of a search's hits

    def fit(c: str) -> tuple[int, int]:
        words, length = _caption_words(c)
        return (len(asked.intersection(words)), -length)

    return max(captions, key=fit)


@lru_cache(maxsize=1 << 16)
def _caption_words(caption: str) -> tuple[frozenset[str], int]:
    """A stored caption's distinct words and its length in words, read once: every text
    search compares its hits' captions (ten hits, five captions each) with the query, and the
    same images come up again and again. Bounded (a few tens of MB at 65,536 captions)."""
    words = caption_words(caption)
    return frozenset(words), len(words)


def annotate(resp: SearchResponse, *, judged: bool) -> SearchResponse:
    """The answer with each hit's `match`, a caption hit's text as its `caption`, and a
    `total` timing on a cached answer (the time it took: the cache lookup)."""
    hits: list[Hit] = []
    for h in resp.hits:
        text = h.meta.get("text")
        caption = text if isinstance(text, str) else h.caption
        match = (h.score >= MATCH_THRESHOLD) if judged else None
        hits.append(h.model_copy(update={"caption": caption, "match": match}))
    timings = dict(resp.timings_ms)
    if "total" not in timings:
        timings["total"] = round(sum(timings.values()), 3)
    return resp.model_copy(update={"hits": hits, "timings_ms": timings})
