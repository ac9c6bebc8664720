"""The re-ranker registry: a re-ranker added from outside duet's code (this file and one
`register` line) is in the API schema, the service's menu, the pipeline's dispatch and
`duet eval`'s modes, served by real uvicorn over a socket; one that cannot be built is
refused with the reason its entry gives."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn

from app.config import Settings
from app.main import create_app
from duet.commands.evaluate import eval_modes
from models import rerankers
from models.rerankers import Pairs, Reranker, Scorer
from tests.conftest import free_port


def farthest(model: object) -> Scorer:
    """A toy re-ranker: the candidates the dot product liked least come first."""

    def score(pairs: Pairs) -> np.ndarray:
        return -np.asarray(pairs.dots, np.float32)

    return score


def needs_a_gpu(model: object) -> str:
    return "needs a GPU, and this deployment has none"


@pytest.fixture
def toys() -> Iterator[None]:
    rerankers.register(Reranker("farthest", "the dot product's order, reversed", farthest))
    rerankers.register(Reranker("gpuonly", "a re-ranker this host cannot run", needs_a_gpu))
    try:
        yield
    finally:
        rerankers.unregister("farthest")
        rerankers.unregister("gpuonly")


@pytest.fixture
def served(toys: None, index_dir: Path, corpus: Path) -> Iterator[str]:
    """The app with the toys registered, on real uvicorn in a thread."""
    port = free_port()
    app = create_app(
        Settings(index_dir=index_dir, index_poll_s=0, redis_url="", images_dir=corpus.parent)
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("the service did not become ready")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


def test_a_registered_reranker_is_documented_offered_and_run(served: str) -> None:
    with httpx.Client(base_url=served, timeout=30) as c:
        doc = c.get("/openapi.json").json()
        text_enum = doc["components"]["schemas"]["TextSearchRequest"]["properties"]["reranker"]
        assert "farthest" in text_enum["anyOf"][0]["enum"]
        multipart = doc["paths"]["/search/image"]["post"]["requestBody"]["content"]
        props = multipart["multipart/form-data"]["schema"]["properties"]
        assert "farthest" in props["reranker"]["enum"]

        body = {"query": "a small red circle left of a large blue square", "top_k": 10}
        dot = c.post("/search/text", json={**body, "reranker": "none"})
        toy = c.post("/search/text", json={**body, "reranker": "farthest", "candidates": 10})
        assert dot.status_code == 200 and toy.status_code == 200, toy.text
        dot_ids = [h["id"] for h in dot.json()["hits"]]
        toy_hits = toy.json()["hits"]
        assert [h["id"] for h in toy_hits] == dot_ids[::-1]  # its scores decided the order
        assert toy.json()["reranked"] == 10
        # its default fusion is none: the score is the toy's own (minus the dot product)
        for h in toy_hits:
            assert h["score"] == pytest.approx(-h["retrieval_score"], abs=1e-5)

        # the image route dispatches to it too (candidates are captions there)
        picture = c.get(toy_hits[0]["image_url"])
        assert picture.status_code == 200
        img = c.post(
            "/search/image",
            json={
                "image_b64": base64.b64encode(picture.content).decode(),
                "reranker": "farthest",
                "candidates": 5,
                "top_k": 5,
            },
        )
        assert img.status_code == 200, img.text
        scores = [h["score"] for h in img.json()["hits"]]
        assert scores == sorted(scores, reverse=True)
        assert [h["retrieval_score"] for h in img.json()["hits"]] == sorted(
            h["retrieval_score"] for h in img.json()["hits"]
        )

        refused = c.post("/search/text", json={**body, "reranker": "gpuonly"})
        assert refused.status_code == 422
        err = refused.json()["error"]
        assert err["code"] == "reranker_unavailable"
        assert "needs a GPU" in err["message"] and "farthest" in err["message"]

        unknown = c.post("/search/text", json={**body, "reranker": "bm25"})
        assert unknown.status_code == 422 and "farthest" in unknown.text


def test_a_reranker_with_an_evaluator_is_a_duet_eval_mode(toys: None) -> None:
    assert "farthest" not in eval_modes()  # no evaluator: the service only
    rerankers.register(
        Reranker(
            "farthest",
            "the dot product's order, reversed",
            farthest,
            evaluate=lambda model, theta: lambda d, dots, words, mask, images: -dots,
        )
    )
    assert "farthest" in eval_modes()
    assert eval_modes()[:2] == ("dot", "coop") and eval_modes()[-1] == "ce-full"


def test_names_stay_plain() -> None:
    for bad in ("none", "two words", ""):
        with pytest.raises(ValueError, match="plain name"):
            rerankers.register(Reranker(bad, "", farthest))


def test_the_setting_names_the_cross_encoder_as_a_request_does() -> None:
    """DUET_RERANKER=ce is what `reranker: ce` runs; `builtin`, its older name, is the same."""
    from models.loading import load_models

    ce, builtin = load_models("builtin", "ce"), load_models("builtin", "builtin")
    assert ce.fingerprint == builtin.fingerprint
    assert ce.menu.available == builtin.menu.available == ("ce", "late", "han", "none")
    assert ce.menu.default == builtin.menu.default == "ce"
    assert set(load_models("builtin", "none").menu.why) == {"ce", "late", "han"}
