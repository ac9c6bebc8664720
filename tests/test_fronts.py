"""The process layout (DUET_FRONTENDS > 0, `app.fronts`): real `duet serve` processes, fronts
on the public port, the model work over the owner's Unix socket."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from index_builder.build import build
from models.builtin import BuiltinModel
from tests.conftest import (
    REPO,
    Placed,
    RedisServer,
    child_pids,
    process_alive,
    start_service,
    stop_service,
)

pytestmark = pytest.mark.slow

QUERIES = [
    {"query": "a small red diamond left of a small yellow triangle", "top_k": 5},
    {"query": "two blue squares", "top_k": 3, "candidates": 20, "fusion": "norm_add"},
    {"query": "a red square", "top_k": 4, "rerank": False},
    {"query": "a green cross", "reranker": "late"},
]


def _hits(body: dict[str, object]) -> list[tuple[str, float, object, object]]:
    return [
        (h["id"], round(h["score"], 5), h.get("caption"), h.get("match"))
        for h in body["hits"]  # type: ignore[attr-defined]
    ]


def _logged(log: Path, text: str, wait_s: float = 10.0) -> int:
    """Lines of `log` holding `text`, once their count has stopped growing for a second."""
    deadline, seen, since = time.monotonic() + wait_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = log.read_text(errors="replace").count(text)
        if n != seen:
            seen, since = n, time.monotonic()
        elif time.monotonic() - since > 1.0:
            break
        time.sleep(0.1)
    return seen


def test_fronts_answer_as_one_process_does(index_dir: Path, tmp_path: Path) -> None:
    """Two fronts and an owner: the same answers as one process (text, image, every
    re-ranker), validation errors from the fronts, the rest passed through to the owner, the
    fronts' requests counted on the owner's /metrics, and SIGTERM ends every process."""
    fronts = start_service(index_dir, tmp_path / "fronts.log", DUET_FRONTENDS="2")
    single = start_service(index_dir, tmp_path / "single.log", DUET_GC_FREEZE="0")
    try:
        kids = [p for p in child_pids(fronts.proc.pid) if "serve-front" in _cmdline(p)]
        assert len(kids) == 2
        # each front accepts on a socket of its own (SO_REUSEPORT), not one they share
        port = int(fronts.url.rsplit(":", 1)[1])
        listening = [_listening(p, port) for p in kids]
        assert all(len(s) == 1 for s in listening) and listening[0] != listening[1], listening
        with fronts.client() as f, single.client() as s:
            schemas = s.get("/openapi.json").json()["components"]["schemas"]
            # the last one answered from the cache; a café: one word the model does not know
            bodies = [*QUERIES, QUERIES[0], {"query": "a red café circle"}]
            for body in bodies:
                a, b = f.post("/search/text", json=body), s.post("/search/text", json=body)
                assert a.status_code == b.status_code == 200, (a.text, b.text)
                assert _hits(a.json()) == _hits(b.json()), body
                assert a.json()["index_version"] == b.json()["index_version"]
                assert a.json()["unknown_words"] == b.json()["unknown_words"]
                for answer in (a.json(), b.json()):  # what the document calls required is there
                    assert set(schemas["SearchResponse"]["required"]) <= set(answer)
                    for hit in answer["hits"]:
                        assert set(schemas["Hit"]["required"]) <= set(hit), hit
            # a PNG, and a photo-sized JPEG the front decodes at the DCT scale the owner's
            # model reads: the owner gets the front's picture, not the upload, to encode
            for name, upload in _an_image(index_dir):
                a = f.post("/search/image", files={"image": (name, upload)}, data={"top_k": "3"})
                b = s.post("/search/image", files={"image": (name, upload)}, data={"top_k": "3"})
                assert a.status_code == 200, a.text
                assert _hits(a.json()) == _hits(b.json()), name
                assert set(schemas["SearchResponse"]["required"]) <= set(a.json())
                assert all(set(schemas["Hit"]["required"]) <= set(h) for h in a.json()["hits"])
            _refusals_and_the_rest_alike(f, s)
            deadline = time.monotonic() + 5  # each front sends its counts a few times a second
            while time.monotonic() < deadline:
                metrics = f.get("/metrics").text
                text = _count(metrics, 'endpoint="/search/text",status="200"')
                image = _count(metrics, 'endpoint="/search/image",status="200"')
                if text >= len(bodies) + 1 and image >= 2:
                    break
                time.sleep(0.2)
            # each of the bodies, and the café's once more
            assert _count(metrics, 'endpoint="/search/text",status="200"') == len(bodies) + 1
            assert _count(metrics, 'endpoint="/search/image",status="200"') == 2  # PNG, JPEG
            # passed through, counted once: by the owner (the front counted it too)
            assert _count(metrics, 'endpoint="/search/text",status="405"') == 1
            assert 'duet_stage_seconds_count{stage="rerank"}' in metrics
            # the fronts' memory, which the owner's process_* metrics leave out (~280 MB each)
            memory = re.search(r"^duet_fronts_resident_memory_bytes (\S+)$", metrics, re.M)
            assert memory and 2 * 100e6 < float(memory[1]) < 2 * 4e9, memory
        # each process froze its start-up heap (app.heap), unless told not to
        assert _logged(fronts.log, "start-up heap frozen") == 3  # the owner, two fronts
        assert _logged(single.log, "start-up heap frozen") == 0
        fronts.proc.send_signal(signal.SIGTERM)
        fronts.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(process_alive(p) for p in kids), "a front outlived its owner"
    finally:
        stop_service(fronts)
        stop_service(single)


def _refusals_and_the_rest_alike(f: httpx.Client, s: httpx.Client) -> None:
    """A front (`f`) refuses as one process (`s`) does, and passes the rest to its owner."""
    # nothing the model reads, or more than it reads: refused alike
    for q in ("crimson box", "zzz qqq", "a " * 31 + "red circle"):
        a, b = f.post("/search/text", json={"query": q}), s.post("/search/text", json={"query": q})
        assert a.status_code == b.status_code == 422 and a.json() == b.json()
    cafe = f.post("/search/text", json={"query": "a red café circle"}).json()
    assert cafe["unknown_words"] == ["café"]
    bad = f.post("/search/text", json={"query": ""})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"
    broken = f.post("/search/image", files={"image": ("x.png", b"not an image")})
    assert broken.status_code == 400, broken.text
    assert f.get("/readyz").status_code == 200
    assert f.get("/healthz").status_code == 200
    assert f.get("/").status_code == 200  # the page, from the owner
    for path in ("/readyz", "/"):  # HEAD as GET without the body, through the front
        got, head = f.get(path), f.head(path)
        assert head.status_code == 200 and head.content == b"", path
        assert head.headers["content-length"] == str(len(got.content)), path
    got = f.post("/search/text?top_k=1", json={"query": "a red circle"})
    assert got.status_code == 422 and got.json()["error"]["details"], got.text
    assert f.get("/search/text").status_code == s.get("/search/text").status_code == 405


def test_fronts_pass_on_overload_and_swaps(index_dir: Path, corpus: Path, tmp_path: Path) -> None:
    """A 429 from the owner's admission reaches the client with its Retry-After; a new index
    version swapped in by the owner is what the fronts' answers then carry."""
    own = tmp_path / "indexes"
    shutil.copytree(index_dir, own, symlinks=True)
    svc = start_service(
        own,
        tmp_path / "svc.log",
        DUET_FRONTENDS="2",
        DUET_WORKERS="1",
        DUET_MAX_QUEUE="1",
        DUET_INDEX_POLL_S="0.3",
        # the GPU layout on the CPU device: ids made by the fronts, tables per version
        DUET_LAYOUT="gpu",
        DUET_MAX_BATCH="8",
        DUET_RERANK_MAX_BATCH="200",
    )
    try:
        with svc.client() as c:
            first = c.post("/search/text", json=QUERIES[0]).json()["index_version"]
            # the API's documents are the owner's, every route in them, not a front's own
            paths = c.get("/openapi.json").json()["paths"]
            assert {"/search/text", "/healthz", "/admin/reload"} <= set(paths), sorted(paths)
            assert c.get("/docs").status_code == 200

            def one(i: int) -> httpx.Response:
                with httpx.Client(base_url=svc.url, timeout=30) as cc:
                    body = {"query": f"a red circle above {i % 3 + 1} blue squares", "top_k": 3}
                    body["candidates"] = 200 + i
                    return cc.post("/search/text", json=body)

            with ThreadPoolExecutor(24) as pool:
                codes = list(pool.map(one, range(48)))
            refused = [r for r in codes if r.status_code == 429]
            assert refused and all(r.headers.get("retry-after") for r in refused)
            assert {r.status_code for r in codes} <= {200, 429}
            build(corpus, own, BuiltinModel.load(), progress=False)  # a new version
            deadline = time.monotonic() + 20
            version = first
            while version == first and time.monotonic() < deadline:
                time.sleep(0.3)
                version = c.post("/search/text", json=QUERIES[2]).json()["index_version"]
            assert version != first
            assert c.post("/search/text", json=QUERIES[1]).json()["index_version"] == version
    finally:
        stop_service(svc)


