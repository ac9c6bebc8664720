"""SIGTERM drains for DUET_HTTP_DRAIN_S, then closes what is still open: a stalled upload held
the exit for the body timeout (30 s), past Docker's 10 s and into its SIGKILL."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from tests.conftest import child_pids, process_alive, start_service, stop_service

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fronts", ["0", "2"])
def test_a_stalled_upload_does_not_hold_the_exit_past_the_drain(
    index_dir: Path, tmp_path: Path, fronts: str
) -> None:
    svc = start_service(
        index_dir, tmp_path / "serve.log", DUET_HTTP_DRAIN_S="1", DUET_FRONTENDS=fronts
    )
    kids = child_pids(svc.proc.pid)
    host, port = svc.url.removeprefix("http://").split(":")
    try:
        stalled = socket.create_connection((host, int(port)), timeout=30)
        head = (
            "POST /search/image HTTP/1.1\r\nhost: duet\r\ncontent-length: 100000\r\n"
            "content-type: multipart/form-data; boundary=b\r\n\r\n--b\r\n"
        )
        stalled.sendall(head.encode())  # and nothing more: the body timeout is 30 s
        time.sleep(0.5)  # in the server's hands
        t0 = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        svc.proc.wait(timeout=25)
        took = time.monotonic() - t0
        # drained 1 s (the owner), then 1 s (its fronts), and stopped; not the 30 s it was
        assert took < 10, took
        assert not any(process_alive(p) for p in kids), "a child outlived the service"
        said = b""
        while chunk := stalled.recv(4096):  # closed, not left hanging (an answer or none)
            said += chunk
        assert said == b"" or said.startswith(b"HTTP/1.1 "), said
        stalled.close()
    finally:
        stop_service(svc)
