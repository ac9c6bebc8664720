"""The serving benchmark compares like with like: the baseline script ranks exactly as duet's
default does (same model, same index, the default ADD_λ), and the benchmark runs end to end."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from app.main import create_app
from benchmarks.baseline_server import make_app
from store.indexio import resolve_current
from tests.conftest import REPO


def _run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/`script` with `args`, from the repo, as a user runs it; it must succeed."""
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res


async def _hits(app: Any, path: str, body: dict[str, object]) -> list[tuple[str, float]]:
    """`app`'s hits for one search, as (id, score to 4 places)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
        r = await c.post(path, json=body)
    assert r.status_code == 200, r.text
    return [(h["id"], round(h["score"], 4)) for h in r.json()["hits"]]


async def test_baseline_script_ranks_as_duet_does(index_dir: Path) -> None:
    baseline = make_app(resolve_current(index_dir))
    duet = create_app(Settings(index_dir=index_dir, index_poll_s=0))
    queries = ["a red circle above a small blue square", "two green crosses", "a big diamond"]
    async with duet.router.lifespan_context(duet):
        for rerank in (True, False):
            for q in queries:
                body = {"query": q, "top_k": 5, "candidates": 20, "rerank": rerank}
                got = [await _hits(app, "/search/text", body) for app in (duet, baseline)]
                assert got[0] == got[1], (q, rerank)


async def test_baseline_script_ranks_uploads_as_duet_does(index_dir: Path) -> None:
    """The plain script's /search/image (`serve_load --route image`) answers an upload with
    duet's captions and scores; the load's uploads are each their own bytes, one picture."""
    import base64
    import io
    import json

    import numpy as np
    from PIL import Image

    from benchmarks.image_queries import ImageQueries

    baseline = make_app(resolve_current(index_dir))
    duet = create_app(Settings(index_dir=index_dir, index_poll_s=0))
    queries = ImageQueries(seed=11, scenes=2)
    bodies = [json.loads(queries.body(rerank, 20)) for rerank in (True, False, True)]
    files = [base64.b64decode(b["image_b64"]) for b in bodies]
    assert len(set(files)) == 3  # no two share a cache key
    first, third = (np.asarray(Image.open(io.BytesIO(f))) for f in (files[0], files[2]))
    np.testing.assert_array_equal(first, third)  # the same scene, other bytes
    async with duet.router.lifespan_context(duet):
        for body in bodies:
            body["top_k"] = 5
            got = [await _hits(app, "/search/image", body) for app in (duet, baseline)]
            assert got[0] == got[1], body["rerank"]


@pytest.mark.slow
def test_serve_load_benchmark_runs_and_writes_its_report(index_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "performance.md"
    _run_benchmark(
        "serve_load.py",
        "--index-dir",
        str(index_dir),
        "--seconds",
        "0.5",
        "--rounds",
        "1",
        "--concurrency",
        "1,2",
        "--overload",
        "8",
        # the GPU check's options, on the CPU: load over two processes, an offered-load
        # run, duet in the GPU layout (its device step on the CPU device) behind two fronts
        "--procs",
        "2",
        "--open-loop",
        "10",
        "--duet-env",
        "DUET_LAYOUT=gpu,DUET_RERANK_MAX_BATCH=200,DUET_MAX_BATCH=8,DUET_FRONTENDS=2",
        "--out",
        str(out),
    )
    report = out.read_text()
    for row in ("| re-ranked | 1 |", "| re-ranked | 2 |", "| dot only | 1 |", "| dot only | 2 |"):
        assert row in report
    assert "pairs/s" in report and '"errors_5xx": 0' in report
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "DUET_LAYOUT=gpu" in report and "2 load process(es)" in report
    offered = [
        line
        for line in report.splitlines()
        if line.startswith(("| duet | 10 |", "| baseline | 10 |"))
    ]
    assert len(offered) == 2
    for line in offered:  # both answered about what was offered, without errors, in time
        answered, errors, late = (line.split("|")[i] for i in (3, 10, 11))
        assert float(answered) > 5 and int(errors) == 0 and int(late) == 0, line
    # duet's own p50 and p99, read off its request histogram: bucket bounds, p50 <= p99
    own = [float(x) for x in offered[0].split("|")[6].split("/")]
    assert offered[0].startswith("| duet |") and 0 < own[0] <= own[1], offered[0]
    # and of it the queue's and the device step's per request (the request histogram's
    # buckets), and per step (buckets of its own): each counted
    queue, device, step = (float(x) for x in offered[0].split("|")[7].split("/"))
    assert 0 < queue <= own[1] and 0 < device <= own[1] and 0 < step < math.inf, offered[0]
    # the slowest 1 % of the answers, placed in the run's 100 ms windows
    slow = re.fullmatch(r" (\d+) in (\d+) of (\d+) \((\d+)%\) ", offered[0].split("|")[8])
    assert slow, offered[0]
    n, held, windows, share = (int(x) for x in slow.groups())
    assert 1 <= held <= min(n, windows) and 0 < share <= 100, offered[0]
    assert out.with_name("performance_open.png").stat().st_size > 10_000
    lone = report.split("A lone request (1 client)")[1].split("\n\n")[1].splitlines()[2:]
    assert [row.split("|")[1].strip() for row in lone] == ["re-ranked", "dot only"]
    for row in lone:  # the server's own account: its time, the device step's, the look-ups'
        server, device, lookup = (float(row.split("|")[i]) for i in (3, 8, 10))
        assert server > 0 and device > 0 and lookup > 0, row
    dot_rows = [line.split("|") for line in report.splitlines() if line.startswith("| dot only")]
    cores = [cells for cells in dot_rows if len(cells) == 12 and "/" in cells[5]]  # cores table
    assert len(cores) == 2
    for cells in cores:  # the owner, its two fronts and the load generator were each seen busy
        server, fronts, busiest, load, per_answer, fronts_per = (
            float(cells[i]) for i in (4, 6, 7, 8, 9, 10)
        )
        assert server > 0 and load > 0 and per_answer > 0 and fronts_per > 0, cells
        assert 0 < busiest <= fronts, cells  # one of the two fronts: at most their total
        # the owner's threads, told apart by the names duet gives them: the threads reading
        # the fronts' searches and its engine worker each did some of the work (its event
        # loop only what is passed through), and no more than the whole process
        loop, wire, engine, other = (float(x) for x in cells[5].split("/"))
        assert wire > 0 and engine > 0 and loop + wire + engine + other <= server + 0.02, cells


@pytest.mark.slow
def test_serve_load_runs_duet_alone_for_an_ab(index_dir: Path, tmp_path: Path) -> None:
    """--no-baseline (gpu_check's A/B steps): duet's cells and its offered load, no plain
    script started, its columns "-"; --warm-up loads it first, uncounted, and says so."""
    out = tmp_path / "alone.md"
    res = _run_benchmark(
        "serve_load.py",
        *("--index-dir", str(index_dir), "--seconds", "0.3", "--rounds", "1"),
        *("--concurrency", "1", "--modes", "dot only", "--overload", "0", "--skip-bound"),
        *("--open-loop", "10", "--no-baseline", "--warm-up", "0.5", "--out", str(out)),
    )
    report = out.read_text()
    assert "warm-up: 0.5 s of re-ranked load on duet" in res.stdout
    assert "after 0.5 s of re-ranked load (8 clients, not counted)" in report
    assert "serve_load.py --device cpu --warm-up 0.5`" in report
    row = next(line for line in report.splitlines() if line.startswith("| dot only | 1 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[2]) > 0 and cells[3] == cells[4] == cells[6] == cells[8] == "-", row
    assert "no plain script in this run" in report
    assert "| duet | 10 |" in report and "| baseline |" not in report
    cells_run = [x for x in res.stdout.splitlines() if x.startswith(("round", "offered"))]
    assert cells_run and not [x for x in cells_run if "baseline" in x], res.stdout


async def test_open_loop_abandons_what_a_slow_server_has_not_answered_in_time() -> None:
    """Offered far above what a server answers, the open loop stops `grace` seconds after its
    last request and counts the rest late, instead of waiting out the server's backlog."""
    import asyncio
    import time

    from benchmarks.cell import Cell
    from benchmarks.load_client import Queries, finish_message, open_loop

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # a keep-alive HTTP/1.1 server that takes 0.4 s an answer, one at a time
                await finish_message(reader, await reader.readuntil(b"\r\n\r\n"))
                async with lock:
                    await asyncio.sleep(0.4)
                body = b'{"hits": []}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    lock = asyncio.Lock()
    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cell = Cell()
    t0 = time.monotonic()
    await open_loop(
        f"http://127.0.0.1:{port}", 40, 0.5, True, 50, Queries(1, n=200), cell, 0.0, grace=0.5
    )
    took = time.monotonic() - t0
    server.close()
    assert took < 2.5  # 0.5 s offered + 0.5 s grace, not the 8 s the backlog would take
    assert len(cell.latencies) + cell.late == 20 and 1 <= len(cell.latencies) <= 3
    assert cell.late >= 17 and cell.errors == 0


@pytest.mark.slow
def test_ce_ceiling_writes_its_table(index_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ceiling.md"
    _run_benchmark(
        "ce_ceiling.py",
        "--index-dir",
        str(index_dir),
        "--pairs",
        "50,100",
        "--seconds",
        "0.2",
        "--out",
        str(out),
    )
    rows = [line for line in out.read_text().splitlines() if line.startswith("| fp32 |")]
    assert len(rows) == 2
    for line in rows:  # every path measured a rate (none failed); graphs: CUDA only
        cells = [c.strip() for c in line.split("|")[3:10]]
        assert cells[3] == cells[6] == "-", line  # the text and image steps' graphs
        del cells[6], cells[3]
        assert all(c.replace(",", "").isdigit() and int(c.replace(",", "")) > 0 for c in cells)


@pytest.mark.slow
def test_heavy_reranker_row_runs_with_a_blip_stand_in(corpus: Path, tmp_path: Path) -> None:
    """The real-size row's plumbing, with a tiny checkpoint of the same kind: blip_base.py
    writes a BLIP ITM checkpoint from its config, `duet build --reranker` stores its image
    states, and the plain script re-ranks with it exactly as duet does."""
    blip = tmp_path / "blip"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    make = [sys.executable, str(REPO / "benchmarks" / "blip_base.py"), "--out", str(blip)]
    res = subprocess.run(
        [*make, "--tiny", "--dtype", "fp32"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert "BLIP ITM tiny-shaped" in res.stdout
    idx = tmp_path / "idx"
    build_cmd = [
        sys.executable,
        "-m",
        "duet.cli",
        "build",
        "--corpus",
        str(corpus),
        "--out",
        str(idx),
    ]
    res = subprocess.run(
        [*build_cmd, "--reranker", str(blip), "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    baseline = make_app(resolve_current(idx), reranker=blip)
    duet = create_app(Settings(index_dir=idx, index_poll_s=0, reranker=str(blip)))
    body = {"query": "a red circle above a small blue square", "top_k": 5, "candidates": 20}
    got = []
    with TestClient(duet) as d, TestClient(baseline) as b:
        for client in (d, b):
            r = client.post("/search/text", json=body)
            assert r.status_code == 200, r.text
            got.append([(h["id"], round(h["score"], 4)) for h in r.json()["hits"]])
    assert got[0] == got[1]


def test_scale_serve_measures_a_row_per_index(index_dir: Path, tmp_path: Path) -> None:
    """benchmarks/scale_serve.py (issue 38's table): start-up, memory, bytes per image and
    the three latency cells of one index, as a Markdown row and JSON."""
    import json

    from store.manifest import MANIFEST

    manifest = json.loads((resolve_current(index_dir) / MANIFEST).read_text())
    n = int(manifest["counts"]["images"])
    out = tmp_path / "rows.json"
    res = _run_benchmark(
        "scale_serve.py",
        "--index",
        f"{n}={index_dir}",
        "--seconds",
        "0.5",
        "--clients",
        "2",
        "--logs",
        str(tmp_path),
        "--json",
        str(out),
    )
    assert f"| {n:,} |" in res.stdout
    (row,) = json.loads(out.read_text())
    assert row["n"] == n and row["start_s"] > 0 and row["rss_mb"] > 50
    assert 0 < row["dot_1_p50"] < row["reranked_1"][0]  # re-ranking costs more than a dot
    assert row["reranked_many"][0] > 0 and row["reranked_1"][1] >= row["reranked_1"][0]
    tokens = row["bytes_per_image"]["tokens"]  # fp16 states, plus the .npy header per image
    assert tokens >= 16 * 128 * 2
    # where a lone request went, by duet's own clock: the server's handling covers its stages
    for cell in ("reranked_1", "dot_1"):
        lone = row["lone"][cell]
        assert lone["request"] > 0 and lone["lookup"] > 0
        assert lone["request"] >= sum(v for k, v in lone.items() if k != "request" and v == v)
    assert "| re-ranked |" in res.stdout and "| dot only |" in res.stdout


def test_duets_own_quantiles_are_read_off_its_histograms_buckets() -> None:
    from benchmarks.duet_metrics import bucket_quantile

    before = {0.01: 5.0, 0.025: 5.0, 0.05: 5.0, math.inf: 5.0}
    # 200 requests in between: 50 within 10 ms, 95 more within 25, 54 more within 50, 1 above
    after = {0.01: 55.0, 0.025: 150.0, 0.05: 204.0, math.inf: 205.0}
    assert bucket_quantile(before, after, 0.5) == 25.0
    assert bucket_quantile(before, after, 0.99) == 50.0
    assert bucket_quantile(before, after, 1.0) == math.inf
    assert math.isnan(bucket_quantile(after, after, 0.5))  # nothing counted


def test_the_open_loops_tail_is_placed_in_time() -> None:
    """The slowest 1 % of an open loop's answers: a stall puts them in one window, a tail
    spread over the run in many."""
    from benchmarks.cell import Cell

    due = [1 + i / 1000 for i in range(2000)]  # 2 s at 1,000 req/s
    stalled = Cell(latencies=[0.01] * 2000, due=due)
    for i in range(710, 730):  # 20 answers due within 20 ms, each 100 ms late
        stalled.latencies[i] = 0.1
    assert stalled.tail() == (20, 1, 20, 1.0)
    spread = Cell(latencies=[0.01 + (i % 100 == 50) for i in range(2000)], due=due)
    n, held, windows, busiest = spread.tail()
    assert (n, held, windows) == (20, 20, 20) and busiest == 1 / 20
    assert Cell(latencies=[0.01]).tail()[0] == 0  # no due times (a closed loop): nothing


def test_duets_own_histograms_are_read_off_its_metrics_page() -> None:
    """What `own_buckets` reads of /metrics: /search/* answered 200 (both endpoints summed,
    other statuses and paths left out), the queue and device stages, the device step."""
    from benchmarks.duet_metrics import own_quantiles, parse_own

    page = "\n".join(
        [
            'duet_request_seconds_bucket{endpoint="/search/text",le="0.025",status="200"} 90.0',
            'duet_request_seconds_bucket{endpoint="/search/text",le="+Inf",status="200"} 100.0',
            'duet_request_seconds_bucket{endpoint="/search/image",le="0.025",status="200"} 10.0',
            'duet_request_seconds_bucket{endpoint="/search/image",le="+Inf",status="200"} 10.0',
            'duet_request_seconds_bucket{endpoint="/search/text",le="0.025",status="429"} 7.0',
            'duet_request_seconds_bucket{endpoint="/healthz",le="0.025",status="200"} 5.0',
            'duet_stage_seconds_bucket{le="0.005",stage="queue"} 3.0',
            'duet_stage_seconds_bucket{le="+Inf",stage="queue"} 4.0',
            'duet_stage_seconds_bucket{le="0.005",stage="lookup"} 4.0',
            'duet_stage_seconds_bucket{le="0.01",stage="device"} 4.0',
            'duet_device_step_seconds_bucket{le="0.002"} 2.0',
            "duet_device_step_seconds_count 2.0",
        ]
    )
    got = parse_own(page)
    assert got == {
        "request": {0.025: 100.0, math.inf: 110.0},
        "queue": {0.005: 3.0, math.inf: 4.0},
        "device": {0.01: 4.0},
        "step": {0.002: 2.0},
    }
    q = own_quantiles({}, got)
    assert q["p50"] == 25.0 and q["p99"] == math.inf and q["queue p99"] == math.inf
    assert q["device p99"] == 10.0 and q["step p99"] == 2.0


def test_the_tail_is_binned_from_the_first_answer_due() -> None:
    from benchmarks.cell import Cell

    # two answers 20 ms apart, across a multiple of the window: one window, not two
    assert Cell(latencies=[0.1, 0.2], due=[0.99, 1.01]).tail(share=1.0) == (2, 1, 1, 1.0)
