"""How FAISS index types scale: build throughput, batch-1 latency, recall@10 and size vs N.

    .venv/bin/python benchmarks/index_scale.py                          # N = 10k, 100k, 1M
    .venv/bin/python benchmarks/index_scale.py --sizes 2000 --plot ''   # quick check, seconds

Vectors are synthetic but shaped like embeddings rather than noise: d = 128 (duet's
embedding size), L2-normalised, searched by inner product, drawn from a two-level Gaussian
mixture (64 groups of 64 components: 4,096 centres). The within-component noise has a
decaying spectrum, so the data has a low intrinsic dimension as learned embeddings do,
and is wider than the spacing of a group's components, so the density has no gaps for
IVF cells to line up with (with well-separated components the 4,096 IVF lists at 1M each
recovered one component and nprobe=1 reached recall 0.98, while 10k of the same data
looked like noise).
Queries come from the same mixture but are never indexed. Seeds are fixed.

Per index type and N it measures: train + add time (all FAISS threads) as vectors/s;
the search knob (IVF nprobe, HNSW efSearch), tuned on a separate query set to the
smallest grid value whose recall@10 reaches --target-recall, passed per call as
SearchParameters (the index is never mutated); p50/p99 latency of single-vector searches
with FAISS limited to one thread; recall@10 of those same searches against exact search;
and the serialized index size per vector. It prints a Markdown table, writes it into
--out between marker comments (text around the markers is kept, so hand-written reading
survives a rerun) and plots latency vs N to --plot. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

_faiss: Any = faiss  # its SWIG stubs do not know the keyword-argument constructors

DIM = 128
K = 10
GROUPS, PER_GROUP = 64, 64
GROUP_SPREAD = 0.7  # norm of a component centre's offset from its group's unit centre
NOISE = 0.9  # norm of a vector's offset from its component centre
SPECTRUM_DECAY = 0.5  # noise scale of the i-th principal direction ~ i**-SPECTRUM_DECAY
DATA_SEED, BASE_SEED, QUERY_SEED, TUNE_SEED, SAMPLE_SEED = 0, 1, 2, 3, 4
TRAIN_PER_LIST = 50  # k-means sample per IVF list: FAISS warns below 39, caps at 256
MIN_N = 1000
WARMUP = 10
DEFAULT_TYPES = ("Flat", "HNSW32", "IVF{nlist},Flat", "IVF{nlist},PQ32x8", "IVF{nlist}_HNSW32,SQ8")
NPROBES = tuple(2**i for i in range(13))
EF_SEARCHES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PLATEAU = 0.002  # a knob step that gains less recall than this is not worth its time
BEGIN, END = "<!-- index_scale:begin -->", "<!-- index_scale:end -->"


class UsageError(Exception):
    """A bad option: main reports it and exits 2."""


class Mixture:
    """Clustered unit vectors; the same instance gives base and query vectors one distribution."""

    def __init__(self, seed: int = DATA_SEED) -> None:
        rng = np.random.default_rng(seed)
        groups = _unit(rng.standard_normal((GROUPS, DIM), dtype=np.float32))
        offsets = rng.standard_normal((GROUPS * PER_GROUP, DIM), dtype=np.float32)
        self.centres = _unit(
            np.repeat(groups, PER_GROUP, axis=0) + offsets * np.float32(GROUP_SPREAD / np.sqrt(DIM))
        )
        basis, _ = np.linalg.qr(rng.standard_normal((DIM, DIM)))
        scale = np.arange(1, DIM + 1, dtype=np.float64) ** -SPECTRUM_DECAY
        scale *= NOISE / np.sqrt((scale**2).sum())
        self.noise = (scale[:, None] * basis).astype(np.float32)

    def sample(self, n: int, seed: int, chunk: int = 1 << 16) -> np.ndarray:
        """n float32 unit vectors, built chunk by chunk so 1M costs one 512 MB array."""
        rng = np.random.default_rng(seed)
        out = np.empty((n, DIM), dtype=np.float32)
        for lo in range(0, n, chunk):
            m = min(chunk, n - lo)
            x = self.centres[rng.integers(len(self.centres), size=m)]
            x += rng.standard_normal((m, DIM), dtype=np.float32) @ self.noise
            out[lo : lo + m] = _unit(x)
        return out


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def nlist_for(n: int) -> int:
    """IVF list count: FAISS's 4·√N rounded to a power of two, but at most N/39 (FAISS's
    minimum of 39 training vectors per list)."""
    nlist = 2 ** round(math.log2(4 * math.sqrt(n)))
    while nlist > 1 and nlist * 39 > n:
        nlist //= 2
    return nlist


def train_size(n: int, nlist: int) -> int:
    return min(n, TRAIN_PER_LIST * nlist)


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Share of the true top-k ids that the search returned (FAISS pads misses with -1)."""
    hits = (found[:, :, None] == truth[:, None, :]).any(axis=2).sum()
    return float(hits) / truth.size


