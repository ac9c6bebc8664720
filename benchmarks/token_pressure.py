"""Re-ranked latency when the served version does not fit in memory: `duet serve` in a memory
cgroup smaller than its process plus its files, one client, every query a different caption.

A token table larger than the page cache cannot be made by dropping pages from outside (a
page the server has mapped stays); a memory limit on the server's cgroup makes the kernel
reclaim its file pages for real, as it does once the table outgrows the machine. The
version's files are dropped from the page cache first, so what the server reads is charged
to its cgroup. Run it once per code version for an A/B (`--repo` a `git worktree` of the
older commit); needs root and a cgroup memory controller (v1 or v2).

    sudo python benchmarks/token_pressure.py --index-dir /tmp/idx100k --limit-mb 900
    python benchmarks/token_pressure.py --index-dir /tmp/idx100k --repo /tmp/wt-old ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import serve_load
from benchmarks.load_client import Queries
from store.indexio import resolve_current

V1, V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")


def make_cgroup(name: str, limit: int) -> Path:
    """A memory cgroup of `limit` bytes (v1's memory controller, else v2); OSError if none
    can be made here."""
    if (V1 / "memory.limit_in_bytes").exists():
        group = V1 / name
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(limit))
    else:
        group = V2 / name
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(str(limit))
    return group


def drop_from_cache(version: Path) -> None:
    """The version's files out of the page cache (the pages no process has mapped)."""
    for f in version.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(args: argparse.Namespace, group: Path | None) -> dict[str, float]:
    """p50 / p90 / p99 ms of `args.requests` re-ranked searches, after 20 unmeasured ones."""
    repo = Path(args.repo).resolve()
    serve_load.REPO, serve_load.CHILD_PYTHONPATH = repo, str(repo)
    drop_from_cache(resolve_current(args.index_dir))
    env = {
        "DUET_INDEX_DIR": str(args.index_dir),
        "DUET_PORT": str(args.port),
        "DUET_REDIS_URL": "",
        "DUET_INDEX_POLL_S": "0",
        "DUET_DEVICE": "cpu",
        "DUET_LAYOUT": "cpu",
        **dict(kv.split("=", 1) for kv in args.env),
    }
    serve = f"exec {sys.executable} -m duet.cli serve"
    cmd = ["sh", "-c", f"echo $$ > {group}/cgroup.procs; {serve}" if group else serve]
    queries = Queries(5, n=args.requests + 100)
    log = Path("/tmp/duet-token-pressure.log")
    times = []
    with (
        serve_load.server(cmd, env, args.port, log, timeout=600) as duet,
        httpx.Client(base_url=duet.url, timeout=60) as client,
    ):
        for i in range(20 + args.requests):
            body = {"query": queries.next(), "top_k": 10, "candidates": 50}
            t0 = time.perf_counter()
            r = client.post("/search/text", json=body)
            if i >= 20:
                times.append(time.perf_counter() - t0)
            r.raise_for_status()
    ms = np.array(times) * 1e3
    return {f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--index-dir", type=Path, required=True, help="serves INDEX_DIR/current")
    p.add_argument("--repo", default=str(serve_load.REPO), help="the duet checkout to serve")
    p.add_argument("--limit-mb", type=int, default=900, help="the cgroup's memory (0: none)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--port", type=int, default=8411)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for duet serve")
    args = p.parse_args(argv)
    group = None
    if args.limit_mb:
        try:
            group = make_cgroup("duet-token-pressure", args.limit_mb * 2**20)
        except OSError as exc:
            p.error(f"cannot make a memory cgroup here ({exc}): run as root, or --limit-mb 0")
    try:
        got = measure(args, group)
    finally:
        if group is not None:
            time.sleep(0.5)  # the server has exited; its cgroup empties
            group.rmdir()
    limit = f"{args.limit_mb} MB cgroup" if args.limit_mb else "no limit"
    print(
        f"{Path(args.repo).name} ({limit}): re-ranked at 1 client, {args.requests} requests: "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in got.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
