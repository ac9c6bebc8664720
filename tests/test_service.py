"""The app in-process (httpx over ASGI): concurrent requests share engine batches."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
from prometheus_client import generate_latest

from app.config import Settings
from app.main import Resources, create_app
from app.routes.search import TextSearchASGI
from models.builtin import BuiltinModel
from store.indexio import IndexVersion, resolve_current


async def test_concurrent_requests_share_rerank_batches(index_dir: Path) -> None:
    settings = Settings(index_dir=index_dir, rerank_max_batch=1000)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            queries = [
                f"a {c} circle above a small green square"
                for c in ("red", "blue", "yellow", "purple", "orange", "green")
            ]
            rs = await asyncio.gather(
                *(
                    client.post("/search/text", json={"query": q, "top_k": 5, "candidates": 20})
                    for q in queries
                )
            )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        hist = app.state.metrics.rerank_batch_size
        count = hist._sum  # total pairs scored
        samples = {s.name: s.value for m in hist.collect() for s in m.samples}
        engine = {
            s.name: s.value
            for m in app.state.metrics.engine_batch_size.collect()
            for s in m.samples
        }
    assert samples["duet_rerank_batch_size_sum"] == 6 * 20 == count.get()
    # six requests, fewer forward passes and engine batches: they were batched together
    assert samples["duet_rerank_batch_size_count"] < 6
    assert engine["duet_engine_batch_size_sum"] == 6
    assert engine["duet_engine_batch_size_count"] < 6


async def test_a_batched_requests_stages_add_up_to_its_total(index_dir: Path) -> None:
    """Six requests in one engine batch, each its own re-rank call (20 pairs, at most 20 a
    call): the later ones wait in the worker for the earlier ones' calls. That wait is their
    `batch` stage, so each answer's stages add up to about its total (before it, most of a
    loaded request's total was in no stage); a lone request has no `batch`."""
    settings = Settings(index_dir=index_dir, rerank_max_batch=20)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            body = {"top_k": 5, "candidates": 20}
            lone = await client.post("/search/text", json={"query": "a red circle", **body})
            queries = [f"a {c} circle" for c in ("blue", "yellow", "purple", "orange", "green")]
            rs = await asyncio.gather(
                *(client.post("/search/text", json={"query": q, **body}) for q in queries)
            )
    assert lone.status_code == 200 and "batch" not in lone.json()["timings_ms"]
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    timings = [r.json()["timings_ms"] for r in rs]
    assert any(t.get("batch", 0) > 0 for t in timings), timings
    for t in timings:
        unattributed = t["total"] - sum(v for k, v in t.items() if k != "total")
        assert unattributed <= max(5.0, 0.2 * t["total"]), t


async def test_not_ready_before_startup(index_dir: Path) -> None:
    app = create_app(Settings(index_dir=index_dir))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
        r = await client.post("/search/text", json={"query": "a red circle"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/healthz")).status_code == 200


class _BrokenReranker:
    """The real model, except that its cross-encoder fails (e.g. out of memory)."""

    def __init__(self, model: BuiltinModel) -> None:
        self._model = model
        self.name, self.fingerprint, self.dim = model.name, model.fingerprint, model.dim
        self.token_shape = model.token_shape
        self.encode_texts = model.encode_texts
        self.encode_images = model.encode_images

    def score_pairs(self, texts: Sequence[str], image_tokens: np.ndarray) -> np.ndarray:
        raise MemoryError("simulated failure inside the cross-encoder")


async def test_rerank_failure_is_a_json_500_for_every_request(
    index_dir: Path, model: BuiltinModel
) -> None:
    settings = Settings(index_dir=index_dir)
    index = IndexVersion.open(resolve_current(index_dir), expect_fingerprint=model.fingerprint)
    app = create_app(settings, Resources(_BrokenReranker(model), index))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            rs = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        client.post("/search/text", json={"query": f"a red circle {i}"})
                        for i in range(4)
                    )
                ),
                timeout=30,
            )
            ok = await client.post("/search/text", json={"query": "a red circle", "rerank": False})
        text = generate_latest(app.state.metrics.registry).decode()
    assert [r.status_code for r in rs] == [500] * 4
    assert all(r.json()["error"]["code"] == "internal_error" for r in rs)
    assert "simulated" not in rs[0].text  # internals stay in the log
    assert ok.status_code == 200  # dot-only search still works
    assert 'duet_request_seconds_count{endpoint="/search/text",status="500"} 4.0' in text


class _PoisonedEncoder(_BrokenReranker):
    """The real model, except that one sentence makes its text encoder fail."""

    def __init__(self, model: BuiltinModel) -> None:
        super().__init__(model)
        self.score_pairs = model.score_pairs  # type: ignore[method-assign]
        self.encode_texts = self._encode_texts

    def _encode_texts(self, texts: Sequence[str]) -> np.ndarray:
        if any("poison" in t for t in texts):
            raise ValueError("simulated failure on one query")
        return self._model.encode_texts(texts)


