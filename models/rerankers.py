"""The re-ranker registry: every re-ranker a request, `DUET_RERANKER` or `duet eval` can name.

One entry per re-ranker says what it is called (the one word the API, the setting and
`duet eval --modes` use), what the API docs say of it, which fusion it defaults to, which
request options it reads, and how to build its scorer from the loaded models, or why it
cannot be built. The request schema's enum, the service's menu (`menu`), the pipeline's
dispatch and `duet eval`'s modes are all read from here, so adding a re-ranker is its own
file plus one `register(...)` line.

A scorer takes one request's candidates as `Pairs` (a `batched` scorer: the pairs of
several requests at once) and returns one score per pair, higher = better; the pipeline
fuses it with the dot product as the request's `fusion` says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NONE = "none"  # no re-ranking: the dot-product order (not a registry entry)
NO_TOKENS_WHY = "needs token-level text features, which this model does not provide"
HAN_WHY = "is not available in this deployment (its model has no trained HAN head)"


@dataclass(frozen=True)
class Pairs:
    """Candidates to score: pair i is (`texts[i]`, `tokens[i]`), found with dot `dots[i]`."""

    texts: Sequence[str]  # a text query repeated, or an image query's candidate captions
    tokens: np.ndarray  # (n, T, d) image states: the candidates', or the image query's
    dots: np.ndarray  # (n,) the retrieval scores
    text_query: bool  # a sentence finds images (True) or an image finds captions
    theta: float | None = None  # the request's `theta`, for a re-ranker that reads it


Scorer = Callable[[Pairs], np.ndarray]


# duet eval's form, over precomputed token features:
# (direction "t2i" / "i2t", dots, text features, text mask, image tokens) -> scores
EvalScorer = Callable[[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Reranker:
    """One registry entry."""

    name: str
    summary: str  # the API docs' words for it
    build: Callable[[Any], Scorer | str]  # loaded models -> its scorer, or why not
    fusion: str = "none"  # the default `fusion` of a request naming it
    options: frozenset[str] = field(default_factory=frozenset)  # e.g. {"theta"}
    batched: bool = False  # one call may score several requests' pairs (a cross-encoder)
    # duet eval: (models, theta) -> a scorer over precomputed token features, or why not;
    # None: `duet eval` has no mode of this name
    evaluate: Callable[[Any, float], EvalScorer | str] | None = None

    @property
    def cost_kind(self) -> str:
        """The cost model's unit for one of its pairs (each re-ranker has its own price)."""
        return "pair" if self.name == "ce" else f"pair/{self.name}"


REGISTRY: dict[str, Reranker] = {}


