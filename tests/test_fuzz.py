"""Schema fuzzing against a real `duet serve` over real sockets (issue 15): schemathesis reads
the service's own OpenAPI document and sends generated requests, valid and not, to every
operation. Every answer must be a documented status (never a 5xx), with the documented
content type and a body matching the documented schema."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import Service, start_service, stop_service

# the two search routes x (valid, invalid) + /admin/reload, 200 examples each: over 1,000
EXAMPLES = 200
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
SENT: Counter[str] = Counter()


@pytest.fixture(scope="module")
def fuzzed_service(index_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(
        index_dir,
        tmp_path_factory.mktemp("fuzz") / "serve.log",
        DUET_ADMIN_TOKEN="fuzz-token",
        DUET_MAX_IMAGE_BYTES="200000",
    )
    yield svc
    stop_service(svc)
    assert "Traceback" not in svc.log.read_text()


OPERATIONS = [
    ("POST", "/search/text"),
    ("POST", "/search/image"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("POST", "/admin/reload"),
    ("GET", "/images/{item_id}"),
]


@pytest.fixture(scope="module")
def api_schema(fuzzed_service: Service) -> Any:
    schema = schemathesis.openapi.from_url(f"{fuzzed_service.url}/openapi.json")
    found = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}  # type: ignore[union-attr]
    assert found == set(OPERATIONS), found  # a new route is fuzzed once it is listed here
    return schema


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_operation_answers_as_documented(
    api_schema: Any, fuzzed_service: Service, method: str, path: str, mode: GenerationMode
) -> None:
    """Requests valid by the schema, then invalid ones (wrong types, missing fields, values
    out of range, other media types)."""
    operation = api_schema[path][method]
    if not path.startswith("/search/") and mode is GenerationMode.NEGATIVE:
        pytest.skip("no body or parameters to get wrong (only an optional header)")

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        SENT[f"{method} {path} {mode.value}"] += 1
        case.call_and_validate(base_url=fuzzed_service.url, checks=CHECKS, timeout=60)

    fuzz()


def test_fuzzing_sent_enough_requests() -> None:
    """Runs after the fuzzing above (same module, file order): at least 1,000 requests, every
    operation reached."""
    if len(SENT) < len(OPERATIONS) + 2:
        pytest.skip("the fuzz tests did not all run in this session (deselected)")
    assert sum(SENT.values()) >= 1_000, SENT
