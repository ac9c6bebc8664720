"""Wrong DUET_ENCODER / DUET_RERANKER choices, on tiny random CLIP, SigLIP and BLIP ITM
checkpoints (tests/hf_checkpoints.py): `duet serve` exits 2 with a message naming the variable
and what is wrong with its value, before any index is read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from duet.cli import main
from models.trainconfig import DEFAULT_WEIGHTS
from tests.conftest import CHILD_PYTHONPATH, DUET, REPO
from tests.hf_wiring_helpers import make_checkpoints


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize(
    "case", ["encoder-is-blip", "reranker-is-clip", "missing", "late", "han", "han-untrained"]
)
def test_wrong_choices_exit_2_naming_the_variable(
    case: str,
    ckpt: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    encoder, reranker, want = {
        "encoder-is-blip": (
            ckpt["blip"],
            "builtin",
            "DUET_ENCODER={}: not a CLIP or SigLIP checkpoint (its config.json "
            "says model_type 'blip')",
        ),
        "reranker-is-clip": ("builtin", ckpt["clip"], "DUET_RERANKER={}: not a BLIP checkpoint"),
        "missing": (tmp_path / "nope", "builtin", "DUET_ENCODER={}: no such directory"),
        "late": (ckpt["clip"], "late", "DUET_RERANKER=late needs token-level text features"),
        "han": (ckpt["clip"], "han", "DUET_RERANKER=han needs token-level text features"),
        "han-untrained": ("builtin", "han", "DUET_RERANKER=han: {} has no trained HAN head"),
    }[case]
    monkeypatch.setenv("DUET_ENCODER", str(encoder))
    monkeypatch.setenv("DUET_RERANKER", str(reranker))
    monkeypatch.setenv("DUET_PORT", "0")  # `duet serve` tries its port first: 8000 may be taken
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("served"))
    bad = encoder if "DUET_ENCODER" in want else reranker
    if case == "han-untrained":  # duet's weights without the HAN head beside them
        bad = tmp_path / "weights"
        bad.mkdir()
        for name in ("model.safetensors", "config.json", "vocab.json"):
            shutil.copy(DEFAULT_WEIGHTS / name, bad / name)
        monkeypatch.setenv("DUET_MODEL_DIR", str(bad))
    assert main(["serve", "--index-dir", str(tmp_path)]) == 2
    assert want.format(bad) in capsys.readouterr().err


def test_duet_serve_exits_2_for_a_wrong_kind(ckpt: dict[str, Path], tmp_path: Path) -> None:
    """The real process: exit status 2 and the message, before any index is read."""
    env = {
        **os.environ,
        "PYTHONPATH": CHILD_PYTHONPATH,
        "DUET_ENCODER": str(ckpt["blip"]),
        "DUET_INDEX_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [*DUET, "serve"], capture_output=True, text=True, env=env, timeout=120, cwd=REPO
    )
    assert proc.returncode == 2, proc.stderr
    assert f"duet: error: DUET_ENCODER={ckpt['blip']}: not a CLIP or SigLIP" in proc.stderr
