"""Refusals that say what to send: a method a route does not take, a path no route serves, a
JSON body that is no object or misses or adds a field, a data URL, a body or an image over its
limit (naming the limit and setting that applies there, not a size nobody measured), HEAD on
the page; and each refusal counted under the route it was sent to. Real uvicorn over real
sockets under duet's HTTP protocol; the pipeline behind the routes answers at once."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from PIL import Image
from prometheus_client import generate_latest

from app.config import Settings
from app.main import create_app
from app.pipeline import Served
from tests.conftest import uvicorn_thread
from tests.test_client_gone import ANSWER

MAX_IMAGE_BYTES = 100_000
SETTINGS = Settings(max_image_bytes=MAX_IMAGE_BYTES, max_body_bytes=4096)


class Answering:
    model = None  # knows no words: every query is let through

    async def search_text(self, query: str, opts: Any) -> Served:
        return Served(ANSWER)

    async def search_image(self, data: bytes, image: Any, opts: Any) -> Served:
        return Served(ANSWER)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, httpx.Client]]:
    app = create_app(SETTINGS)
    app.state.pipeline = Answering()
    with (
        uvicorn_thread(app, SETTINGS, lifespan="off") as port,
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):
        yield app, client


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return str(body["error"]["message"])


def test_a_method_a_route_does_not_take_says_what_to_send(served: tuple[Any, httpx.Client]) -> None:
    _, c = served
    r = c.get("/search/text")
    says = _error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    assert "use POST" in says and '{"query": ' in says and "application/json" in says
    says = _error(c.get("/search/image"), 405, "method_not_allowed")
    assert "use POST" in says and '"image"' in says and "image_b64" in says


def test_a_405_allows_every_method_the_path_takes(served: tuple[Any, httpx.Client]) -> None:
    """/healthz, /readyz, /metrics and /images/{id} answer HEAD, but their 405s said
    `Allow: GET` (Starlette names the first route at the path only)."""
    _, c = served
    for path in ("/healthz", "/readyz", "/metrics", "/images/a/b", "/"):
        r = c.put(path)
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD", (path, r.headers)
        assert _error(r, 405, "method_not_allowed").endswith("it takes GET, HEAD")


def test_a_path_no_route_serves_lists_the_routes(served: tuple[Any, httpx.Client]) -> None:
    says = _error(served[1].get("/search"), 404, "not_found")
    assert "no route GET /search" in says
    for route in ("POST /search/text", "POST /search/image", "GET /healthz", "/openapi.json"):
        assert route in says, says


def test_head_on_the_page_is_get_without_the_body(served: tuple[Any, httpx.Client]) -> None:
    """/healthz's HEAD was an empty 200 without its content type and length."""
    _, c = served
    for path in ("/", "/favicon.ico", "/healthz"):
        got, head = c.get(path), c.head(path)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == got.headers["content-type"]
        assert head.headers["content-length"] == str(len(got.content))


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/search/text", "{}", 'query: Field required; send a JSON object such as {"query": '),
        ("/search/text", "[1, 2]", 'the body must be a JSON object such as {"query": '),
        ("/search/text", "", 'the body is empty; send a JSON object such as {"query": '),
        ("/search/text", '{"query": "a", "image_b64": "x"}', "image_b64: not a field of this"),
        ("/search/text", '{"query": "a", "lambda": NaN}', "lambda: Input should be a finite"),
        ("/search/image", "{}", 'image_b64: Field required; send a JSON object such as {"image'),
        ("/search/image", "[1]", 'the body must be a JSON object such as {"image_b64": '),
        ("/search/image", "", 'the body is empty; send a JSON object such as {"image_b64": '),
        (
            "/search/image",
            '{"image_b64": "eA==", "query": "a red circle"}',
            "query: not a field of this route; it takes image_b64, top_k",
        ),
    ],
)
def test_a_json_body_refused_names_the_field_and_what_to_send(
    served: tuple[Any, httpx.Client], path: str, body: str, says: str
) -> None:
    r = served[1].post(path, content=body, headers={"content-type": "application/json"})
    assert says in _error(r, 422, "validation_error")
    if not body:  # both routes locate it alike
        assert r.json()["error"]["details"][0]["type"] == "missing"


def test_an_unknown_form_field_is_named(served: tuple[Any, httpx.Client]) -> None:
    r = served[1].post(
        "/search/image", files={"image": ("a.png", _png((8, 8)))}, data={"query": "a red circle"}
    )
    assert "query: not a field of this route; it takes image, top_k" in _error(
        r, 422, "validation_error"
    )


