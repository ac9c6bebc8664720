"""`duet bench` against a real `duet serve` over real sockets: it reports what it measured
(answers, percentiles, the service's own stage times), counts the cache's answers once its
queries run out, and refuses what it cannot run before sending anything."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CHILD_PYTHONPATH, DUET, Service, free_port, start_service, stop_service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(index_dir, tmp_path_factory.mktemp("bench") / "serve.log")
    yield svc
    stop_service(svc)


def _bench(*args: str, index_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    if index_dir is not None:
        env["DUET_INDEX_DIR"] = str(index_dir)
    return subprocess.run(
        [*DUET, "bench", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _cells(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout)["cells"])


def test_it_measures_each_mode_and_count_of_clients(service: Service, index_dir: Path) -> None:
    quick = ("--seconds", "0.6", "--warmup", "0.2", "--clients", "1,2")
    cells = _cells(_bench("--url", service.url, *quick, "--json", index_dir=index_dir))
    assert [(c["mode"], c["clients"]) for c in cells] == [
        ("reranked", 1),
        ("reranked", 2),
        ("dot", 1),
        ("dot", 2),
    ]
    for c in cells:
        assert c["answered"] > 0 and c["req_per_s"] > 0 and c["errors"] == {}, c
        assert 0 < c["p50_ms"] <= c["p99_ms"], c
        assert "cache" in c["stages_ms"], c  # the service's own stage times
    # every query a different caption of the index, while its 200 captions last
    assert cells[0]["cached"] == 0 and cells[0]["answered"] < 150, cells[0]
    assert {"encode", "search", "rerank"} <= set(cells[0]["stages_ms"]), cells[0]
    assert "rerank" not in cells[2]["stages_ms"] and "rerank" not in cells[3]["stages_ms"]
    table = _bench("--url", service.url, *quick, "--modes", "dot", index_dir=index_dir)
    assert table.returncode == 0, table.stderr
    assert "| dot | 2 |" in table.stdout and "(duet_stage_seconds;" in table.stdout


def test_queries_that_run_out_come_back_as_cached_answers(service: Service, tmp_path: Path) -> None:
    asked = tmp_path / "q.txt"
    asked.write_text("a red circle\n\na blue square\n")
    args = ("--url", service.url, "--queries", str(asked), "--modes", "dot", "--clients", "1")
    [cell] = _cells(_bench(*args, "--seconds", "0.5", "--warmup", "0.1", "--json"))
    assert cell["cached"] >= cell["answered"] - 2 > 0, cell
    # the table said "every query a different caption" over answers all from the cache
    table = _bench(*args, "--seconds", "0.5", "--warmup", "0.1")
    assert table.returncode == 0, table.stderr
    assert "every answer computed" not in table.stdout
    assert "came from the cache" in table.stdout and "measure the cache" in table.stdout


def test_what_it_cannot_run_is_refused_before_any_request(tmp_path: Path) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    for args, says in (
        (("--clients", "1,x"), "--clients '1,x': give whole numbers"),
        (("--clients", "0"), "must be at least 1"),
        (("--modes", "fast"), "--modes: fast is no mode"),
        (("--seconds", "0"), "--seconds must be more than 0"),
        (("--url", "https://example.com"), "give http://HOST:PORT"),
        (("--url", nobody), "does not answer"),
    ):
        proc = _bench(*args)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_options_the_service_refuses_are_told_before_the_load(service: Service) -> None:
    """--top-k 101 made every request of the run a 422, counted as errors."""
    proc = _bench("--url", service.url, "--top-k", "101", "--queries", "/dev/null")
    assert proc.returncode == 2 and "--queries /dev/null has no query" in proc.stderr
    asked = service.log.parent / "q.txt"
    asked.write_text("a red circle\n")
    proc = _bench("--url", service.url, "--top-k", "101", "--queries", str(asked))
    assert proc.returncode == 2, proc.stderr
    assert "a reranked search with these options was refused (422): top_k" in proc.stderr
    host_port = service.url.removeprefix("http://")
    proc = _bench("--url", f"http://{host_port}x", "--queries", str(asked))
    assert proc.returncode == 2 and "give http://HOST:PORT" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_captions_and_no_queries_file_says_what_to_give(
    service: Service, tmp_path: Path
) -> None:
    proc = _bench("--url", service.url, "--index-dir", str(tmp_path / "none"))
    assert proc.returncode == 2 and "give --queries FILE" in proc.stderr, proc.stderr


def test_a_service_that_goes_away_leaves_the_cells_measured_before(
    index_dir: Path, tmp_path: Path
) -> None:
    """It was an httpx traceback, every measured cell lost."""
    import threading

    svc = start_service(index_dir, tmp_path / "serve.log")
    try:
        # stopped while the second cell runs (each: 0.2 s warm-up, ~0.6 s of metrics, 1.5 s)
        threading.Timer(3.5, svc.proc.terminate).start()
        proc = _bench(
            "--url",
            svc.url,
            "--modes",
            "dot",
            "--clients",
            "1,1,1",
            "--seconds",
            "1.5",
            "--warmup",
            "0.2",
            index_dir=index_dir,
        )
    finally:
        stop_service(svc)
    assert proc.returncode == 2 and "stopped answering" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "| dot | 1 |" in proc.stdout, proc.stdout


def test_the_benchmarks_wait_as_long_as_the_fronts_take_to_send_their_metrics() -> None:
    """`duet.loadgen.stage_totals` (duet bench's and the benchmarks') waits for the fronts'
    observations (a load client keeps the interval itself, not importing the app's server
    side): the two must agree."""
    from app.remote import FLUSH_S
    from benchmarks import duet_metrics
    from duet import loadgen

    assert loadgen.FLUSH_S == duet_metrics.FLUSH_S == FLUSH_S
