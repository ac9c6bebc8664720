"""Prometheus metrics, one registry per app (so tests can build many apps)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    """The service's metrics; names are part of the dashboard contract."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # the builtin model's kept caption states, once a pipeline is made (`watch_caption_states`)
        self.caption_states: CaptionStatesCollector | None = None
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc., for the dashboard
        self.request_seconds = Histogram(
            "duet_request_seconds",
            "HTTP request latency",
            ["endpoint", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "duet_stage_seconds",
            "Time per pipeline stage",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_requests = Counter(
            "duet_cache_requests", "Cache look-ups by result", ["result"], registry=r
        )
        self.cache_write_errors = Counter(
            "duet_cache_write_errors", "Cache writes that failed (answers not cached)", registry=r
        )
        self._engine_metrics(r)
        self.shed = Counter(
            "duet_shed_requests",
            "Requests dropped before model work, by reason "
            "(queue_full = 429 at DUET_MAX_QUEUE, queue_wait = 429 when the work ahead would "
            "outlast the request's deadline, deadline = 429 deadline_exceeded, client_gone, "
            "inflight = 429 at DUET_HTTP_MAX_INFLIGHT before any parsing; answered before any "
            "route, which no request metric counts: header_timeout = 408, idle_timeout = 408 "
            "to a connection that sent nothing, headers_too_large = 431, bad_request = 400 "
            "for bytes that are not HTTP/1.1)",
            ["reason"],
            registry=r,
        )
        self.degraded = Counter(
            "duet_degraded_requests",
            "Responses that re-ranked fewer candidates than asked "
            "because the deadline could not fit them",
            registry=r,
        )
        self._index_metrics(r)
        self.queue_depth = Gauge(
            "duet_queue_depth", "Requests waiting for an inference-engine worker", registry=r
        )
        self.queue_capacity = Gauge(
            "duet_queue_capacity",
            "Requests the engine queue holds before answering 429 "
            "(it also refuses earlier when the queued work would outlast the deadline)",
            registry=r,
        )
        for result in ("ok", "refused"):
            self.index_reloads.labels(result=result)
        for result in ("hit", "miss", "error"):
            self.cache_requests.labels(result=result)
        for reason in (
            *("queue_full", "queue_wait", "deadline", "client_gone", "inflight"),
            *("header_timeout", "idle_timeout", "headers_too_large", "bad_request"),
        ):
            self.shed.labels(reason=reason)
        for stage in ("cache", "queue", "encode", "search", "rerank", "lookup"):
            self.stage_seconds.labels(stage=stage)

    def _index_metrics(self, r: CollectorRegistry) -> None:
        """The served index version: its items, its swaps and refusals, its health."""
        self.index_items = Gauge(
            "duet_index_items", "Items in the served index", ["modality"], registry=r
        )
        self.index_info = Gauge(
            "duet_index_info", "1 for the index version being served", ["version"], registry=r
        )
        self.index_reloads = Counter(
            "duet_index_reloads",
            "Attempts to load a new index version, by result",
            ["result"],
            registry=r,
        )
        self.index_current_refused = Gauge(
            "duet_index_current_refused",
            "1 while INDEX_DIR/current names a version this process refused (it serves the one "
            "before; a restarted replica would not start on it), 0 once current is served",
            registry=r,
        )
        self.index_served_damaged = Gauge(
            "duet_index_served_damaged",
            "1 while the served version's files have changed on disk and fail their checks "
            "(it serves on what it still reads), 0 once they pass again",
            registry=r,
        )
        self.ready = Gauge(
            "duet_ready", "1 when model and index are loaded and search is served", registry=r
        )

    def _engine_metrics(self, r: CollectorRegistry) -> None:
        """The batches the engine forms, the device steps it runs, and the fronts that feed
        it (the process layout)."""
        self.fronts = Gauge(
            "duet_fronts",
            "Front processes on the public port (process layout, DUET_FRONTENDS): wanted, and "
            "alive (one that died within its first 10 s is not replaced); 0 and 0 in one process",
            ["state"],
            registry=r,
        )
        for state in ("wanted", "alive"):
            self.fronts.labels(state=state)
        self.fronts_memory = Gauge(
            "duet_fronts_resident_memory_bytes",
            "Resident memory of the process layout's front processes together (0 in one "
            "process); process_resident_memory_bytes is the owner's alone",
            registry=r,
        )
        self.rerank_batch_size = Histogram(
            "duet_rerank_batch_size",
            "Pairs per batched re-ranker call, across requests: whole queries, up to "
            "DUET_RERANK_MAX_BATCH pairs, or one query's candidates when they alone are more",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.engine_batch_size = Histogram(
            "duet_engine_batch_size",
            "Requests per inference-engine batch",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.cuda_graphs = Gauge(
            "duet_cuda_graphs",
            "CUDA graphs the served version's device step replays, by query kind (GPU layout "
            "on CUDA, DUET_CUDA_GRAPHS; 0: the eager step serves, e.g. graphs turned off)",
            ["queries"],
            registry=r,
        )
        for kind in ("text", "image"):
            self.cuda_graphs.labels(queries=kind)
        self.device_seconds = Histogram(
            "duet_device_step_seconds",
            "Wall time of one device step (GPU layout): a batch's text tower, search, "
            "cross-encoder and the copy back, from launch to the answer on the host",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )


class CaptionStatesCollector(Collector):
    """An image query's candidate captions whose text states the model keeps
    (`models.caption_states`): how many were read from those kept and how many went through
    the text tower, the model's own counters (each only grows) read at each scrape."""

    def __init__(self, states: Any) -> None:
        self.states = states

    def collect(self) -> Iterator[Metric]:
        kept, computed = self.states.kept, self.states.computed
        got = CounterMetricFamily(
            "duet_caption_states",
            "An image query's candidate captions by where the cross-encoder read their text "
            "states: kept from an earlier request, or computed by the text tower now",
            labels=["result"],
        )
        got.add_metric(["kept"], kept)
        got.add_metric(["computed"], computed)
        yield got
        held = GaugeMetricFamily(
            "duet_caption_states_bytes",
            "Bytes of captions' text states kept for image queries (at most "
            "models.caption_states.CAPTION_STATES_BYTES)",
        )
        held.add_metric([], self.states.bytes)
        yield held


def watch_caption_states(metrics: Metrics, model: Any) -> None:
    """Export the caption states `model` keeps (the builtin cross-encoder's, directly or as
    the service's configured one), if it keeps any."""
    for owner in (model, getattr(model, "cross", None)):
        states = getattr(owner, "caption_states", None)
        if states is not None and hasattr(states, "computed"):
            if metrics.caption_states is not None:  # the app started again
                metrics.caption_states.states = states
            else:
                metrics.caption_states = CaptionStatesCollector(states)
                metrics.registry.register(metrics.caption_states)
            return