def test_a_data_url_in_image_b64_is_taken(served: tuple[Any, httpx.Client]) -> None:
    """What a browser's FileReader gives: `data:image/png;base64,` and the file."""
    _, c = served
    url = "data:image/png;base64," + base64.b64encode(_png((8, 8))).decode()
    assert c.post("/search/image", json={"image_b64": url}).status_code == 200
    says = _error(
        c.post("/search/image", json={"image_b64": "data:image/png,abc"}), 400, "invalid_image"
    )
    assert "data URL without base64" in says
    says = _error(c.post("/search/image", json={"image_b64": "not base64!"}), 400, "invalid_image")
    assert "base64 -w0" in says


def test_wrapped_and_url_safe_base64_are_taken(served: tuple[Any, httpx.Client]) -> None:
    """`base64 FILE` wraps its lines at 76 characters, and JWT-style encoders use - and _:
    both were a 400 "not valid base64"; a mix of the two alphabets still is."""
    _, c = served
    png = _png((40, 40), "RGBA")
    std = base64.b64encode(png).decode()
    wrapped = "\n".join(std[i : i + 76] for i in range(0, len(std), 76)) + "\n"
    assert "\n" in wrapped.strip()
    urlsafe = base64.urlsafe_b64encode(png).decode()
    assert "-" in urlsafe or "_" in urlsafe
    unpadded = urlsafe.rstrip("=")  # base64url's usual form
    for sent in (wrapped, urlsafe, unpadded, "data:image/png;base64," + wrapped):
        assert c.post("/search/image", json={"image_b64": sent}).status_code == 200
    mixed = "ab-+" + std[4:]
    _error(c.post("/search/image", json={"image_b64": mixed}), 400, "invalid_image")


def test_an_image_far_over_the_pixel_limit_gets_duets_message(
    served: tuple[Any, httpx.Client],
) -> None:
    """12,000 x 12,000 is past Pillow's own guard (89,478,485 pixels) too, which refused it
    first with its own message, naming its own limit."""
    png = _png((12000, 12000), "1")
    r = served[1].post("/search/image", files={"image": ("big.png", png)})
    says = _error(r, 413, "image_too_large")
    assert says == (
        "image is 12000x12000 = 144000000 pixels; the limit is 25000000 (DUET_MAX_IMAGE_PIXELS)"
    )


