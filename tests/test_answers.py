"""Answers a person can trust (issue 37), against a real `duet serve` over real sockets: a query
the model understood nothing of is a 422 that says so; each hit carries its caption and
whether its score reads as a fit; a cached answer says how long it took; a JSON body must say
it is JSON (any case, any parameters); the page's icon is served."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from app.answers import best_caption, hits_of
from app.pipeline import render
from app.schemas import Hit, SearchResponse
from app.work import Answer
from models.builtin import BuiltinModel
from models.fusion import MATCH_THRESHOLD
from models.match_threshold import choose, served_caption_hits, served_hits, sweep
from models.tokenizer import WordTokenizer, unknown_words
from models.trainconfig import HELD_OUT_SEED_BASE
from models.world import Scene, satisfies
from tests.conftest import REPO, Service, start_service, stop_service

API_DOC = (REPO / "docs" / "api.md").read_text()
# fits no image of the tests' 40-image corpus (checked below): "nothing fits" as a person sees it
NO_FIT = "a large purple diamond in the top left corner"


@pytest.fixture(scope="module")
def service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(index_dir, tmp_path_factory.mktemp("answers") / "serve.log")
    yield svc
    stop_service(svc)


def test_readyz_and_the_log_say_when_hits_images_cannot_be_served(
    service: Service, corpus: Path
) -> None:
    """Served without DUET_IMAGES_DIR, from an index folder apart from its corpus: every
    hit's image_url is a 404, which /readyz and the start-up log say, naming the setting."""
    with service.client() as c:
        said = c.get("/readyz").json()["images"]
        hit = c.post("/search/text", json={"query": "a red circle", "top_k": 1}).json()
        assert c.get(hit["hits"][0]["image_url"]).status_code == 404
    assert f"set DUET_IMAGES_DIR={corpus.parent}" in said, said
    assert "GET /images/{id} cannot serve this version's images" in service.log.read_text()


def _scenes(corpus: Path) -> list[Scene]:
    lines = corpus.read_text().splitlines()
    return [Scene.from_json(json.loads(ln)["meta"]["scene"]) for ln in lines if ln.strip()]


# -- row 1: nothing understood ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("crimson box", ["crimson", "box"]),
        ("pink star", ["pink", "star"]),
        ("zzz qqq", ["zzz", "qqq"]),
        ("a pink star in the sky", ["pink", "star", "sky"]),  # articles, prepositions: nothing
        ("in the", []),
        ("🐶 ★", ["🐶", "★"]),  # answered 200 once symbols were in the cache key: a guess
    ],
)
def test_a_query_of_unknown_words_is_refused_plainly(
    service: Service, query: str, named: list[str]
) -> None:
    with service.client() as c:
        r = c.post("/search/text", json={"query": query})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error"
    assert "has no words the model can read" in err["message"]
    for word in named:
        assert f'"{word}"' in err["message"]
    assert "a red circle" in err["message"]  # says what to do instead


