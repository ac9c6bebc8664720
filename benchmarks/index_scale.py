"""How FAISS index types scale: build throughput, batch-1 latency, recall@10 and size vs N.

    .venv/bin/python benchmarks/index_scale.py                          # N = 10k, 100k, 1M
    .venv/bin/python benchmarks/index_scale.py --sizes 2000 --plot '' --out ''  # quick, no files

Vectors are synthetic but shaped like embeddings rather than noise: d = 128 (duet's
embedding size), L2-normalised, searched by inner product, drawn from a two-level Gaussian
mixture (64 groups of 64 components: 4,096 centres). The within-component noise has a
decaying spectrum, so the data has a low intrinsic dimension as learned embeddings do,
and is wider than the spacing of a group's components, so the density has no gaps for
IVF cells to line up with (with well-separated components the 4,096 IVF lists at 1M each
recovered one component and nprobe=1 reached recall 0.98, while 10k of the same data
looked like noise).
Queries come from the same mixture but are never indexed. Seeds are fixed.

Every index is the one `duet build --factory TYPE` writes: its nlist, training sample and
build are store.ann's (default_nlist, build_index). Per index type and N it measures:
train + add time (all FAISS threads, but one while filling an HNSW graph, as the builder
does) as vectors/s; the search knob (IVF nprobe, HNSW efSearch), tuned on a separate
query set to the smallest grid value whose recall@10 reaches --target-recall, passed per
call as the service passes it (store.ann.search_params; the index is never mutated);
p50/p99 latency of single-vector searches with FAISS limited to one thread; recall@10 of
those same searches against exact search; and the serialized index size per vector. It
prints a Markdown table, writes it into --out between marker comments (text around the
markers is kept, so hand-written reading survives a rerun) and plots latency vs N to
--plot. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # its sibling modules, when run as a script
from benchmarks.scale_data import DIM, Mixture  # noqa: E402
from benchmarks.scale_report import BEGIN, END, Row, plot, report, write_markdown  # noqa: E402
from store import ann  # noqa: E402

K = 10
BASE_SEED, QUERY_SEED, TUNE_SEED = 1, 2, 3
MIN_N = 1000
WARMUP = 10
DEFAULT_TYPES = ("Flat", "HNSW32", "IVF{nlist},Flat", "IVF{nlist},PQ32x8", "IVF{nlist}_HNSW32,SQ8")
NPROBES = tuple(2**i for i in range(13))
EF_SEARCHES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PLATEAU = 0.002  # a knob step that gains less recall than this is not worth its time


class UsageError(Exception):
    """A bad option: main reports it and exits 2."""


def factory_for(template: str, n: int) -> str:
    """TYPE with {nlist} filled in as `duet build` would choose it for n vectors."""
    return template.format(nlist=ann.default_nlist(n))


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Share of the true top-k ids that the search returned (FAISS pads misses with -1)."""
    hits = (found[:, :, None] == truth[:, None, :]).any(axis=2).sum()
    return float(hits) / truth.size


