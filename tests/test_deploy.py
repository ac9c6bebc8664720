"""What ops teams run: Dockerfile, docker-compose, Prometheus, Grafana, Kubernetes.

There is no Docker engine here, so each artefact is checked by the real tool that can check
it without one: Debian's docker-compose and the compose-spec JSON schema, promtool and a real
Prometheus server scraping a real `duet serve`, hadolint, and the Kubernetes OpenAPI schemas
(kubernetes-validate). Missing tools fail under CI=true (make test installs them), else skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from app.config import Settings
from tests.conftest import REPO, Service, free_port, start_service, stop_service, system_tool

DEPLOY = REPO / "deploy"
COMPOSE = REPO / "docker-compose.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "duet.json"
K8S = sorted((DEPLOY / "k8s").rglob("*.yaml"))
SETTINGS = sorted(f"DUET_{name.upper()}" for name in Settings.model_fields)
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


# -- docker compose ------------------------------------------------------------------------
def compose_config(*profiles: str) -> dict[str, Any]:
    """`docker-compose config` (resolves anchors, merges, interpolation) with .env.example."""
    args = [tool("docker-compose"), "--env-file", str(REPO / ".env.example"), "-f", str(COMPOSE)]
    for p in profiles:
        args += ["--profile", p]
    res = run(*args, "config")
    assert res.returncode == 0, res.stderr
    config: dict[str, Any] = yaml.safe_load(res.stdout)
    return config


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


def test_empty_setting_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose passes every DUET_* through, empty when unset; that must mean the default."""
    monkeypatch.setenv("DUET_RERANK_MAX_BATCH", "")
    monkeypatch.setenv("DUET_MODEL_DIR", "")
    s = Settings()
    assert s.rerank_max_batch == Settings.model_fields["rerank_max_batch"].default
    assert s.model_dir is None


# -- Dockerfile ------------------------------------------------------------------------------
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
    assert final["VOLUME"] == '["/data/indexes"]' and final["EXPOSE"] == "8000"
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


# -- Kubernetes --------------------------------------------------------------------------------
def test_k8s_manifests_match_their_schemas() -> None:
    kinds = set()
    for path in K8S:
        for doc in load_yaml_docs(path):
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
            kinds.add(doc["kind"])
    assert {"Deployment", "Service", "Job", "PersistentVolumeClaim", "ConfigMap"} <= kinds


