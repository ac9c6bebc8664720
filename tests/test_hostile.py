"""What a hostile client can still try (issue 36), against a real `duet serve` over real
sockets: uploads in formats duet does not read, decoder errors, a 500 on a keep-alive
connection."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from PIL import Image

from app.config import Settings
from app.errors import install_handlers
from duet.commands.serve import ONEDNN_CACHE_DEFAULT, ONEDNN_CACHE_ENV
from tests.conftest import (
    CHILD_PYTHONPATH,
    REPO,
    Service,
    read_response,
    start_service,
    stop_service,
    uvicorn_thread,
)

DOCKERFILE = REPO / "Dockerfile"
EPS_LOOP = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n{ } loop\n"


@dataclass
class Hostile:
    service: Service
    gs_ran: Path  # a fake `gs` first on the server's PATH creates this file when run


@pytest.fixture(scope="module")
def hostile(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    tmp = tmp_path_factory.mktemp("hostile")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    gs_ran = tmp / "gs-ran"
    fake_gs = bin_dir / "gs"
    # what the EPS loop does to a real Ghostscript: never ends (here, 30 s)
    fake_gs.write_text(f"#!/bin/sh\ntouch {gs_ran}\nsleep 30\n")
    fake_gs.chmod(fake_gs.stat().st_mode | stat.S_IXUSR)
    svc = start_service(
        index_dir,
        tmp / "serve.log",
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    yield Hostile(svc, gs_ran)
    stop_service(svc)
    assert "Traceback" not in svc.log.read_text()


def test_eps_upload_is_refused_without_ghostscript(hostile: Hostile) -> None:
    """Row 1: two concurrent EPS uploads are 400 at once; no Ghostscript (here a fake `gs`
    that would hang for 30 s) is ever started, and image search still answers."""

    def post(_: int) -> tuple[int, str, float]:
        t0 = time.monotonic()
        with hostile.service.client() as c:
            r = c.post("/search/image", files={"image": ("f.eps", EPS_LOOP, "image/x-eps")})
        return r.status_code, r.json()["error"]["code"], time.monotonic() - t0

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(post, range(2)))
    assert [a[:2] for a in answers] == [(400, "invalid_image")] * 2
    assert max(a[2] for a in answers) < 5
    assert not hostile.gs_ran.exists()
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 10)).save(buf, format="PNG")
    with hostile.service.client() as c:
        r = c.post("/search/image", files={"image": ("x.png", buf.getvalue(), "image/png")})
        assert r.status_code == 200, r.text


def test_decoder_errors_are_400(hostile: Hostile) -> None:
    """Row 2: an AVIF with its last byte flipped raised RuntimeError in the decoder (a 500)."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 10)).save(buf, format="AVIF")
    avif = bytearray(buf.getvalue())
    avif[-1] ^= 0xFF
    with hostile.service.client() as c:
        r = c.post("/search/image", files={"image": ("x.png", bytes(avif), "image/png")})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_image"
        assert "PNG, JPEG, WebP, GIF, TIFF or BMP" in r.json()["error"]["message"]


@pytest.fixture
def failing_server() -> Iterator[tuple[str, int]]:
    """duet's error handlers and HTTP protocol (`uvicorn_options`) on real uvicorn in a
    thread, with a route that fails the way a bug would."""
    app = FastAPI()
    install_handlers(app)

    async def boom() -> None:
        raise RuntimeError("a bug")

    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    app.add_api_route("/boom", boom)
    app.add_api_route("/ok", ok)
    with uvicorn_thread(app, Settings()) as port:
        yield "127.0.0.1", port


