"""`duet bench`'s report: the table of each cell's figures, the service's stage times, and
the notes its figures need (cached answers, degraded ones, 429s, a busy client, errors)."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from duet.commands.bench import Cell

BUSY_CLIENT = 0.85  # of a core: past it, the client may be what bounds the figures


def print_cells(url: str, info: dict[str, Any], cells: list[Cell], as_json: bool) -> None:
    """The cells measured, as tables (or one JSON object): all of them, or those measured
    before the service went away or Ctrl-C."""
    if as_json:
        doc = {"url": url, "readyz": info, "cells": [c.as_json() for c in cells]}
        print(json.dumps(doc, allow_nan=False))
    elif cells:
        print(_tables(url, info, cells))


# the stages in the order a search goes through them (`app.pipeline`, `app.work`); any other
# the service reports comes after, then its whole time
PIPELINE = ("cache", "queue", "batch", "encode", "search", "device", "lookup", "rerank")


def _tables(url: str, info: dict[str, Any], cells: list[Cell]) -> str:
    cached = sum(c.cached for c in cells)
    out = [
        f"duet bench {url}: model {info.get('model')}, index {info.get('index_version')}, "
        f"cache {info.get('cache')}; closed loop"
        + ("" if cached else ", every answer computed (no query answered from the cache)"),
        "",
        "| mode | clients | req/s | p50 ms | p99 ms | 429 | errors | cached | degraded "
        "| client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        j = c.as_json()
        errors = sum(c.errors.values())
        p50, p99 = (f"{j[k]}" if j[k] is not None else "-" for k in ("p50_ms", "p99_ms"))
        out.append(
            f"| {c.mode} | {c.clients} | {j['req_per_s']:,} | {p50} | {p99} "
            f"| {c.refused} | {errors} | {c.cached} | {c.degraded} | {c.client_cpu:.0%} |"
        )
    found = {s for c in cells for s in c.stages}
    stages = [s for s in PIPELINE if s in found]
    stages += sorted(found - set(PIPELINE) - {"request"}) + (
        ["request"] if "request" in found else []
    )
    if stages:
        out += [
            "",
            "The service's mean ms per stage of the requests that went through it "
            "(duet_stage_seconds; `batch`: waiting in the engine while batch-mates are served; "
            "`request`: its whole time per search, duet_request_seconds):",
            "",
            "| mode | clients | " + " | ".join(stages) + " |",
            "|---|---|" + "---|" * len(stages),
        ]
        for c in cells:
            cols = " | ".join(f"{c.stages[s]:.2f}" if s in c.stages else "-" for s in stages)
            out.append(f"| {c.mode} | {c.clients} | {cols} |")
    out += _notes(cells)
    return "\n".join(out)


def _notes(cells: list[Cell]) -> list[str]:
    """What the table's figures need said: cells the cache answered, answers left out of
    them, clients that waited out 429s, a load generator that may bound them, errors."""
    notes = []
    if cached := [c for c in cells if c.cached]:
        share = sum(c.cached for c in cached) / sum(len(c.latencies) for c in cached)
        notes.append(
            f"{share:.0%} of the answers in {len(cached)} cell(s) came from the cache: the "
            "queries ran out, or an earlier run asked them while the cache kept them "
            "(DUET_CACHE_TTL_S); those cells measure the cache, not the search. Give more "
            "--queries, or clear the cache (restart duet; redis-cli FLUSHDB for Redis)."
        )
    if degraded := [c for c in cells if c.degraded]:
        notes.append(
            f"{sum(c.degraded for c in degraded):,} answers were degraded (fewer candidates "
            "re-ranked, to meet DUET_REQUEST_TIMEOUT_MS): left out of req/s and the "
            "percentiles, which count full answers only."
        )
    if refused := [c for c in cells if c.refused]:
        notes.append(
            f"{sum(c.refused for c in refused):,} searches were refused with 429 (the service "
            "at capacity); each such client waited as Retry-After said (at most 1 s), so "
            "those cells ran with fewer searches in flight than clients."
        )
    if busy := [c for c in cells if c.client_cpu > BUSY_CLIENT]:
        notes.append(
            f"The load generator kept {max(c.client_cpu for c in busy):.0%} of a core busy in "
            f"{len(busy)} cell(s): there, it may be what bounds req/s; run it from another "
            "machine (--url) to be sure."
        )
    if failed := [c for c in cells if c.errors]:
        kinds = Counter[str]()
        for c in failed:
            kinds.update(c.errors)
        notes.append(f"Errors: {dict(kinds)} (the service's log says why).")
    return [line for note in notes for line in ("", note)]
