"""Memory and latency of a `duet serve` process across a zero-downtime index swap.

    .venv/bin/python benchmarks/swap_memory.py --index-dir indexes

Starts `duet serve` on INDEX_DIR (current must exist), warms it with searches, copies the current
version to a new directory (`<version>-swapcopy`, same files, new version name), points
`current` at it and calls POST /admin/reload while a client keeps searching and a sampler reads
VmRSS / RssAnon / RssFile from /proc/PID/status every 5 ms. Prints RSS before, peak during and
after the swap, the swap's wall time and search latency before vs during the swap (same run).
Afterwards `current` points at the original version again and the copy is removed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from models import world
from store.indexio import Manifest, point_current, resolve_current

REPO = Path(__file__).resolve().parent.parent
# the repo first, then what this process was given (packages in a --target folder, say)
CHILD_PYTHONPATH = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
FIELDS = ("VmRSS", "RssAnon", "RssFile")


def rss(pid: int) -> dict[str, int]:
    """Resident set sizes in MiB from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0]) // 1024
    return out


def start(index_dir: Path, port: int, token: str) -> subprocess.Popen[bytes]:
    """Start `duet serve` on `index_dir` and wait until it is ready."""
    env = {
        **os.environ,
        "DUET_INDEX_DIR": str(index_dir),
        "DUET_PORT": str(port),
        "DUET_ADMIN_TOKEN": token,
        "DUET_INDEX_POLL_S": "0",
        "PYTHONPATH": CHILD_PYTHONPATH,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "duet.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("duet serve did not become ready")


def copy_version(original: Path, copy: Path) -> Manifest:
    """Copy a version's files to `copy` under a new version name; its manifest."""
    shutil.copytree(original, copy)
    manifest = replace(Manifest.read(copy), version=copy.name)
    manifest.write(copy)
    return manifest


def print_summary(
    original: Path,
    manifest: Manifest,
    result: object,
    swap_s: float,
    before: dict[str, int],
    samples: list[dict[str, int]],
    after: dict[str, int],
) -> None:
    """The index's size, the swap's answer and time, and the RSS table."""
    files = sum(f.stat().st_size for f in original.iterdir()) // 2**20
    faiss_mib = sum((original / n).stat().st_size for n in ("image.faiss", "text.faiss")) // 2**20
    print(
        f"index {original.name}: {asdict(manifest.counts)}, files {files} MiB "
        f"(FAISS {faiss_mib} MiB); swap answered {result} in {swap_s:.2f} s"
    )
    print("| RSS MiB | before | peak during | after 2 s |\n|---|---|---|---|")
    for f in FIELDS:
        print(f"| {f} | {before[f]} | {max(s[f] for s in samples)} | {after[f]} |")


def print_latencies(latencies: dict[str, list[float]]) -> None:
    """Search p50 during the swap against before it."""
    during, base = latencies["during"], statistics.median(latencies["before"])
    if during:
        p50 = statistics.median(during)
        print(
            f"searches that ended during the swap: {len(during)}, p50 {p50:.1f} ms vs "
            f"{base:.1f} ms before (ratio {p50 / base:.2f})"
        )
    else:
        print(f"no search ended during the swap; p50 before {base:.1f} ms")


def main() -> None:
    """Serve, swap the index under load, print memory and latency around the swap."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index-dir", type=Path, required=True)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--warmup", type=int, default=40, help="searches before measuring")
    args = p.parse_args()

    original = resolve_current(args.index_dir)
    copy = original.parent / f"{original.name}-swapcopy"
    token = secrets.token_hex(8)
    proc = start(args.index_dir, args.port, token)
    queries = [c for s in world.generate(2000, seed=515, n_captions=1) for c in s.captions]
    latencies: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    phase = ["before"]
    stop = threading.Event()
    samples: list[dict[str, int]] = []

    def search_loop(client: httpx.Client) -> None:
        for i, q in enumerate(queries):
            if stop.is_set():
                return
            t0 = time.perf_counter()
            r = client.post("/search/text", json={"query": q, "top_k": 10, "candidates": 50})
            r.raise_for_status()
            if i >= args.warmup:
                latencies[phase[0]].append((time.perf_counter() - t0) * 1000)

    def sample_loop() -> None:
        while not stop.is_set():
            samples.append(rss(proc.pid))
            time.sleep(0.005)

    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=60) as client:
            manifest = copy_version(original, copy)
            searcher = threading.Thread(target=search_loop, args=(client,))
            searcher.start()
            while len(latencies["before"]) < 60:
                time.sleep(0.05)
            before = rss(proc.pid)
            sampler = threading.Thread(target=sample_loop)
            sampler.start()
            point_current(args.index_dir, copy.name)
            phase[0] = "during"
            t0 = time.perf_counter()
            r = client.post("/admin/reload", headers={"authorization": f"Bearer {token}"})
            swap_s = time.perf_counter() - t0
            phase[0] = "after"
            time.sleep(2.0)
            stop.set()
            searcher.join()
            sampler.join()
            after = rss(proc.pid)
            r.raise_for_status()
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=30)
        point_current(args.index_dir, original.name)
        shutil.rmtree(copy, ignore_errors=True)

    print_summary(original, manifest, r.json()["result"], swap_s, before, samples, after)
    print_latencies(latencies)


if __name__ == "__main__":
    main()
