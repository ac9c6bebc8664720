"""duet's own clock, read from its /metrics around a benchmark cell: the mean time of each
stage (`duet_stage_seconds`) and of /search/* requests, and the request latency's
histogram, whose buckets bound the quantiles as duet saw them: a client's p99 far above
duet's own says the time went outside duet's request handling (the client, the sockets,
a front's queue before the app)."""

from __future__ import annotations

import math
import re

import httpx

from duet.loadgen import FLUSH_S as FLUSH_S  # what the benchmarks import from here
from duet.loadgen import stage_label as _stage
from duet.loadgen import stage_totals as stage_totals

_BUCKETS = re.compile(r"^duet_(request|stage|device_step)_seconds_bucket\{([^}]*)\} (\S+)$", re.M)
OWN = ("request", "queue", "device", "step")  # what `own_buckets` reads


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def _own(family: str, labels: str) -> str | None:
    """Which of `OWN` a histogram series counts: "request" (/search/* answered 200: the
    answers a client counts), "queue" and "device" (those stages of `duet_stage_seconds`, per
    request), "step" (`duet_device_step_seconds`, per device step); None for the rest."""
    if family == "request":
        ok = 'endpoint="/search/' in labels and 'status="200"' in labels
        return "request" if ok else None
    if family == "device_step":
        return "step"
    stage = _stage(labels)
    return stage if stage in ("queue", "device") else None


def own_buckets(url: str) -> dict[str, dict[float, float]]:
    """duet's /metrics now: for each of `OWN`, the cumulative count per bucket bound (seconds).
    A cell's window also holds any answer to the cell before it still in flight when it
    began."""
    return parse_own(_metrics(url))


def parse_own(text: str) -> dict[str, dict[float, float]]:
    """`own_buckets` from the text of a /metrics page."""
    out: dict[str, dict[float, float]] = {}
    for family, labels, value in _BUCKETS.findall(text):
        le = re.search(r'le="([^"]+)"', labels)
        name = _own(family, labels)
        if le and name:
            bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
            counts = out.setdefault(name, {})
            counts[bound] = counts.get(bound, 0.0) + float(value)
    return out


def own_quantiles(
    before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
) -> dict[str, float]:
    """The bucket bounds (ms) holding duet's own p50 and p99 of its requests, and the p99 of
    each other histogram of `OWN`, counted between two `own_buckets` readings."""
    out = {}
    for name in OWN:
        for q in (50, 99) if name == "request" else (99,):
            key = f"p{q}" if name == "request" else f"{name} p{q}"
            out[key] = bucket_quantile(before.get(name, {}), after.get(name, {}), q / 100)
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound, in ms, of the bucket holding the q-quantile of the requests counted
    between `before` and `after` (inf: above the last bound; NaN: none counted)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= q * counts[-1]:
            return bound * 1000
    return math.inf
