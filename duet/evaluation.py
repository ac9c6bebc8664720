"""`duet eval`: recall@K over an index's own corpus, as the papers measure it.

Every caption is a text->image query answered by its image; every image is an image->text
query answered by any of its captions. Queries and pool come from the index itself (stored
vectors, stored image tokens, stored captions), so an evaluation needs no raw images and
encodes nothing twice. A distractor index adds its items to the pool, never to the queries.

Modes: `dot` (bi-encoder only), `coop` (dot top-M, then the cross-encoder reorders them;
the papers' retrieve-and-rerank), `late` (TGDT's S_gl over the same top-M), `han` (HAN's
S_AVG over the same top-M), `ce-full` (the cross-encoder over the whole pool, on a query
sample: the slow baseline). Sweeps: M (Rerank-Smart Table 8) and score fusion
ADD_lambda / NORM_ADD_lambda (Table 9). Recalls are percentages.

Partial queries (`evaluate_partial`): what people type ("a red circle", "two blue squares"),
generated from a held-out world seed, are judged by whether each hit's scene (the demo
corpus's meta) fits the query, not by one right image: precision at 1 and at 10.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models import evaluate, world
from models.errors import UserError
from models.evaluate import KS, fit_matrix, precision, reorder
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse, norm_fuse
from models.protocols import BiEncoder, PairReranker, TokenEncoder
from store.indexio import IndexVersion, version_dir

M_SWEEP = (10, 20, 50, 100)
LAMBDAS = (0.1, 0.5, 0.9)
# the fusion sweep also reports the service's default re-ranking: ADD at the λ chosen on the
# validation split (models/weights/README.md), never tuned on an evaluated split
DEFAULT_FUSION = f"ADD_{DEFAULT_FUSION_LAMBDA}"
CE_FULL_MAX_POOL = 1000
PAIR_BATCH = 512


class EvalError(UserError, ValueError):
    """The index cannot be evaluated as asked (no ground truth, pool too large, ...)."""


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
        return {"images": len(self.image_vecs), "texts": len(self.texts)}


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
    _, extra = _load_part(distractors, fingerprint)
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


def top_m(queries: np.ndarray, items: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, dots), both (Q, m), best first, by exact inner product."""
    m = min(m, len(items))
    out_i, out_d = [], []
    for s in range(0, len(queries), 1024):
        sim = queries[s : s + 1024] @ items.T
        part = np.argpartition(-sim, m - 1, axis=1)[:, :m]
        d = np.take_along_axis(sim, part, axis=1)
        order = np.argsort(-d, axis=1, kind="stable")
        out_i.append(np.take_along_axis(part, order, axis=1))
        out_d.append(np.take_along_axis(d, order, axis=1))
    return np.concatenate(out_i), np.concatenate(out_d)


def recall(good: np.ndarray) -> dict[str, float]:
    """`good[q, r]` is True when the item at rank r answers query q; percent, 2 decimals."""
    return {k: round(v, 2) for k, v in evaluate.recall(good).items()}


@dataclass
class Direction:
    """One retrieval direction: its queries, the pool side, and what counts as a hit."""

    name: str
    query_vecs: np.ndarray
    item_vecs: np.ndarray
    text_ids: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (query ids, item ids) -> text rows
    image_ids: Callable[[np.ndarray, np.ndarray], np.ndarray]  # ... -> image rows
    is_hit: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (query ids (Q,1), items (Q,M))


def directions(pool: Pool) -> list[Direction]:
    t_ids = np.flatnonzero(pool.owner[: pool.n_texts] >= 0)  # captions whose image is known
    i_ids = np.arange(pool.n_images)
    return [
        Direction(
            "t2i",
            pool.text_vecs[t_ids],
            pool.image_vecs,
            lambda q, it: t_ids[q],
            lambda q, it: it,
            lambda q, it: pool.owner[t_ids[q]] == it,
        ),
        Direction(
            "i2t",
            pool.image_vecs[i_ids],
            pool.text_vecs,
            lambda q, it: it,
            lambda q, it: i_ids[q],
            lambda q, it: pool.owner[it] == i_ids[q],
        ),
    ]


