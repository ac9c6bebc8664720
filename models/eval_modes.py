"""The evaluator: recall@K of a pool per re-ranking mode and sweep (`evaluate_pool`), and
precision@K of partial text queries over its images (`evaluate_partial_pool`). `duet eval`
runs it over a built index's pool, `models.evaluate` (`duet train`'s validation) over images
and captions encoded in memory.

Modes: `dot` (bi-encoder only), `coop` (dot top-M, then the cross-encoder reorders them;
the papers' retrieve-and-rerank), token-level re-rankers such as `late` (TGDT's S_gl) and
`han` (HAN's S_AVG) over the same top-M, `ce-full` (the cross-encoder over the whole pool, on
a query sample: the slow baseline). Sweeps: M (Rerank-Smart Table 8) and score fusion
ADD_lambda / NORM_ADD_lambda (Table 9). Recalls are percentages.

Partial queries: what people type ("a red circle", "two blue squares") are judged by whether
each hit's scene fits the query, not by one right image: precision at 1 and at 10.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.errors import UserError
from models.eval_metrics import KS, precision, recall, reorder, top_m
from models.eval_pool import (
    PAIR_BATCH,
    Direction,
    Pool,
    TextTokens,
    TokenScorer,
    cross_scores,
    directions,
    texts_to_images,
    token_scores,
)
from models.fusion import DEFAULT_FUSION_LAMBDA, fuse, norm_fuse
from models.protocols import PairReranker, TokenEncoder

M_SWEEP = (10, 20, 50, 100)
LAMBDAS = (0.1, 0.5, 0.9)
# the fusion sweep also reports the service's default re-ranking: ADD at the λ chosen on the
# validation split (models/weights/README.md), never tuned on an evaluated split
DEFAULT_FUSION = f"ADD_{DEFAULT_FUSION_LAMBDA}"

# (name, fusion of dots and cross-encoder logits, λ): one ranking of the fusion sweep
Fusion = tuple[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray], float]
FUSION_SWEEP: tuple[Fusion, ...] = (
    *(
        (f"{name}_{lam}", f, lam)
        for lam in LAMBDAS
        for name, f in (("ADD", fuse), ("NORM_ADD", norm_fuse))
    ),
    (DEFAULT_FUSION, fuse, DEFAULT_FUSION_LAMBDA),
)


class EvalError(UserError, ValueError):
    """The pool cannot be evaluated as asked (no ground truth, pool too large, ...)."""


@dataclass(frozen=True)
class Plan:
    """What `evaluate_pool` runs: the modes, M, the sweeps, and how it batches and rounds."""

    candidates: int = 20  # M: what coop, the token-level modes and the fusions re-rank
    modes: Sequence[str] = ("dot", "coop", "ce-full")
    m_sweep: Sequence[int] = ()
    fusions: Sequence[Fusion] = ()
    ce_full_queries: int = 100  # per direction
    ce_full_max_pool: int | None = None  # images; None: ce-full on a pool of any size
    seed: int = 0  # draws ce-full's query sample
    pair_batch: int = PAIR_BATCH  # pairs per re-ranker call
    digits: int | None = 2  # recalls rounded to; None: as computed
    bars: bool = False  # a progress bar (stderr) per re-ranker scoring


@dataclass
class _Ranked:
    """One direction's queries and their dot-product top-M, best first."""

    d: Direction
    queries: np.ndarray
    cand: np.ndarray  # (Q, M) item rows
    dots: np.ndarray  # (Q, M)
    dot_ms: float  # what finding them took, per query
    digits: int | None

    def recall(self, queries: np.ndarray, cand: np.ndarray, scores: np.ndarray) -> dict[str, float]:
        """Recall of `queries` once their candidates are reordered by `scores` (best first)."""
        return recall(self.d.is_hit(queries[:, None], reorder(cand, scores)), self.digits)


