"""End to end: generated corpus -> `duet build` -> `duet serve` (real uvicorn) -> httpx.

The search API on a shared running service (hits, re-ranking, caching, metrics, bad requests),
and requests still answered while Redis is killed under the service. Refusals at start-up are
in test_e2e_startup.py.
"""

from __future__ import annotations

import base64
import collections
import io
import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.schemas import Readiness
from models.fusion import DEFAULT_FUSION_LAMBDA
from tests.conftest import (
    RedisServer,
    Service,
    start_redis,
    start_service,
    stop_service,
)

pytestmark = pytest.mark.slow


def _manifest(corpus: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in corpus.read_text().splitlines()]


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def service(
    index_dir: Path, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    svc = start_service(
        index_dir,
        log,
        DUET_REDIS_URL=redis.url,
        DUET_MAX_IMAGE_BYTES="200000",
        DUET_MAX_IMAGE_PIXELS="1000000",
    )
    yield svc
    stop_service(svc)


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name:
            got = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
            if got == want:
                return float(m.group(3))
    raise AssertionError(f"metric {name}{{{want}}} not exported")


def test_caption_finds_its_image(service: Service, corpus: Path) -> None:
    items = _manifest(corpus)
    found = 0
    with service.client() as c:
        for item in items[:10]:
            caption = item["captions"][0]  # type: ignore[index]
            r = c.post("/search/text", json={"query": caption, "top_k": 10})
            assert r.status_code == 200, r.text
            body = r.json()
            ids = [h["id"] for h in body["hits"]]
            assert len(ids) == 10 and [h["rank"] for h in body["hits"]] == list(range(1, 11))
            found += item["id"] in ids
            assert body["hits"][0]["meta"]["image"].startswith("images/")
    assert found >= 9, f"only {found}/10 captions found their image in the top 10"


def test_image_finds_one_of_its_captions(service: Service, corpus: Path) -> None:
    items = _manifest(corpus)
    found = 0
    with service.client() as c:
        for item in items[:10]:
            data = (corpus.parent / str(item["image"])).read_bytes()
            r = c.post(
                "/search/image", files={"image": ("q.png", data, "image/png")}, data={"top_k": "10"}
            )
            assert r.status_code == 200, r.text
            hits = r.json()["hits"]
            found += any(h["meta"]["image_id"] == item["id"] for h in hits)
            assert all(h["id"].split("#")[0] == h["meta"]["image_id"] for h in hits)
    assert found >= 9, f"only {found}/10 images found one of their captions in the top 10"


def test_json_base64_image_equals_multipart(service: Service, corpus: Path) -> None:
    data = (corpus.parent / "images" / "0003.png").read_bytes()
    with service.client() as c:
        a = c.post(
            "/search/image",
            files={"image": ("q.png", data, "image/png")},
            data={"top_k": "5", "rerank": "false"},
        ).json()
        b = c.post(
            "/search/image",
            json={"image_b64": base64.b64encode(data).decode(), "top_k": 5, "rerank": False},
        ).json()
    assert [h["id"] for h in a["hits"]] == [h["id"] for h in b["hits"]]


def test_rerank_false_returns_dot_order(service: Service) -> None:
    with service.client() as c:
        body = c.post(
            "/search/text",
            json={"query": "a big blue square above a red circle", "top_k": 8, "rerank": False},
        ).json()
    dots = [h["retrieval_score"] for h in body["hits"]]
    assert dots == sorted(dots, reverse=True)
    assert all(
        h["rerank_score"] is None and h["score"] == h["retrieval_score"] for h in body["hits"]
    )
    assert "rerank" not in body["timings_ms"]


def test_rerank_orders_by_cross_encoder(service: Service) -> None:
    with service.client() as c:
        body = c.post(
            "/search/text",
            json={
                "query": "two small green triangles left of a large red diamond",
                "top_k": 10,
                "candidates": 20,
            },
        ).json()
    hits = body["hits"]
    assert all(h["rerank_score"] is not None and 0.0 <= h["rerank_score"] <= 1.0 for h in hits)
    # ordered by ADD_lambda fusion of the dot product and the cross-encoder probability
    lam = DEFAULT_FUSION_LAMBDA
    for h in hits:
        assert h["score"] == pytest.approx(
            lam * h["retrieval_score"] + (1 - lam) * h["rerank_score"], abs=1e-6
        )
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)
    assert body["timings_ms"]["rerank"] > 0


