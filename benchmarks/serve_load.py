"""duet serve against the plain FastAPI script (benchmarks/baseline_server.py), side by side.

Starts both servers on one index, then runs closed-loop load (each client sends its next
request when the last one answers; every query is a different caption, so no cache
answers) at each concurrency, re-ranked and dot-only, the two servers interleaved and the
whole grid repeated `--rounds` times so machine noise hits both alike. Also measures, in
the same run, the cross-encoder's pairs/s alone (the model's PyTorch forward and duet's
serving runtime: the compute bound) and an overload run against duet at `--overload`
clients. Writes a markdown report and a plot.

    python benchmarks/serve_load.py                       # CPU, indexes/current
    python benchmarks/serve_load.py --device cuda         # on a GPU host

Nothing else should run on the machine meanwhile; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
# duet's server reads it from the environment; its runtime's figure below uses the same
PRECISION = os.environ.get("DUET_PRECISION") or "auto"
# the repo first, then what this process was given (packages in a --target folder, say)
CHILD_PYTHONPATH = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
sys.path.insert(0, str(REPO))  # the repo's packages and this script's siblings

from benchmarks.cell import Cell  # noqa: E402
from benchmarks.duet_metrics import (  # noqa: E402
    FLUSH_S,
    own_buckets,
    own_quantiles,
    stage_totals,
)
from benchmarks.load_client import (  # noqa: E402
    LoadPool,
    Queries,
    closed_loop,
    overload,
    queries_for,
)
from benchmarks.procstat import CpuSnapshot, add_server_cpu, cpu_seconds  # noqa: E402
from benchmarks.serve_args import MODES, parse  # noqa: E402
from benchmarks.serve_report import write_report  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """A server `server()` started: where it answers, its process, how long it took to."""

    url: str
    proc: subprocess.Popen[bytes]
    start_s: float


@contextmanager
def server(
    cmd: list[str], env: dict[str, str], port: int, log: Path, timeout: float = 120.0
) -> Iterator[Running]:
    """Run `cmd` on `port` (the repo on its PYTHONPATH, output to `log`) until it answers a
    search with 200, then yield it; stopped on the way out."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, **env},
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{' '.join(cmd)} exited:\n{log.read_text()[-3000:]}")
            try:
                r = httpx.post(f"{url}/search/text", json={"query": "a red circle"}, timeout=5)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"{' '.join(cmd)}: no answer on {url} in {timeout:.0f} s")
            time.sleep(0.05)
        yield Running(url, proc, time.monotonic() - t0)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def pairs_per_second(
    index_dir: Path, device: str, candidates: int, seconds: float = 3.0
) -> dict[str, float]:
    """The cross-encoder alone, one request's pairs at a time: the model's PyTorch forward
    and duet's serving runtime (the same logits)."""
    import torch

    from models.builtin import BuiltinModel
    from models.inference import PrecisionChoice
    from store.indexio import IndexVersion, resolve_current

    model = BuiltinModel.load(device=device, precision=cast(PrecisionChoice, PRECISION))
    index = IndexVersion.open(resolve_current(index_dir))
    toks = np.array(index.image_tokens[:candidates], dtype=np.float32)
    q = "a small red circle left of a large blue square"
    ids, pad = model.tokenizer.batch([q])
    ids, pad = ids.to(model.device), pad.to(model.device)
    img = torch.from_numpy(toks).to(model.device)
    out = {}
    with torch.inference_mode():
        text = model.model.text_tokens(ids, pad)

        def forward() -> None:
            model.model.itm_logits(text.expand(len(toks), -1, -1), pad.expand(len(toks), -1), img)

        def runtime() -> None:
            model.score_pairs([q] * len(toks), toks)

        host = "duet runtime (the host path's `score_pairs`)"
        for name, fn in (("pytorch forward", forward), (host, runtime)):
            fn()
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn()
                n += 1
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            out[name] = n * len(toks) / (time.perf_counter() - t0)
    index.close()
    return out


def run_grid(
    urls: dict[str, str],
    args: argparse.Namespace,
    levels: list[int],
    queries: Queries,
    results: dict[str, Cell],
    pool: LoadPool | None = None,
    pids: dict[str, int] | None = None,
) -> None:
    """Closed-loop load on every (mode, clients, server) cell, `--rounds` times, the servers'
    order swapped each round (the clients spread over `pool`'s processes when given); adds
    to `results`, with the CPU each server (`pids`) and the load generator spent, and prints
    each cell as it ends."""
    for rnd in range(args.rounds):
        order = [s for s in ("duet", "baseline") if s in urls]
        order = order if rnd % 2 == 0 else order[::-1]
        for mode, rerank in MODES:
            if mode not in args.modes:
                continue
            for c in levels:
                for srv in order:
                    cell = results.setdefault(f"{srv}|{mode}|{c}", Cell())
                    pid = (pids or {}).get(srv)
                    told = srv == "duet" and c == 1  # where a lone request's time goes
                    stages0 = stage_totals(urls[srv]) if told else {}
                    before = cpu_seconds(pid) if pid else CpuSnapshot()
                    load0, wall0 = time.process_time(), time.monotonic()
                    if pool is not None:
                        pool.closed(urls[srv], c, args.seconds, rerank, args.candidates, cell)
                    else:
                        asyncio.run(
                            closed_loop(
                                urls[srv], c, args.seconds, rerank, args.candidates, queries, cell
                            )
                        )
                        cell.add_cpu("load", time.process_time() - load0)
                    cell.wall += time.monotonic() - wall0
                    if pid:
                        add_server_cpu(cell, before, cpu_seconds(pid), pid)
                    if told:
                        cell.add_stages(stages0, stage_totals(urls[srv]))
                    print(
                        f"round {rnd + 1} {mode:9s} c={c:3d} {srv:8s} "
                        f"{cell.throughput:6.1f}/s p50 {cell.q(50):7.1f} ms "
                        f"(cores: {cell.cores('server'):.2f} server, "
                        f"{cell.cores('server loop'):.2f} its loop, "
                        f"{cell.cores('server wire'):.2f} its wire, "
                        f"{cell.cores('engine max'):.2f} its engine, "
                        f"{cell.cores('fronts'):.2f} fronts, {cell.cores('load'):.2f} load)",
                        flush=True,
                    )