@dataclass
class TextTokens:
    """Every pool text's token features (what late interaction and HAN read), padded."""

    tokens: np.ndarray  # (texts, L, D) float16
    mask: np.ndarray  # (texts, L) True for real tokens
    seconds: float  # what computing them took

    @classmethod
    def of(cls, model: TokenEncoder, texts: Sequence[str], batch: int = PAIR_BATCH) -> TextTokens:
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


# (direction name, dots (B,), word features (B, L, D), word mask (B, L), image tokens (B, T, D))
# -> scores (B,), higher is better: a re-ranker that reads token features
TokenScorer = Callable[[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def reranked_recall(
    d: Direction, queries: np.ndarray, cand: np.ndarray, scores: np.ndarray
) -> dict[str, float]:
    """Recall of `queries` once their candidates are reordered by `scores` (best first)."""
    return recall(d.is_hit(queries[:, None], reorder(cand, scores)))


def cross_scores(
    reranker: PairReranker, pool: Pool, d: Direction, queries: np.ndarray, cand: np.ndarray
) -> np.ndarray:
    """Cross-encoder logits (Q, M) for each query against its candidates, in pair batches."""
    q = np.repeat(queries, cand.shape[1])
    it = cand.reshape(-1)
    out = []
    for s in range(0, len(q), PAIR_BATCH):
        qs, its = q[s : s + PAIR_BATCH], it[s : s + PAIR_BATCH]
        out.append(
            reranker.score_pairs(
                [pool.texts[i] for i in d.text_ids(qs, its)],
                np.asarray(pool.image_tokens[d.image_ids(qs, its)]),
            )
        )
    return np.concatenate(out).reshape(cand.shape)


def token_scores(
    scorer: TokenScorer,
    tt: TextTokens,
    pool: Pool,
    d: Direction,
    queries: np.ndarray,
    cand: np.ndarray,
    dots: np.ndarray,
) -> np.ndarray:
    """A token-level re-ranker's scores (Q, M) for each query against its candidates."""
    q = np.repeat(queries, cand.shape[1])
    it, dd = cand.reshape(-1), dots.reshape(-1)
    out = []
    for s in range(0, len(q), PAIR_BATCH):
        qs, its = q[s : s + PAIR_BATCH], it[s : s + PAIR_BATCH]
        t = d.text_ids(qs, its)
        out.append(
            scorer(
                d.name,
                dd[s : s + PAIR_BATCH],
                tt.tokens[t].astype(np.float32),
                tt.mask[t],
                np.asarray(pool.image_tokens[d.image_ids(qs, its)], dtype=np.float32),
            )
        )
    return np.concatenate(out).reshape(cand.shape)


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
) -> dict[str, Any]:
    """The `duet eval` result: {"pool", "modes": {mode: {t2i, i2t, ms_per_query}}, "sweeps"}.

    `token_scorers` ("late", "han") re-rank the same top-M as coop from token features:
    `text_tokens` (every pool text's) and the pool's image tokens.
    """
    need = max([candidates, *m_sweep])
    result: dict[str, Any] = {"pool": pool.sizes, "modes": {}, "sweeps": {}}
    token_scorers = token_scorers or {}
    if reranker is None and set(modes) - {"dot", *token_scorers}:
        raise EvalError("modes other than dot need a re-ranker")
    if token_scorers and text_tokens is None:
        raise EvalError("token-level modes need the pool texts' token features")
    if "ce-full" in modes and pool.sizes["images"] > CE_FULL_MAX_POOL:
        raise EvalError(
            f"ce-full scores every pool item per query; it is allowed on pools of "
            f"at most {CE_FULL_MAX_POOL} images, this one has "
            f"{pool.sizes['images']}: leave it out (--modes dot,coop)"
        )
    rng = np.random.default_rng(seed)
    for d in directions(pool):
        queries = np.arange(len(d.query_vecs))
        progress(f"{d.name}: {len(queries)} queries over {len(d.item_vecs)} items")
        t0 = time.perf_counter()
        cand, dots = top_m(d.query_vecs, d.item_vecs, max(need, 10))
        dot_ms = 1000 * (time.perf_counter() - t0) / len(queries)
        hits = d.is_hit(queries[:, None], cand)
        result["modes"].setdefault("dot", {})[d.name] = recall(hits)
        result["modes"]["dot"].setdefault("ms_per_query", {})[d.name] = round(dot_ms, 4)
        c = min(candidates, cand.shape[1])
        for name, scorer in token_scorers.items():
            if name not in modes:
                continue
            assert text_tokens is not None
            t0 = time.perf_counter()
            scores = token_scores(scorer, text_tokens, pool, d, queries, cand[:, :c], dots[:, :c])
            # plus encoding the text side: the query's words (t2i) or each candidate's (i2t)
            per_text = text_tokens.seconds / max(1, len(pool.texts))
            ms = 1000 * (
                (time.perf_counter() - t0) / len(queries) + per_text * (1 if d.name == "t2i" else c)
            )
            result["modes"].setdefault(name, {})[d.name] = reranked_recall(
                d, queries, cand[:, :c], scores
            )
            result["modes"][name].setdefault("ms_per_query", {})[d.name] = round(dot_ms + ms, 4)
        if reranker is None:
            continue
        m = min(need, cand.shape[1])
        t0 = time.perf_counter()
        logits = cross_scores(reranker, pool, d, queries, cand[:, :m])
        ce_ms_per_pair = 1000 * (time.perf_counter() - t0) / logits.size

        coop = functools.partial(reranked_recall, d, queries)
        if "coop" in modes:
            result["modes"].setdefault("coop", {})[d.name] = coop(
                cand[:, :candidates], logits[:, :candidates]
            )
            result["modes"]["coop"].setdefault("ms_per_query", {})[d.name] = round(
                dot_ms + ce_ms_per_pair * candidates, 4
            )
        for mm in m_sweep:
            entry = result["sweeps"].setdefault("M", {}).setdefault(str(mm), {})
            entry[d.name] = coop(cand[:, :mm], logits[:, :mm])
            entry.setdefault("ms_per_query", {})[d.name] = round(dot_ms + ce_ms_per_pair * mm, 4)
        if fusion_sweep:
            runs = [
                (f"{name}_{lam}", f, lam)
                for lam in LAMBDAS
                for name, f in (("ADD", fuse), ("NORM_ADD", norm_fuse))
            ]
            runs.append((DEFAULT_FUSION, fuse, DEFAULT_FUSION_LAMBDA))
            for key, f, lam in runs:
                entry = result["sweeps"].setdefault("fusion", {}).setdefault(key, {})
                entry[d.name] = coop(cand[:, :c], f(dots[:, :c], logits[:, :c], lam))
        if "ce-full" in modes:
            sample = np.sort(rng.choice(queries, min(ce_full_queries, len(queries)), replace=False))
            progress(f"{d.name}: ce-full over {len(d.item_vecs)} items for {len(sample)} queries")
            every = np.broadcast_to(np.arange(len(d.item_vecs)), (len(sample), len(d.item_vecs)))
            t0 = time.perf_counter()
            full = cross_scores(reranker, pool, d, sample, np.ascontiguousarray(every))
            full_ms = 1000 * (time.perf_counter() - t0) / len(sample)
            entry = result["modes"].setdefault("ce-full", {"queries": {}})
            entry[d.name] = reranked_recall(d, sample, every, full)
            entry["queries"][d.name] = len(sample)
            entry.setdefault("ms_per_query", {})[d.name] = round(full_ms, 4)
            # coop on the very same queries, for a like-for-like comparison
            entry.setdefault("coop_same_queries", {})[d.name] = reranked_recall(
                d, sample, cand[sample, :candidates], logits[sample, :candidates]
            )
    return result


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
) -> dict[str, Any]:
    """Precision of partial text->image queries over the pool's images: {"queries", "judged",
    "candidates", "modes": {mode: {"P@1", "P@10"}}}. Re-rankers reorder the dot product's top
    `candidates`; `DEFAULT_FUSION` is the service's default (ADD at `fusion_lambda`)."""
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
    cand, dots = top_m(qv, pool.image_vecs, max(candidates, 10))
    cand, dots = cand[:, :candidates], dots[:, :candidates]
    out: dict[str, Any] = {
        "queries": len(queries),
        "judged": int((fit.sum(axis=1) > 0).sum()),
        "candidates": candidates,
        "modes": {"dot": precision(cand, fit)},
    }
    pairs_text = [texts[q] for q in range(len(texts)) for _ in range(cand.shape[1])]
    pairs_img = cand.reshape(-1)
    if token_scorers:
        if token_encoder is None:
            raise EvalError("token-level modes need a token encoder for the queries")
        words, mask = token_encoder.text_token_features(texts)
        rows = np.repeat(np.arange(len(texts)), cand.shape[1])
        for name, scorer in token_scorers.items():
            if name not in modes:
                continue
            scores = np.concatenate(
                [
                    scorer(
                        "t2i",
                        dots.reshape(-1)[s : s + PAIR_BATCH],
                        words[rows[s : s + PAIR_BATCH]].astype(np.float32),
                        mask[rows[s : s + PAIR_BATCH]],
                        np.asarray(
                            pool.image_tokens[pairs_img[s : s + PAIR_BATCH]], dtype=np.float32
                        ),
                    )
                    for s in range(0, len(rows), PAIR_BATCH)
                ]
            ).reshape(cand.shape)
            out["modes"][name] = precision(reorder(cand, scores), fit)
    if reranker is not None and "coop" in modes:
        logits = np.concatenate(
            [
                reranker.score_pairs(
                    pairs_text[s : s + PAIR_BATCH],
                    np.asarray(pool.image_tokens[pairs_img[s : s + PAIR_BATCH]]),
                )
                for s in range(0, len(pairs_text), PAIR_BATCH)
            ]
        ).reshape(cand.shape)
        out["modes"]["coop"] = precision(reorder(cand, logits), fit)
        out["modes"][f"ADD_{fusion_lambda}"] = precision(
            reorder(cand, fuse(dots, logits, fusion_lambda)), fit
        )
    return out


