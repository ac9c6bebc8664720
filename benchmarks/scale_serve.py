"""duet served at several index sizes, one table: the cost per item read off side by side.

For each `--index N=DIR` (a folder `duet build` wrote; DIR/current is served) it starts
`duet serve`, times start-up (process start to the first answered search), reads the
server's resident memory (and the GPU's, when there is one), the index's bytes per image
(vectors, image tokens, item store), then measures closed-loop load with different captions
(no cache answers): re-ranked at 1 and `--clients` clients, dot-only at 1 client.

    python benchmarks/scale_serve.py --index 20000=/tmp/idx20k --index 100000=/tmp/idx100k
    python benchmarks/scale_serve.py --device cuda --index ...          # on a GPU host

Writes the Markdown table to stdout and the rows as JSON to `--json`. Nothing else should
run meanwhile: the sizes are measured one after another, not interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.cell import Cell  # noqa: E402
from benchmarks.duet_metrics import stage_totals  # noqa: E402
from benchmarks.load_client import LoadPool  # noqa: E402
from benchmarks.serve_load import server  # noqa: E402

# what a version folder holds, by what it is for (bytes per image are summed per group)
FILES = {
    "vectors": ("image.faiss", "text.faiss"),
    "tokens": ("image_tokens.npy",),
    "items": ("items.sqlite",),
}


@dataclass
class Row:
    n: int
    start_s: float
    rss_mb: float
    gpu_mb: float | None
    bytes_per_image: dict[str, float]
    reranked_1: tuple[float, float]  # p50, p99 ms
    reranked_many: tuple[float, float]
    dot_1_p50: float
    clients: int
    tiled: str = ""  # "x50 of <version>" for a version benchmarks/startup_scale.py tiled
    # a lone request's mean ms by duet's own clock, per 1-client cell: "request" (the server's
    # whole handling) and its stages (`duet_stage_seconds`)
    lone: dict[str, dict[str, float]] = field(default_factory=dict)


LONE_STAGES = ("request", "cache", "queue", "device", "encode", "search", "rerank", "lookup")


def version_bytes(index_dir: Path, n: int) -> dict[str, float]:
    """Bytes per image of each group of the served version's files."""
    version = (index_dir / "current").resolve()
    return {
        group: sum((version / f).stat().st_size for f in names if (version / f).exists()) / n
        for group, names in FILES.items()
    }