def register(entry: Reranker) -> Reranker:
    """Add (or replace) a re-ranker; what is registered before a service starts is served."""
    if entry.name == NONE or not entry.name.replace("_", "").isalnum():
        raise ValueError(f"a re-ranker needs a plain name other than {NONE!r}: {entry.name!r}")
    REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every name a request may send for `reranker`, `none` last."""
    return (*REGISTRY, NONE)


@dataclass(frozen=True)
class Menu:
    """The re-rankers a deployment can run, the one a request gets by default, why each
    other one is unavailable, and the scorers of the available ones."""

    available: tuple[str, ...]
    default: str
    why: dict[str, str] = field(default_factory=dict)
    scorers: dict[str, Scorer] = field(default_factory=dict, repr=False)


def menu(model: Any) -> Menu:
    """What `model` offers: each registered re-ranker whose scorer builds (unless the model's
    configuration, `model.why`, already says why not; its key `*` rules out every one), then
    `none`. The default is the model's configured one (`model.default_reranker`), else `ce`,
    else `none`."""
    configured: dict[str, str] = dict(getattr(model, "why", {}))
    why: dict[str, str] = {}
    scorers: dict[str, Scorer] = {}
    for entry in REGISTRY.values():
        if (reason := configured.get(entry.name, configured.get("*"))) is not None:
            why[entry.name] = reason
            continue
        built = entry.build(model)
        if isinstance(built, str):
            why[entry.name] = built
        else:
            scorers[entry.name] = built
    available = (*scorers, NONE)
    default = getattr(model, "default_reranker", None) or ("ce" if "ce" in scorers else NONE)
    if default not in available:
        default = NONE
    return Menu(available, default, why, scorers)


# -- the built-in re-rankers ----------------------------------------------------------------
def _ce(model: Any) -> Scorer | str:
    if getattr(model, "cross", model) is None or not hasattr(model, "score_pairs"):
        return "is not configured (DUET_RERANKER=none)"
    from models.fusion import sigmoid

    # an image query's candidates are the index's captions: a model that keeps their text
    # states between requests (`BuiltinModel.score_captions`) reads them from there
    captions = getattr(model, "score_captions", None)

    def score(p: Pairs) -> np.ndarray:
        pairs = model.score_pairs if p.text_query or captions is None else captions
        return np.asarray(sigmoid(pairs(p.texts, p.tokens)), np.float32)

    return score


def _late(model: Any) -> Scorer | str:
    if not callable(getattr(model, "text_token_features", None)) or not getattr(
        model, "has_text_tokens", True
    ):
        return NO_TOKENS_WHY
    from models.late import DEFAULT_THETA, text_image_late_scores

    def score(p: Pairs) -> np.ndarray:
        theta = DEFAULT_THETA if p.theta is None else p.theta
        if p.text_query:  # one sentence against its candidate images: its words once
            q, mask = model.text_token_features(list(p.texts[:1]))
            q, mask = q.repeat(len(p.texts), axis=0), mask.repeat(len(p.texts), axis=0)
        else:  # the index stores no caption tokens: the text tower computes them here
            q, mask = model.text_token_features(list(p.texts))
        return text_image_late_scores(p.text_query, p.dots, q, mask, p.tokens, theta)

    return score


def _late_eval(model: Any, theta: float) -> EvalScorer | str:
    if getattr(model, "joint", model) is None:
        return "it reads duet's own model's tokens (--encoder builtin)"
    from models.late import text_image_late_scores

    def score(
        direction: str, dots: np.ndarray, words: np.ndarray, mask: np.ndarray, images: np.ndarray
    ) -> np.ndarray:
        # the query's tokens are the ones averaged over (words for t2i, image tokens for i2t)
        return text_image_late_scores(direction == "t2i", dots, words, mask, images, theta)

    return score


def _han(model: Any) -> Scorer | str:
    head = getattr(model, "han", None)
    if head is None:
        return HAN_WHY

    from models.han import with_dot

    def score(p: Pairs) -> np.ndarray:
        return with_dot(p.dots, head.score_pairs(p.texts, p.tokens))

    return score


def _han_eval(model: Any, theta: float) -> EvalScorer | str:
    head = getattr(model, "han", None)
    if getattr(model, "joint", model) is None:
        return "it reads duet's own model's tokens (--encoder builtin)"
    if head is None:
        return "this model has no trained HAN head (han.safetensors); `duet train` makes one"

    from models.han import with_dot

    def score(
        direction: str, dots: np.ndarray, words: np.ndarray, mask: np.ndarray, images: np.ndarray
    ) -> np.ndarray:
        # S_AVG (words aligned to regions) whichever side the query is, blended with the dot
        return with_dot(dots, head.score(words, mask, images))

    return score


register(
    Reranker(
        "ce",
        "cross-encoder (default): the text and the image read together",
        _ce,
        fusion="add",
        batched=True,
    )
)
register(
    Reranker(
        "late",
        "late interaction, S_gl = (1-theta)*dot + theta*S_l",
        _late,
        options=frozenset({"theta"}),
        evaluate=_late_eval,
    )
)
register(
    Reranker(
        "han",
        "HAN's word-region alignment S_AVG, blended with the dot product",
        _han,
        evaluate=_han_eval,
    )
)