def _listening(pid: int, port: int) -> set[str]:
    """The socket inodes process `pid` holds that listen on TCP `port` (from /proc)."""
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held.add(os.readlink(fd))
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                f = row.split()
                listens = f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port
                if listens and f"socket:[{f[9]}]" in held:
                    out.add(f[9])
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _count(metrics: str, labels: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("duet_request_seconds_count{") and labels in line:
            return float(line.split()[-1])
    return 0.0


def _an_image(index_dir: Path) -> list[tuple[str, bytes]]:
    """A PNG of the test corpus (the manifest's corpus folder holds its images), and the same
    picture as a 512 x 384 JPEG."""
    import io
    import json

    from PIL import Image

    current = (index_dir / "current").resolve()
    corpus = Path(json.loads((current / "manifest.json").read_text())["corpus"]).parent
    png = next((corpus / "images").glob("*.png")).read_bytes()
    photo = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").resize((512, 384)).save(photo, format="JPEG")
    return [("q.png", png), ("q.jpg", photo.getvalue())]


def test_serve_front_alone_says_how_it_starts() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "duet.cli", "serve-front"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert res.returncode == 2 and "DUET_FRONTENDS" in res.stderr


@pytest.mark.parametrize(
    ("env", "device", "cores", "want"),
    [
        ({}, "cpu", 16, 0),  # the CPU layout keeps one process
        ({}, "cuda:0", 16, 6),  # the H100 host measured: six fronts
        ({}, "cuda:0", 64, 6),
        ({}, "cuda:0", 8, 3),
        ({}, "cuda:0", 4, 0),  # one front would only add the hop
        ({"DUET_LAYOUT": "cpu"}, "cuda:0", 16, 0),
        ({"DUET_FRONTENDS": "2"}, "cpu", 2, 2),  # a number is taken as it is
        ({"DUET_FRONTENDS": "0"}, "cuda:0", 16, 0),
    ],
)
def test_auto_fronts_only_where_the_model_is_on_cuda(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], device: str, cores: int, want: int
) -> None:
    from app.config import Settings
    from app.main import front_count

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert front_count(Settings(), Placed(device), cores) == want