def _count(app: Any, endpoint: str, status: int) -> float:
    for line in generate_latest(app.state.metrics.registry).decode().splitlines():
        if line.startswith(
            f'duet_request_seconds_count{{endpoint="{endpoint}",status="{status}"}}'
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_image_request_counts_under_the_documented_path(
    served: tuple[Any, httpx.Client],
) -> None:
    """The label was the router's `/images/{item_id:path}`; api.md and the OpenAPI
    document say `/images/{item_id}`."""
    app, c = served
    before = _count(app, "/images/{item_id}", 405)
    assert c.put("/images/a/b").status_code == 405
    assert _count(app, "/images/{item_id}", 405) == before + 1


def test_limits_name_what_applies_and_413s_count_under_their_route(
    served: tuple[Any, httpx.Client],
) -> None:
    app, c = served
    before = {p: _count(app, p, 413) for p in ("/search/text", "/search/image", "other")}
    says = _error(c.post("/search/text", json={"query": "a" * 5000}), 413, "payload_too_large")
    assert says == (
        "request body is larger than 4096 bytes, the limit for /search/text: DUET_MAX_BODY_BYTES "
        "(a query itself may be at most 512 characters)"
    )
    body = json.dumps({"image_b64": "A" * 200_000})
    r = c.post("/search/image", content=body, headers={"content-type": "application/json"})
    says = _error(r, 413, "payload_too_large")
    limit = MAX_IMAGE_BYTES * 4 // 3 + 65536
    assert f"larger than {limit} bytes" in says and "DUET_MAX_BODY_BYTES" not in says
    assert f"an image of at most {MAX_IMAGE_BYTES} bytes (DUET_MAX_IMAGE_BYTES)" in says
    assert "base64" in says
    # an upload under the body's limit but over the image's: its size was not measured
    r = c.post("/search/image", files={"image": ("a.bin", b"x" * 110_000)})
    says = _error(r, 413, "image_too_large")
    assert (
        says == f"image is larger than the limit of {MAX_IMAGE_BYTES} bytes (DUET_MAX_IMAGE_BYTES)"
    )
    assert _count(app, "/search/text", 413) == before["/search/text"] + 1
    assert _count(app, "/search/image", 413) == before["/search/image"] + 2
    assert _count(app, "other", 413) == before["other"]


def test_fastapis_own_routes_count_under_their_paths(served: tuple[Any, httpx.Client]) -> None:
    """/openapi.json (and /docs) are routes FastAPI adds itself: counted by their path, not as
    `other`, which is left for paths no route serves."""
    app, c = served
    before = {p: _count(app, p, 200) for p in ("/openapi.json", "/docs", "other")}
    assert c.get("/openapi.json").status_code == 200
    assert c.get("/docs").status_code == 200
    assert _count(app, "/openapi.json", 200) == before["/openapi.json"] + 1
    assert _count(app, "/docs", 200) == before["/docs"] + 1
    assert _count(app, "other", 200) == before["other"]


def test_every_documented_error_has_the_shape_duet_answers(
    served: tuple[Any, httpx.Client],
) -> None:
    """The OpenAPI document lists each route's errors as `ErrorResponse` (what every error
    is), not FastAPI's own 422 shape, which no duet route answers; and a 422's `details`
    are in the error body's schema."""
    doc = served[1].get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(doc)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for status, answer in op["responses"].items():
                if int(status) >= 400:
                    ref = answer["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse"), (method, path, status)
    assert "details" in doc["components"]["schemas"]["ErrorBody"]["properties"]
    for route in ("/search/text", "/search/image"):  # a body cut short, or timed out
        assert {"408", "499"} <= set(doc["paths"][route]["post"]["responses"])
    r = served[1].post("/search/text", json={"query": "a red circle", "top_k": 0})
    assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"][-1] == "top_k"


@pytest.mark.parametrize(
    ("path", "send"),
    [
        ("/search/text", {"json": {"query": "a red circle"}}),
        ("/search/image", {"files": {"image": ("a.png", _png((8, 8)))}}),
    ],
)
def test_options_in_the_url_are_refused_not_ignored(
    served: tuple[Any, httpx.Client], path: str, send: dict[str, Any]
) -> None:
    """`?top_k=1` on a search route would change nothing (options are read from the body):
    a 422 naming the parameters and where to send them, with `details`."""
    r = served[1].post(path + "?top_k=1&foo=bar&top_k=2", **send)
    says = _error(r, 422, "validation_error")
    assert "URL parameters top_k, foo" in says and "send them as fields of it" in says, says
    assert r.json()["error"]["details"][0]["loc"] == ["query", "top_k"]
    assert served[1].post(path, **send).status_code == 200


def test_a_multipart_body_that_cannot_be_cut_up_says_what_to_send(
    served: tuple[Any, httpx.Client],
) -> None:
    """Two files, a multipart type without its boundary, a body cut before its closing
    boundary: 422s that say how a form is sent, not Starlette's bare 400."""
    c = served[1]
    two = c.post(
        "/search/image",
        files=[("image", ("a.png", _png((8, 8)))), ("image", ("b.png", _png((8, 8))))],
    )
    says = _error(two, 422, "validation_error")
    assert "Too many files" in says and 'one file field named "image"' in says, says
    bare = c.post("/search/image", content=b"x", headers={"content-type": "multipart/form-data"})
    assert "boundary" in _error(bare, 422, "validation_error")
    cut = (
        b'--b\r\ncontent-disposition: form-data; name="image"; filename="a.png"\r\n'
        b"content-type: image/png\r\n\r\n" + _png((8, 8))
    )
    r = c.post(
        "/search/image", content=cut, headers={"content-type": "multipart/form-data; boundary=b"}
    )
    says = _error(r, 422, "validation_error")
    assert 'a file field named "image"' in says and "closing boundary" in says, says


def test_every_422_of_the_services_own_checks_has_details(
    served: tuple[Any, httpx.Client],
) -> None:
    """api.md: a validation 422 adds `details` (each fault's loc, msg and type), whether
    pydantic or duet's own checks refused it."""
    c = served[1]
    bad_form = c.post(
        "/search/image", files={"image": ("a.png", _png((8, 8)))}, data={"top_k": "many"}
    )
    _error(bad_form, 422, "validation_error")
    (fault,) = bad_form.json()["error"]["details"]
    assert fault["loc"] == ["body", "top_k"] and fault["type"] and fault["msg"], fault
    blank = c.post("/search/text", json={"query": "   "})
    _error(blank, 422, "validation_error")
    assert blank.json()["error"]["details"][0]["loc"] == ["body", "query"]
    not_utf8 = c.post(
        "/search/text", content=b'{"query": "\xff"}', headers={"content-type": "application/json"}
    )
    _error(not_utf8, 422, "validation_error")
    assert not_utf8.json()["error"]["details"][0]["loc"] == ["body"]


def test_head_on_metrics_is_get_without_the_body(served: tuple[Any, httpx.Client]) -> None:
    c = served[1]
    head = c.head("/metrics")
    assert head.status_code == 200 and head.content == b"", head.status_code
    assert head.headers["content-type"] == c.get("/metrics").headers["content-type"]
