"""Per-request re-ranking options (`reranker`, `fusion`, `lambda`, `theta`) on a real `duet serve`.

Every expected score is recomputed here from the model and the index the service loaded:
the cross-encoder's probability, ADD / NORM_ADD fusion, and late interaction's S_gl.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from app.config import Settings
from app.main import Resources, create_app
from models.builtin import BuiltinModel
from models.fusion import DEFAULT_FUSION_LAMBDA, norm_add_scores, norm_fuse, sigmoid
from models.han import HANReranker, with_dot
from models.late import DEFAULT_THETA, late_scores
from models.trainconfig import DEFAULT_WEIGHTS
from store.indexio import IndexVersion, resolve_current
from tests.conftest import Service, start_service, stop_service

pytestmark = pytest.mark.slow

QUERY = "two small green triangles left of a large red diamond"
TOL = 2e-4  # the service's forward passes batch and pad differently from the ones here


@pytest.fixture(scope="module")
def service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    svc = start_service(index_dir, log, DUET_INDEX_POLL_S="0", DUET_REDIS_URL="")
    yield svc
    stop_service(svc)


@pytest.fixture(scope="module")
def index(index_dir: Path, model: BuiltinModel) -> Iterator[IndexVersion]:
    version = IndexVersion.open(resolve_current(index_dir), expect_fingerprint=model.fingerprint)
    yield version
    version.close()


@pytest.fixture(scope="module")
def image_rows(index: IndexVersion) -> dict[str, int]:
    n = index.image_index.ntotal
    return {row.id: i for i, row in enumerate(index.store.images(list(range(n))))}


def _image(corpus: Path, i: int = 3) -> bytes:
    return (corpus.parent / "images" / f"{i:04d}.png").read_bytes()


def _text(c: httpx.Client, **opts: Any) -> dict[str, Any]:
    r = c.post("/search/text", json={"query": QUERY, **opts})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _image_search(c: httpx.Client, data: bytes, **opts: Any) -> dict[str, Any]:
    """Multipart: every option travels as a form field (a string)."""
    fields = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in opts.items()}
    r = c.post("/search/image", files={"image": ("q.png", data, "image/png")}, data=fields)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _cols(body: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hits = body["hits"]
    return (
        np.array([h["retrieval_score"] for h in hits]),
        np.array([h["rerank_score"] for h in hits], dtype=np.float64),
        np.array([h["score"] for h in hits]),
    )


def _ordered(body: dict[str, Any]) -> None:
    scores = [h["score"] for h in body["hits"]]
    assert scores == sorted(scores, reverse=True)
    assert [h["rank"] for h in body["hits"]] == list(range(1, len(scores) + 1))


def _ce_text(
    model: BuiltinModel, index: IndexVersion, rows: dict[str, int], body: dict[str, Any]
) -> np.ndarray:
    """The cross-encoder's logits for the query and each hit's stored image tokens."""
    toks = np.asarray(index.image_tokens[[rows[h["id"]] for h in body["hits"]]])
    return model.score_pairs([QUERY] * len(body["hits"]), toks)


# -- the cross-encoder with each fusion --------------------------------------------------------
def test_fusion_none_scores_are_the_ce_probability(
    service: Service, model: BuiltinModel, index: IndexVersion, image_rows: dict[str, int]
) -> None:
    with service.client() as c:
        body = _text(c, top_k=10, candidates=10, reranker="ce", fusion="none")
    _, rr, score = _cols(body)
    np.testing.assert_allclose(rr, sigmoid(_ce_text(model, index, image_rows, body)), atol=TOL)
    np.testing.assert_array_equal(score, rr)
    _ordered(body)


def test_add_with_lambda(
    service: Service, model: BuiltinModel, index: IndexVersion, image_rows: dict[str, int]
) -> None:
    with service.client() as c:
        body = _text(c, top_k=10, candidates=10, fusion="add", **{"lambda": 0.3})
        default = _text(c, top_k=10, candidates=10)  # add with DUET_RERANK_FUSION_LAMBDA
    dots, rr, score = _cols(body)
    np.testing.assert_allclose(rr, sigmoid(_ce_text(model, index, image_rows, body)), atol=TOL)
    np.testing.assert_allclose(score, 0.3 * dots + 0.7 * rr, atol=1e-6)
    _ordered(body)
    d_dots, d_rr, d_score = _cols(default)
    lam = DEFAULT_FUSION_LAMBDA
    np.testing.assert_allclose(d_score, lam * d_dots + (1 - lam) * d_rr, atol=1e-6)
    assert not np.allclose(sorted(score), sorted(d_score))  # lambda took effect


def test_norm_add_matches_norm_fuse(
    service: Service, model: BuiltinModel, index: IndexVersion, image_rows: dict[str, int]
) -> None:
    with service.client() as c:  # top_k == candidates: the normalisation set is all returned
        body = _text(c, top_k=12, candidates=12, fusion="norm_add", **{"lambda": 0.4})
    dots, _, score = _cols(body)
    logits = _ce_text(model, index, image_rows, body)
    np.testing.assert_allclose(score, norm_fuse(dots, logits, 0.4), atol=TOL)
    assert score.min() >= -TOL and score.max() <= 1 + TOL  # both terms normalised to 0-1
    _ordered(body)


def test_image_endpoint_ce_options(service: Service, model: BuiltinModel, corpus: Path) -> None:
    data = _image(corpus)
    with service.client() as c:
        alone = _image_search(c, data, top_k=8, candidates=8, reranker="ce", fusion="none")
        added = _image_search(c, data, top_k=8, candidates=8, fusion="add", **{"lambda": 0.2})
        normed = _image_search(c, data, top_k=8, candidates=8, fusion="norm_add", **{"lambda": 0.5})
    _, toks = model.encode_images([Image.open(io.BytesIO(data))])
    texts = [h["meta"]["text"] for h in alone["hits"]]
    probs = sigmoid(model.score_pairs(texts, np.repeat(toks, len(texts), axis=0)))
    _, rr, score = _cols(alone)
    np.testing.assert_allclose(rr, probs, atol=TOL)
    np.testing.assert_array_equal(score, rr)
    dots, rr, score = _cols(added)
    np.testing.assert_allclose(score, 0.2 * dots + 0.8 * rr, atol=1e-6)
    dots, rr, score = _cols(normed)
    logits = np.log(rr / (1 - rr))  # the CE probabilities the service returned, as logits
    np.testing.assert_allclose(score, norm_fuse(dots, logits, 0.5), atol=TOL)
    for body in (alone, added, normed):
        _ordered(body)


# -- late interaction ------------------------------------------------------------------------
def test_late_text_query_is_s_gl(
    service: Service, model: BuiltinModel, index: IndexVersion, image_rows: dict[str, int]
) -> None:
    with service.client() as c:
        body = _text(c, top_k=10, candidates=10, reranker="late", theta=0.3)
        default = _text(c, top_k=10, candidates=10, reranker="late")
        theta0 = _text(c, top_k=10, candidates=10, reranker="late", theta=0)
    q, mask = model.text_token_features([QUERY])
    for got, theta in ((body, 0.3), (default, DEFAULT_THETA)):
        dots, rr, score = _cols(got)
        toks = np.asarray(index.image_tokens[[image_rows[h["id"]] for h in got["hits"]]])
        n = len(dots)
        want = late_scores(
            dots,
            np.repeat(q, n, axis=0),
            np.repeat(mask, n, axis=0),
            toks.astype(np.float32),
            theta,
        )
        np.testing.assert_allclose(rr, want, atol=TOL)
        np.testing.assert_array_equal(score, rr)  # late's default fusion is none: S_gl alone
        _ordered(got)
    dots, rr, _ = _cols(theta0)  # theta = 0 is the bi-encoder alone
    np.testing.assert_allclose(rr, dots, atol=1e-6)
    assert not np.allclose(_cols(body)[1], _cols(default)[1])


def test_late_image_query_uses_caption_tokens(
    service: Service, model: BuiltinModel, corpus: Path
) -> None:
    data = _image(corpus, 5)
    with service.client() as c:
        body = _image_search(c, data, top_k=10, candidates=10, reranker="late", theta=0.6)
        added = _image_search(
            c,
            data,
            top_k=10,
            candidates=10,
            reranker="late",
            theta=0.6,
            fusion="add",
            **{"lambda": 0.5},
        )
    _, toks = model.encode_images([Image.open(io.BytesIO(data))])
    texts = [h["meta"]["text"] for h in body["hits"]]
    items, item_mask = model.text_token_features(texts)
    dots, rr, score = _cols(body)
    n = len(texts)
    q = np.repeat(toks.astype(np.float32), n, axis=0)
    want = late_scores(dots, q, np.ones(q.shape[:2], dtype=bool), items, 0.6, item_mask)
    np.testing.assert_allclose(rr, want, atol=TOL)
    np.testing.assert_array_equal(score, rr)
    _ordered(body)
    dots, rr, score = _cols(added)
    np.testing.assert_allclose(score, 0.5 * dots + 0.5 * rr, atol=1e-6)
    _ordered(added)


# -- HAN ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def han(model: BuiltinModel) -> HANReranker:
    head = HANReranker.load(DEFAULT_WEIGHTS, model)
    assert head is not None, "the shipped weights carry a HAN head"
    return head


def test_han_text_query_is_s_avg_blended_with_the_dot(
    service: Service, han: HANReranker, index: IndexVersion, image_rows: dict[str, int]
) -> None:
    with service.client() as c:
        body = _text(c, top_k=10, candidates=10, reranker="han")
        fused = _text(
            c, top_k=10, candidates=10, reranker="han", fusion="norm_add", **{"lambda": 0.4}
        )
    dots, rr, score = _cols(body)
    toks = np.asarray(index.image_tokens[[image_rows[h["id"]] for h in body["hits"]]])
    s_avg = han.score_pairs([QUERY] * len(dots), toks)
    np.testing.assert_allclose(rr, with_dot(dots, s_avg), atol=TOL)
    assert np.abs(rr - s_avg).max() > 10 * TOL  # the dot product's share is there
    np.testing.assert_array_equal(score, rr)  # han's default fusion is none: its score alone
    _ordered(body)
    dots, rr, score = _cols(fused)
    np.testing.assert_allclose(score, norm_add_scores(dots, rr, 0.4), atol=1e-6)


def test_han_image_query_scores_the_candidate_captions(
    service: Service, model: BuiltinModel, han: HANReranker, corpus: Path
) -> None:
    data = _image(corpus, 7)
    with service.client() as c:
        body = _image_search(c, data, top_k=10, candidates=10, reranker="han")
    _, toks = model.encode_images([Image.open(io.BytesIO(data))])
    texts = [h["meta"]["text"] for h in body["hits"]]
    dots, rr, _ = _cols(body)
    s_avg = han.score_pairs(texts, np.repeat(toks, len(texts), axis=0))
    np.testing.assert_allclose(rr, with_dot(dots, s_avg), atol=TOL)
    _ordered(body)


# -- no re-ranker ------------------------------------------------------------------------------
def test_reranker_none_is_the_dot_order(service: Service, corpus: Path) -> None:
    data = _image(corpus)
    with service.client() as c:
        text_none = _text(c, top_k=6, reranker="none")
        text_flag = _text(c, top_k=6, rerank=False)
        img_none = _image_search(c, data, top_k=6, reranker="none")
        img_flag = c.post(
            "/search/image",
            json={"image_b64": base64.b64encode(data).decode(), "top_k": 6, "rerank": False},
        ).json()
    for none, flag in ((text_none, text_flag), (img_none, img_flag)):
        assert [h["id"] for h in none["hits"]] == [h["id"] for h in flag["hits"]]
        dots, _, score = _cols(none)
        assert all(h["rerank_score"] is None for h in none["hits"])
        np.testing.assert_array_equal(score, dots)
        assert list(dots) == sorted(dots, reverse=True)
        assert "rerank" not in none["timings_ms"]


# -- invalid options: a 4xx that says what is allowed, never a 500 ---------------------------
BAD: list[tuple[dict[str, Any], int, str, list[str]]] = [
    ({"reranker": "bm25"}, 422, "validation_error", ["bm25", "ce, late, han, none"]),
    ({"fusion": "mul"}, 422, "validation_error", ["'none'", "'add'", "'norm_add'"]),
    ({"lambda": 1.5}, 422, "validation_error", ["lambda", "1"]),
    ({"lambda": -0.1}, 422, "validation_error", ["lambda", "0"]),
    ({"reranker": "late", "theta": 2}, 422, "validation_error", ["theta", "1"]),
    ({"theta": 0.3}, 422, "validation_error", ["theta applies only to reranker=late"]),
    ({"rerank": False, "reranker": "ce"}, 422, "validation_error", ["contradicts"]),
    ({"rerank": True, "reranker": "none"}, 422, "validation_error", ["contradicts"]),
    ({"reranker": "none", "fusion": "add"}, 422, "validation_error", ["fusion needs"]),
    ({"rerank": False, "lambda": 0.2}, 422, "validation_error", ["lambda needs"]),
    ({"fusion": "none", "lambda": 0.2}, 422, "validation_error", ["lambda applies only"]),
    (
        {"reranker": "han", "theta": 0.2},
        422,
        "validation_error",
        ["theta applies only to reranker=late"],
    ),
]


def _bad_requests(c: httpx.Client, data: bytes, opts: dict[str, Any]) -> list[httpx.Response]:
    form = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in opts.items()}
    return [
        c.post("/search/text", json={"query": QUERY, **opts}),
        c.post("/search/image", files={"image": ("q.png", data, "image/png")}, data=form),
        c.post("/search/image", json={"image_b64": base64.b64encode(data).decode(), **opts}),
    ]


@pytest.mark.parametrize(
    ("opts", "status", "code", "says"), BAD, ids=[json.dumps(b[0]) for b in BAD]
)
def test_bad_options_are_4xx_naming_what_is_allowed(
    service: Service, corpus: Path, opts: dict[str, Any], status: int, code: str, says: list[str]
) -> None:
    with service.client() as c:
        for r in _bad_requests(c, _image(corpus), opts):
            assert r.status_code == status, (r.request.url, r.text)
            err = r.json()["error"]
            assert err["code"] == code, r.text
            for s in says:
                assert s in err["message"], (s, err["message"])


# -- the cache keeps options apart -------------------------------------------------------------
def test_cache_entries_are_per_option(service: Service, corpus: Path) -> None:
    query = "a tiny purple cross in the top left"
    other_lambda = 0.7  # not the default: an omitted lambda and the default share one entry
    assert other_lambda != DEFAULT_FUSION_LAMBDA
    variants: list[dict[str, Any]] = [
        {},
        {"fusion": "none"},
        {"lambda": other_lambda},
        {"fusion": "norm_add"},
        {"reranker": "late"},
        {"reranker": "late", "theta": 0.9},
        {"reranker": "none"},
    ]
    with service.client() as c:
        first = [
            c.post("/search/text", json={"query": query, "top_k": 5, **v}).json() for v in variants
        ]
        again = [
            c.post("/search/text", json={"query": query, "top_k": 5, **v}).json() for v in variants
        ]
        flag = c.post("/search/text", json={"query": query, "top_k": 5, "rerank": False}).json()
        data = _image(corpus, 7)
        img_ce = _image_search(c, data, top_k=5, fusion="none")
        img_late = _image_search(c, data, top_k=5, reranker="late")
    assert all(b["cached"] is False for b in first), [b["cached"] for b in first]
    assert all(b["cached"] is True for b in again)
    for a, b in zip(first, again, strict=True):
        assert a["hits"] == b["hits"]
    scores = [tuple(h["score"] for h in b["hits"]) for b in first]
    assert len(set(scores)) == len(variants)  # each variant answered with its own scores
    assert flag["cached"] is True and flag["hits"] == first[-1]["hits"]  # same as reranker none
    assert img_late["cached"] is False
    assert [h["score"] for h in img_ce["hits"]] != [h["score"] for h in img_late["hits"]]


# -- a model without token features cannot run late interaction --------------------------------
class _NoTokens:
    """The real model minus `text_token_features`."""

    def __init__(self, model: BuiltinModel) -> None:
        self.name, self.fingerprint, self.dim = model.name, model.fingerprint, model.dim
        self.token_shape = model.token_shape
        self.encode_texts = model.encode_texts
        self.encode_images = model.encode_images
        self.score_pairs = model.score_pairs


async def test_late_is_unavailable_without_token_features(
    index_dir: Path, model: BuiltinModel
) -> None:
    index = IndexVersion.open(resolve_current(index_dir), expect_fingerprint=model.fingerprint)
    app = create_app(
        Settings(index_dir=index_dir, index_poll_s=0), Resources(_NoTokens(model), index)
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            late = await client.post("/search/text", json={"query": QUERY, "reranker": "late"})
            han = await client.post("/search/text", json={"query": QUERY, "reranker": "han"})
            ce = await client.post("/search/text", json={"query": QUERY, "reranker": "ce"})
    assert han.status_code == 422 and "no trained HAN head" in han.json()["error"]["message"]
    assert late.status_code == 422, late.text
    assert late.json()["error"]["code"] == "reranker_unavailable"
    assert "available: ce, none" in late.json()["error"]["message"]
    assert ce.status_code == 200
