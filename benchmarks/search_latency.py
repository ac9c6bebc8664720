"""Warm latency of POST /search/text against a running duet, with and without re-rank.

    .venv/bin/python benchmarks/search_latency.py --url http://127.0.0.1:8000 --requests 200

Every request carries a different caption (so the cache never answers), the two
modes are interleaved in one loop (so machine noise hits both alike), and the
result is reported as p50/p90/p99 per mode plus the re-rank/dot ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from models import world


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=200, help="per mode")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--candidates", type=int, default=50)
    p.add_argument("--top-k", type=int, default=10)
    args = p.parse_args()

    n = args.requests + args.warmup
    queries = [c for s in world.generate(n, seed=4242, n_captions=2) for c in s.captions]
    times: dict[bool, list[float]] = {True: [], False: []}
    with httpx.Client(base_url=args.url, timeout=30) as client:
        for i in range(n):
            for rerank in (True, False):
                body = {
                    "query": queries[2 * i + rerank],
                    "top_k": args.top_k,
                    "candidates": args.candidates,
                    "rerank": rerank,
                }
                t0 = time.perf_counter()
                r = client.post("/search/text", json=body)
                dt = (time.perf_counter() - t0) * 1000
                r.raise_for_status()
                if r.json()["cached"]:
                    raise SystemExit("a request was answered from the cache; restart the service")
                if i >= args.warmup:
                    times[rerank].append(dt)

    def q(xs: list[float], p: float) -> float:
        return statistics.quantiles(xs, n=100)[int(p) - 1]

    print(f"{args.requests} requests per mode, candidates={args.candidates}, top_k={args.top_k}")
    print("| mode | p50 ms | p90 ms | p99 ms |\n|---|---|---|---|")
    for rerank, label in ((False, "dot only"), (True, "re-ranked")):
        xs = times[rerank]
        print(f"| {label} | {statistics.median(xs):.1f} | {q(xs, 90):.1f} | {q(xs, 99):.1f} |")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"re-ranked / dot-only p50 ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
