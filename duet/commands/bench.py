"""`duet bench`: how fast a running duet answers, measured from outside as a client sees it.

Closed-loop load (each client sends its next search when the last one is answered) at each
number of clients, re-ranked and dot-only, every query a different sentence (no answer from
the cache unless the queries run out, which the table counts), and what the service's own
`/metrics` says its time went to. It measures any deployment it can reach (docker compose,
Kubernetes, `duet serve` on a GPU host); the side-by-side against a plain FastAPI script is
`benchmarks/serve_load.py`, in the repository.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from duet.commands.bench_report import print_cells
from duet.commands.common import HelpFormatter, fail, load_settings

MODES = {"reranked": True, "dot": False}
MAX_QUERIES = 500_000  # read from the index's captions at most: more than a run sends


def add(sub: Any) -> None:
    """bench"""
    b = sub.add_parser(
        "bench",
        formatter_class=HelpFormatter,
        help="measure a running service: req/s, p50 and p99 per number of clients",
        description="Closed-loop load against a running duet: each client sends its next "
        "POST /search/text when the last is answered, for --seconds after --warmup, at each "
        "number of --clients, re-ranked and dot-only. Every query is a different sentence "
        "(the served index's own captions, read from DUET_INDEX_DIR, or --queries FILE), so "
        "the cache answers none unless they run out (the table's `cached`). Prints req/s, "
        "p50 and p99 of the answers, 429s and errors, the load generator's share of a core, "
        "and the service's mean time per stage from its /metrics. Run it where nothing else "
        "is busy: its client shares the machine with the service when both run there.",
        epilog="examples:\n\n  duet bench     # the service on 127.0.0.1:$DUET_PORT\n"
        "  duet bench --url http://gpu-host:8000 --queries queries.txt --clients 1,32\n"
        "  docker compose exec api duet bench --seconds 20   # api-cpu on a CPU host",
    )
    b.add_argument(
        "--url", help="the service (default http://127.0.0.1:$DUET_PORT, DUET_PORT 8000)"
    )
    b.add_argument(
        "--clients", default="1,8,32", help="numbers of concurrent clients, comma-separated"
    )
    b.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    b.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each")
    b.add_argument(
        "--modes", default="reranked,dot", help="reranked (rerank: true), dot (rerank: false)"
    )
    b.add_argument("--candidates", type=int, default=50, help="candidates a search re-ranks")
    b.add_argument("--top-k", type=int, default=10, help="hits per answer")
    b.add_argument(
        "--queries",
        type=Path,
        help="a text file of queries, one per line (default: the captions of "
        "DUET_INDEX_DIR/current, shuffled)",
    )
    b.add_argument("--index-dir", type=Path, help="where the captions are (DUET_INDEX_DIR)")
    b.add_argument(
        "--seed",
        type=int,
        default=None,
        help="order of the queries (default: a new one each run; the cache keeps what an "
        "earlier run asked, and answers it again)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object, no tables")
    b.set_defaults(fn=cmd_bench)


@dataclass
class Cell:
    """One (mode, clients) run's figures."""

    mode: str
    clients: int
    seconds: float
    latencies: list[float] = field(default_factory=list)  # answered 200s, seconds
    cached: int = 0
    degraded: int = 0
    refused: int = 0  # 429
    errors: Counter[str] = field(default_factory=Counter)  # other statuses, failed connections
    client_cpu: float = 0.0  # the load generator's share of one core
    stages: dict[str, float] = field(default_factory=dict)  # the service's mean ms per stage

    def q(self, p: float) -> float:
        """The p-th percentile of the answers' latency, ms (numpy's, interpolated: as the
        benchmark scripts' `Cell.q`)."""
        import numpy as np

        return float(np.percentile(self.latencies, p) * 1000) if self.latencies else math.nan

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "clients": self.clients,
            "req_per_s": round(len(self.latencies) / self.seconds, 1),
            "p50_ms": None if not self.latencies else round(self.q(50), 2),
            "p99_ms": None if not self.latencies else round(self.q(99), 2),
            "answered": len(self.latencies),
            "cached": self.cached,
            "degraded": self.degraded,
            "refused_429": self.refused,
            "errors": dict(self.errors),
            "client_cpu": round(self.client_cpu, 2),
            "stages_ms": {k: round(v, 3) for k, v in self.stages.items()},
        }