def test_second_identical_request_is_cached(service: Service) -> None:
    query = {"query": "a tiny purple cross in the top left", "top_k": 4}
    with service.client() as c:
        before = _metric(c.get("/metrics").text, "duet_cache_requests_total", result="hit")
        first = c.post("/search/text", json=query).json()
        # same query after normalisation (case, spacing) is the same cache entry
        second = c.post(
            "/search/text", json={**query, "query": "  A tiny purple CROSS in the top left "}
        ).json()
        after = _metric(c.get("/metrics").text, "duet_cache_requests_total", result="hit")
        # "and" is read as "with", so it is that query's entry too (its unknown_words: none)
        pair = {"query": "a red circle with a blue square", "top_k": 4}
        typed = c.post("/search/text", json={**pair, "query": "a red circle and a blue square"})
        written = c.post("/search/text", json=pair).json()
    assert first["cached"] is False and second["cached"] is True
    assert second["hits"] == first["hits"]
    assert after == before + 1
    assert typed.json()["cached"] is False and typed.json()["unknown_words"] == []
    assert written["cached"] is True and written["hits"] == typed.json()["hits"]


def test_metrics_exported(service: Service) -> None:
    with service.client() as c:
        c.post("/search/text", json={"query": "a red circle"})
        text = c.get("/metrics").text
    assert _metric(text, "duet_index_items", modality="image") == 40
    assert _metric(text, "duet_index_items", modality="text") == 200
    assert _metric(text, "duet_request_seconds_count", endpoint="/search/text", status="200") >= 1
    for stage in ("cache", "encode", "search", "rerank"):
        assert _metric(text, "duet_stage_seconds_count", stage=stage) >= 1
    assert _metric(text, "duet_rerank_batch_size_count") >= 1
    assert _metric(text, "duet_ready") == 1
    assert _metric(text, "duet_queue_depth") == 0
    assert _metric(text, "duet_queue_capacity") == 1024
    assert _metric(text, "duet_index_reloads_total", result="refused") == 0


def test_index_version_metric_matches_readyz(service: Service) -> None:
    with service.client() as c:
        version = c.get("/readyz").json()["index_version"]
        text = c.get("/metrics").text
    assert _metric(text, "duet_index_info", version=version) == 1


@pytest.mark.parametrize(
    "body",
    [
        {"query": ""},
        {"query": "   "},
        {"query": "a red circle " * 100},
        {"query": "a red circle", "top_k": 0},
        {"query": "a red circle", "top_k": 20, "candidates": 10},
        {"query": "a red circle", "rerank": "maybe"},
        {"query": "a red circle", "colour": "red"},
        {},
    ],
)
def test_bad_text_queries_are_422(service: Service, body: dict[str, object]) -> None:
    with service.client() as c:
        r = c.post("/search/text", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "validation_error"
    assert r.json()["error"]["message"]


def _png(size: tuple[int, int], noise: bool = False) -> bytes:
    if noise:
        arr = np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)
        img = Image.fromarray(arr)
    else:
        img = Image.new("RGB", size, (10, 200, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"this is not an image", 400, "invalid_image"),
        (_png((64, 64))[:60], 400, "invalid_image"),  # truncated
        (b"", 400, "invalid_image"),
        (_png((1200, 1200)), 413, "image_too_large"),  # 1.44 M pixels > DUET_MAX_IMAGE_PIXELS
        (_png((300, 300), noise=True), 413, "image_too_large"),  # ~270 kB > DUET_MAX_IMAGE_BYTES
    ],
)
def test_bad_images_are_4xx(service: Service, payload: bytes, status: int, code: str) -> None:
    with service.client() as c:
        r = c.post("/search/image", files={"image": ("x.png", payload, "image/png")})
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        # and the service is still fine afterwards
        assert c.post("/search/text", json={"query": "a red circle"}).status_code == 200