def format_tables(result: dict[str, Any]) -> str:
    """Markdown tables of an `evaluate_index` result."""
    head = [
        "| {} | t2i R@1 | t2i R@5 | t2i R@10 | i2t R@1 | i2t R@5 | i2t R@10 | ms/query "
        "(t2i, i2t) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(name: str, r: dict[str, Any]) -> str:
        cells = [f"{r[d][f'R@{k}']:.1f}" if d in r else "–" for d in ("t2i", "i2t") for k in KS]
        ms = r.get("ms_per_query", {})
        timing = ", ".join(f"{ms[d]:.3g}" for d in ("t2i", "i2t") if d in ms) or "–"
        return f"| {name} | " + " | ".join(cells) + f" | {timing} |"

    pool = result["pool"]
    out = [
        f"pool: {pool['images']} images, {pool['texts']} texts",
        "",
        head[0].format("mode"),
        head[1],
    ]
    for mode, r in result["modes"].items():
        out.append(row(mode, r))
        if "queries" in r:
            out.append(
                row(
                    f"coop, same {r['queries'].get('t2i', 0)}/{r['queries'].get('i2t', 0)} queries",
                    r["coop_same_queries"],
                )
            )
    for sweep, entries in result["sweeps"].items():
        out += ["", head[0].format(sweep), head[1]]
        out += [row(name, r) for name, r in entries.items()]
    if "partial" in result:
        out += ["", format_partial(result["partial"])]
    return "\n".join(out)


def format_partial(part: dict[str, Any]) -> str:
    """Markdown table of an `evaluate_partial` result."""
    out = [
        f"partial queries: {part['queries']} (world seed {part.get('seed', '?')}), "
        f"{part['judged']} with a fitting image in the pool, top {part['candidates']} "
        "re-ranked; P@k out of min(k, fitting images)",
        "",
        "| mode | P@1 | P@10 |",
        "|---|---|---|",
    ]
    out += [f"| {m} | {r['P@1']:.3f} | {r['P@10']:.3f} |" for m, r in part["modes"].items()]
    return "\n".join(out)