def cmd_bench(args: argparse.Namespace) -> int:
    import httpx

    problem = _problem(args)
    if problem:
        return fail(problem)
    settings = load_settings(index_dir=args.index_dir)
    url = (args.url or f"http://127.0.0.1:{settings.port}").rstrip("/")
    parts = urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:  # a port that is no number
        port = 0
    if not port or parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        return fail(f"--url {url!r}: give http://HOST:PORT (no path; https is not measured)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6
    url = f"http://{host}:{port}"
    try:
        ready = httpx.get(f"{url}/readyz", timeout=10)
    except httpx.HTTPError as exc:
        return fail(f"{url} does not answer ({exc}): start the service, or give --url")
    if ready.status_code != 200:
        return fail(f"{url}/readyz answered {ready.status_code}: the service is not ready yet")
    info = ready.json()
    queries = _queries(args.queries, args.index_dir or settings.index_dir, args.seed)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:  # one search each, before the load: options it refuses, told once
        asked = {"query": queries.texts[-1], "top_k": args.top_k, "rerank": MODES[mode]}
        if MODES[mode]:
            asked["candidates"] = args.candidates
        said = httpx.post(f"{url}/search/text", json=asked, timeout=60)
        if 400 <= said.status_code < 500 and said.status_code != 429:
            why = said.json().get("error", {}).get("message", said.text[:200])
            return fail(
                f"a {mode} search with these options was refused ({said.status_code}): {why}"
            )
    clients = [int(c) for c in args.clients.split(",")]
    say = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    say(
        f"{url}: model {info.get('model')}, index {info.get('index_version')} "
        f"({info.get('items', {}).get('images')} images), cache {info.get('cache')}; "
        f"{len(queries.texts):,} different queries"
    )
    cells: list[Cell] = []
    try:
        for mode in modes:
            for n in clients:
                plural = "s" if n > 1 else ""
                say(f"{mode}, {n} client{plural}: {args.warmup:g} + {args.seconds:g} s")
                cells.append(_cell(url, mode, n, args, queries))
    except (httpx.HTTPError, OSError) as exc:  # the service went away: what was measured
        print_cells(url, info, cells, args.json)
        return fail(f"{url} stopped answering ({exc}); the cells above were measured before")
    except KeyboardInterrupt:
        print_cells(url, info, cells, args.json)
        raise
    print_cells(url, info, cells, args.json)
    return 0


def _problem(args: argparse.Namespace) -> str | None:
    """Why the options cannot be run, or None: told before any request."""
    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        return f"--clients {args.clients!r}: give whole numbers, comma-separated (1,8,32)"
    if not clients or min(clients) < 1:
        return "--clients: each number of clients must be at least 1"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        return "--modes names no mode; give reranked, dot or both"
    if unknown := [m for m in modes if m not in MODES]:
        return f"--modes: {', '.join(unknown)} is no mode; give reranked, dot or both"
    if not args.seconds > 0 or not args.warmup >= 0:
        return "--seconds must be more than 0 and --warmup 0 or more"
    if args.candidates < 1 or args.top_k < 1:
        return "--candidates and --top-k must be at least 1"
    return None


class Queries:
    """Each query once, in order; past the last, the first again (and the cache may answer:
    the table counts those answers)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self._it: Iterator[str] = iter(texts)

    def next(self) -> str:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.texts)
            return next(self._it)


def _queries(path: Path | None, index_dir: Path, seed: int | None) -> Queries:
    """--queries' lines, or the captions of the served index version, shuffled by `seed`
    (None: a new order each run)."""
    from models.errors import UserError
    from store.indexio import ITEMS, IndexLoadError, version_dir
    from store.items import ItemStore

    if path is not None:
        try:
            lines = path.read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeError) as exc:
            raise UserError(f"--queries {path}: cannot read it ({exc})") from exc
        texts = list(dict.fromkeys(ln.strip() for ln in lines if ln.strip()))
        if not texts:
            raise UserError(f"--queries {path} has no query (one per line)")
        random.Random(seed).shuffle(texts)
        return Queries(texts)
    try:
        store = ItemStore(version_dir(index_dir) / ITEMS)
        try:
            captions = list(itertools.islice(store.all_texts(), MAX_QUERIES))
        finally:
            store.close()
    except (IndexLoadError, sqlite3.Error) as exc:
        raise UserError(
            f"no captions to ask with in {index_dir} ({exc}): give --queries FILE, one query "
            "a line, or --index-dir (DUET_INDEX_DIR) where the served index is"
        ) from exc
    texts = list(dict.fromkeys(c for c in captions if c and len(c.split()) <= 30))
    if not texts:
        raise UserError(f"the index in {index_dir} has no captions: give --queries FILE")
    random.Random(seed).shuffle(texts)
    return Queries(texts)


def _cell(url: str, mode: str, clients: int, args: argparse.Namespace, q: Queries) -> Cell:
    """One (mode, clients) run: the warm-up, unmeasured; then `args.seconds` measured, the
    service's stage times read around them once its fronts have sent theirs."""
    from duet.loadgen import stage_totals

    cell = Cell(mode, clients, args.seconds)
    options = {"top_k": args.top_k, "rerank": MODES[mode]}
    if MODES[mode]:
        options["candidates"] = args.candidates

    def body() -> bytes:
        return json.dumps({"query": q.next(), **options}).encode()

    if args.warmup > 0:
        asyncio.run(_load(url, clients, args.warmup, body, None))
    before = stage_totals(url)
    wall, cpu = time.perf_counter(), time.process_time()
    asyncio.run(_load(url, clients, args.seconds, body, cell))
    # the client's CPU over the window it ran, its last answers' tails included
    cell.client_cpu = (time.process_time() - cpu) / (time.perf_counter() - wall)
    for stage, (total, n) in stage_totals(url).items():
        was_total, was_n = before.get(stage, (0.0, 0.0))
        if n > was_n:
            cell.stages[stage] = 1000 * (total - was_total) / (n - was_n)
    return cell


async def _load(
    url: str, clients: int, seconds: float, body: Callable[[], bytes], cell: Cell | None
) -> None:
    """`clients` closed loops for `seconds`; each answer counted in `cell` (None: a warm-up).
    A 429 is waited out as its Retry-After says (at most 1 s), measured or not."""
    from duet.loadgen import Conn

    t_end = time.perf_counter() + seconds

    async def one() -> None:
        conn = Conn(url)
        try:
            while (now := time.perf_counter()) < t_end:
                try:
                    status, headers, data = await conn.request("POST", "/search/text", body())
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    conn.close()  # a reply not read to its end leaves the connection unusable
                    if cell is not None:
                        cell.errors[
                            str(exc) if isinstance(exc, ValueError) else type(exc).__name__
                        ] += 1
                    await asyncio.sleep(0.05)
                    continue
                done = time.perf_counter()
                if status == 429:
                    if cell is not None:
                        cell.refused += 1
                    await asyncio.sleep(min(1.0, float(headers.get("retry-after", "1"))))
                elif cell is None:
                    continue
                elif status != 200:
                    cell.errors[str(status)] += 1
                elif b'"degraded":true' in data:  # fewer candidates re-ranked: not a full answer
                    cell.degraded += 1
                else:
                    cell.latencies.append(done - now)
                    cell.cached += b'"cached":true' in data
        finally:
            conn.close()

    await asyncio.gather(*(one() for _ in range(clients)))