def test_other_bad_image_requests(service: Service) -> None:
    with service.client() as c:
        assert (
            c.post(
                "/search/image", content=b"xx", headers={"content-type": "text/plain"}
            ).status_code
            == 415
        )
        r = c.post("/search/image", json={"image_b64": "!!not base64!!"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image"
        r = c.post("/search/image", data={"top_k": "3"}, files={"other": ("x", b"1")})
        assert r.status_code == 422
        r = c.post(
            "/search/image",
            files={"image": ("x.png", _png((64, 64)), "image/png")},
            data={"top_k": "-1"},
        )
        assert r.status_code == 422 and "top_k" in r.json()["error"]["message"]
        r = c.post("/search/image", json=[1, 2])
        assert r.status_code == 422
        deep = b"[" * 100_000 + b"]" * 100_000  # Python's JSON parser recurses per level
        r = c.post("/search/image", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "nested too deeply" in r.json()["error"]["message"]
        assert c.get("/healthz").status_code == 200  # same keep-alive connection, still served
        assert c.get("/nope").json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"query": "a red circle", "top_k": True}, "top_k"),  # JSON types are not coerced
        ({"query": "a red circle", "top_k": "5"}, "top_k"),
        ({"query": "a red circle", "candidates": 50.0}, "candidates"),
        ({"query": "\x00"}, "no words"),  # nothing the model reads
        ({"query": "\u200b\u200b\u200b"}, "no words"),
        ({"query": "\U0001f431" * 100}, "no words"),  # the builtin model reads a-z and 0-9 only
        ({"query": "!!! ???"}, "no words"),
    ],
)
def test_text_queries_refused_with_422(service: Service, body: dict[str, Any], where: str) -> None:
    with service.client() as c:
        r = c.post("/search/text", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "validation_error" and where in r.json()["error"]["message"]


def test_bodies_that_are_not_json_get_the_same_422(service: Service) -> None:
    with service.client() as c:
        for body in (b'{"query": "a red \xff circle"}', b'{"query": '):  # not UTF-8; cut short
            r = c.post("/search/text", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text


def test_model_work_runs_below_the_event_loop(service: Service) -> None:
    """DUET_WORKER_NICE (default 10): the engine's worker and the torch threads it starts run
    at niceness 10, the event loop's thread at 0, so parsing, 429s and health checks win the
    CPU from model work."""
    with service.client() as c:
        assert c.post("/search/text", json={"query": "two green squares"}).status_code == 200
    pid = service.proc.pid
    nice = {
        int(t.name): int(Path(t, "stat").read_text().rpartition(")")[2].split()[16])
        for t in Path(f"/proc/{pid}/task").iterdir()
    }
    assert nice[pid] == 0
    assert sum(n == 10 for n in nice.values()) >= 2, nice  # the worker and its torch threads


def test_health_and_ready(service: Service) -> None:
    with service.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz").json()
    assert ready["status"] == "ready" and ready["cache"] == "redis" and ready["cache_answers"]
    assert ready["items"] == {"images": 40, "texts": 200}
    # what the OpenAPI document says it is (it had no schema), field for field
    assert Readiness.model_validate(ready).model_dump() == ready


def test_redis_killed_mid_test_requests_still_succeed(index_dir: Path, tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    svc = start_service(index_dir, tmp_path / "serve.log", DUET_REDIS_URL=redis.url)
    try:
        with svc.client() as c:
            q = {"query": "a large yellow diamond below a small blue circle", "top_k": 3}
            assert c.post("/search/text", json=q).json()["cached"] is False
            assert c.post("/search/text", json=q).json()["cached"] is True
            redis.stop()
            for i in range(5):
                r = c.post("/search/text", json={**q, "top_k": 3 + i})
                assert r.status_code == 200, r.text
                assert r.json()["cached"] is False
            ready = c.get("/readyz")  # still ready, and says the cache is not answering
            assert ready.status_code == 200 and ready.json()["cache_answers"] is False
            errors = _metric(c.get("/metrics").text, "duet_cache_requests_total", result="error")
            assert errors >= 5
    finally:
        redis.stop()
        stop_service(svc)
    assert "serving without the cache" in (tmp_path / "serve.log").read_text()


def test_redis_killed_and_restarted_under_load(index_dir: Path, tmp_path: Path) -> None:
    """Four clients search without pause while Redis is SIGKILLed and, 1.5 s later, started
    again on the same port: every request is answered 200, and caching comes back."""
    redis = start_redis(tmp_path)
    svc = start_service(index_dir, tmp_path / "serve.log", DUET_REDIS_URL=redis.url)
    stop = threading.Event()
    codes: list[int] = []

    def client(k: int) -> None:
        with svc.client() as c:
            for i in itertools.count():
                if stop.is_set():
                    return
                q = {"query": "a small red circle", "top_k": 1 + (k * 7 + i) % 20}
                codes.append(c.post("/search/text", json=q).status_code)

    try:
        with ThreadPoolExecutor(4) as pool:
            for k in range(4):
                pool.submit(client, k)
            time.sleep(1.5)
            redis.stop()  # SIGKILL
            time.sleep(1.5)
            redis = start_redis(tmp_path, port=redis.port)
            time.sleep(2.0)
            stop.set()
        with svc.client() as c:
            q = {"query": "a large blue square", "top_k": 2}
            c.post("/search/text", json=q)
            assert c.post("/search/text", json=q).json()["cached"] is True  # Redis is back
            assert c.get("/readyz").json()["cache_answers"] is True
    finally:
        redis.stop()
        stop_service(svc)
    assert len(codes) > 20 and set(codes) == {200}, collections.Counter(codes)
