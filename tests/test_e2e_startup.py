"""End to end, start-up: `duet serve`, `build`, `eval` and `demo-index` as real processes refuse
to start, with exit status 2 and a clear message, on an index from another model, a missing
index, a bad setting, a .env naming a missing model, or CUDA without a GPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Literal

import pytest
import torch

from app.config import Settings
from app.main import load_resources
from models.builtin import save_model
from models.joint import JointConfig, JointModel
from models.tokenizer import WordTokenizer
from models.world import vocabulary
from tests.conftest import CHILD_PYTHONPATH, DUET, free_port

pytestmark = pytest.mark.slow


def test_index_from_another_model_is_refused(corpus: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-model"
    tok = WordTokenizer(vocabulary())
    save_model(JointModel(JointConfig(vocab_size=tok.vocab_size)), tok, other)
    out = tmp_path / "idx"
    # DUET_PORT=0: `duet serve` tries its port before loading, and 8000 may be taken here
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "DUET_PORT": "0"}
    subprocess.run(
        [
            *DUET,
            "build",
            "--corpus",
            str(corpus),
            "--out",
            str(out),
            "--model-dir",
            str(other),
            "--no-progress",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    proc = subprocess.run(
        [*DUET, "serve"],
        env={**env, "DUET_INDEX_DIR": str(out)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "was built by model" in proc.stderr and "rebuild the index" in proc.stderr


def _serve_without_an_index(port: int, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`duet serve` on 127.0.0.1:`port` with an empty index folder: it stops at the port or
    at the index, whichever it reaches first."""
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "DUET_INDEX_DIR": str(tmp_path)}
    return subprocess.run(
        [*DUET, "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_port_in_use_is_one_clear_line_before_anything_loads(tmp_path: Path) -> None:
    """It printed "serving on" and "duet ready", then `[Errno 98] ... address already in use`,
    and exited 3: now the port is tried first, before the model and index (none here)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve_without_an_index(port, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr
    assert "--port" in proc.stderr and "DUET_PORT" in proc.stderr
    for claim in ("serving on", "duet ready", "Traceback", "duet build"):
        assert claim not in proc.stderr, proc.stderr


def test_a_misspelt_setting_is_told_with_the_name_it_is_closest_to() -> None:
    """DUET_REDIS_ULR was ignored without a word (the service ran on the in-process cache);
    docker-compose's own DUET_* variables and Kubernetes' service links are not settings."""
    env = {
        **os.environ,
        "PYTHONPATH": CHILD_PYTHONPATH,
        "DUET_REDIS_ULR": "redis://127.0.0.1:6379/0",
        "DUET_FLAVOR": "cpu",
        "DUET_API_PORT": "tcp://10.0.0.1:8000",
        "DUET_SERVICE_HOST": "10.0.0.2",  # Kubernetes' links of a Service named "duet"
        "DUET_log_level": "info",  # a setting: pydantic-settings reads names in any case
    }
    url = f"http://127.0.0.1:{free_port()}/healthz"
    proc = subprocess.run(
        [*DUET, "healthcheck", "--url", url, "--timeout", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        "ignoring DUET_REDIS_ULR: no duet setting has that name; did you mean DUET_REDIS_URL?"
        in (proc.stderr)
    )
    for fine in ("DUET_FLAVOR", "DUET_API_PORT", "DUET_SERVICE_HOST", "DUET_log_level"):
        assert fine not in proc.stderr, proc.stderr


def test_a_liveness_port_in_use_names_its_setting(tmp_path: Path) -> None:
    """It was "duet: error: Address already in use", naming no port and no setting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"DUET_HEALTH_PORT": str(port), "DUET_PORT": "0", "DUET_INDEX_DIR": str(tmp_path)}
        full = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, **env}
        proc = subprocess.run(
            [*DUET, "serve"], env=full, capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port} for the liveness port" in proc.stderr
    assert "set DUET_HEALTH_PORT" in proc.stderr and "Traceback" not in proc.stderr