def tiled_from(index_dir: Path) -> str:
    """ "x<times> of <version>" when the served version is a tiled one (a source version
    repeated under new ids, its indexes Flat whatever its size), else ""."""
    manifest = json.loads(((index_dir / "current").resolve() / "manifest.json").read_text())
    tiled = manifest.get("tiled")
    return f"x{tiled['times']} of {tiled['from']}" if isinstance(tiled, dict) else ""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gpu_mb(pid: int) -> float | None:
    """The server's GPU memory (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [
        float(b)
        for a, b in (line.split(",") for line in out.splitlines() if "," in line)
        if int(a) == pid
    ]
    return sum(used) if used else None


def measure(n: int, index_dir: Path, args: argparse.Namespace, pool: LoadPool) -> Row:
    port = 18_000 + n % 10_000
    env = {
        "DUET_INDEX_DIR": str(index_dir),
        "DUET_PORT": str(port),
        "DUET_DEVICE": args.device,
        "DUET_REDIS_URL": "",
        "DUET_INDEX_POLL_S": "0",
    }
    log = Path(args.logs) / f"serve-{n}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "duet.cli", "serve"]
    with server(cmd, env, port, log, timeout=args.start_timeout) as duet:
        cells = {}
        for name, clients, rerank in (
            ("reranked_1", 1, True),
            ("reranked_many", args.clients, True),
            ("dot_1", 1, False),
        ):
            cell = Cell()
            before = stage_totals(duet.url) if clients == 1 else {}
            pool.closed(duet.url, clients, args.seconds, rerank, args.candidates, cell)
            if clients == 1:
                cell.add_stages(before, stage_totals(duet.url))
            cells[name] = cell
        return Row(
            n=n,
            start_s=round(duet.start_s, 1),
            rss_mb=round(rss_mb(duet.proc.pid), 1),
            gpu_mb=gpu_mb(duet.proc.pid),
            bytes_per_image={k: round(v, 1) for k, v in version_bytes(index_dir, n).items()},
            reranked_1=(round(cells["reranked_1"].q(50), 2), round(cells["reranked_1"].q(99), 2)),
            reranked_many=(
                round(cells["reranked_many"].q(50), 2),
                round(cells["reranked_many"].q(99), 2),
            ),
            dot_1_p50=round(cells["dot_1"].q(50), 2),
            clients=args.clients,
            tiled=tiled_from(index_dir),
            lone={
                name: {s: round(cells[name].stage_ms(s), 3) for s in LONE_STAGES}
                for name in ("reranked_1", "dot_1")
            },
        )


def table(rows: list[Row], device: str) -> str:
    c = rows[0].clients if rows else 32
    out = [
        f"Machine: {os.cpu_count()} CPU cores, device {device}, {platform.machine()}; "
        "closed-loop clients, different captions (no cache answers), 50 candidates, top 10.",
        "",
        "| images | start-up s | RSS MB | GPU MB | vectors B/image | tokens B/image | items "
        f"B/image | re-ranked p50 / p99 ms, 1 client | re-ranked p50 / p99 ms, {c} clients "
        "| dot-only p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r.bytes_per_image
        gpu = "-" if r.gpu_mb is None else f"{r.gpu_mb:,.0f}"
        images = f"{r.n:,} (tiled)" if r.tiled else f"{r.n:,}"
        out.append(
            f"| {images} | {r.start_s} | {r.rss_mb:,.0f} | {gpu} | {b['vectors']:,.0f} | "
            f"{b['tokens']:,.0f} | {b['items']:,.0f} | {r.reranked_1[0]} / {r.reranked_1[1]} | "
            f"{r.reranked_many[0]} / {r.reranked_many[1]} | {r.dot_1_p50} |"
        )
    out += lone_table(rows)
    out += [
        f"\n(tiled): {r.n:,} images that are {r.tiled} (`benchmarks/startup_scale.py "
        "--tile-only`): the start-up, memory and request costs of that many rows, vectors and "
        "tokens, with Flat indexes where the builder would write IVF at that size (its "
        "vectors' bytes and RSS are Flat's) and copies of each image, so search quality means "
        "nothing."
        for r in rows
        if r.tiled
    ]
    return "\n".join(out)


def lone_table(rows: list[Row]) -> list[str]:
    """Where a lone request's time went, by duet's own clock (the means of its 1-client
    cells): the server's handling, its stages, and what no stage covers (the hop to the
    process that owns the model and back, the event loops, rendering the answer)."""
    out = [
        "",
        "A lone request by duet's own clock, mean ms (`duet_request_seconds` of /search/*, "
        "`duet_stage_seconds`; the client's p50 beside them; `other`: the server's time no "
        "stage covers):",
        "",
        "| images | mode | client p50 | server | " + " | ".join(LONE_STAGES[1:]) + " | other |",
        "|---|---|---|---|" + "---|" * len(LONE_STAGES),
    ]
    for r in rows:
        for name, mode, p50 in (
            ("reranked_1", "re-ranked", r.reranked_1[0]),
            ("dot_1", "dot only", r.dot_1_p50),
        ):
            got = r.lone.get(name, {})
            if not got:
                continue
            parts = [got.get(s, float("nan")) for s in LONE_STAGES[1:]]
            other = got.get("request", float("nan")) - sum(v for v in parts if v == v)
            out.append(
                f"| {r.n:,} | {mode} | {p50} | {got.get('request', float('nan')):.2f} | "
                + " | ".join(f"{v:.2f}" for v in parts)
                + f" | {other:.2f} |"
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--index",
        action="append",
        required=True,
        metavar="N=DIR",
        help="an index folder and its number of images (repeat: one row each)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--clients", type=int, default=32, help="the loaded row's clients (32)")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds per cell (6)")
    p.add_argument("--candidates", type=int, default=50, help="re-ranked candidates (50)")
    p.add_argument("--procs", type=int, default=1, help="load-generating processes (1)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds (600)")
    p.add_argument("--logs", default="/tmp/duet-scale-serve", help="server logs folder")
    p.add_argument("--json", default="", help="also write the rows here as JSON")
    args = p.parse_args()
    pairs = []
    for spec in args.index:
        n, _, d = spec.partition("=")
        if not d or not n.isdigit():
            p.error(f"--index wants N=DIR, got {spec!r}")
        pairs.append((int(n), Path(d)))
    pool = LoadPool(args.procs, seed=2_100_000)  # held-out world seeds
    try:
        rows = [measure(n, d, args, pool) for n, d in pairs]
    finally:
        pool.close()
    print(table(rows, args.device))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
