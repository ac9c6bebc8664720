"""Real checkpoints wired in: DUET_ENCODER / DUET_RERANKER and `duet build|eval --encoder
--reranker`, on tiny random CLIP, SigLIP and BLIP ITM directories (tests/hf_checkpoints.py).

build (the real CLI) -> serve (real uvicorn on a socket) -> query; every expected score is
computed here with `HFDualEncoder` / `HFBlipReranker` on the corpus' own files. Random weights:
this checks the plumbing, not retrieval quality. Wrong DUET_ENCODER / DUET_RERANKER choices
are in test_hf_wiring_choices.py.
"""

from __future__ import annotations

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
from duet.cli import main
from models.builtin import BuiltinModel
from models.fusion import DEFAULT_FUSION_LAMBDA, sigmoid
from models.hf import HFBlipReranker, HFDualEncoder
from models.images import KEEP_SIDE, side_of
from models.loading import ChoiceError, Models, load_models
from models.rerankers import menu as reranker_menu
from models.world import write_corpus
from store import indexio
from tests.conftest import Service, start_service, stop_service
from tests.hf_wiring_helpers import make_checkpoints

N_IMAGES = 24
TOKEN = "wiring-token"
QUERY = "a small red circle left of a large blue square"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), N_IMAGES, 4242, progress=False)


def _build(corpus: Path, out: Path, *options: str) -> None:
    assert (
        main(["build", "--corpus", str(corpus), "--out", str(out), "--no-progress", *options]) == 0
    )


@pytest.fixture(scope="module")
def clip_index(
    tmp_path_factory: pytest.TempPathFactory, ckpt: dict[str, Path], corpus: Path
) -> Path:
    """The CLI's `duet build --encoder CLIP --reranker BLIP`."""
    out = tmp_path_factory.mktemp("idx-clip")
    _build(corpus, out, "--encoder", str(ckpt["clip"]), "--reranker", str(ckpt["blip"]))
    return out