async def test_one_failing_query_does_not_fail_its_batch_mates(
    index_dir: Path, model: BuiltinModel
) -> None:
    index = IndexVersion.open(resolve_current(index_dir), expect_fingerprint=model.fingerprint)
    app = create_app(
        Settings(index_dir=index_dir, index_poll_s=0), Resources(_PoisonedEncoder(model), index)
    )
    queries = ["a red circle", "a blue square", "poison", "a green cross", "a big diamond"]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            rs = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        client.post("/search/text", json={"query": q, "candidates": 20})
                        for q in queries
                    )
                ),
                30,
            )
        batches = {
            s.name: s.value
            for m in app.state.metrics.engine_batch_size.collect()
            for s in m.samples
        }
    assert [r.status_code for r in rs] == [200, 200, 500, 200, 200]
    assert batches["duet_engine_batch_size_count"] < len(queries)  # some shared a batch


# (content type, body) of text searches: answered, refused at each check, and one that fails
_TEXT_REQUESTS: list[tuple[str | None, str]] = [
    ("application/json", '{"query": "a red circle above a green square", "top_k": 3}'),
    ("application/json", '{"query": "two blue squares", "rerank": false, "candidates": 20}'),
    ("Application/JSON; charset=utf-8", '{"query": "a small yellow cross", "top_k": 2}'),
    ("application/json", '{"query": ""}'),
    ("application/json", "{}"),
    ("application/json", '{"query": 5}'),
    ("application/json", "not json"),
    ("application/json", "[]"),
    ("application/json", '{"query": "a red circle", "top_k": 0}'),
    ("application/json", '{"query": "a red circle", "reranker": "nope"}'),
    ("application/json", '{"query": "a red circle", "fusion": "bad", "extra": 1}'),
    ("application/json", '{"query": "a red circle", "candidates": 100000}'),
    ("application/json", b'{"query": "caf\xe9"}'.decode("latin-1")),
    ("text/plain", '{"query": "a red circle"}'),
    (None, '{"query": "a red circle"}'),
    ("application/json", '{"query": "a red poison circle"}'),  # the encoder fails: a 500
]


COUNTED = "duet_request_seconds_count"


def _same(a: object, b: object) -> bool:
    """`a` equals `b`, floats to 1e-5 relative, however deep."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


async def _answers(app: object) -> list[tuple[int, dict[str, str], object]]:
    """Each of `_TEXT_REQUESTS` through `app` in process: status, the headers a client reads,
    and the JSON body without its timings."""
    out = []
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
        for ctype, body in _TEXT_REQUESTS:
            headers = {} if ctype is None else {"content-type": ctype}
            r = await client.post("/search/text", content=body.encode("latin-1"), headers=headers)
            data = r.json()
            if isinstance(data, dict):
                data.pop("timings_ms", None)
            kept = ("content-type", "retry-after", "connection", "www-authenticate")
            out.append((r.status_code, {k: v for k, v in r.headers.items() if k in kept}, data))
        out.append(((await client.get("/search/text")).status_code, {}, None))
    return out


async def test_the_text_route_answers_as_fastapi_would_route_it(
    index_dir: Path, model: BuiltinModel
) -> None:
    """POST /search/text is answered past FastAPI's router (`TextSearchASGI`): the same
    requests through the router (the app with that middleware taken out) get the same status,
    headers and body, answers, each refusal and a failure alike; the request metrics count
    them under the route either way."""
    settings = Settings(index_dir=index_dir, index_poll_s=0)
    apps = []
    for fast in (True, False):
        index = IndexVersion.open(resolve_current(index_dir), expect_fingerprint=model.fingerprint)
        app = create_app(settings, Resources(_PoisonedEncoder(model), index))
        routed = [m for m in app.user_middleware if m.cls is not cast(Any, TextSearchASGI)]
        assert len(routed) == len(app.user_middleware) - 1
        if not fast:
            app.user_middleware = routed
        apps.append(app)
    answers, counts = [], []
    for app in apps:
        async with app.router.lifespan_context(app):
            answers.append(await asyncio.wait_for(_answers(app), 60))
        text = generate_latest(app.state.metrics.registry).decode()
        counts.append(sorted(ln for ln in text.splitlines() if ln.startswith(COUNTED)))
    got, want = answers
    statuses = [s for s, _, _ in want]
    assert statuses == [200, 200, 200, *[422] * 10, 415, 415, 500, 405]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        # scores to 1e-5: two runs of the CPU cross-encoder may differ in the 7th digit
        assert _same(a, b), (
            _TEXT_REQUESTS[i] if i < len(_TEXT_REQUESTS) else "GET",
            a,
            b,
        )
    assert counts[0] == counts[1]
    assert f'{COUNTED}{{endpoint="/search/text",status="422"}} 10.0' in counts[0]