def test_k8s_schema_check_catches_a_typo() -> None:
    doc = next(d for d in load_yaml_docs(DEPLOY / "k8s" / "api.yaml") if d["kind"] == "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_k8s_api_probes_gpu_and_volume() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for p in K8S for d in load_yaml_docs(p)}
    pod = docs[("Deployment", "duet-api")]["spec"]["template"]["spec"]
    api = pod["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert api["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert claims == {"duet-indexes"} and ("PersistentVolumeClaim", "duet-indexes") in docs
    job = docs[("Job", "duet-index-builder")]["spec"]["template"]["spec"]
    assert job["containers"][0]["args"][0] == "build"
    assert {v["persistentVolumeClaim"]["claimName"] for v in job["volumes"]} == {
        "duet-indexes",
        "duet-corpus",
    }
    assert ("Service", "duet-api") in docs and ("Service", "duet-redis") in docs
    assert docs[("ConfigMap", "duet-config")]["data"]["DUET_REDIS_URL"].startswith(
        "redis://duet-redis:"
    )


# -- Prometheus and Grafana ------------------------------------------------------------------
def test_promtool_checks_config_and_rules() -> None:
    promtool = tool("promtool")
    res = run(promtool, "check", "config", str(PROM_CONFIG))
    assert res.returncode == 0, res.stdout + res.stderr
    res = run(promtool, "check", "rules", str(ALERTS))
    assert res.returncode == 0 and "SUCCESS: 8 rules found" in res.stdout, res.stdout


def test_alerts_fire_when_they_should() -> None:
    """promtool's rule unit tests: down, 5xx ratio (probes excluded, idle = no alert),
    queue saturation, not ready."""
    res = run(tool("promtool"), "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml"))
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_alerts_cover_what_ops_must_hear_about() -> None:
    names = {r["alert"] for r in alert_rules()}
    assert {
        "DuetDown",
        "DuetNotReady",
        "DuetSearchLatencyP99High",
        "DuetHigh5xxRate",
        "DuetCacheErrors",
        "DuetQueueSaturated",
    } <= names
    runbook = "docs/operations.md"
    headings = {
        github_anchor(m) for m in re.findall(r"^#+ (.+)$", (REPO / runbook).read_text(), flags=re.M)
    }
    for rule in alert_rules():
        assert rule["annotations"]["summary"] and rule["labels"]["severity"]
        path, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert path == runbook, f"{rule['alert']}: runbook {path!r} is not {runbook}"
        assert anchor in headings, f"{runbook} has no runbook heading for {rule['alert']}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_dashboard_exprs_parse(tmp_path: Path) -> None:
    """promtool parses every dashboard expression (as recording rules)."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr{i}", "expr": e.replace("$__rate_interval", "5m")}
                    for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    res = run(tool("promtool"), "check", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr


def test_dashboard_panels_and_datasource() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"]
        assert all(t["datasource"]["uid"] == ds["uid"] for t in panel["targets"])
    exprs = " ".join(dashboard_exprs())
    for needle in (
        "rate(duet_request_seconds_count",
        "histogram_quantile(0.99",
        "histogram_quantile(0.5",
        "duet_stage_seconds_bucket",
        'duet_cache_requests_total{result="hit"}',
        "duet_rerank_batch_size",
        "duet_index_items",
        "duet_index_info",
    ):
        assert needle in exprs, needle
    # the provider reads the directory compose mounts the dashboards into, the home dashboard
    # is in it, and Grafana's own data directory is the persistent volume
    board = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "duet.yml").read_text()
    )["providers"][0]
    grafana = compose_config()["services"]["grafana"]
    mounts = {target: source for source, target, _ in volumes(grafana)}
    assert Path(mounts[board["options"]["path"]]) == DASHBOARD.parent
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == Path(board["options"]["path"]) and home.name == DASHBOARD.name
    assert mounts["/var/lib/grafana"] == "grafana"


PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "le",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names, strings or durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, rest = m.group(0), expr[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue  # a function call or a keyword
        if m.start() > 0 and (expr[m.start() - 1].isdigit() or expr[m.start() - 1] == "."):
            continue  # part of a number such as 1e3
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    assert metric_names(
        "histogram_quantile(0.99, sum by (le, endpoint) (rate("
        'duet_request_seconds_bucket{endpoint=~"/search/.*"}[5m]))) > 0.25'
    ) == {"duet_request_seconds_bucket"}
    assert metric_names(
        'sum(rate(a_total{result="error"}[5m])) / sum(rate(b[$__rate_interval]))'
    ) == {"a_total", "b"}
    assert metric_names('up{job="duet"} == 0') == {"up"}
    assert metric_names("duet_queue_depth / duet_queue_capacity > 0.8") == {
        "duet_queue_depth",
        "duet_queue_capacity",
    }


def exported_names(metrics_text: str) -> set[str]:
    """Every series name a /metrics page can produce (histogram and counter suffixes too)."""
    names = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", metrics_text, flags=re.M):
        name, kind = m.groups()
        suffixes = {
            "histogram": ["_bucket", "_count", "_sum", "_created"],
            "counter": ["_total", "_created"],
            "summary": ["_count", "_sum"],
        }
        names |= {name} | {name + s for s in suffixes.get(kind, [])}
    return names


@pytest.fixture(scope="module")
def service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(index_dir, tmp_path_factory.mktemp("deploy") / "serve.log")
    yield svc
    stop_service(svc)


def test_dashboard_and_alerts_name_only_exported_metrics(service: Service) -> None:
    with service.client() as c:
        exported = exported_names(c.get("/metrics").text) | {"up"}  # `up`: Prometheus's own
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used <= exported, f"not exported by duet: {sorted(used - exported)}"
    assert len(used) >= 10


def test_healthcheck_command(service: Service) -> None:
    ok = run(sys.executable, "-m", "duet.cli", "healthcheck", "--url", f"{service.url}/healthz")
    assert ok.returncode == 0, ok.stderr
    down = run(
        sys.executable,
        "-m",
        "duet.cli",
        "healthcheck",
        "--url",
        f"http://127.0.0.1:{free_port()}/healthz",
        "--timeout",
        "1",
    )
    assert down.returncode == 1 and "unhealthy" in down.stderr


def _prom_query(base: str, query: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5).json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_prometheus_scrapes_a_running_duet(service: Service, tmp_path: Path) -> None:
    """A real Prometheus, configured from deploy/prometheus, scrapes `duet serve` on loopback."""
    binary = tool("prometheus")
    config = yaml.safe_load(PROM_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    duet_job = next(j for j in config["scrape_configs"] if j["job_name"] == "duet")
    duet_job["static_configs"] = [{"targets": [service.url.removeprefix("http://")]}]
    config["rule_files"] = [str(ALERTS)]
    port = free_port()
    config["scrape_configs"] = [duet_job]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with service.client() as c:
            for q in ("a red circle", "two blue squares", "a small green triangle"):
                assert c.post("/search/text", json={"query": q}).status_code == 200
        deadline = time.monotonic() + 60
        series: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            try:
                series = _prom_query(base, 'duet_request_seconds_count{endpoint="/search/text"}')
            except httpx.TransportError:
                series = []
            if series and float(series[0]["value"][1]) >= 3:
                break
            time.sleep(0.5)
        assert series, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert sum(float(s["value"][1]) for s in series) >= 3
        assert float(_prom_query(base, 'up{job="duet"}')[0]["value"][1]) == 1
        assert float(_prom_query(base, "duet_ready")[0]["value"][1]) == 1
        rules = httpx.get(f"{base}/api/v1/rules", timeout=5).json()["data"]["groups"]
        loaded = {r["name"] for g in rules for r in g["rules"]}
        assert loaded == {r["alert"] for r in alert_rules()}
        assert all(
            r["health"] == "ok"
            for g in rules
            for r in g["rules"]
            if r.get("lastEvaluation", "").startswith("2")
        ), rules
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


# -- first run -------------------------------------------------------------------------------
def test_demo_index_builds_once_even_when_started_twice_at_once(tmp_path: Path) -> None:
    """Two replicas' init containers on one volume: one builds, the other waits and skips.
    The test holds the lock while both start, so both reach it before either has built."""
    out = tmp_path / "indexes"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "duet.cli",
        "demo-index",
        "--out",
        str(out),
        "--images",
        "12",
        "--no-progress",
    ]
    with (out / ".demo-index.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        time.sleep(3)  # both import and wait on the lock
        assert not (out / "current").exists() and all(p.poll() is None for p in procs)
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("nothing to do" in stdout for stdout, _ in outputs) == 1
    assert (out / "current" / "manifest.json").is_file()
    assert (tmp_path / "demo-corpus" / "manifest.jsonl").is_file()
    versions = [d for d in out.iterdir() if d.is_dir() and not d.is_symlink()]
    assert versions == [(out / "current").resolve()]
