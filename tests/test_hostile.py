"""What a hostile client can still try (issue 36), against a real `duet serve` over real
sockets: uploads in formats duet does not read, decoder errors, HEAD probes, the in-flight cap."""

from __future__ import annotations

import io
import os
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import Service, start_service, stop_service

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
