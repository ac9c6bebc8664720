"""benchmarks/index_scale.py's output: its result rows, the Markdown report (written between
marker comments so hand-written text around it survives a rerun) and the latency plot."""

from __future__ import annotations

import os
import platform
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

BEGIN, END = "<!-- index_scale:begin -->", "<!-- index_scale:end -->"


@dataclass(frozen=True)
class Row:
    """One index type at one N: how it built, how fast and well it searched, its size."""

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


def markdown_table(rows: Sequence[Row]) -> str:
    """The rows as one Markdown table, a line per (type, N)."""
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
    """The CPU and library versions the figures came from."""
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
    rows: Sequence[Row],
    argv: Sequence[str],
    target: float,
    build_threads: int,
    elapsed_s: float,
    *,
    dim: int,
    k: int,
) -> str:
    """The block that goes between the markers: machine, command, method, table."""
    cmd = shlex.join([".venv/bin/python", "benchmarks/index_scale.py", *argv])
    return "\n".join(
        [
            f"Machine: {machine()}.",
            "",
            f"Command: `{cmd}` ({elapsed_s / 60:.1f} min in all).",
            "",
            f"d = {dim}, inner product, k = {k}. Build (train + add) is `duet build`'s own "
            f"(`store.ann.build_index`) on {build_threads} FAISS thread(s), one while filling "
            f"an HNSW graph; latency is batch 1 with FAISS on 1 thread. The knob is the "
            f"cheapest reaching recall@10 ≥ {target} on separate tuning queries; "
            f'"plateau" marks an index whose recall stopped improving below that. recall@10 '
            f"is against exact search on the timed queries; bytes/vector = "
            f"`faiss.serialize_index` size / N.",
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


def plot(path: Path, rows: Sequence[Row], *, dim: int, k: int) -> None:
    """Latency against N, a line per index type (solid p50, dashed p99), as a PNG."""
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
    ax.set_title(f"FAISS batch-1 search, d={dim}, k={k}, 1 thread, tuned to recall@10 target")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