def test_a_500_leaves_no_dead_keep_alive_connection(failing_server: tuple[str, int]) -> None:
    """Row 10: a 500 went out as keep-alive, then uvicorn closed the socket, so the client's
    next request on it failed. Now the 500 says `Connection: close` (and the socket closes),
    or the connection serves the next request."""
    with socket.create_connection(failing_server, timeout=10) as sock:
        sock.sendall(b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
        head, body = read_response(sock)
        assert head.startswith(b"http/1.1 500")
        assert json.loads(body)["error"]["code"] == "internal_error"
        if b"\r\nconnection: close" in head:
            assert sock.recv(1) == b""  # and the server closed it
        else:
            sock.sendall(b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n")
            assert read_response(sock)[0].startswith(b"http/1.1 200")
    # a client that reuses connections never meets a dead one
    with httpx.Client(base_url=f"http://{failing_server[0]}:{failing_server[1]}") as c:
        for _ in range(20):
            assert c.get("/boom").status_code == 500
            assert c.get("/ok").status_code == 200


def test_head_healthz_is_200(hostile: Hostile) -> None:
    """A probe that sends HEAD got 405."""
    with hostile.service.client() as c:
        r = c.head("/healthz")
        assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad header line\r\n\r\n",
        b"GET /\x00 HTTP/1.1\r\n\r\n",
    ],
)
def test_malformed_http_gets_the_json_error(hostile: Hostile, raw: bytes) -> None:
    """uvicorn's own 400 for bytes that are not HTTP was plain text."""
    host, port = hostile.service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        head, body = read_response(sock)
        assert sock.recv(1) == b""  # closed after the answer
    assert head.startswith(b"http/1.1 400") and b"content-type: application/json" in head
    err = json.loads(body)["error"]
    assert err["code"] == "bad_request" and "not valid HTTP/1.1" in err["message"]


def test_form_fields_have_the_json_bounds(hostile: Hostile) -> None:
    """The multipart form's top_k and candidates had no bounds in the OpenAPI document."""
    with hostile.service.client() as c:
        doc = c.get("/openapi.json").json()
    body = doc["paths"]["/search/image"]["post"]["requestBody"]["content"]
    form = body["multipart/form-data"]["schema"]["properties"]
    json_props = body["application/json"]["schema"]["properties"]
    for name in ("top_k", "candidates"):
        assert form[name]["minimum"] == json_props[name]["minimum"] == 1
        assert form[name]["maximum"] == json_props[name]["maximum"]
    with hostile.service.client() as c:
        png = io.BytesIO()
        Image.new("RGB", (32, 32)).save(png, format="PNG")
        r = c.post(
            "/search/image",
            files={"image": ("x.png", png.getvalue(), "image/png")},
            data={"candidates": "1001"},
        )
        assert r.status_code == 422 and "candidates" in r.json()["error"]["message"]


def test_onednn_cache_setting_reaches_the_serving_process(hostile: Hostile) -> None:
    """Row 4: oneDNN's per-shape primitive cache grew a replica by gigabytes over a mix of
    search sizes. `duet serve` sets ONEDNN_PRIMITIVE_CACHE_CAPACITY (unless the operator
    did) before torch is imported, which is when it must be set; the Docker image too."""
    want = os.environ.get(ONEDNN_CACHE_ENV, ONEDNN_CACHE_DEFAULT)
    assert f"{ONEDNN_CACHE_ENV}={want}" in hostile.service.log.read_text()
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    probe = "import sys, duet.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr  # the entry point imports no torch
    docker_env = re.search(rf"^\s+{ONEDNN_CACHE_ENV}=(\S+)", DOCKERFILE.read_text(), re.M)
    assert docker_env is not None and docker_env.group(1) == ONEDNN_CACHE_DEFAULT


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_pipelining_clients_that_never_read_stay_bounded(hostile: Hostile) -> None:
    """Row 3: 20 connections that each send `GET /healthz` 500 times a burst and never read
    grew the server by a gigabyte in 30 s, and /healthz timed out for everyone else. Now each
    connection has at most MAX_PIPELINED requests queued and is not read beyond them."""
    host, port = hostile.service.url.removeprefix("http://").split(":")
    burst = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n" * 500
    pid = hostile.service.proc.pid
    before = _rss_mb(pid)
    stop = threading.Event()
    socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]

    def flood(sock: socket.socket) -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                sock.sendall(burst)
            except TimeoutError:
                continue  # the server stopped reading: what it should do
            except OSError:
                return

    threads = [threading.Thread(target=flood, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    waits: list[float] = []
    peak = before
    try:
        with httpx.Client(base_url=hostile.service.url, timeout=10) as c:
            for _ in range(24):  # 12 s of probes, one each half second
                t0 = time.monotonic()
                assert c.get("/healthz").status_code == 200
                waits.append(time.monotonic() - t0)
                peak = max(peak, _rss_mb(pid))
                time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for s in socks:
            s.close()
    print(f"\nRSS {before:.0f} -> peak {peak:.0f} MB; /healthz max {max(waits) * 1000:.0f} ms")
    assert peak - before < 100, f"grew {peak - before:.0f} MB"
    assert max(waits) < 1.0, waits