@pytest.mark.parametrize("bad", ["-1", "65", "many"])
def test_a_bad_fronts_setting_is_refused(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    from duet.commands.common import load_settings
    from models.errors import UserError

    monkeypatch.setenv("DUET_FRONTENDS", bad)
    with pytest.raises(UserError, match="DUET_FRONTENDS"):
        load_settings()


def test_grouped_observations_count_as_one_by_one_would() -> None:
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from app.owner import apply
    from app.remote import grouped

    def family(reg: CollectorRegistry) -> tuple[Histogram, Counter]:
        buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 1.0)
        return (
            Histogram("t_seconds", "t", ["stage"], buckets=buckets, registry=reg),
            Counter("t_total", "t", ["result"], registry=reg),
        )

    one, bulk = CollectorRegistry(), CollectorRegistry()
    (h1, c1), (h2, c2) = family(one), family(bulk)
    # bounds themselves, between them, below, above, a second label
    values = [0.001, 0.0005, 0.005, 0.007, 0.01, 0.3, 1.0, 7.5, 0.05, 0.0]
    observed: list[tuple[str, tuple[tuple[str, str], ...], str, float]]
    observed = [("h", (("stage", "search"),), "observe", v) for v in values]
    observed += [("h", (("stage", "rerank"),), "observe", v * 2) for v in values[:4]]
    observed += [("c", (("result", "hit"),), "inc", 1.0)] * 3
    for name, labels, method, v in observed:
        target = (h1 if name == "h" else c1).labels(**dict(labels))
        getattr(target, method)(v)
    groups = grouped(observed)
    assert len(groups) == 3  # one item per family, labels and method
    for name, labelled, method, vs in groups:
        apply((h2 if name == "h" else c2).labels(**dict(labelled)), method, vs)

    def samples(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for m in reg.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        }

    got, want = samples(bulk), samples(one)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


