"""What reading one re-rank's image states costs once the token table is not in the page cache.

A re-rank reads `--rows` random rows (4 KB each in fp16) of a version's memory-mapped
`image_tokens.npy`. Each trial draws new rows and reads them two ways, the table's pages
either left in the page cache or dropped from it first (POSIX_FADV_DONTNEED: what a table
larger than the page cache looks like to most requests):

- plain: `np.asarray(table[rows])`, the gather before issue 38;
- announced: `store.tokens.gather`, the rows' byte ranges announced with
  POSIX_FADV_WILLNEED first (what the service does).

    python benchmarks/token_reads.py indexes/current
    python benchmarks/token_reads.py /tmp/idx100k/current --rows 50 --trials 60

Linux only (posix_fadvise). Nothing else should read the file meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import tokens
from store.indexio import IMAGE_TOKENS


def measure(path: Path, rows: int, trials: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """p50 / p90 ms per read, by way and cache state."""
    table = np.load(path, mmap_mode="r")
    fd = tokens.open_hints(path)
    if fd is None:
        raise SystemExit("this platform has no posix_fadvise: nothing to measure")
    rng = np.random.default_rng(seed)
    ways = {
        "plain": lambda r: np.asarray(table[r]),
        "announced": lambda r: tokens.gather(table, r, fd),
    }
    times: dict[str, list[float]] = {f"{w} {c}": [] for w in ways for c in ("cached", "dropped")}
    try:
        for _ in range(trials):
            for way, read in ways.items():  # interleaved: noise hits both alike
                for cache in ("cached", "dropped"):
                    r = np.sort(rng.choice(len(table), min(rows, len(table)), replace=False))
                    if cache == "dropped":
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    else:
                        read(r)
                    t0 = time.perf_counter()
                    got = read(r)
                    times[f"{way} {cache}"].append(time.perf_counter() - t0)
                    assert got.shape[0] == len(r)
    finally:
        tokens.close_hints(fd)
    return {
        k: {"p50_ms": float(np.median(v) * 1e3), "p90_ms": float(np.quantile(v, 0.9) * 1e3)}
        for k, v in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("table", type=Path, help=f"a version folder or its {IMAGE_TOKENS}")
    p.add_argument("--rows", type=int, default=50, help="rows per read (a re-rank's candidates)")
    p.add_argument("--trials", type=int, default=60)
    args = p.parse_args(argv)
    path = args.table / IMAGE_TOKENS if args.table.is_dir() else args.table
    n = len(np.load(path, mmap_mode="r"))
    got = measure(path, args.rows, args.trials)
    print(f"{path}: {n:,} rows, {path.stat().st_size / 1e6:,.0f} MB; {args.rows} random rows")
    print("| read | cache | p50 ms | p90 ms |\n|---|---|---|---|")
    for key, v in got.items():
        way, cache = key.split()
        print(f"| {way} | {cache} | {v['p50_ms']:.3f} | {v['p90_ms']:.3f} |")
    for cache in ("cached", "dropped"):
        ratio = got[f"plain {cache}"]["p50_ms"] / got[f"announced {cache}"]["p50_ms"]
        print(f"{cache}: plain / announced p50 = {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