def evaluate_pool(
    pool: Pool,
    reranker: PairReranker | None,
    plan: Plan | None = None,
    *,
    token_scorers: dict[str, TokenScorer] | None = None,
    text_tokens: TextTokens | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """{"pool", "modes": {mode: {t2i, i2t, ms_per_query}}, "sweeps"}: `plan` (by default
    `Plan()`) over `pool`.

    `token_scorers` ("late", "han") re-rank the same top-M as coop from token features:
    `text_tokens` (every pool text's) and the pool's image tokens.
    """
    plan = plan or Plan()
    scorers = token_scorers or {}
    _check(pool, reranker, plan, scorers, text_tokens)
    result: dict[str, Any] = {"pool": pool.sizes, "modes": {}, "sweeps": {}, "queries": {}}
    result["candidates"] = plan.candidates  # M: what every re-ranking mode re-ranks
    rng = np.random.default_rng(plan.seed)
    for d in directions(pool):
        run = _dot_mode(result, plan, d, progress)
        for name, scorer in scorers.items():
            if name in plan.modes:
                assert text_tokens is not None
                _token_mode(result, plan, run, name, scorer, text_tokens)
        if reranker is not None:
            logits = _cross_modes(result, plan, run, reranker)
            if "ce-full" in plan.modes:
                _ce_full(result, plan, run, reranker, logits, rng, progress)
    return result


def _check(
    pool: Pool,
    reranker: PairReranker | None,
    plan: Plan,
    scorers: dict[str, TokenScorer],
    text_tokens: TextTokens | None,
) -> None:
    """Refuse a plan the models or the pool cannot run, before any work."""
    if reranker is None and set(plan.modes) - {"dot", *scorers}:
        raise EvalError("modes other than dot need a re-ranker")
    if scorers and text_tokens is None:
        raise EvalError("token-level modes need the pool texts' token features")
    limit = plan.ce_full_max_pool
    if "ce-full" in plan.modes and limit is not None and pool.sizes["images"] > limit:
        raise EvalError(
            f"ce-full scores every pool item per query; it is allowed on pools of "
            f"at most {limit} images, this one has "
            f"{pool.sizes['images']}: leave it out (--modes dot,coop)"
        )


def _bar(plan: Plan, direction: str, what: str) -> str | None:
    """The progress bar's name for scoring `what` in `direction`, if the plan shows bars."""
    return f"{direction}: {what}" if plan.bars else None


def _record(table: dict[str, Any], name: str, d: str, recalls: Any, ms: float) -> None:
    """`table[name]`'s recalls and ms per query for direction `d`."""
    table.setdefault(name, {})[d] = recalls
    table[name].setdefault("ms_per_query", {})[d] = round(ms, 4)


def _dot_mode(
    result: dict[str, Any], plan: Plan, d: Direction, progress: Callable[[str], None]
) -> _Ranked:
    """The dot product's top-M of every query of `d` (deep enough for R@10 and every M of
    the sweep), recorded as mode `dot`."""
    queries = np.arange(len(d.query_vecs))
    progress(f"{d.name}: {len(queries)} queries over {len(d.item_vecs)} items")
    result["queries"][d.name] = len(queries)
    t0 = time.perf_counter()
    cand, dots = top_m(d.query_vecs, d.item_vecs, max([plan.candidates, *plan.m_sweep, 10]))
    dot_ms = 1000 * (time.perf_counter() - t0) / len(queries)
    hits = d.is_hit(queries[:, None], cand)
    _record(result["modes"], "dot", d.name, recall(hits, plan.digits), dot_ms)
    return _Ranked(d, queries, cand, dots, dot_ms, plan.digits)


def _token_mode(
    result: dict[str, Any],
    plan: Plan,
    run: _Ranked,
    name: str,
    scorer: TokenScorer,
    tt: TextTokens,
) -> None:
    """Mode `name`: a token-level re-ranker over the top `plan.candidates`."""
    c = min(plan.candidates, run.cand.shape[1])
    t0 = time.perf_counter()
    scores = token_scores(
        scorer,
        tt,
        run.d,
        run.queries,
        run.cand[:, :c],
        run.dots[:, :c],
        plan.pair_batch,
        _bar(plan, run.d.name, name),
    )
    # plus encoding the text side: the query's words (t2i) or each candidate's (i2t)
    per_text = tt.seconds / max(1, len(run.d.texts))
    ms = 1000 * (
        (time.perf_counter() - t0) / len(run.queries) + per_text * (1 if run.d.name == "t2i" else c)
    )
    recalls = run.recall(run.queries, run.cand[:, :c], scores)
    _record(result["modes"], name, run.d.name, recalls, run.dot_ms + ms)


def _cross_modes(
    result: dict[str, Any], plan: Plan, run: _Ranked, reranker: PairReranker
) -> np.ndarray:
    """coop, the M sweep and the fusions, all from one scoring of the top M; its logits."""
    d, cand, dots, k = run.d, run.cand, run.dots, plan.candidates
    m = min(max([k, *plan.m_sweep]), cand.shape[1])
    t0 = time.perf_counter()
    logits = cross_scores(
        reranker, d, run.queries, cand[:, :m], plan.pair_batch, _bar(plan, d.name, f"top {m}")
    )
    ce_ms_per_pair = 1000 * (time.perf_counter() - t0) / logits.size
    coop = functools.partial(run.recall, run.queries)
    if "coop" in plan.modes:
        ms = run.dot_ms + ce_ms_per_pair * k
        _record(result["modes"], "coop", d.name, coop(cand[:, :k], logits[:, :k]), ms)
    for mm in plan.m_sweep:
        ms = run.dot_ms + ce_ms_per_pair * mm
        swept = coop(cand[:, :mm], logits[:, :mm])
        _record(result["sweeps"].setdefault("M", {}), str(mm), d.name, swept, ms)
    c = min(k, cand.shape[1])
    for key, f, lam in plan.fusions:
        entry = result["sweeps"].setdefault("fusion", {}).setdefault(key, {})
        entry[d.name] = coop(cand[:, :c], f(dots[:, :c], logits[:, :c], lam))
    return logits


def _ce_full(
    result: dict[str, Any],
    plan: Plan,
    run: _Ranked,
    reranker: PairReranker,
    logits: np.ndarray,
    rng: np.random.Generator,
    progress: Callable[[str], None],
) -> None:
    """Mode ce-full: the cross-encoder over every item for a sample of queries, beside coop
    on the very same queries (`logits`: coop's) for a like-for-like comparison."""
    d, k = run.d, plan.candidates
    sample = np.sort(
        rng.choice(run.queries, min(plan.ce_full_queries, len(run.queries)), replace=False)
    )
    progress(f"{d.name}: ce-full over {len(d.item_vecs)} items for {len(sample)} queries")
    every = np.broadcast_to(np.arange(len(d.item_vecs)), (len(sample), len(d.item_vecs)))
    t0 = time.perf_counter()
    full = cross_scores(
        reranker,
        d,
        sample,
        np.ascontiguousarray(every),
        plan.pair_batch,
        _bar(plan, d.name, "ce-full"),
    )
    full_ms = 1000 * (time.perf_counter() - t0) / len(sample)
    entry = result["modes"].setdefault("ce-full", {"queries": {}})
    entry[d.name] = run.recall(sample, every, full)
    entry["queries"][d.name] = len(sample)
    entry.setdefault("ms_per_query", {})[d.name] = round(full_ms, 4)
    entry.setdefault("coop_same_queries", {})[d.name] = run.recall(
        sample, run.cand[sample, :k], logits[sample, :k]
    )


def evaluate_partial_pool(
    pool: Pool,
    texts: Sequence[str],
    query_vecs: np.ndarray,
    fit: np.ndarray,
    reranker: PairReranker | None,
    *,
    candidates: int = 50,
    modes: Sequence[str] = ("dot", "coop"),
    lambdas: Sequence[float] = (DEFAULT_FUSION_LAMBDA,),
    token_scorers: dict[str, TokenScorer] | None = None,
    token_encoder: TokenEncoder | None = None,
    pair_batch: int = PAIR_BATCH,
    bars: bool = False,
) -> dict[str, Any]:
    """Precision of partial text->image queries (`texts`, encoded as `query_vecs`; `fit[q, i]`:
    query q fits pool image i) over the pool's images: {"queries", "judged", "candidates",
    "modes": {mode: {"P@1", "P@10"}}}. Re-rankers reorder the dot product's top
    `candidates`; `ADD_λ`, per λ of `lambdas`, fuses coop's logits with the dots."""
    d = texts_to_images(pool, texts, query_vecs, fit)
    queries = np.arange(len(texts))
    cand, dots = top_m(query_vecs, pool.image_vecs, max(candidates, 10))
    cand, dots = cand[:, :candidates], dots[:, :candidates]
    out: dict[str, Any] = {
        "queries": len(texts),
        "judged": int((fit.sum(axis=1) > 0).sum()),
        "candidates": candidates,
        "modes": {"dot": precision(cand, fit)},
    }
    if token_scorers:
        if token_encoder is None:
            raise EvalError("token-level modes need a token encoder for the queries")
        words = TextTokens(*token_encoder.text_token_features(texts), seconds=0.0)
        for name, scorer in token_scorers.items():
            if name in modes:
                bar = f"partial: {name}" if bars else None
                scores = token_scores(scorer, words, d, queries, cand, dots, pair_batch, bar)
                out["modes"][name] = precision(reorder(cand, scores), fit)
    if reranker is not None and "coop" in modes:
        bar = f"partial: top {candidates}" if bars else None
        logits = cross_scores(reranker, d, queries, cand, pair_batch, bar)
        out["modes"]["coop"] = precision(reorder(cand, logits), fit)
        for lam in lambdas:
            out["modes"][f"ADD_{lam}"] = precision(reorder(cand, fuse(dots, logits, lam)), fit)
    return out


def format_tables(result: dict[str, Any]) -> str:
    """Markdown tables of an `evaluate_pool` result (and its "partial" part, if any)."""
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
    corpus = result.get("corpus") or {}
    split = f", split {corpus['split']}" if corpus.get("split") else ""
    changed = f", changed from {corpus['changed_from']}" if corpus.get("changed_from") else ""
    out = [
        *(
            [f"index {result['index_version']}: corpus {corpus['path']}{split}{changed}"]
            if "index_version" in result and corpus
            else []
        ),
        f"pool: {pool['images']} images, {pool['texts']} texts"
        + (
            f" (with the distractors of {result['distractors']})" if "distractors" in result else ""
        ),
        *(
            [
                "queries: "
                + ", ".join(f"{d} {n}" for d, n in result["queries"].items())
                + f"; re-ranking modes re-rank each one's top {result['candidates']} (M)"
                + (f"; late's theta {result['theta']:g}" if "theta" in result else "")
            ]
            if result.get("queries")
            else []
        ),
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
    """Markdown table of an `evaluate_partial_pool` result."""
    out = [
        f"partial queries: {part['queries']} (world seed {part.get('seed', '?')}), "
        f"{part['judged']} with a fitting image in the pool, top {part['candidates']} "
        "re-ranked; P@k out of min(k, fitting images)",
        "",
        "| mode | P@1 | P@10 |",
        "|---|---|---|",
    ]
    if not part["judged"]:  # every P@k would be 0 / 0: "nan" said nothing
        return "\n".join(
            [
                out[0],
                "",
                "No query has a fitting image in this pool, so none is judged: give more "
                "--partial queries, or evaluate a larger index.",
            ]
        )
    out += [f"| {m} | {r['P@1']:.3f} | {r['P@10']:.3f} |" for m, r in part["modes"].items()]
    return "\n".join(out)