def run_open_loop(
    urls: dict[str, str], args: argparse.Namespace, queries: Queries, pool: LoadPool | None
) -> dict[str, Cell]:
    """Each --open-loop rate against each server (re-ranked); the cells by "server|rate"."""
    from benchmarks.load_client import open_loop

    out: dict[str, Cell] = {}
    for rate in [float(r) for r in args.open_loop.split(",") if r]:
        for srv, url in urls.items():
            cell = out.setdefault(f"{srv}|{rate:g}", Cell())
            own: list[dict[str, dict[float, float]]] = []
            if srv == "duet":  # duet's histograms once the loop's warm-up second is over
                lead = 1.0 + (LoadPool.LEAD if pool is not None else 0.0)
                reading = threading.Timer(lead, lambda u=url, o=own: o.append(own_buckets(u)))
                reading.start()
            if pool is not None:
                pool.open(url, rate, args.seconds, True, args.candidates, cell)
            else:
                asyncio.run(
                    open_loop(url, rate, args.seconds, True, args.candidates, queries, cell)
                )
                cell.seconds += args.seconds
            if srv == "duet":  # duet's own clock: bucket bounds of its histograms' quantiles
                reading.join()
                time.sleep(2 * FLUSH_S)  # the fronts send their observations every FLUSH_S
                if own:
                    cell.own = own_quantiles(own[0], own_buckets(url))
            print(
                f"offered {rate:g}/s {srv:8s} answered {cell.throughput:6.1f}/s "
                f"p50 {cell.q(50):7.1f} ms p99 {cell.q(99):7.1f} ms 429 {cell.refused} "
                f"errors {cell.errors} late {cell.late} own {cell.own}",
                flush=True,
            )
    return out


def _commands(
    args: argparse.Namespace, duet_port: int, base_port: int
) -> tuple[list[str], dict[str, str], list[str]]:
    """duet's command and settings, and the plain script's command."""
    duet_cmd = [sys.executable, "-m", "duet.cli", "serve"]
    duet_env = {
        "DUET_INDEX_DIR": str(args.index_dir),
        "DUET_PORT": str(duet_port),
        "DUET_DEVICE": args.device,
        "DUET_INDEX_POLL_S": "0",
        "DUET_REDIS_URL": "",
        "DUET_LOG_LEVEL": "info",  # start-up figures and warnings, for gpu_check.sh's log
        **dict(kv.split("=", 1) for kv in args.duet_env.split(",") if kv),
        **({"DUET_RERANKER": str(args.reranker)} if args.reranker else {}),
    }
    base_cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "baseline_server.py"),
        "--index",
        str((args.index_dir / "current").resolve()),
        "--port",
        str(base_port),
        "--device",
        args.device,
        *(["--reranker", str(args.reranker)] if args.reranker else []),
    ]
    return duet_cmd, duet_env, base_cmd


def main() -> None:
    """Measure the compute bound, run the grid and the overload, write the report."""
    args = parse(__doc__.splitlines()[0])
    levels = [int(c) for c in args.concurrency.split(",")]
    logs = Path(os.environ.get("TMPDIR", "/tmp"))

    bound: dict[str, float] = {}
    # the builtin cross-encoder's figure (a sentence's pairs: the text route's)
    if not args.skip_bound and args.reranker is None and args.route == "text":
        print("cross-encoder alone ...", flush=True)
        bound = pairs_per_second(
            args.index_dir, args.device, args.candidates, min(3.0, args.seconds)
        )
    queries = queries_for(args.route, seed=2_000_000)
    results: dict[str, Cell] = {}
    duet_port, base_port = _free_port(), _free_port()
    duet_cmd, duet_env, base_cmd = _commands(args, duet_port, base_port)
    baseline = (
        contextlib.nullcontext(None)
        if args.no_baseline
        else server(base_cmd, {}, base_port, logs / "baseline-serve-load.log")
    )
    with (
        server(duet_cmd, duet_env, duet_port, logs / "duet-serve-load.log") as duet,
        baseline as base,
    ):
        urls = {"duet": duet.url} | ({} if base is None else {"baseline": base.url})
        pool = LoadPool(args.procs, 2_000_000, route=args.route) if args.procs > 1 else None
        over = None
        try:
            pids = {"duet": duet.proc.pid} | ({} if base is None else {"baseline": base.proc.pid})
            for name, url in urls.items() if args.warm_up > 0 else ():  # nothing counted
                print(f"warm-up: {args.warm_up:g} s of re-ranked load on {name} ...", flush=True)
                asyncio.run(
                    closed_loop(url, 8, 0.0, True, args.candidates, queries, Cell(), args.warm_up)
                )
            run_grid(urls, args, levels, queries, results, pool, pids)
            if args.overload:
                print(f"overload: {args.overload} clients against duet ...", flush=True)
                over = asyncio.run(
                    overload(duet.url, args.overload, 3 * args.seconds, args.candidates, queries)
                )
            # last: a server far below the offered rate goes on working through the requests
            # the open loop abandoned, and would load the machine under whatever came next
            offered = run_open_loop(urls, args, queries, pool)
        finally:
            if pool is not None:
                pool.close()
    write_report(args, levels, results, bound, over, offered)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
