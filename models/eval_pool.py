"""The in-memory pool an evaluation searches, its two retrieval directions, and the re-rankers'
scores of a query's candidates in it.

A pool is what `duet eval` loads from a built index (stored vectors, stored image tokens,
stored captions) or what `models.evaluate` encodes from images and captions in memory; either
way every caption is a text->image query answered by its image, and every image is an
image->text query answered by any of its captions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from models import world
from models.protocols import PairReranker, TokenEncoder
from models.rerankers import EvalScorer

PAIR_BATCH = 512

# (direction name, dots (B,), word features (B, L, D), word mask (B, L), image tokens (B, T, D))
# -> scores (B,), higher is better: a re-ranker that reads token features
TokenScorer = EvalScorer


@dataclass
class Pool:
    """What queries search over; the first `n_images` / `n_texts` items are the queries'."""

    image_vecs: np.ndarray  # (images, d) float32
    image_tokens: np.ndarray  # (images, T, D), what the cross-encoder reads
    text_vecs: np.ndarray  # (texts, d) float32
    texts: list[str]
    owner: np.ndarray  # (texts,) pool row of each caption's image; -1 when unknown
    n_images: int
    n_texts: int
    scenes: list[world.Scene | None]  # each image's scene, from a demo corpus's meta

    @property
    def sizes(self) -> dict[str, int]:
        """How many images and texts the pool holds, queries' and distractors' alike."""
        return {"images": len(self.image_vecs), "texts": len(self.texts)}


@dataclass
class Direction:
    """One retrieval direction: its queries, the pool side, and what counts as a hit."""

    name: str
    query_vecs: np.ndarray
    item_vecs: np.ndarray
    texts: Sequence[str]  # what `text_ids` rows index
    image_tokens: np.ndarray  # what `image_ids` rows index
    text_ids: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (query ids, item ids) -> text rows
    image_ids: Callable[[np.ndarray, np.ndarray], np.ndarray]  # ... -> image rows
    is_hit: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (query ids (Q,1), items (Q,M))


def directions(pool: Pool) -> list[Direction]:
    """Text->image (every caption whose image is known) and image->text (every query image)."""
    t_ids = np.flatnonzero(pool.owner[: pool.n_texts] >= 0)  # captions whose image is known
    i_ids = np.arange(pool.n_images)
    return [
        Direction(
            "t2i",
            pool.text_vecs[t_ids],
            pool.image_vecs,
            pool.texts,
            pool.image_tokens,
            lambda q, it: t_ids[q],
            lambda q, it: it,
            lambda q, it: pool.owner[t_ids[q]] == it,
        ),
        Direction(
            "i2t",
            pool.image_vecs[i_ids],
            pool.text_vecs,
            pool.texts,
            pool.image_tokens,
            lambda q, it: it,
            lambda q, it: i_ids[q],
            lambda q, it: pool.owner[it] == i_ids[q],
        ),
    ]


def texts_to_images(
    pool: Pool, texts: Sequence[str], query_vecs: np.ndarray, fit: np.ndarray | None = None
) -> Direction:
    """Text->image for queries that are not the pool's own captions (partial, counting,
    threshold queries): `texts`, encoded as `query_vecs`, over the pool's images; `fit[q, i]`
    says query q fits image i (None: no image counts as a hit)."""
    return Direction(
        "t2i",
        query_vecs,
        pool.image_vecs,
        texts,
        pool.image_tokens,
        lambda q, it: q,
        lambda q, it: it,
        (lambda q, it: fit[q, it]) if fit is not None else (lambda q, it: np.zeros(it.shape, bool)),
    )


@dataclass
class TextTokens:
    """Token features of texts (what late interaction and HAN read), padded, by text row."""

    tokens: np.ndarray  # (texts, L, D), float16 from `of`
    mask: np.ndarray  # (texts, L) True for real tokens
    seconds: float  # what computing them took

    @classmethod
    def of(cls, model: TokenEncoder, texts: Sequence[str], batch: int = PAIR_BATCH) -> TextTokens:
        """Every text's token features, computed `batch` texts at a time and timed."""
        t0 = time.perf_counter()
        parts = [
            model.text_token_features(texts[s : s + batch]) for s in range(0, len(texts), batch)
        ]
        width = max(t.shape[1] for t, _ in parts)
        tokens = np.zeros((len(texts), width, parts[0][0].shape[2]), dtype=np.float16)
        mask = np.zeros((len(texts), width), dtype=bool)
        row = 0
        for t, m in parts:
            tokens[row : row + len(t), : t.shape[1]] = t
            mask[row : row + len(t), : m.shape[1]] = m
            row += len(t)
        return cls(tokens, mask, time.perf_counter() - t0)


def pair_batches(n: int, batch: int, bar: str | None = None) -> Iterator[int]:
    """The start of each `batch` pairs of `n`, counted on a progress bar (stderr) named `bar`
    when one is given."""

    from models.bars import tqdm

    with tqdm(
        total=n,
        desc=bar,
        unit="pair",
        unit_scale=True,
        leave=False,
        disable=bar is None,
        mininterval=0.5,  # on a terminal (a line every 15 s in a log file: `models.bars`)
    ) as shown:
        for s in range(0, n, batch):
            yield s
            shown.update(min(batch, n - s))


def cross_scores(
    reranker: PairReranker,
    d: Direction,
    queries: np.ndarray,
    cand: np.ndarray,
    batch: int = PAIR_BATCH,
    bar: str | None = None,
) -> np.ndarray:
    """Cross-encoder logits (Q, M) for each query against its candidates, `batch` pairs a call
    (on a progress bar named `bar`, if given)."""
    q = np.repeat(queries, cand.shape[1])
    it = cand.reshape(-1)
    out = []
    for s in pair_batches(len(q), batch, bar):
        qs, its = q[s : s + batch], it[s : s + batch]
        out.append(
            reranker.score_pairs(
                [d.texts[i] for i in d.text_ids(qs, its)],
                np.asarray(d.image_tokens[d.image_ids(qs, its)]),
            )
        )
    return np.concatenate(out).reshape(cand.shape)


def token_scores(
    scorer: TokenScorer,
    tt: TextTokens,
    d: Direction,
    queries: np.ndarray,
    cand: np.ndarray,
    dots: np.ndarray,
    batch: int = PAIR_BATCH,
    bar: str | None = None,
) -> np.ndarray:
    """A token-level re-ranker's scores (Q, M) for each query against its candidates; `tt`
    holds the token features of the texts `d.text_ids` rows index."""
    q = np.repeat(queries, cand.shape[1])
    it, dd = cand.reshape(-1), dots.reshape(-1)
    out = []
    for s in pair_batches(len(q), batch, bar):
        qs, its = q[s : s + batch], it[s : s + batch]
        t = d.text_ids(qs, its)
        out.append(
            scorer(
                d.name,
                dd[s : s + batch],
                tt.tokens[t].astype(np.float32),
                tt.mask[t],
                np.asarray(d.image_tokens[d.image_ids(qs, its)], dtype=np.float32),
            )
        )
    return np.concatenate(out).reshape(cand.shape)
