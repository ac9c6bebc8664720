"""The Kubernetes manifests under deploy/k8s: every resource matches its OpenAPI schema
(kubernetes-validate, strict), and the api Deployment, Services, volumes and builder Job fit
together."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy_helpers import DEPLOY, K8S, load_yaml_docs, numeric_default


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
    assert (
        claims == {"duet-indexes", "duet-corpus"}
        and ("PersistentVolumeClaim", "duet-indexes") in docs
    )
    job = docs[("Job", "duet-index-builder")]["spec"]["template"]["spec"]
    assert job["containers"][0]["args"][0] == "build"
    claimed = [v for v in job["volumes"] if "persistentVolumeClaim" in v]
    assert {v["persistentVolumeClaim"]["claimName"] for v in claimed} == {
        "duet-indexes",
        "duet-corpus",
    }
    assert ("Service", "duet-api") in docs and ("Service", "duet-redis") in docs
    assert docs[("ConfigMap", "duet-config")]["data"]["DUET_REDIS_URL"].startswith(
        "redis://duet-redis:"
    )


def test_k8s_api_serves_the_builders_images_and_drains_before_it_is_killed() -> None:
    """The api mounts the corpus where the builder Job read it, under DUET_IMAGES_DIR (a
    version built from /data/corpus had every image a 404), and its grace period covers
    preStop and two drains (owner, then fronts): 30 s by default killed requests under way."""
    docs = {(d["kind"], d["metadata"]["name"]): d for p in K8S for d in load_yaml_docs(p)}
    pod = docs[("Deployment", "duet-api")]["spec"]["template"]["spec"]
    job = docs[("Job", "duet-index-builder")]["spec"]["template"]["spec"]
    config = docs[("ConfigMap", "duet-config")]["data"]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    read = next(m for m in job["containers"][0]["volumeMounts"] if m["name"] == "corpus")
    assert mounts[read["mountPath"]]["readOnly"] is True
    assert read["mountPath"].startswith(config["DUET_IMAGES_DIR"].rstrip("/") + "/")
    assert config["DUET_INDEX_DIR"].startswith(config["DUET_IMAGES_DIR"].rstrip("/") + "/")
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    drain = float(config["DUET_HTTP_DRAIN_S"])
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[-1]) + 2 * drain + 5
    assert ("PodDisruptionBudget", "duet-api") in docs


# settings the manifests set on purpose to other than the service's default
CHOSEN = {"DUET_HEALTH_PORT": 8001.0}  # liveness off the event loop (app.liveness)


def test_k8s_config_sets_the_numeric_defaults() -> None:
    # the ConfigMap spells out every setting; a numeric one that drifts from the service's default
    # (λ, for one, is re-chosen whenever the shipped weights change) would quietly serve otherwise
    docs = {(d["kind"], d["metadata"]["name"]): d for p in K8S for d in load_yaml_docs(p)}
    data = docs[("ConfigMap", "duet-config")]["data"]
    checked = 0
    for key, value in data.items():
        if key in CHOSEN:  # a deployment's choice, not a default
            assert float(value) == CHOSEN[key], (key, value)
            continue
        if value and (default := numeric_default(key)) is not None:
            assert float(value) == default, (key, value, default)
            checked += 1
    assert checked >= 20 and "DUET_RERANK_FUSION_LAMBDA" in data
