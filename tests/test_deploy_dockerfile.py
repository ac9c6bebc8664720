"""The Dockerfile and the docker build context: hadolint, and a parser-based check of the two
image flavours (GPU and CPU), the runtime user, healthcheck, entrypoint and volume.

Missing tools fail under CI=true (make test installs them), else skip.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO
from tests.deploy_helpers import run, tool


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_passes_hadolint() -> None:
    res = run(tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), "Dockerfile")
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install duet\n")
    res = run(tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), str(bad))
    assert res.returncode != 0 and "DL3007" in res.stdout


def test_dockerfile_gpu_and_cpu_images_run_the_same_way() -> None:
    ins = dockerfile_instructions()
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    assert args["FLAVOR"] == "gpu"
    # the CUDA base brings the NVIDIA runtime hooks; CUDA libraries come as torch's wheels
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:12.") and "-base-" in args["CUDA_IMAGE"]
    assert args["PYTHON_IMAGE"].startswith("python:3.")
    stages = [a for k, a in ins if k == "FROM"]
    assert "${PYTHON_IMAGE} AS os-cpu" in stages and "${CUDA_IMAGE} AS os-gpu" in stages
    assert stages[-1] == "os-${FLAVOR} AS runtime"
    runtime = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM") :]
    final = {k: a for k, a in runtime}
    user = final["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "the runtime image must not run as root"
    assert final["HEALTHCHECK"].endswith('CMD ["duet", "healthcheck"]')
    assert final["ENTRYPOINT"] == '["duet"]' and final["CMD"] == '["serve"]'
    assert final["VOLUME"] == '["/data/indexes"]' and final["EXPOSE"] == "8000 8001"
    assert "DUET_INDEX_DIR=/data/indexes" in final["ENV"]
    # faiss-gpu and a CUDA torch on GPU images, the CPU builds on CPU images
    env = " ".join(a for k, a in ins if k == "ENV")
    assert "FAISS_PACKAGE=faiss-gpu-cu12" in env and "FAISS_PACKAGE=faiss-cpu" in env
    assert "whl/cu126" in env and "whl/cpu" in env


def test_docker_context_has_the_code_and_weights_and_nothing_else() -> None:
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "**"  # everything is excluded unless listed
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = {
        a.split()[0]
        for k, a in dockerfile_instructions()
        if k == "COPY" and not a.startswith("--from")
    } - {"pyproject.toml"}
    assert copied | {"pyproject.toml", "README.md"} <= allowed, copied - allowed
    assert not {".venv", "indexes", "data", ".git"} & allowed
    assert "models" in allowed  # models/weights/ ships inside the image
    assert (REPO / "models" / "weights" / "model.safetensors").is_file()
