"""How `duet serve`'s start-up grows with the index: a version tiled N times, served from
process start to its first answered search, side by side with the version itself.

Start-up at scale is mostly proving the version whole (`IndexVersion.verify`: every file's
sha256, every item row, every stored vector), so what it costs per item needs a large
version, not a large corpus: the tiled version repeats the source's vectors, tokens and
rows `--times` times (new ids; the manifest's counts and hashes rewritten), which costs
seconds where building 100k images costs a quarter of an hour on 2 cores. Search quality
over the copies means nothing; the start-up's work per row is the real one. Each `--repo`
(e.g. a `git worktree` of an older commit) is started on both versions, interleaved, for
`--rounds` rounds.

    python benchmarks/startup_scale.py                     # the demo version, 50 times
    python benchmarks/startup_scale.py --repo /tmp/wt-old --repo .
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import serve_load
from store.files import file_sha256
from store.indexio import resolve_current


def _copy_rows(src: sqlite3.Connection, dst: sqlite3.Connection, times: int) -> tuple[int, int]:
    """The item tables repeated `times` times, each copy's ids (and caption image ids) made
    new by a suffix; (images, texts) per copy."""
    for (sql,) in src.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL"):
        dst.execute(sql)
    images = src.execute("SELECT row, id, path, meta FROM images ORDER BY row").fetchall()
    texts = src.execute("SELECT row, id, text, image_id, meta FROM texts ORDER BY row").fetchall()
    for k in range(times):
        dst.executemany(
            "INSERT INTO images VALUES (?, ?, ?, ?)",
            [(r + k * len(images), f"{i}~{k}", p, m) for r, i, p, m in images],
        )
        dst.executemany(
            "INSERT INTO texts VALUES (?, ?, ?, ?, ?)",
            [
                (r + k * len(texts), f"{i}~{k}", t, None if im is None else f"{im}~{k}", m)
                for r, i, t, im, m in texts
            ],
        )
    dst.commit()
    return len(images), len(texts)


def tile(source: Path, times: int, out: Path) -> Path:
    """OUT/current: `source` (a version folder) repeated `times` times; kept between runs."""
    manifest = json.loads((source / "manifest.json").read_text())
    name = f"{manifest['version']}-x{times}"
    if (out / name / "manifest.json").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    dst = out / name
    dst.mkdir(parents=True)
    for kind in ("image", "text"):
        vectors = np.tile(np.load(source / f"{kind}_vectors.npy"), (times, 1))
        np.save(dst / f"{kind}_vectors.npy", vectors)
        flat = faiss.IndexFlatIP(vectors.shape[1])
        flat.add(vectors)
        faiss.write_index(flat, str(dst / f"{kind}.faiss"))
    tokens = np.load(source / "image_tokens.npy", mmap_mode="r")
    np.save(dst / "image_tokens.npy", np.tile(np.asarray(tokens), (times, 1, 1)))
    with (
        sqlite3.connect(source / "items.sqlite") as src,
        sqlite3.connect(dst / "items.sqlite") as items,
    ):
        n_images, n_texts = _copy_rows(src, items, times)
    src.close()
    items.close()
    manifest["tiled"] = {"from": manifest["version"], "times": times}  # kept, not read
    manifest["version"] = name
    manifest["counts"] = {"images": n_images * times, "texts": n_texts * times}
    for kind in ("image", "text"):
        manifest["indexes"][kind]["count"] = manifest["counts"][f"{kind}s"]
    manifest["files"] = {f: file_sha256(dst / f) for f in manifest["files"]}
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    os.symlink(name, out / "current")
    return out


def started(repo: Path, index_dir: Path, port: int) -> float:
    """Seconds from starting `duet serve` (the code in `repo`) to its first answered search."""
    serve_load.REPO, serve_load.CHILD_PYTHONPATH = repo, str(repo)
    env = {
        "DUET_INDEX_DIR": str(index_dir),
        "DUET_PORT": str(port),
        "DUET_REDIS_URL": "",
        "DUET_INDEX_POLL_S": "0",
        "DUET_DEVICE": "cpu",
        "DUET_LAYOUT": "cpu",
    }
    cmd = [sys.executable, "-m", "duet.cli", "serve"]
    log = Path(f"/tmp/duet-startup-{port}.log")
    with serve_load.server(cmd, env, port, log, timeout=900) as duet:
        return duet.start_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--index-dir",
        type=Path,
        default=serve_load.REPO / "indexes",
        help="the source version: INDEX_DIR/current (default: the demo index)",
    )
    ap.add_argument("--times", type=int, default=50, help="copies of the source version")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("/tmp/duet-startup-tiled"),
        help="where the tiled version is written (kept for the next run)",
    )
    ap.add_argument(
        "--repo",
        action="append",
        type=Path,
        help="a tree whose `duet serve` is timed (repeatable; default this one)",
    )
    ap.add_argument(
        "--tile-only",
        action="store_true",
        help="write the tiled version to --out and stop (scale_serve's million row on a GPU "
        "host without the million-image build: benchmarks/gpu_check.sh, step scale-tiled)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8396)
    args = ap.parse_args()
    source = resolve_current(args.index_dir)
    tiled = tile(source, args.times, args.out)
    if args.tile_only:
        print(f"tiled {source} {args.times} times: {resolve_current(tiled)}")
        return
    repos = [r.resolve() for r in (args.repo or [serve_load.REPO])]
    sizes = {"source": args.index_dir, "tiled": tiled}
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for repo in repos:
            for size, index_dir in sizes.items():
                got.setdefault((str(repo), size), []).append(started(repo, index_dir, args.port))
    n = json.loads((source / "manifest.json").read_text())["counts"]["images"]
    print(f"source {n} images, tiled {n * args.times}; seconds to the first answer, each round")
    print("| tree | source | tiled | per extra image (median) |\n|---|---|---|---|")
    for repo in repos:
        small, big = got[(str(repo), "source")], got[(str(repo), "tiled")]
        per = (statistics.median(big) - statistics.median(small)) / (n * (args.times - 1))
        rounds = " / ".join(f"{s:.2f}" for s in small), " / ".join(f"{s:.2f}" for s in big)
        print(f"| {repo} | {rounds[0]} | {rounds[1]} | {per * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
