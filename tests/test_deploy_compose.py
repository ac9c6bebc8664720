"""docker-compose.yml and the settings it passes: checked with Debian's docker-compose
(`config`, with .env.example, per profile) and the compose-spec JSON schema; every setting is
in .env.example, compose and the Kubernetes ConfigMap.

Missing tools fail under CI=true (make test installs them), else skip.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import Settings
from tests.conftest import REPO
from tests.deploy_helpers import (
    COMPOSE,
    DEPLOY,
    compose_config,
    load_yaml_docs,
    numeric_default,
    run,
    tool,
    volumes,
)

SETTINGS = sorted(f"DUET_{name.upper()}" for name in Settings.model_fields)


def test_compose_file_and_resolved_config_match_the_compose_spec(tmp_path: Path) -> None:
    resolved = tmp_path / "resolved.yml"
    resolved.write_text(yaml.safe_dump(compose_config("gpu", "build")))
    for path in (COMPOSE, resolved):
        res = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
        assert res.returncode == 0, res.stdout + res.stderr


def test_compose_schema_check_catches_a_broken_file(tmp_path: Path) -> None:
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["redis"]["helthcheck"] = broken["services"]["redis"].pop("healthcheck")
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    res = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
    assert res.returncode != 0


def _devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = (
        service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    )
    return devices


def test_compose_gpu_and_cpu_hosts() -> None:
    gpu = compose_config("gpu")["services"]
    assert _devices(gpu["api"]) == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["api"]["build"]["args"]["FLAVOR"] == "gpu"
    assert gpu["api"]["profiles"] == ["gpu"] and gpu["api-cpu"]["profiles"] == ["cpu"]
    assert _devices(gpu["api-cpu"]) == []
    # both api variants answer to `api`, the name prometheus scrapes
    for name in ("api", "api-cpu"):
        assert gpu[name]["networks"]["default"]["aliases"] == ["api"]
    # a CPU host: .env.example with DUET_FLAVOR=cpu
    cpu_env = {**os.environ, "DUET_FLAVOR": "cpu", "COMPOSE_PROFILES": "cpu"}
    res = run(
        tool("docker-compose"),
        "--env-file",
        str(REPO / ".env.example"),
        "-f",
        str(COMPOSE),
        "config",
        env=cpu_env,
    )
    assert res.returncode == 0, res.stderr
    cpu = yaml.safe_load(res.stdout)["services"]
    assert cpu["api-cpu"]["image"] == "duet:cpu" and _devices(cpu["api-cpu"]) == []
    assert cpu["api-cpu"]["build"]["args"]["FLAVOR"] == "cpu"


def test_compose_services_come_up_in_order() -> None:
    svc = compose_config("gpu", "build")["services"]
    assert {
        "redis",
        "index-init",
        "api",
        "api-cpu",
        "index-builder",
        "prometheus",
        "grafana",
    } <= set(svc)
    redis_cmd = svc["redis"]["command"]
    pairs = dict(zip(redis_cmd[1::2], redis_cmd[2::2], strict=False))
    assert pairs["--save"] == "" and pairs["--appendonly"] == "no"  # a cache: no persistence
    assert pairs["--maxmemory-policy"] == "allkeys-lru" and pairs["--maxmemory"] == "512mb"
    for name in ("redis", "api", "api-cpu", "prometheus", "grafana"):
        assert svc[name]["healthcheck"]["test"], f"{name} has no healthcheck"
    assert svc["api"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "index-init": {"condition": "service_completed_successfully"},
    }
    assert svc["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert svc["api"]["healthcheck"]["test"] == ["CMD", "duet", "healthcheck"]
    for name in ("index-init", "index-builder", "index-builder-cpu"):  # jobs, not servers
        assert svc[name]["healthcheck"] in ({"disable": True}, {"test": ["NONE"]})
    # the builder is a one-shot job in its own profile that writes where the api reads
    builder = svc["index-builder"]
    assert builder["profiles"] == ["build"] and builder["restart"] == "no"
    assert builder["command"][0] == "build" and "/data/indexes" in builder["command"]
    assert _devices(builder)
    assert ("indexes", "/data/indexes", True) in volumes(svc["api"])
    assert ("indexes", "/data/indexes", False) in volumes(builder)
    # the files prometheus and grafana mount are in the repo
    for name in ("prometheus", "grafana"):
        binds = [source for source, _, _ in volumes(svc[name]) if source.startswith("/")]
        assert binds and all(Path(source).exists() for source in binds), binds


def test_compose_api_serves_the_builders_images_and_drains_before_it_is_killed() -> None:
    """The api mounts the corpus where index-builder read it, under DUET_IMAGES_DIR (a
    version built from /data/corpus had every image a 404), and its stop grace covers two
    drains (owner, then fronts): Docker's 10 s SIGKILLed requests under way."""
    svc = compose_config("gpu", "build")["services"]
    api, builder = svc["api"], svc["index-builder"]
    images = api["environment"]["DUET_IMAGES_DIR"].rstrip("/") + "/"
    corpus = next(v for v in volumes(builder) if v[1] == "/data/corpus")
    assert (corpus[0], corpus[1], True) in volumes(api) and corpus[1].startswith(images)
    assert api["environment"]["DUET_INDEX_DIR"].startswith(images)
    grace = api["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) >= 2 * Settings().http_drain_s + 5, grace
    assert builder["shm_size"] in ("1gb", "1073741824", 1073741824), builder["shm_size"]


def test_every_setting_is_in_env_example_compose_and_k8s() -> None:
    env_example = {
        line.split("=", 1)[0]
        for line in (REPO / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    }
    assert set(SETTINGS) <= env_example, set(SETTINGS) - env_example
    api_env = compose_config("gpu")["services"]["api"]["environment"]
    assert set(SETTINGS) <= set(api_env), set(SETTINGS) - set(api_env)
    configmap = next(
        d for d in load_yaml_docs(DEPLOY / "k8s" / "config.yaml") if d["kind"] == "ConfigMap"
    )
    api = next(d for d in load_yaml_docs(DEPLOY / "k8s" / "api.yaml") if d["kind"] == "Deployment")[
        "spec"
    ]["template"]["spec"]["containers"][0]
    secret_env = {e["name"] for e in api["env"] if "secretKeyRef" in e["valueFrom"]}
    assert secret_env == {"DUET_ADMIN_TOKEN"}  # a secret, not in the ConfigMap
    assert set(SETTINGS) == set(configmap["data"]) | secret_env
    # values the ConfigMap sets must be valid settings (an empty value = the default)
    Settings(**{k[5:].lower(): v for k, v in configmap["data"].items() if v})


def test_env_example_states_the_numeric_defaults() -> None:
    """Each numeric setting's `default:` comment in .env.example is the default the service
    uses (λ, for one, is re-chosen whenever the shipped weights change)."""
    lines = (REPO / ".env.example").read_text().splitlines()
    checked = 0
    for above, line in itertools.pairwise(lines):
        name = line.split("=", 1)[0]
        if not line.startswith("DUET_") or "default:" not in above:
            continue
        if (default := numeric_default(name)) is not None:
            assert float(above.rsplit("default:", 1)[1]) == default, (name, above)
            checked += 1
    assert checked >= 20, checked


def test_empty_setting_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose passes every DUET_* through, empty when unset; that must mean the default."""
    monkeypatch.setenv("DUET_RERANK_MAX_BATCH", "")
    monkeypatch.setenv("DUET_MODEL_DIR", "")
    s = Settings()
    assert s.rerank_max_batch == Settings.model_fields["rerank_max_batch"].default
    assert s.model_dir is None
