"""The app in-process (httpx over ASGI): concurrent requests share re-rank batches."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from app.config import Settings
from app.main import create_app


async def test_concurrent_requests_share_rerank_batches(index_dir: Path) -> None:
    settings = Settings(index_dir=index_dir, rerank_max_batch=1000, rerank_max_wait_ms=200)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            queries = [f"a {c} circle above a small green square" for c in
                       ("red", "blue", "yellow", "purple", "orange", "green")]
            rs = await asyncio.gather(*(client.post("/search/text", json={
                "query": q, "top_k": 5, "candidates": 20}) for q in queries))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        hist = app.state.metrics.rerank_batch_size
        count = hist._sum  # total pairs scored
        samples = {s.name: s.value for m in hist.collect() for s in m.samples}
    assert samples["duet_rerank_batch_size_sum"] == 6 * 20 == count.get()
    # six requests, fewer forward passes: they were batched together
    assert samples["duet_rerank_batch_size_count"] < 6


async def test_not_ready_before_startup(index_dir: Path) -> None:
    app = create_app(Settings(index_dir=index_dir))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
        r = await client.post("/search/text", json={"query": "a red circle"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/healthz")).status_code == 200
