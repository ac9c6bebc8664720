"""Paths, tool lookup and parsers shared by the deploy/ artefact tests (tests/test_deploy_*.py).

There is no Docker engine here, so each artefact is checked by the real tool that can check
it without one. Missing tools fail under CI=true (make test installs them), else skip.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from app.config import Settings
from tests.conftest import REPO, system_tool

DEPLOY = REPO / "deploy"
COMPOSE = REPO / "docker-compose.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "duet.json"
K8S = sorted((DEPLOY / "k8s").rglob("*.yaml"))
# how to get each tool pip cannot (make test installs them with apt-get where it may)
GET = {
    "docker-compose": "apt-get install docker-compose",
    "promtool": "apt-get install prometheus",
    "prometheus": "apt-get install prometheus",
}


def tool(name: str) -> str:
    """Path of a command-line tool, from the venv or PATH; fail under CI, else skip."""
    return system_tool(name, GET.get(name, "make install (the dev extra)"))


def run(*cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, **kw)


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def compose_config(*profiles: str) -> dict[str, Any]:
    """`docker-compose config` (resolves anchors, merges, interpolation) with .env.example."""
    args = [tool("docker-compose"), "--env-file", str(REPO / ".env.example"), "-f", str(COMPOSE)]
    for p in profiles:
        args += ["--profile", p]
    res = run(*args, "config")
    assert res.returncode == 0, res.stderr
    config: dict[str, Any] = yaml.safe_load(res.stdout)
    return config


def volumes(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of a service's volumes, short or long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            out.append((source, target, mode == ["ro"]))
        else:
            out.append((v["source"], v["target"], bool(v.get("read_only"))))
    return out


def numeric_default(env_name: str) -> float | None:
    """The service's default for DUET_<NAME> when it is a number; None for any other setting."""
    field = Settings.model_fields.get(env_name.removeprefix("DUET_").lower())
    default = field.default if field is not None else None
    if isinstance(default, int | float) and not isinstance(default, bool):
        return float(default)
    return None
