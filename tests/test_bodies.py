"""Search bodies a QA pass sent that were read wrongly or answered at great cost, over real
uvicorn: a body of many made-up fields (its 422 listed each one with the whole field list:
324 MB for 1.15M keys, 20 s of a blocked event loop), a field given twice (the last one won,
unseen), JSON in UTF-16 (read, where api.md says a body must be UTF-8), and Python's own
words in a 422 (a codec's, `sys.set_int_max_str_digits`)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx
import pytest

from app.bodies import NAMED_AT_MOST
from tests.test_guidance import _error, _png, served  # noqa: F401

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(("path", "first"), [("/search/text", "query"), ("/search/image", "")])
def test_many_unknown_fields_are_named_up_to_a_few_and_counted(
    served: tuple[Any, httpx.Client],  # noqa: F811
    path: str,
    first: str,
) -> None:
    made_up = {f"k{i}": 0 for i in range(300)}
    body = {"query": "a red circle"} if first else {"image_b64": "eA=="}
    r = served[1].post(path, content=json.dumps({**body, **made_up}), headers=JSON)
    said = _error(r, 422, "validation_error")
    assert said.startswith("k0, k1, k2")
    assert f"k{NAMED_AT_MOST - 1} and 290 more: not fields" in said
    assert f"k{NAMED_AT_MOST}," not in said and "it takes" in said
    details = r.json()["error"]["details"]
    assert len(details) == NAMED_AT_MOST and details[0]["loc"] == ["body", "k0"]
    assert len(r.content) < 3000, len(r.content)


def test_a_million_unknown_fields_cost_a_small_answer_and_no_long_stall(
    served: tuple[Any, httpx.Client],  # noqa: F811
) -> None:
    """The QA's body, scaled to this fixture's image limit (100 kB): an answer of a few
    hundred bytes, not one line per key."""
    made_up = {f"k{i}": 0 for i in range(14_000)}
    body = json.dumps({"image_b64": "eA==", **made_up}, separators=(",", ":"))
    t0 = time.perf_counter()
    r = served[1].post("/search/image", content=body, headers=JSON)
    assert "and 13,990 more: not fields of this route" in _error(r, 422, "validation_error")
    assert len(r.content) < 3000 and time.perf_counter() - t0 < 5


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/search/text", '{"query": "a red circle", "top_k": 1, "top_k": 3}'),
        ("/search/image", '{"image_b64": "eA==", "top_k": 1, "top_k": 3}'),
    ],
)
def test_a_field_given_twice_is_refused_not_read_as_the_last(
    served: tuple[Any, httpx.Client],  # noqa: F811
    path: str,
    body: str,
) -> None:
    r = served[1].post(path, content=body, headers=JSON)
    said = _error(r, 422, "validation_error")
    assert said == "top_k: given more than once in one JSON object; give each field once"
    assert r.json()["error"]["details"][0]["loc"] == ["body", "top_k"]


@pytest.mark.parametrize("path", ["/search/text", "/search/image"])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "latin-1"])
def test_a_body_that_is_not_utf8_is_refused_on_both_routes_alike(
    served: tuple[Any, httpx.Client],  # noqa: F811
    path: str,
    encoding: str,
) -> None:
    """UTF-16 and UTF-32 JSON were answered 200 (json.loads of bytes guesses the encoding);
    /search/image's other refusals quoted Python's codec error."""
    field = "query" if path == "/search/text" else "image_b64"
    raw = json.dumps({field: "é a red circle"}, ensure_ascii=False).encode(encoding)
    said = _error(served[1].post(path, content=raw, headers=JSON), 422, "validation_error")
    assert said.startswith("body is not valid JSON: it must be UTF-8 encoded (byte "), said
    assert "codec" not in said


def test_a_number_of_thousands_of_digits_is_told_without_pythons_words(
    served: tuple[Any, httpx.Client],  # noqa: F811
) -> None:
    """(Past the text route's body limit here; both routes read JSON alike.)"""
    raw = f'{{"image_b64": "a", "top_k": {"9" * 5000}}}'
    r = served[1].post("/search/image", content=raw, headers=JSON)
    said = _error(r, 422, "validation_error")
    assert "more than 4,300 digits" in said and "sys." not in said, said


def test_url_parameters_on_a_form_upload_list_the_forms_fields(
    served: tuple[Any, httpx.Client],  # noqa: F811
) -> None:
    """They listed the JSON body's fields (image_b64, ...) to a multipart upload."""
    r = served[1].post("/search/image?top_k=1", files={"image": ("a.png", _png((8, 8)))})
    said = _error(r, 422, "validation_error")
    assert "send them as fields of it (image, top_k" in said and "image_b64" not in said


@pytest.mark.parametrize(
    ("path", "field"), [("/search/text", "query"), ("/search/image", "image_b64")]
)
def test_a_utf8_body_with_a_byte_order_mark_is_read(
    served: tuple[Any, httpx.Client],  # noqa: F811
    path: str,
    field: str,
) -> None:
    """Windows tools write one; json.loads of bytes skipped it, and RFC 8259 lets a reader."""
    value = "a red circle" if field == "query" else base64.b64encode(_png((8, 8))).decode()
    raw = "\ufeff".encode() + json.dumps({field: value}).encode()
    assert served[1].post(path, content=raw, headers=JSON).status_code == 200


def test_a_duplicate_inside_a_value_and_a_long_unknown_name_are_told_plainly(
    served: tuple[Any, httpx.Client],  # noqa: F811
) -> None:
    """A name given twice inside a value was located as a field of the body; an unknown name
    of 100 kB was quoted whole, twice (a 200 kB answer)."""
    c = served[1]
    nested = '{"image_b64": "eA==", "top_k": {"a": 1, "a": 2}}'
    r = c.post("/search/image", content=nested, headers=JSON)
    assert _error(r, 422, "validation_error").startswith("a: given more than once")
    assert r.json()["error"]["details"][0]["loc"] == ["body"]
    r = c.post(
        "/search/image", content=json.dumps({"image_b64": "eA==", "k" * 100_000: 1}), headers=JSON
    )
    assert "'" + "k" * 64 + "...'" in _error(r, 422, "validation_error")
    assert len(r.content) < 2000, len(r.content)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"top_k": 20, "candidates": 10, "reranker": "ce"}, "candidates"),
        ({"reranker": "none", "fusion": "add"}, "fusion"),
        ({"rerank": False, "reranker": "ce"}, "rerank"),
        ({"fusion": "none", "lambda": 0.5}, "lambda"),
    ],
)
def test_two_fields_at_odds_are_located_at_the_one_the_message_names(
    served: tuple[Any, httpx.Client],  # noqa: F811
    body: dict[str, Any],
    field: str,
) -> None:
    """They were located at "body" alone, where api.md says `loc` names the field."""
    r = served[1].post("/search/text", json={"query": "a red circle", **body})
    said = _error(r, 422, "validation_error")
    assert said.startswith(f"{field}: "), said
    assert r.json()["error"]["details"][0]["loc"] == ["body", field]