def exact_knn(queries: np.ndarray, base: np.ndarray) -> np.ndarray:
    _, ids = faiss.knn(queries, base, K, metric=faiss.METRIC_INNER_PRODUCT)
    return ids


@dataclass(frozen=True)
class Knob:
    """One setting of an index's search-time accuracy knob, as per-call SearchParameters."""

    name: str  # "nprobe" or "efSearch"
    value: int
    params: faiss.SearchParameters

    @property
    def label(self) -> str:
        return f"{self.name}={self.value}"


def knobs(index: faiss.Index) -> list[Knob]:
    """The grid to tune over, cheapest first; empty for exhaustive indexes."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        hnsw_quantizer = isinstance(faiss.downcast_index(ivf.quantizer), faiss.IndexHNSW)
        out = []
        for p in (p for p in NPROBES if p <= ivf.nlist):
            if hnsw_quantizer:  # the quantizer must find the nprobe nearest lists itself
                qp = _faiss.SearchParametersHNSW(efSearch=max(64, 2 * p))
                params = _faiss.SearchParametersIVF(nprobe=p, quantizer_params=qp)
            else:
                params = _faiss.SearchParametersIVF(nprobe=p)
            out.append(Knob("nprobe", p, params))
        return out
    if isinstance(index, faiss.IndexHNSW):
        return [
            Knob("efSearch", ef, _faiss.SearchParametersHNSW(efSearch=ef)) for ef in EF_SEARCHES
        ]
    return []


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
        _, ids = index.search(queries, K, params=knob.params)
        r = recall_at_k(ids, truth)
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
    params = None if knob is None else knob.params
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        for i in range(min(WARMUP, len(queries))):
            index.search(queries[i : i + 1], K, params=params)
        seconds, ids = [], []
        start = time.perf_counter()
        for i in range(len(queries)):
            t0 = time.perf_counter()
            _, found = index.search(queries[i : i + 1], K, params=params)
            seconds.append(time.perf_counter() - t0)
            ids.append(found[0])
            if i >= 99 and time.perf_counter() - start > max_seconds:
                break
    finally:
        faiss.omp_set_num_threads(threads)
    return np.array(seconds), np.array(ids)


@dataclass(frozen=True)
class Row:
    type: str
    n: int
    params: str
    build_s: float
    p50_ms: float
    p99_ms: float
    recall: float
    bytes_per_vector: float
    queries: int

    @property
    def vectors_per_s(self) -> float:
        return self.n / self.build_s


def skip_polysemous_training(index: faiss.Index) -> None:
    """The factory turns on IVF-PQ's polysemous training, which only serves Hamming
    pre-filtering (polysemous_ht, off by default) yet costs over a minute per build here
    whatever N is; duet does not filter that way, so it would only distort build time."""
    ivf = faiss.try_extract_index_ivf(index)
    pq: Any = faiss.downcast_index(ivf) if ivf is not None else None
    if isinstance(pq, faiss.IndexIVFPQ):
        pq.do_polysemous_training = False  # type: ignore[attr-defined]  # not in SWIG stubs


def measure(
    template: str,
    base: np.ndarray,
    sample: np.ndarray,
    queries: np.ndarray,
    truth: np.ndarray,
    tune_queries: np.ndarray,
    tune_truth: np.ndarray,
    target: float,
    max_seconds: float,
) -> Row:
    n = len(base)
    nlist = nlist_for(n)
    index = faiss.index_factory(DIM, template.format(nlist=nlist), faiss.METRIC_INNER_PRODUCT)
    skip_polysemous_training(index)
    t0 = time.perf_counter()
    if not index.is_trained:
        index.train(sample)
    index.add(base)
    build_s = time.perf_counter() - t0
    size = faiss.serialize_index(index).size
    knob, met = tune(index, tune_queries, tune_truth, target)
    seconds, ids = batch1_latency(index, queries, knob, max_seconds)
    truth = truth[: len(ids)]
    labels = [f"nlist={nlist}"] if "{nlist}" in template else []
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


def markdown_table(rows: Sequence[Row]) -> str:
    lines = [
        "| type | N | params | build s | vectors/s | p50 ms | p99 ms | recall@10 "
        "| bytes/vector | queries |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| `{r.type}` | {r.n:,} | {r.params} | {r.build_s:.2f} "
            f"| {r.vectors_per_s:,.0f} | {r.p50_ms:.3f} | {r.p99_ms:.3f} "
            f"| {r.recall:.3f} | {r.bytes_per_vector:.1f} | {r.queries} |"
        )
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), CPU only; faiss {faiss.__version__}, "
        f"numpy {np.__version__}, Python {platform.python_version()}"
    )


def report(
    rows: Sequence[Row], argv: Sequence[str], target: float, build_threads: int, elapsed_s: float
) -> str:
    cmd = shlex.join([".venv/bin/python", "benchmarks/index_scale.py", *argv])
    return "\n".join(
        [
            f"Machine: {machine()}.",
            "",
            f"Command: `{cmd}` ({elapsed_s / 60:.1f} min in all).",
            "",
            f"d = {DIM}, inner product, k = {K}. Build (train + add) uses {build_threads} FAISS "
            f"thread(s); latency is batch 1 with FAISS on 1 thread. The knob is the cheapest "
            f'reaching recall@10 ≥ {target} on separate tuning queries; "plateau" marks an '
            f"index whose recall stopped improving below that. recall@10 is against exact "
            f"search on the timed queries; bytes/vector = `faiss.serialize_index` size / N.",
            "",
            markdown_table(rows),
        ]
    )


def write_markdown(path: Path, block: str) -> None:
    """Put block between the markers in path, keeping the text around them."""
    body = f"{BEGIN}\n{block}\n{END}"
    if path.exists():
        text = path.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = head + body + tail
    else:
        text = f"# Index scale benchmark\n\n{body}\n"
    path.write_text(text)


def check_markdown(path: Path) -> None:
    if path.exists() and not (BEGIN in (text := path.read_text()) and END in text):
        raise UsageError(
            f"--out {path} exists without the {BEGIN} / {END} markers; "
            "add them where the table belongs, or choose another file"
        )


def plot(path: Path, rows: Sequence[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for template in dict.fromkeys(r.type for r in rows):
        mine = [r for r in rows if r.type == template]
        ns = [r.n for r in mine]
        (line,) = ax.plot(ns, [r.p50_ms for r in mine], marker="o", label=template)
        ax.plot(
            ns,
            [r.p99_ms for r in mine],
            linestyle="--",
            marker=".",
            color=line.get_color(),
            alpha=0.7,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    sizes = sorted({r.n for r in rows})
    ax.set_xticks(sizes, [f"{n / 1e6:g}M" if n >= 10**6 else f"{n / 1e3:g}k" for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("N (indexed vectors)")
    ax.set_ylabel("search latency, ms (solid p50, dashed p99)")
    ax.set_title(f"FAISS batch-1 search, d={DIM}, k={K}, 1 thread, tuned to recall@10 target")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the module docstring kept as written."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="Each index is faiss.index_factory(128, TYPE, faiss.METRIC_INNER_PRODUCT); "
        "{nlist} in a TYPE becomes 4·√N rounded to a power of two, at most N/39, "
        "and IVF training uses 50·nlist vectors (at most N). IVF-PQ's polysemous "
        "training is turned off: it only serves Hamming pre-filtering, which duet "
        "does not use, and costs over a minute per build. Exit status 2 on a bad "
        "option.",
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


def check_types(types: Sequence[str]) -> None:
    for template in types:
        try:
            faiss.index_factory(DIM, template.format(nlist=1), faiss.METRIC_INNER_PRODUCT)
        except (KeyError, IndexError, ValueError, RuntimeError) as e:
            raise UsageError(
                f"--types {template!r} is not an index-factory string FAISS "
                f"accepts ({type(e).__name__}); see the FAISS wiki page "
                "'The index factory'"
            ) from e


def check_plot_backend() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UsageError(
            "--plot needs matplotlib: pip install -e '.[bench]', or pass --plot ''"
        ) from e


def log(msg: str) -> None:
    print(f"[index_scale] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[Row]:
    mixture = Mixture()
    queries = mixture.sample(args.queries, QUERY_SEED)
    tune_queries = mixture.sample(args.queries, TUNE_SEED)
    rows = []
    for n in args.sizes:
        log(f"N={n:,}: generating vectors and exact top-{K}")
        base = mixture.sample(n, BASE_SEED)
        truth, tune_truth = exact_knn(queries, base), exact_knn(tune_queries, base)
        pick = np.random.default_rng(SAMPLE_SEED).choice(
            n, size=train_size(n, nlist_for(n)), replace=False
        )
        sample = base[np.sort(pick)]
        for template in args.types:
            log(f"N={n:,} {template}: build, tune, time")
            row = measure(
                template,
                base,
                sample,
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
        del base, sample
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        check_types(args.types)
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
    block = report(rows, argv, args.target_recall, build_threads, time.perf_counter() - start)
    print(block)
    if args.out:
        write_markdown(Path(args.out), block)
        log(f"wrote {args.out}")
    if args.plot:
        plot(Path(args.plot), rows)
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