def test_the_port_is_not_held_while_the_model_loads(tmp_path: Path) -> None:
    """The port is tried, not kept: a service that refuses to start (no index here) leaves
    it to anyone, and one that another socket merely bound (not listening) still starts."""
    with socket.socket() as bound:
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        proc = _serve_without_an_index(port, tmp_path)
    assert proc.returncode == 2 and "duet build" in proc.stderr  # got past the port to the index
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # nothing of the refused service holds it


def test_missing_index_says_how_to_build(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": CHILD_PYTHONPATH,
        "DUET_INDEX_DIR": str(tmp_path / "none"),
        "DUET_PORT": "0",  # the port is tried first: 8000 may be taken here
    }
    proc = subprocess.run([*DUET, "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "duet build" in proc.stderr


@pytest.mark.parametrize(("precision", "runs"), [("auto", "fp32"), ("bf16", "bf16")])
def test_precision_setting_reaches_the_cross_encoder(
    index_dir: Path, precision: Literal["auto", "bf16"], runs: str
) -> None:
    settings = Settings(index_dir=index_dir, index_poll_s=0, device="cpu", precision=precision)
    res = load_resources(settings)
    try:  # auto on the CPU is fp32
        assert res.model.joint.cross.precision == runs  # type: ignore[attr-defined]
    finally:
        res.index.close()


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"DUET_RERANK_MAX_BATCH": "lots"}, "DUET_RERANK_MAX_BATCH"),
        ({"DUET_DEVICE": "tpu"}, "DUET_DEVICE"),
        ({"DUET_PRECISION": "fp8"}, "DUET_PRECISION"),
        # a traceback after "serving on", exit 3, before the URL was checked with the others
        ({"DUET_REDIS_URL": "http://127.0.0.1:6379"}, "DUET_REDIS_URL: Redis URL must specify"),
        ({"DUET_REDIS_URL": "redis://h:notaport/0"}, "give redis://[:password@]host:port/db"),
        # taken as db 0 without a word
        ({"DUET_REDIS_URL": "redis://h:6379/abc"}, "the database 'abc' is no number"),
        # on, and every call a 401: HTTP takes the spaces off the header's value
        ({"DUET_ADMIN_TOKEN": " tok"}, "DUET_ADMIN_TOKEN: it has spaces around it"),
        ({"DUET_LOG_LEVEL": "loud"}, "DUET_LOG_LEVEL: unknown level 'loud': one of"),  # a traceback
        # found after the load, as uvicorn's "address already in use"
        # before the port is tried (a port in use would be told first)
        ({"DUET_HEALTH_PORT": "18431", "DUET_PORT": "18431"}, "DUET_HEALTH_PORT is the service's"),
    ],
)
def test_bad_setting_is_a_clear_error(index_dir: Path, env: dict[str, str], says: str) -> None:
    full = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "DUET_INDEX_DIR": str(index_dir), **env}
    proc = subprocess.run([*DUET, "serve"], env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["build", "--corpus", "CORPUS", "--out", "OUT"],
        ["eval", "--index", "INDEX", "--modes", "dot"],
        ["demo-index", "--out", "OUT", "--images", "2"],
    ],
)
def test_every_command_reads_the_same_dotenv(
    command: list[str], corpus: Path, index_dir: Path, tmp_path: Path
) -> None:
    """One configuration path (issue 14): a .env in the working directory configures build,
    eval and demo-index as it configures serve, so they cannot encode with other models than
    the service serves. Here it names a model directory that does not exist."""
    (tmp_path / ".env").write_text(f"DUET_MODEL_DIR={tmp_path / 'no-such-model'}\n")
    args = [
        {"CORPUS": str(corpus), "OUT": str(tmp_path / "out"), "INDEX": str(index_dir)}.get(a, a)
        for a in command
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUET_")}
    proc = subprocess.run(
        [*DUET, *args],
        env={**env, "PYTHONPATH": CHILD_PYTHONPATH},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no-such-model" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused(index_dir: Path) -> None:
    full = {
        **os.environ,
        "PYTHONPATH": CHILD_PYTHONPATH,
        "DUET_INDEX_DIR": str(index_dir),
        "DUET_DEVICE": "cuda",
        "DUET_PORT": "0",  # the port is tried first: 8000 may be taken here
    }
    proc = subprocess.run([*DUET, "serve"], env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr


def test_a_second_ctrl_c_quits_at_once_in_one_line(index_dir: Path, tmp_path: Path) -> None:
    """uvicorn's force quit (Ctrl-C twice) skips the app's shutdown, and logged the lifespan
    task it then cancelled as a CancelledError traceback: one line says it now, exit 0."""
    import signal
    import time

    from tests.conftest import start_service

    svc = start_service(index_dir, tmp_path / "serve.log", DUET_REDIS_URL="")
    svc.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    svc.proc.send_signal(signal.SIGINT)
    assert svc.proc.wait(timeout=30) == 0
    said = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in said and "CancelledError" not in said, said
    assert "forced to quit (a second Ctrl-C)" in said


def test_a_setting_names_the_flag_that_gave_it_and_auto_takes_any_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from duet.commands.common import load_settings
    from models.errors import UserError

    with pytest.raises(UserError, match=r"--port: Input should be less than or equal to 65535"):
        load_settings(port=99999)  # it said DUET_PORT, which was not set
    assert Settings(frontends="AUTO").frontends == "auto"  # was refused
    monkeypatch.setenv("DUET_INDEX_POLL_S", "0.0001")  # the poller spent the event loop
    with pytest.raises(UserError, match=r"DUET_INDEX_POLL_S: .*0.0001 s is too often: give 0"):
        load_settings()
    monkeypatch.setenv("DUET_INDEX_POLL_S", "0")
    assert load_settings().index_poll_s == 0
    for wrong in ("lots", "99", "2.5"):  # pydantic's union said two things, one about 'auto'
        monkeypatch.setenv("DUET_FRONTENDS", wrong)
        with pytest.raises(UserError, match=f"DUET_FRONTENDS: '{wrong}' is no count of front"):
            load_settings()


def test_a_wrong_value_from_dotenv_says_it_came_from_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from duet.commands.common import load_settings
    from models.errors import UserError

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DUET_PORT", raising=False)
    (tmp_path / ".env").write_text("DUET_PORT=abc\n")
    with pytest.raises(UserError, match=r"DUET_PORT \(in ./.env\): Input should be a valid int"):
        load_settings()


def test_a_misspelt_setting_in_dotenv_is_told_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """./.env's typos were not looked at (only the environment's were): DUET_RERANKR=none
    there left the re-ranker on without a word."""
    from duet.commands.common import load_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DUET_RERANKR", raising=False)
    (tmp_path / ".env").write_text("# a comment\nexport DUET_RERANKR=none\nDUET_PORT=8001\n")
    with caplog.at_level("WARNING", logger="duet"):
        assert load_settings().port == 8001
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "ignoring DUET_RERANKR (in ./.env): no duet setting has that name; did you mean "
        "DUET_RERANKER? (docs/configuration.md lists them)"
    ]


def test_only_a_force_quit_hides_the_cancelled_lifespan() -> None:
    """A shutdown that fails on its own (one Ctrl-C) keeps its traceback."""
    import logging
    from types import SimpleNamespace

    from duet.commands.serve import _ForcedQuit

    said = "Traceback (most recent call last):\n  ...\nasyncio.exceptions.CancelledError"
    record = logging.LogRecord("uvicorn.error", logging.ERROR, "", 0, said, None, None)
    assert _ForcedQuit(SimpleNamespace(force_exit=False)).filter(record)
    assert not _ForcedQuit(SimpleNamespace(force_exit=True)).filter(record)
