"""`duet eval`: recall@K over an index's own corpus, as the papers measure it.

Every caption is a text->image query answered by its image; every image is an image->text
query answered by any of its captions. Queries and pool come from the index itself (stored
vectors, stored image tokens, stored captions), so an evaluation needs no raw images and
encodes nothing twice. A distractor index adds its items to the pool, never to the queries.
This module loads the index version(s) into a pool (checking that the model is the one that
built them) and runs the shared evaluator (`models.eval_modes`, where the modes and sweeps
are described) with `duet eval`'s options over it.

Partial queries (`evaluate_partial`): what people type ("a red circle", "two blue squares"),
generated from a held-out world seed, are judged by whether each hit's scene (the demo
corpus's meta) fits the query, not by one right image: precision at 1 and at 10.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models import world
from models.eval_metrics import fit_matrix
from models.eval_modes import (
    FUSION_SWEEP,
    EvalError,
    Plan,
    evaluate_partial_pool,
    evaluate_pool,
)
from models.eval_pool import PAIR_BATCH, Pool, TextTokens, TokenScorer
from models.fusion import DEFAULT_FUSION_LAMBDA
from models.protocols import BiEncoder, PairReranker, TokenEncoder
from store.indexio import IndexVersion, version_dir

# ce-full scores every pool item per query: beyond this many images it takes too long
CE_FULL_MAX_POOL = 1000


def _vectors(index: Any) -> np.ndarray:
    return np.asarray(index.reconstruct_n(0, index.ntotal), dtype=np.float32)


def _load_part(path: Path, fingerprint: str | None) -> tuple[IndexVersion, Pool]:
    v = IndexVersion.open(version_dir(path), expect_fingerprint=fingerprint)
    n_img, n_txt = v.image_index.ntotal, v.text_index.ntotal
    images = v.store.images(list(range(n_img)))
    texts = v.store.texts(list(range(n_txt)))
    row_of = {r.id: i for i, r in enumerate(images)}
    owner = np.array([row_of.get(t.image_id or "", -1) for t in texts], dtype=np.int64)
    scenes = [
        world.Scene.from_json(r.meta["scene"]) if isinstance(r.meta.get("scene"), dict) else None
        for r in images
    ]
    pool = Pool(
        _vectors(v.image_index),
        np.asarray(v.image_tokens),
        _vectors(v.text_index),
        [t.text for t in texts],
        owner,
        n_img,
        n_txt,
        scenes,
    )
    return v, pool


def load_pool(
    index: Path, fingerprint: str | None = None, distractors: Path | None = None
) -> tuple[str, Pool]:
    """(version, pool) of INDEX (a version directory or an index directory with `current`),
    with DISTRACTORS' items appended to the pool."""
    version, pool = _load_part(index, fingerprint)
    if (pool.owner >= 0).sum() == 0:
        raise EvalError(
            f"index {version.path} has no caption whose image is in it: "
            "recall needs the manifest's image-caption pairing"
        )
    if distractors is None:
        return version.version, pool
    other, extra = _load_part(distractors, fingerprint)
    same = other.path.resolve() == version.path.resolve() or (
        other.manifest.content_hash is not None
        and other.manifest.content_hash == version.manifest.content_hash
    )  # (not the ids: demo corpora all name theirs img-0000 on)
    if same:
        raise EvalError(
            f"--distractors {distractors} holds the evaluated index's own corpus "
            f"({other.version}): each image would be in the pool twice, a twin of a right "
            "answer; give another corpus's index"
        )
    shifted = np.where(extra.owner >= 0, extra.owner + pool.n_images, -1)
    return version.version, Pool(
        np.concatenate([pool.image_vecs, extra.image_vecs]),
        np.concatenate([pool.image_tokens, extra.image_tokens]),
        np.concatenate([pool.text_vecs, extra.text_vecs]),
        pool.texts + extra.texts,
        np.concatenate([pool.owner, shifted]),
        pool.n_images,
        pool.n_texts,
        pool.scenes + extra.scenes,
    )


def evaluate_index(
    pool: Pool,
    reranker: PairReranker | None,
    *,
    candidates: int = 20,
    modes: Sequence[str] = ("dot", "coop", "ce-full"),
    m_sweep: Sequence[int] = (),
    fusion_sweep: bool = False,
    ce_full_queries: int = 100,
    seed: int = 0,
    token_scorers: dict[str, TokenScorer] | None = None,
    text_tokens: TextTokens | None = None,
    progress: Callable[[str], None] = lambda _: None,
    bars: bool = False,
) -> dict[str, Any]:
    """The `duet eval` result: {"pool", "modes": {mode: {t2i, i2t, ms_per_query}}, "sweeps"}.

    `token_scorers` ("late", "han") re-rank the same top-M as coop from token features:
    `text_tokens` (every pool text's) and the pool's image tokens. `progress` gets a line per
    stage; `bars`: a progress bar on stderr per re-ranker scoring.
    """
    plan = Plan(
        candidates=candidates,
        modes=modes,
        m_sweep=m_sweep,
        fusions=FUSION_SWEEP if fusion_sweep else (),
        ce_full_queries=ce_full_queries,
        ce_full_max_pool=CE_FULL_MAX_POOL,
        seed=seed,
        bars=bars,
    )
    return evaluate_pool(
        pool,
        reranker,
        plan,
        token_scorers=token_scorers,
        text_tokens=text_tokens,
        progress=progress,
    )


def evaluate_partial(
    pool: Pool,
    encoder: BiEncoder,
    reranker: PairReranker | None,
    queries: Sequence[tuple[str, world.Desc]],
    *,
    candidates: int = 50,
    modes: Sequence[str] = ("dot", "coop"),
    token_scorers: dict[str, TokenScorer] | None = None,
    token_encoder: TokenEncoder | None = None,
    fusion_lambda: float = DEFAULT_FUSION_LAMBDA,
    bars: bool = False,
) -> dict[str, Any]:
    """Precision of partial text->image queries over the pool's images: {"queries", "judged",
    "candidates", "modes": {mode: {"P@1", "P@10"}}}. Re-rankers reorder the dot product's top
    `candidates`; `ADD_{fusion_lambda}` is the service's default re-ranking."""
    if any(s is None for s in pool.scenes):
        raise EvalError(
            "partial queries are judged by each image's scene: the index's images "
            "need meta.scene, as a `duet demo-corpus` corpus has"
        )
    scenes = [s for s in pool.scenes if s is not None]
    texts = [t for t, _d in queries]
    fit = fit_matrix([d for _t, d in queries], scenes)
    qv = np.concatenate(
        [encoder.encode_texts(texts[s : s + PAIR_BATCH]) for s in range(0, len(texts), PAIR_BATCH)]
    )
    return evaluate_partial_pool(
        pool,
        texts,
        qv,
        fit,
        reranker,
        candidates=candidates,
        modes=modes,
        lambdas=(fusion_lambda,),
        token_scorers=token_scorers,
        token_encoder=token_encoder,
        bars=bars,
    )
