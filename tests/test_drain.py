"""SIGTERM drains for DUET_HTTP_DRAIN_S, then closes what is still open: a stalled upload held
the exit for the body timeout (30 s), past Docker's 10 s and into its SIGKILL, and then, cut
at the drain's end, got uvicorn's plain-text 500 and a traceback in the log."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.conftest import (
    child_pids,
    process_alive,
    start_service,
    start_service_under,
    stop_service,
)

pytestmark = pytest.mark.slow


def _upload(host: str, port: int, body: bytes) -> socket.socket:
    """A connection that has sent an image upload's headers and `body`'s first 20 bytes."""
    conn = socket.create_connection((host, port), timeout=30)
    head = (
        f"POST /search/image HTTP/1.1\r\nhost: duet\r\ncontent-length: {len(body)}\r\n"
        "content-type: multipart/form-data; boundary=b\r\n\r\n"
    )
    conn.sendall(head.encode() + body[:20])
    return conn


def _answer(conn: socket.socket) -> tuple[bytes, bytes]:
    """(status line and headers, body) of what came back before the server closed."""
    said = b""
    while chunk := conn.recv(4096):
        said += chunk
    conn.close()
    head, _, body = said.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize(
    ("fronts", "sig"),
    [("0", signal.SIGTERM), ("2", signal.SIGTERM), ("2", signal.SIGHUP)],
    ids=["term", "term-fronts", "hup-fronts"],
)
def test_an_upload_finishing_in_the_drain_is_answered_and_a_stalled_one_told_503(
    index_dir: Path, corpus: Path, tmp_path: Path, fronts: str, sig: signal.Signals
) -> None:
    """SIGHUP as SIGTERM: uvicorn left it alone, so a hang-up ended the owner at once and
    without a word, cutting its requests, and with it every front."""
    svc = start_service(
        index_dir, tmp_path / "serve.log", DUET_HTTP_DRAIN_S="3", DUET_FRONTENDS=fronts
    )
    kids = child_pids(svc.proc.pid)
    host, port = svc.url.removeprefix("http://").split(":")
    image = json.loads(corpus.read_text().splitlines()[0])["image"]
    body = (
        b'--b\r\ncontent-disposition: form-data; name="image"; filename="a.png"\r\n'
        b"content-type: image/png\r\n\r\n"
        + (corpus.parent / image).read_bytes()
        + b'\r\n--b\r\ncontent-disposition: form-data; name="top_k"\r\n\r\n2\r\n--b--\r\n'
    )
    try:
        stalled = _upload(host, int(port), body)  # the rest never comes (body timeout: 30 s)
        slow = _upload(host, int(port), body)  # the rest comes during the drain
        time.sleep(0.5)  # both in the server's hands
        t0 = time.monotonic()
        svc.proc.send_signal(sig)
        time.sleep(0.2)
        slow.sendall(body[20:])
        head, answer = _answer(slow)
        assert head.startswith(b"HTTP/1.1 200 "), head + answer
        assert len(json.loads(answer)["hits"]) == 2
        head, answer = _answer(stalled)
        # the documented JSON, not uvicorn's plain-text 500 for a task it cancelled
        assert head.startswith(b"HTTP/1.1 503 "), head + answer
        assert json.loads(answer)["error"]["code"] == "shutting_down"
        assert svc.proc.wait(timeout=25) == -sig  # what stopped it, as uvicorn re-raises it
        took = time.monotonic() - t0
        # a drain of 3 s (the owner's, then its fronts'), not the 30 s it was
        assert took < 15, took
        assert not any(process_alive(p) for p in kids), "a child outlived the service"
        log = svc.log.read_text()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        assert ("SIGHUP: stopping as for SIGTERM" in log) == (sig == signal.SIGHUP), log
    finally:
        stop_service(svc)


def test_under_nohup_a_hang_up_leaves_the_service_running(index_dir: Path, tmp_path: Path) -> None:
    """`nohup duet serve &` ignores SIGHUP so that the service outlives its terminal: duet
    takes SIGHUP as SIGTERM only where it was not ignored."""
    svc = start_service_under(("nohup",), index_dir, tmp_path / "serve.log", DUET_FRONTENDS="2")
    try:
        svc.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert svc.proc.poll() is None
        with svc.client() as c:
            assert c.post("/search/text", json={"query": "a red circle"}).status_code == 200
        assert "SIGHUP" not in svc.log.read_text()
    finally:
        stop_service(svc)