def test_a_refused_body_names_the_field_and_says_what_is_wrong(service: Service) -> None:
    """The text route reads its own body (app.routes.search._text_request): its 422s name
    the field, `query` included (it was dropped as if it were FastAPI's location word)."""
    cases = {
        '{"query": ""}': "query: String should have at least 1 character",
        "{}": 'query: Field required; send a JSON object such as {"query": ',
        '{"query": 5}': "query: Input should be a valid string",
        '{"query": "x", "top_k": "5"}': "top_k: Input should be a valid integer",
        '{"query": "x"': "body is not valid JSON at character 13 (JSON decode error)",
        "not json": "body is not valid JSON at character 0",
        "[" * 60000: "body is not valid JSON: nested too deeply",
        "[]": 'the body must be a JSON object such as {"query": "a red circle"}',
        '{"query": "x", "top_k": ' + "1" * 5000 + "}": "body is not valid JSON",  # not a 500
    }
    with service.client() as c:
        for body, says in cases.items():
            r = c.post("/search/text", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422, (body[:20], r.text)
            assert says in r.json()["error"]["message"], (body[:20], r.text)
        r = c.post("/search/text", content='{"query": "x"}', headers={"content-type": "text/plain"})
        assert r.status_code == 415, r.text  # before the body is read, as before


def test_a_query_with_one_known_content_word_is_answered(service: Service) -> None:
    with service.client() as c:
        r = c.post("/search/text", json={"query": "a big pink star", "top_k": 3})
    assert r.status_code == 200, r.text
    assert r.json()["unknown_words"] == ["pink", "star"] and len(r.json()["hits"]) == 3


def test_content_words_leave_out_articles_and_prepositions() -> None:
    tok = WordTokenizer(["a", "the", "in", "red", "circle", "left", "with"])
    assert tok.content_words("A red zebra in the left") == ["red", "left"]
    assert tok.content_words("a zebra in the sky and a cat") == []
    assert unknown_words("crimson box") == ["crimson", "box"]


def test_caption_words_read_every_ascii_text_as_the_tokenizer_pattern_does() -> None:
    """`caption_words` splits a plain text (lower-case letters and spaces once lowered) at its
    spaces and reads any other ASCII one with the pattern: the same words either way."""
    import random

    from models.shipped import caption_words

    rng = random.Random(5)
    alphabet = "abcxyz ABCXYZ  0123 9\t\n,.;'-_\u212a/"  # the Kelvin sign lowers to "k"
    texts = ["", " ", "a red circle", "  A  Red   circle ", "two 2red circles", "\u212aelvin"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    for text in texts:
        assert caption_words(text) == re.findall(r"[a-z]+|\d+", text.lower()), repr(text)


def test_caption_words_read_other_scripts_whole_and_full_width_letters_as_ascii() -> None:
    """A word with letters outside ASCII is one word, as typed (lower-cased), so the model
    reads it as one unknown word and the answer names it; compatibility forms (full-width
    letters and digits, ligatures) are read as the letters they stand for."""
    from models.shipped import caption_words

    assert caption_words("ｒｅｄ circle") == ["red", "circle"]
    assert caption_words("Ｒed ＣＩＲＣＬＥ １２") == ["red", "circle", "12"]
    assert caption_words("a café red circle") == ["a", "café", "red", "circle"]
    assert caption_words("naïve, NAÏVE") == ["naïve", "naïve"]
    assert caption_words("un cercle rouge é 日本の猫 🙂 red") == [
        *("un", "cercle", "rouge", "é", "日本の猫", "red")
    ]
    assert caption_words("ﬁre red\u00a0circle") == ["fire", "red", "circle"]
    assert caption_words("x_y 3d") == ["x", "y", "3", "d"]  # ASCII as the pattern reads it
    assert caption_words("नमस्ते दुनिया, İstanbul red") == ["नमस्ते", "दुनिया", "i̇stanbul", "red"]
    assert unknown_words("a café red circle") == ["café"]
    assert unknown_words("ｒｅｄ circle") == []
    assert unknown_words("naïve 日本の猫 🙂 red") == ["naïve", "日本の猫", "🙂"]


def test_emoji_and_signs_are_listed_as_unread_and_keep_their_own_cache_key() -> None:
    """The tokenizer drops symbols (no letter, no digit), so "a red 🐶 square" was answered
    as "a red square" with `unknown_words` empty; now each run of non-ASCII symbols is
    listed as typed (an emoji's skin tone, joined family or variation selector with it),
    punctuation is not, the ids are unchanged, and the cache key tells the two apart."""
    from models.shipped import caption_words, dropped_symbols
    from models.tokenizer import _shipped_vocab

    tok = _shipped_vocab()
    assert unknown_words("a red 🐶 square") == ["🐶"]
    assert tok.ids("a red 🐶 square") == tok.ids("a red square")
    assert tok.reading("a red 🐶 square") != tok.reading("a red square")
    assert tok.reading("a red 🐱 square") != tok.reading("a red 🐶 square")
    family, thumb, heart = "👨\u200d👩\u200d👧", "👍🏽", "❤\ufe0f"
    assert dropped_symbols(f"{family} {thumb}, {heart} ★→ a") == [family, thumb, heart, "★→"]
    assert caption_words(f"{heart} red") == ["red"]  # its selector was a word of its own
    assert dropped_symbols("a red, square! “quoted” – ok… 3$") == []
    # signs whose compatibility form is a word are read as it, not listed as signs too
    assert unknown_words("ⓡⓔⓓ square") == [] and tok.reading("ⓡⓔⓓ square") == "red square"
    assert unknown_words("red square ™") == ["tm"]  # was ["tm", "™"]
    # the keycaps of signs the tokenizer drops, and each subdivision's flag whole
    assert dropped_symbols("#\ufe0f\u20e3 red") == ["#\ufe0f\u20e3"]
    england = "\U0001f3f4" + "".join(chr(0xE0000 + ord(c)) for c in "gbeng") + "\U000e007f"
    scotland = "\U0001f3f4" + "".join(chr(0xE0000 + ord(c)) for c in "gbsct") + "\U000e007f"
    assert tok.reading(f"a red {england}") != tok.reading(f"a red {scotland}")
    assert tok.reading("a red 🐶 🐶") == tok.reading("a red 🐶")  # one cache entry


def test_a_query_longer_than_the_model_reads_is_refused_naming_the_limit(
    service: Service,
) -> None:
    """The builtin model reads 31 words after its [CLS]: a longer query would be answered from
    its first 31 alone, as confidently and with nothing saying so; it is a 422 instead."""
    tok = WordTokenizer(["a", "red"], max_len=4)
    assert tok.too_long("a red a") is None
    said = tok.too_long("red red red red red") or ""
    # "the words from "red" on" said nothing of which "red" (a QA's 35 reds)
    assert said.endswith(
        'has 5: shorten it by 2 (its last 2, from word 4, "red", on, would not be read)'
    )
    long_query = "a " * 31 + "large blue square"
    with service.client() as c:
        r = c.post("/search/text", json={"query": long_query, "top_k": 1})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert "at most 31 words and this query has 34" in err["message"]
        assert 'from word 32, "large", on' in err["message"]
        assert err["details"][0]["loc"] == ["body", "query"]
        ok = c.post("/search/text", json={"query": "a " * 28 + "red circle", "top_k": 1})
        assert ok.status_code == 200, ok.text


# -- rows 2 and 3: each hit's caption and match ---------------------------------------------
def test_hits_carry_their_caption_and_match(service: Service, corpus: Path) -> None:
    first = json.loads(corpus.read_text().splitlines()[0])
    with service.client() as c:
        body = c.post("/search/text", json={"query": first["captions"][0], "top_k": 5}).json()
        plain = c.post(
            "/search/text", json={"query": first["captions"][0], "top_k": 5, "reranker": "none"}
        ).json()
    top = body["hits"][0]
    assert top["id"] == first["id"] and top["match"] is True
    assert top["caption"] in first["captions"]
    for hit in body["hits"]:
        assert isinstance(hit["caption"], str) and hit["caption"]
        assert hit["match"] is (hit["score"] >= MATCH_THRESHOLD)
    # the threshold was chosen for the default fused score: another score has no `match`
    assert all(h["match"] is None for h in plain["hits"])


def test_a_query_nothing_fits_has_weak_hits(service: Service, corpus: Path) -> None:
    assert not any(satisfies(NO_FIT, s) for s in _scenes(corpus))
    with service.client() as c:
        body = c.post("/search/text", json={"query": NO_FIT, "top_k": 5}).json()
    assert body["hits"] and all(h["match"] is False for h in body["hits"]), body["hits"]


def test_caption_hits_carry_their_text(service: Service, corpus: Path) -> None:
    png = (corpus.parent / "images" / "0003.png").read_bytes()
    with service.client() as c:
        r = c.post(
            "/search/image", files={"image": ("q.png", png, "image/png")}, data={"top_k": "3"}
        )
    for hit in r.json()["hits"]:
        assert hit["caption"] == hit["meta"]["text"] and isinstance(hit["match"], bool)


def test_best_caption_shares_most_words_with_the_query() -> None:
    caps = ["a big red circle at the top", "there is a red circle", "a blue square"]
    assert best_caption("red circle", caps) == "there is a red circle"  # tie: the shorter
    assert best_caption("a blue square", caps) == "a blue square"
    assert best_caption("anything", []) is None
    # a word the caption repeats counts once
    assert best_caption("red circle", ["red red red square", "one red circle"]) == "one red circle"


@pytest.mark.parametrize("kind", ["text", "image"])
def test_a_rendered_answer_is_what_the_response_model_writes(kind: str) -> None:
    """The pipeline renders its hits as dicts (`hits_of`, `render`), not as models: the JSON
    must be, byte for byte, what `SearchResponse.model_dump_json()` writes of the same
    answer, and each hit a valid `Hit` (a field added to the model and not to the dicts, or
    in another order, fails here)."""
    meta_text: dict[str, object] = {
        "text": "a red circle left of a blue square",
        "image_id": "img-1",
        "seed": 3,
    }
    meta_image: dict[str, object] = {
        "image": "images/img-1.png",
        "scene": {"kind": "pair", "position": None},
    }
    meta_text["odd"] = meta_image["odd"] = [float("nan"), float("inf")]  # JSON's null, not NaN
    ranked = [(0, 0.51, 0.25, 0.43), (1, 0.5, None, 0.125), (2, float("nan"), None, 0.1)]
    meta = [(f"i{i}", dict(meta_text if kind == "image" else meta_image)) for i in range(3)]
    captions = {"i0": ["a red circle", "a circle that is red and big"], "i1": []}
    answer = Answer(ranked, meta, {"search": 1.5}, 2, degraded=True, captions=captions)
    for judged in (True, False):
        hits, dropped = hits_of(answer, kind, "red circle" if kind == "text" else None, judged)
        assert dropped == 1 and [Hit.model_validate(h).rank for h in hits] == [1, 2]
        fields = dict(
            timings_ms={"search": 1.5, "total": 2.25, "broken": float("nan")},
            index_version="20261127T000000Z-abc",
            cached=False,
            degraded=True,
            reranked=2,
            unknown_words=["zebra"],
        )
        model = SearchResponse(hits=[Hit.model_validate(h) for h in hits], **fields)
        assert render(hits=hits, **fields) == model.model_dump_json()
        assert "NaN" not in render(hits=hits, **fields)  # browsers' JSON.parse refuses it


def test_threshold_choice_picks_the_best_balanced_accuracy() -> None:
    scores = np.array([[0.9, 0.2], [0.6, 0.05], [0.3, 0.01]])
    fits = np.array([[True, False], [True, False], [False, False]])
    best = choose(sweep(scores, fits))
    assert best["BA"] == 1.0 and 0.3 < best["threshold"] <= 0.6


def test_served_scores_are_judged_on_validation_splits_only(model: BuiltinModel) -> None:
    scores, fits, has_fit = served_hits(model, HELD_OUT_SEED_BASE - 1, 12, 4, 4, top_k=3)
    assert scores.shape == fits.shape == (8, 3) and has_fit.shape == (8,)
    assert fits[:4].any(axis=1).all()  # a full caption's own image is in the pool
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first, as served
    i_scores, i_fits = served_caption_hits(model, HELD_OUT_SEED_BASE - 1, 6, top_k=3)
    assert i_scores.shape == i_fits.shape == (6, 3)
    with pytest.raises(ValueError, match="test split"):
        served_hits(model, HELD_OUT_SEED_BASE + 2026, 12, 4, 4)


def test_the_threshold_is_documented_as_it_is_in_the_code() -> None:
    found = re.search(r"match threshold[^.]*?\*\*([0-9.]+)\*\*", API_DOC)
    assert found is not None, "docs/api.md states the match threshold in bold"
    assert float(found.group(1)) == MATCH_THRESHOLD


# -- row 4: a cached answer's time ----------------------------------------------------------
def test_a_cached_answer_says_how_long_it_took(service: Service) -> None:
    query = {"query": "two green squares", "top_k": 3}
    with service.client() as c:
        first = c.post("/search/text", json=query).json()
        second = c.post("/search/text", json=query).json()
    assert first["cached"] is False and second["cached"] is True
    assert 0 < second["timings_ms"]["total"] < first["timings_ms"]["total"]
    assert second["hits"] == first["hits"]


# -- row 6: the body's content type ---------------------------------------------------------
def test_json_without_its_content_type_is_415_naming_the_header(service: Service) -> None:
    body = b'{"query": "a red circle"}'
    with service.client() as c:
        for headers in (
            {"content-type": "application/x-www-form-urlencoded"},  # what curl -d sends
            {"content-type": "text/plain"},
            {},
        ):
            r = c.post("/search/text", content=body, headers=headers)
            assert r.status_code == 415, (headers, r.text)
            err = r.json()["error"]
            assert err["code"] == "unsupported_media_type"
            assert "content-type: application/json" in err["message"]
    assert "415" in API_DOC and "content-type: application/json" in API_DOC


@pytest.mark.parametrize(
    "ctype",
    ["Application/JSON", "application/json; charset=utf-8", "APPLICATION/JSON;charset=UTF-8"],
)
def test_json_content_type_in_any_case_with_parameters(
    service: Service, corpus: Path, ctype: str
) -> None:
    png = (corpus.parent / "images" / "0003.png").read_bytes()
    image = json.dumps({"image_b64": base64.b64encode(png).decode(), "top_k": 2}).encode()
    with service.client() as c:
        r = c.post(
            "/search/text",
            content=b'{"query": "a red circle", "top_k": 2}',
            headers={"content-type": ctype},
        )
        assert r.status_code == 200, r.text
        r = c.post("/search/image", content=image, headers={"content-type": ctype})
        assert r.status_code == 200, r.text


# -- row 9: the icon ---------------------------------------------------------------------------
def test_favicon_is_served(service: Service) -> None:
    r = httpx.get(f"{service.url}/favicon.ico", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(r.content)).size == (32, 32)
    page = httpx.get(f"{service.url}/", timeout=10).text
    assert 'rel="icon" href="/favicon.ico"' in page


def test_no_route_dependency_is_a_plain_function() -> None:
    """FastAPI runs a plain `def` dependency in its thread pool: a thread hop on every
    request (a plain `_json_body` cost text searches a hop each)."""
    import inspect

    from fastapi.routing import APIRoute

    from app.routes import admin, health, search, ui

    plain: list[str] = []

    def walk(dep: object, route: str) -> None:
        call = getattr(dep, "call", None)
        if call is not None and not inspect.iscoroutinefunction(call):
            plain.append(f"{route}: {getattr(call, '__qualname__', call)}")
        for sub in getattr(dep, "dependencies", []):
            walk(sub, route)

    routes = [
        r for m in (admin, health, search, ui) for r in m.router.routes if isinstance(r, APIRoute)
    ]
    assert any(r.path == "/search/text" for r in routes)
    for r in routes:
        for sub in r.dependant.dependencies:
            walk(sub, r.path)
    assert plain == []