@pytest.fixture(scope="module")
def service(
    clip_index: Path, ckpt: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    svc = start_service(
        clip_index,
        log,
        DUET_ENCODER=str(ckpt["clip"]),
        DUET_RERANKER=str(ckpt["blip"]),
        DUET_INDEX_POLL_S="0",
        DUET_REDIS_URL="",
        DUET_ADMIN_TOKEN=TOKEN,
        DUET_DEVICE="cpu",
    )
    yield svc
    stop_service(svc)


@pytest.fixture(scope="module")
def direct(ckpt: dict[str, Path], corpus: Path) -> dict[str, Any]:
    """The adapters themselves, on every corpus image and caption."""
    enc, blip = HFDualEncoder(ckpt["clip"]), HFBlipReranker(ckpt["blip"])
    items = [json.loads(line) for line in corpus.read_text().splitlines()]
    images = [Image.open(corpus.parent / it["image"]).convert("RGB") for it in items]
    captions = [(f"{it['id']}#{n}", c) for it in items for n, c in enumerate(it["captions"])]
    vecs, _ = enc.encode_images(images)
    return {
        "enc": enc,
        "blip": blip,
        "ids": [it["id"] for it in items],
        "images": images,
        "image_vecs": vecs,
        "tokens": blip.image_tokens(images),
        "captions": captions,
        "text_vecs": enc.encode_texts([c for _, c in captions]),
    }


def _post(c: httpx.Client, path: str, **kw: Any) -> dict[str, Any]:
    r = c.post(path, **kw)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _check_ranking(hits: list[dict[str, Any]], expected: dict[str, float]) -> None:
    """The hits are the top-k of `expected` (up to near-ties), best first."""
    got = [h["id"] for h in hits]
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    rest = max((s for i, s in expected.items() if i not in got), default=-np.inf)
    assert min(expected[i] for i in got) >= rest - 1e-5


# -- build -----------------------------------------------------------------------------------
def test_build_stores_the_encoder_vectors_and_the_blip_tokens(
    clip_index: Path, direct: dict[str, Any]
) -> None:
    path = indexio.resolve_current(clip_index)
    manifest = indexio.Manifest.read(path).to_json()
    enc, blip = direct["enc"], direct["blip"]
    model = manifest["model"]
    assert model["encoder"]["fingerprint"] == enc.fingerprint
    assert model["reranker"]["fingerprint"] == blip.fingerprint
    assert model["fingerprint"] == f"{enc.fingerprint}+{blip.fingerprint}"
    assert manifest["image_tokens"]["shape"] == list(blip.token_shape)
    assert manifest["dim"] == enc.dim and manifest["counts"]["images"] == N_IMAGES
    version = indexio.IndexVersion.open(path, expect_fingerprint=model["fingerprint"])
    try:
        np.testing.assert_allclose(
            np.load(path / indexio.IMAGE_VECTORS), direct["image_vecs"], atol=1e-5
        )
        np.testing.assert_allclose(
            np.load(path / indexio.TEXT_VECTORS), direct["text_vecs"], atol=1e-5
        )
        np.testing.assert_allclose(
            np.asarray(version.image_tokens, np.float32),
            direct["tokens"].astype(np.float32),
            atol=2e-3,
        )
    finally:
        version.close()


# -- serve ---------------------------------------------------------------------------------
def test_text_search_is_clip_then_blip(service: Service, direct: dict[str, Any]) -> None:
    q = direct["enc"].encode_texts([QUERY])[0]
    dots = dict(zip(direct["ids"], direct["image_vecs"] @ q, strict=True))
    logits = direct["blip"].score_pairs([QUERY] * N_IMAGES, direct["tokens"])
    ce = dict(zip(direct["ids"], sigmoid(logits), strict=True))
    fused = {i: DEFAULT_FUSION_LAMBDA * dots[i] + (1 - DEFAULT_FUSION_LAMBDA) * ce[i] for i in dots}
    with httpx.Client(base_url=service.url, timeout=30) as c:
        plain = _post(c, "/search/text", json={"query": QUERY, "top_k": 5, "reranker": "none"})
        reranked = _post(c, "/search/text", json={"query": QUERY, "top_k": 5})  # ce = BLIP
        late = c.post("/search/text", json={"query": QUERY, "reranker": "late"})
        ready = c.get("/readyz").json()
    for h in plain["hits"]:
        assert h["rerank_score"] is None
        assert h["retrieval_score"] == pytest.approx(dots[h["id"]], abs=1e-5)
    _check_ranking(plain["hits"], dots)
    for h in reranked["hits"]:
        assert h["retrieval_score"] == pytest.approx(dots[h["id"]], abs=1e-5)
        assert h["rerank_score"] == pytest.approx(ce[h["id"]], abs=1e-5)
        assert h["score"] == pytest.approx(fused[h["id"]], abs=1e-5)
    _check_ranking(reranked["hits"], fused)
    assert late.status_code == 422 and late.json()["error"]["code"] == "reranker_unavailable"
    assert "available: ce, none" in late.json()["error"]["message"]
    assert ready["model"] == f"{direct['enc'].fingerprint}+{direct['blip'].fingerprint}"
    assert ready["rerankers"] == {"available": ["ce", "none"], "default": "ce"}


def test_image_search_is_clip_then_blip(
    service: Service, corpus: Path, direct: dict[str, Any]
) -> None:
    data = (corpus.parent / "images" / "0005.png").read_bytes()
    v, _ = direct["enc"].encode_images([direct["images"][5]])
    ids = [i for i, _ in direct["captions"]]
    texts = [c for _, c in direct["captions"]]
    dots = dict(zip(ids, direct["text_vecs"] @ v[0], strict=True))
    tokens = direct["blip"].image_tokens([direct["images"][5]])
    ce = dict(
        zip(
            ids,
            sigmoid(direct["blip"].score_pairs(texts, np.repeat(tokens, len(texts), axis=0))),
            strict=True,
        )
    )
    with httpx.Client(base_url=service.url, timeout=30) as c:
        plain = _post(
            c,
            "/search/image",
            files={"image": ("q.png", data, "image/png")},
            data={"top_k": "5", "reranker": "none"},
        )
        # every caption a candidate: the expected top-5 is over all of them
        reranked = _post(
            c,
            "/search/image",
            files={"image": ("q.png", data, "image/png")},
            data={"top_k": "5", "candidates": "200", "fusion": "none"},
        )
    for h in plain["hits"]:
        assert h["retrieval_score"] == pytest.approx(dots[h["id"]], abs=1e-5)
    _check_ranking(plain["hits"], dots)
    for h in reranked["hits"]:
        assert h["retrieval_score"] == pytest.approx(dots[h["id"]], abs=1e-5)
        assert h["rerank_score"] == pytest.approx(ce[h["id"]], abs=1e-4)
        assert h["score"] == h["rerank_score"]  # fusion none: BLIP alone
    _check_ranking(reranked["hits"], ce)


def test_serving_an_index_of_another_encoder_is_refused(
    clip_index: Path,
    ckpt: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    (served / "current").symlink_to(indexio.resolve_current(clip_index))
    monkeypatch.setenv("DUET_ENCODER", str(ckpt["siglip"]))
    monkeypatch.setenv("DUET_RERANKER", str(ckpt["blip"]))
    monkeypatch.setenv("DUET_PORT", "0")  # `duet serve` tries its port first: 8000 may be taken
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("served a foreign index"))
    assert main(["serve", "--index-dir", str(served)]) == 2
    err = capsys.readouterr().err
    assert "was built by model 'hf-clip:" in err and "hf-siglip:" in err
    assert "encoder hf-clip:" in err and str(ckpt["clip"].resolve()) in err
    assert "DUET_ENCODER" in err and "rebuild the index" in err


# -- eval --------------------------------------------------------------------------------------
def test_eval_scores_the_index_with_blip(
    clip_index: Path, ckpt: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "eval",
        "--index",
        str(clip_index),
        "--encoder",
        str(ckpt["clip"]),
        "--reranker",
        str(ckpt["blip"]),
        "--modes",
        "dot,coop",
        "--candidates",
        "5",
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["models"]["reranker"]["name"] == "hf-blip-itm"
    assert set(result["modes"]) == {"dot", "coop"}
    assert result["pool"] == {"images": N_IMAGES, "texts": 5 * N_IMAGES}
    # another encoder is refused; none evaluates dot only
    assert main([*args[:3], "--encoder", str(ckpt["siglip"]), "--reranker", str(ckpt["blip"])]) == 2
    assert "was built by model" in capsys.readouterr().err
    assert main([*args[:5], "--reranker", "none", "--modes", "dot,coop"]) == 2
    assert "only --modes dot" in capsys.readouterr().err


# -- reranker none, defaults, the builtin model -------------------------------------------------
async def _ask(models: Models, index_dir: Path, *bodies: dict[str, Any]) -> list[httpx.Response]:
    """POST /search/text with each body (plus QUERY) to an in-process app serving `models`."""
    index = indexio.IndexVersion.open(
        indexio.resolve_current(index_dir), expect_fingerprint=models.fingerprint
    )
    app = create_app(Settings(index_dir=index_dir, index_poll_s=0), Resources(models, index))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://duet") as client,
    ):
        return [await client.post("/search/text", json={"query": QUERY, **b}) for b in bodies]


async def test_reranker_none_stores_no_tokens_and_serves_the_dot_order(
    ckpt: dict[str, Path], corpus: Path, tmp_path: Path
) -> None:
    _build(corpus, tmp_path, "--encoder", str(ckpt["siglip"]), "--reranker", "none")
    path = indexio.resolve_current(tmp_path)
    manifest = indexio.Manifest.read(path).to_json()
    assert manifest["image_tokens"]["shape"] == [0, 0]
    assert manifest["model"]["reranker"] == {"name": "none", "fingerprint": "none"}
    models = load_models(str(ckpt["siglip"]), "none")
    assert models.fingerprint == manifest["model"]["fingerprint"]
    assert side_of(models) == KEEP_SIDE  # a processor resizes from the whole picture
    short = {"query": "a red circle"}  # the tiny SigLIP reads 16 tokens of its small vocabulary
    default, ce, fused = await _ask(
        models,
        tmp_path,
        {"top_k": 3, **short},
        {"reranker": "ce", **short},
        {"fusion": "add", **short},
    )
    assert default.status_code == 200, default.text
    assert all(h["rerank_score"] is None for h in default.json()["hits"])
    assert ce.status_code == 422 and "not configured (DUET_RERANKER=none)" in ce.text
    assert fused.status_code == 422 and "fusion needs a re-ranker" in fused.text


async def test_reranker_late_is_the_default_of_requests(corpus: Path, tmp_path: Path) -> None:
    models = load_models("builtin", "late")
    builtin = BuiltinModel.load()
    assert models.fingerprint == builtin.fingerprint  # the same index serves builtin and late
    assert reranker_menu(models).default == "late"
    _build(corpus, tmp_path, "--reranker", "late")
    default, late, ce = await _ask(
        models, tmp_path, {"theta": 0.3}, {"reranker": "late", "theta": 0.3}, {"reranker": "ce"}
    )
    assert default.status_code == 200, default.text
    assert default.json()["hits"] == late.json()["hits"]
    assert ce.status_code == 200 and ce.json()["hits"] != late.json()["hits"]


def test_clip_with_the_builtin_cross_encoder_stores_builtin_tokens(
    ckpt: dict[str, Path], corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _build(corpus, tmp_path, "--encoder", str(ckpt["clip"]), "--reranker", "builtin")
    path = indexio.resolve_current(tmp_path)
    builtin = BuiltinModel.load()
    first = Image.open(corpus.parent / "images" / "0000.png")
    np.testing.assert_allclose(
        np.load(path / indexio.IMAGE_TOKENS)[0].astype(np.float32),
        builtin.encode_images([first])[1][0].astype(np.float32),
        atol=1e-3,
    )
    assert (
        indexio.Manifest.read(path).to_json()["model"]["reranker"]["fingerprint"]
        == builtin.fingerprint
    )
    # an append must encode with the models that built the base
    assert main(["build", "--append", str(corpus), "--out", str(tmp_path)]) == 2
    assert "--append/--delete" in capsys.readouterr().err


def test_menus_and_fingerprints_of_the_combinations(ckpt: dict[str, Path]) -> None:
    builtin = BuiltinModel.load()
    clip_builtin = load_models(str(ckpt["clip"]), "builtin")
    assert clip_builtin.menu.available == ("ce", "none")
    # the real reason for each (han said "its model has no trained HAN head", which it has)
    why = clip_builtin.menu.why
    assert "the hf-clip encoder lacks" in why["late"] and why["late"] == why["han"]
    assert clip_builtin.token_shape == builtin.token_shape
    assert clip_builtin.fingerprint.endswith(f"+{builtin.fingerprint}")
    builtin_blip = load_models("builtin", str(ckpt["blip"]))
    assert builtin_blip.menu.available == ("ce", "none")
    assert "stores the BLIP re-ranker's" in builtin_blip.menu.why["han"]
    clip_none = load_models(str(ckpt["clip"]), "none")  # late said "not configured (=none)"
    assert "lacks" in clip_none.menu.why["late"] and "not configured" in clip_none.menu.why["ce"]
    blip_fp = builtin_blip.token_part.fingerprint
    assert builtin_blip.fingerprint == f"{builtin.fingerprint}+{blip_fp}"
    assert load_models("builtin", "none").menu.available == ("none",)
    assert load_models("builtin", "none").fingerprint == builtin.fingerprint
    with pytest.raises(ChoiceError, match=r"--reranker=late needs"):
        load_models(str(ckpt["clip"]), "late", labels=("--encoder", "--reranker"))


def test_cache_identity_is_what_the_models_read(ckpt: dict[str, Path]) -> None:
    """The cache keys a query by what every model reading it sees (issue 15): the builtin
    word tokenizer reads only a-z and digits, a sub-word tokenizer reads the text as given, so
    "c++" and "c#", or two Japanese queries, must not share an entry there."""
    builtin = load_models("builtin", "builtin")
    assert builtin.query_identity("  A Red, circle! ") == "a red circle"
    assert builtin.query_identity("c++") == builtin.query_identity("c#") == "c"
    # "and" is read as "with" (models.shipped.ALIASES), so both spellings share one entry
    assert builtin.query_identity("A red circle AND a square") == "a red circle with a square"
    for models in (
        load_models(str(ckpt["clip"]), "builtin"),
        load_models("builtin", str(ckpt["blip"])),
    ):
        for text in ("c++", "c#", "日本の猫", "猫", " a red circle"):
            assert models.query_identity(text) == text


# -- reload (last: it re-points the served index directory) -------------------------------------
def test_reload_refuses_a_version_built_with_another_encoder(
    service: Service, clip_index: Path, corpus: Path, ckpt: dict[str, Path]
) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as c:
        serving = c.get("/readyz").json()["index_version"]
        _build(
            corpus, clip_index, "--encoder", str(ckpt["siglip"]), "--reranker", str(ckpt["blip"])
        )
        siglip = indexio.Manifest.read(indexio.resolve_current(clip_index)).to_json()
        assert siglip["model"]["encoder"]["name"] == "hf-siglip"
        r = c.post("/admin/reload", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "index_refused" and err["serving"] == serving
        assert "was built by model 'hf-siglip:" in err["message"]
        assert c.get("/readyz").json()["index_version"] == serving
        assert c.post("/search/text", json={"query": QUERY}).status_code == 200