def exact_knn(queries: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Ids of the exact top-K by inner product: the truth recall is measured against."""
    _, ids = faiss.knn(queries, base, K, metric=faiss.METRIC_INNER_PRODUCT)
    return ids


@dataclass(frozen=True)
class Knob:
    """One setting of an index's search-time accuracy knob, as the service's SearchKnobs."""

    name: str  # "nprobe" or "efSearch"
    value: int
    # store.ann.search_params of it for this index, built once (and kept alive) so the
    # timed loop measures FAISS's search, not building SWIG parameter objects
    params: Any

    @property
    def label(self) -> str:
        return f"{self.name}={self.value}"


def _knob(index: faiss.Index, name: str, value: int, knobs: ann.SearchKnobs) -> Knob:
    return Knob(name, value, ann.search_params(index, knobs))


def knobs(index: faiss.Index) -> list[Knob]:
    """The grid to tune over, cheapest first; empty for exhaustive indexes."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        # an HNSW coarse quantizer must find the nprobe nearest lists itself, so the
        # service's efSearch (which reaches it) grows with nprobe; other quantizers ignore it
        grid = []
        for p in (p for p in NPROBES if p <= ivf.nlist):
            setting = ann.SearchKnobs(nprobe=p, ef_search=max(ann.DEFAULT_EF_SEARCH, 2 * p))
            grid.append(_knob(index, "nprobe", p, setting))
        return grid
    if isinstance(faiss.downcast_index(index), faiss.IndexHNSW):
        return [
            _knob(index, "efSearch", ef, ann.SearchKnobs(nprobe=None, ef_search=ef))
            for ef in EF_SEARCHES
        ]
    return []


def search(index: faiss.Index, queries: np.ndarray, knob: Knob | None) -> np.ndarray:
    """Ids of the top-K for each query, with the knob's per-call parameters."""
    if knob is None or knob.params is None:
        _, ids = index.search(queries, K)
    else:
        _, ids = index.search(queries, K, params=knob.params.params)
    return ids


def tune(
    index: faiss.Index, queries: np.ndarray, truth: np.ndarray, target: float
) -> tuple[Knob | None, bool]:
    """The cheapest knob reaching `target` recall on tuning queries, and whether the
    target was met; if recall plateaus below it, the knob where it stopped improving.
    (None, True) for an exhaustive index, which has no knob."""
    grid = knobs(index)
    if not grid:
        return None, True
    best, best_recall = grid[0], -1.0
    for knob in grid:
        r = recall_at_k(search(index, queries, knob), truth)
        if r >= target:
            return knob, True
        if r < best_recall + PLATEAU:
            break
        best, best_recall = knob, r
    return best, False


def batch1_latency(
    index: faiss.Index, queries: np.ndarray, knob: Knob | None, max_seconds: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-query seconds and ids of single-vector searches on one FAISS thread, stopping
    early (after at least 100 queries) once max_seconds have been spent."""
    with ann.faiss_threads(1):
        for i in range(min(WARMUP, len(queries))):
            search(index, queries[i : i + 1], knob)
        seconds, ids = [], []
        start = time.perf_counter()
        for i in range(len(queries)):
            t0 = time.perf_counter()
            found = search(index, queries[i : i + 1], knob)
            seconds.append(time.perf_counter() - t0)
            ids.append(found[0])
            if i >= 99 and time.perf_counter() - start > max_seconds:
                break
    return np.array(seconds), np.array(ids)


def measure(
    template: str,
    base: np.ndarray,
    queries: np.ndarray,
    truth: np.ndarray,
    tune_queries: np.ndarray,
    tune_truth: np.ndarray,
    target: float,
    max_seconds: float,
) -> Row:
    """Build one TYPE on base as `duet build` does, tune its knob, time and score it."""
    n = len(base)
    t0 = time.perf_counter()
    index = ann.build_index(factory_for(template, n), base)
    build_s = time.perf_counter() - t0
    size = faiss.serialize_index(index).size
    knob, met = tune(index, tune_queries, tune_truth, target)
    seconds, ids = batch1_latency(index, queries, knob, max_seconds)
    truth = truth[: len(ids)]
    labels = [f"nlist={ann.default_nlist(n)}"] if "{nlist}" in template else []
    if knob is not None:
        labels.append(knob.label + ("" if met else " (plateau)"))
    p50, p99 = np.percentile(seconds * 1000, [50, 99])
    return Row(
        template,
        n,
        ", ".join(labels) or "exact",
        build_s,
        float(p50),
        float(p99),
        recall_at_k(ids, truth),
        size / n,
        len(ids),
    )


def check_markdown(path: Path) -> None:
    """Refuse an --out that exists but has no place marked for the table."""
    if path.exists() and not (BEGIN in (text := path.read_text()) and END in text):
        raise UsageError(
            f"--out {path} exists without the {BEGIN} / {END} markers; "
            "add them where the table belongs, or choose another file"
        )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the module docstring kept as written."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The options, checked; a bad one exits 2 through argparse."""
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="Each index is store.ann.build_index(TYPE, vectors), as `duet build "
        "--factory TYPE` builds it: inner product; {nlist} in a TYPE becomes "
        "store.ann.default_nlist(N), a power of two near 8·√N within 4..16·√N; training "
        "uses a seeded sample of 64·nlist vectors (at least 9,984 where PQ codebooks train "
        "too; at most N), and an HNSW graph is filled on one thread; IVF-PQ's polysemous "
        "training is off (it only serves Hamming pre-filtering, which duet does not use). "
        "Exit status 2 on a bad option.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        help=f"comma-separated N values (each ≥ {MIN_N}); 2000 is a quick check",
    )
    p.add_argument(
        "--types",
        nargs="+",
        default=list(DEFAULT_TYPES),
        metavar="TYPE",
        help="FAISS index-factory strings; quote them in the shell",
    )
    p.add_argument(
        "--queries",
        type=int,
        default=1000,
        help="timed single-vector queries per index (plus as many for tuning)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=30.0,
        help="stop a latency loop after this long (keeping ≥ 100 queries); "
        "the table shows how many ran",
    )
    p.add_argument(
        "--target-recall",
        type=float,
        default=0.9,
        help="recall@10 the nprobe / efSearch tuning aims for",
    )
    p.add_argument(
        "--out", default="docs/scale.md", help="Markdown file for the table ('' = stdout only)"
    )
    p.add_argument(
        "--plot",
        default="docs/scale.png",
        help="PNG of latency vs N ('' = none; needs matplotlib: pip install -e '.[bench]')",
    )
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: give comma-separated integers, e.g. 10000,100000")
    if min(args.sizes) < MIN_N:
        p.error(f"--sizes: every N must be at least {MIN_N}")
    if args.queries < 100:
        p.error("--queries: at least 100, or p99 means nothing")
    if not 0 < args.target_recall <= 1:
        p.error("--target-recall: a number in (0, 1]")
    return args


def check_types(types: Sequence[str], sizes: Sequence[int]) -> None:
    """Refuse a TYPE FAISS cannot build, or one some N cannot train, as `duet build` does."""
    for template in types:
        try:
            ann.make_index(template.format(nlist=1), DIM)
        except (KeyError, IndexError, ValueError) as e:  # ann.FactoryError is a ValueError
            cause = e.__cause__ or e  # make_index wraps FAISS's RuntimeError
            raise UsageError(
                f"--types {template!r} is not an index-factory string FAISS "
                f"accepts ({type(cause).__name__}); see the FAISS wiki page "
                "'The index factory'"
            ) from e
        for n in sizes:
            try:
                ann.check_factory(factory_for(template, n), DIM, n)
            except ann.FactoryError as e:
                raise UsageError(f"--types {template!r} at N={n:,}: {e}") from e


def check_plot_backend() -> None:
    """Refuse --plot before any work when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UsageError(
            "--plot needs matplotlib: pip install -e '.[bench]', or pass --plot ''"
        ) from e


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[index_scale] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[Row]:
    """Every TYPE at every N, in that order, logging each row as it lands."""
    mixture = Mixture()
    queries = mixture.sample(args.queries, QUERY_SEED)
    tune_queries = mixture.sample(args.queries, TUNE_SEED)
    rows = []
    for n in args.sizes:
        log(f"N={n:,}: generating vectors and exact top-{K}")
        base = mixture.sample(n, BASE_SEED)
        truth, tune_truth = exact_knn(queries, base), exact_knn(tune_queries, base)
        for template in args.types:
            log(f"N={n:,} {template}: build, tune, time")
            row = measure(
                template,
                base,
                queries,
                truth,
                tune_queries,
                tune_truth,
                args.target_recall,
                args.max_seconds,
            )
            log(
                f"  {row.params}: build {row.build_s:.1f} s, p50 {row.p50_ms:.3f} ms, "
                f"p99 {row.p99_ms:.3f} ms, recall@10 {row.recall:.3f}, "
                f"{row.bytes_per_vector:.0f} B/vector"
            )
            rows.append(row)
        del base
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Check the options, measure, print the report and write --out and --plot."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        check_types(args.types, args.sizes)
        if args.out:
            check_markdown(Path(args.out))
        if args.plot:
            check_plot_backend()
    except UsageError as e:
        print(f"index_scale.py: error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    build_threads = faiss.omp_get_max_threads()
    rows = run(args)
    elapsed = time.perf_counter() - start
    block = report(rows, argv, args.target_recall, build_threads, elapsed, dim=DIM, k=K)
    print(block)
    if args.out:
        write_markdown(Path(args.out), block)
        log(f"wrote {args.out}")
    if args.plot:
        plot(Path(args.plot), rows, dim=DIM, k=K)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
