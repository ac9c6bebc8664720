"""`duet.client.DuetClient` against a real `duet serve`: typed hits for text and image
search, the hit's image, errors as exceptions, 429 retried after Retry-After."""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from duet.client import DuetClient, DuetError, Hit, Overloaded
from tests.conftest import Service, free_port, start_service, stop_service


@pytest.fixture(scope="module")
def service(
    index_dir: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    svc = start_service(
        index_dir,
        tmp_path_factory.mktemp("client") / "serve.log",
        DUET_IMAGES_DIR=str(corpus.parent),
    )
    yield svc
    stop_service(svc)


def test_text_and_image_search_give_typed_hits(service: Service, corpus: Path) -> None:
    with DuetClient(service.url) as duet:
        ready = duet.ready()
        res = duet.search_text("a small red circle left of a large blue square", top_k=5)
        assert len(res.hits) == 5 and [h.rank for h in res.hits] == [1, 2, 3, 4, 5]
        assert all(isinstance(h, Hit) and h.image_url for h in res.hits)
        # each image hit carries its caption closest to the query, and whether it fits
        assert all(h.caption and isinstance(h.match, bool) for h in res.hits)
        assert res.index_version == ready["index_version"]
        assert res.reranked == 40 and not res.degraded  # all 40 images: fewer than M = 50
        assert res.unknown_words == []
        scores = [h.score for h in res.hits]
        assert scores == sorted(scores, reverse=True)
        assert all(h.rerank_score is not None for h in res.hits)
        # the same options as the API, lambda included; none = the dot-product order
        dot = duet.search_text("a red circle", top_k=3, reranker="none")
        assert all(h.rerank_score is None for h in dot.hits)
        fused = duet.search_text("a red circle", top_k=3, lambda_=1.0, candidates=3)
        assert [h.id for h in fused.hits] == [h.id for h in dot.hits]  # lambda 1 = dot alone
        assert duet.search_text("a red zebra", top_k=1).unknown_words == ["zebra"]

        # the hit's image, then that image as a query: captions come back, with their text
        png = duet.image(res.hits[0])
        assert png.startswith(b"\x89PNG")
        by_bytes = duet.search_image(png, top_k=3)
        by_path = duet.search_image(next((corpus.parent / "images").glob("*.png")), top_k=3)
        for r in (by_bytes, by_path):
            assert len(r.hits) == 3 and all(h.caption for h in r.hits)
            assert all(isinstance(h.match, bool) for h in r.hits)
        assert by_bytes.hits[0].meta["image_id"] == res.hits[0].id


def test_errors_are_exceptions_with_the_service_code(service: Service) -> None:
    with DuetClient(service.url) as duet:
        with pytest.raises(DuetError) as bad:
            duet.search_text("a red circle", reranker="bm25")
        assert bad.value.status == 422 and bad.value.code == "validation_error"
        assert "bm25" in bad.value.message
        with pytest.raises(DuetError) as missing:
            duet.image("no-such-image")
        assert missing.value.status == 404
        with pytest.raises(DuetError) as broken:
            duet.search_image(b"not an image")
        assert broken.value.status in (400, 415, 422)
    with DuetClient(f"http://127.0.0.1:{free_port()}", timeout=2) as nowhere:
        with pytest.raises(DuetError) as down:
            nowhere.ready()
        assert down.value.code == "unreachable"


def test_a_service_that_does_not_answer_in_time_is_a_timeout_not_unreachable() -> None:
    """A server that takes the connection and says nothing: the client's timeout, told apart
    from a service that cannot be reached (it may still be working on the request)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with DuetClient(url, timeout=0.3) as duet, pytest.raises(DuetError) as slow:
            duet.search_text("a red circle")
    assert slow.value.status == 0 and slow.value.code == "timeout"
    assert "/search/text" in slow.value.message


def test_an_image_of_another_type_is_refused_saying_what_to_pass(service: Service) -> None:
    with DuetClient(service.url) as duet:
        with pytest.raises(TypeError, match="bytes or a path"):
            duet.search_image(io.BytesIO(b"x"))  # type: ignore[arg-type]
        png = io.BytesIO()
        Image.new("RGB", (64, 64), (200, 30, 30)).save(png, format="PNG")
        assert duet.search_image(bytearray(png.getvalue()), top_k=2).hits


class _BusyOnce(BaseHTTPRequestHandler):
    """Answers 429 with Retry-After to the first search, then a result."""

    calls = 0

    def do_POST(self) -> None:
        type(self).calls += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).calls == 1:
            body = {"error": {"code": "overloaded", "message": "busy"}}
            self._send(429, body, {"Retry-After": "1"})
        else:
            hits = [{"id": "a", "rank": 1, "score": 1.0, "retrieval_score": 1.0}]
            self._send(200, {"hits": hits, "index_version": "v", "cached": False}, {})

    def _send(self, status: int, body: object, headers: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {**headers, "Content-Type": "application/json"}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_429_is_retried_after_retry_after_when_asked() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BusyOnce)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with DuetClient(url) as once:
            with pytest.raises(Overloaded) as busy:
                once.search_text("a red circle")
            assert busy.value.retry_after == 1.0 and busy.value.code == "overloaded"
        _BusyOnce.calls = 0
        with DuetClient(url, retries=1, max_wait=0.05) as patient:
            assert [h.id for h in patient.search_text("a red circle").hits] == ["a"]
        assert _BusyOnce.calls == 2
    finally:
        server.shutdown()


def test_access_log_setting_logs_each_request(index_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    svc = start_service(index_dir, log, DUET_ACCESS_LOG="true")
    try:
        with DuetClient(svc.url) as duet:
            duet.search_text("a red circle", top_k=1)
            with pytest.raises(DuetError):
                duet.search_text("a red circle", reranker="bm25")
    finally:
        stop_service(svc)
    text = log.read_text()
    assert '"POST /search/text HTTP/1.1" 200' in text
    assert '"POST /search/text HTTP/1.1" 422' in text


def test_no_access_log_by_default(service: Service) -> None:
    with DuetClient(service.url) as duet:
        duet.search_text("a red circle", top_k=1)
    assert "POST /search/text" not in service.log.read_text()