def test_a_fronts_429s_at_the_in_flight_cap_count_on_the_owners_metrics(
    index_dir: Path, tmp_path: Path
) -> None:
    import socket

    from tests.test_e2e import _metric

    svc = start_service(
        index_dir, tmp_path / "fronts.log", DUET_FRONTENDS="2", DUET_HTTP_MAX_INFLIGHT="2"
    )
    held: list[socket.socket] = []
    try:
        host, port = svc.url.removeprefix("http://").split(":")
        for _ in range(10):  # bodies that never finish: each admitted one stays in flight
            s = socket.create_connection((host, int(port)))
            s.sendall(
                b"POST /search/text HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            held.append(s)
        # two fronts admit two each at most: six or more were refused, by whichever front
        deadline = time.monotonic() + 10
        shed = 0.0
        while time.monotonic() < deadline and shed < 6:
            time.sleep(0.3)  # the fronts send their counts a few times a second
            with svc.client() as c:
                text = c.get("/metrics").text
            shed = _metric(text, "duet_shed_requests_total", reason="inflight")
        assert shed >= 6
    finally:
        for s in held:
            s.close()
        stop_service(svc)


def test_a_fronts_failed_cache_writes_count_on_the_owners_metrics(
    index_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The fronts read and write the cache: a Redis that refuses writes (full, no eviction)
    shows on the service's /metrics as duet_cache_write_errors_total, forwarded as the
    fronts' other counts are."""
    import redis

    direct = redis.Redis.from_url(redis_server.url)
    direct.config_set("maxmemory", 1)
    svc = start_service(
        index_dir, tmp_path / "svc.log", DUET_FRONTENDS="2", DUET_REDIS_URL=redis_server.url
    )
    try:
        with svc.client() as c:
            for k in range(4):
                body = {"query": "a red circle", "top_k": 1 + k, "rerank": False}
                assert c.post("/search/text", json=body).status_code == 200
            deadline = time.monotonic() + 5  # each front sends its counts a few times a second
            while time.monotonic() < deadline:
                text = c.get("/metrics").text
                if "duet_cache_write_errors_total 4.0" in text:
                    break
                time.sleep(0.2)
        assert "duet_cache_write_errors_total 4.0" in text
    finally:
        stop_service(svc)
        direct.close()
