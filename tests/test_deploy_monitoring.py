"""Prometheus and Grafana: promtool checks the config, rules and alert unit tests, the dashboard
and alerts name only metrics a real `duet serve` exports, and a real Prometheus server scrapes
it; `duet healthcheck` against the same service.

Missing tools fail under CI=true (make test installs them), else skip.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import REPO, Service, free_port, start_service, stop_service
from tests.deploy_helpers import (
    ALERTS,
    DASHBOARD,
    DEPLOY,
    PROM_CONFIG,
    compose_config,
    load_yaml_docs,
    run,
    tool,
    volumes,
)


def test_promtool_checks_config_and_rules() -> None:
    promtool = tool("promtool")
    res = run(promtool, "check", "config", str(PROM_CONFIG))
    assert res.returncode == 0, res.stdout + res.stderr
    res = run(promtool, "check", "rules", str(ALERTS))
    assert res.returncode == 0 and "SUCCESS: 10 rules found" in res.stdout, res.stdout


def test_the_k8s_scrape_config_finds_the_api_pods_as_job_duet(tmp_path: Path) -> None:
    """prometheus-k8s.yml keeps the pods deploy/k8s/api.yaml labels, on the port it names
    http, as job `duet` (the alerts' and dashboard's); promtool checks the rest with a static
    target (Debian's build has no Kubernetes discovery)."""
    config = yaml.safe_load(PROM_CONFIG.with_name("prometheus-k8s.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "duet")
    assert config["rule_files"] == ["alerts.yml"] and job["kubernetes_sd_configs"]
    pod = next(d for d in load_yaml_docs(DEPLOY / "k8s" / "api.yaml") if d["kind"] == "Deployment")[
        "spec"
    ]["template"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    label = "__meta_kubernetes_pod_label_app_kubernetes_io_name"
    kept = {
        r["source_labels"][0]: r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    assert kept[label] == pod["metadata"]["labels"]["app.kubernetes.io/name"]
    assert ports[kept["__meta_kubernetes_pod_container_port_name"]] == 8000  # not health's
    job["static_configs"] = [{"targets": ["api:8000"]}]
    del job["kubernetes_sd_configs"]
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text())
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    res = run(tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr


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
        "DuetIndexReloadRefused",
        "DuetIndexDamaged",
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
    r = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5)
    if r.status_code == 503:  # Prometheus still starting ("Service Unavailable", not JSON)
        return []
    body = r.json()
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
