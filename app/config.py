"""Service settings, read from the environment (prefix DUET_) or a .env file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.fusion import DEFAULT_FUSION_LAMBDA
from models.late import DEFAULT_THETA
from store import ann


def _redis_url(url: str) -> str:
    """An empty URL (the in-process cache) or one redis-py reads; its own words otherwise,
    with the forms it takes (a typo failed the start-up with a traceback, after the load)."""
    if url:
        from urllib.parse import urlparse

        from redis.connection import parse_url

        try:
            parse_url(url)
            db = urlparse(url).path.strip("/") if url.startswith(("redis:", "rediss:")) else ""
            if db and not db.isdigit():  # redis-py takes db 0 for it, without a word
                raise ValueError(f"the database {db!r} is no number")
        except ValueError as exc:
            raise ValueError(
                f"{exc}: give redis://[:password@]host:port/db, rediss://... (TLS) or "
                "unix:///path/to/redis.sock, or leave it empty for the in-process cache"
            ) from exc
    return url


def _token(token: SecretStr | None) -> SecretStr | None:
    """A token no Authorization header can carry (HTTP takes the spaces around a header's
    value off) would turn /admin/reload on and answer every call 401."""
    if token is not None and token.get_secret_value() != token.get_secret_value().strip():
        raise ValueError("it has spaces around it, which no Authorization header carries")
    return token


def _frontends(value: object) -> object:
    """auto in any case, or a count of fronts; one message for a wrong one (pydantic's union
    said "unable to parse string as an integer or Input should be 'auto'")."""
    text = value.strip().lower() if isinstance(value, str) else value
    if text == "auto":
        return text
    try:  # "3" and "3.0" as before; no digits of other scripts ("١")
        number = float(text) if isinstance(text, str) and text.isascii() else text
        count = int(number) if number == int(number) else -1  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        count = -1
    if not 0 <= count <= 64:  # a fraction (2.5) is -1 by now
        raise ValueError(f"{value!r} is no count of front processes: give 0 to 64, or auto")
    return count


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


MIN_POLL_S = 0.1
MAX_INFLIGHT = 512  # DUET_HTTP_MAX_INFLIGHT's default
DRAIN_S = 10.0  # DUET_HTTP_DRAIN_S's default


def _poll_s(seconds: float) -> float:
    """0 (no poller) or a pace the event loop can afford: each look lists the version folder
    and stats its files, so DUET_INDEX_POLL_S=0.0001 spent the loop on it."""
    if 0 < seconds < MIN_POLL_S:
        raise ValueError(f"{seconds:g} s is too often: give 0 (off) or at least {MIN_POLL_S:g}")
    return seconds


def _log_level(level: str) -> str:
    """A level as logging and uvicorn both take it (a wrong one was logging's traceback)."""
    if level.strip().lower() not in LOG_LEVELS:
        raise ValueError(f"unknown level {level!r}: one of {', '.join(LOG_LEVELS)}")
    return level.strip().lower()


class Settings(BaseSettings):
    """Every DUET_* knob of every command (serve, build, eval, demo-index, healthcheck), from
    the environment or a .env file: one configuration path, so what `duet build` encodes
    with is what `duet serve` then serves."""

    model_config = SettingsConfigDict(
        env_prefix="DUET_",
        env_file=".env",
        extra="ignore",
        env_ignore_empty=True,
        protected_namespaces=(),
    )

    index_dir: Path = Field(Path("indexes"), description="serves INDEX_DIR/current")
    images_dir: Path | None = Field(
        None,
        description="GET /images/{id} serves files only from under this folder (or the "
        "index version's own), whatever a manifest's corpus path says; empty = DUET_INDEX_DIR",
    )
    index_poll_s: Annotated[float, AfterValidator(_poll_s)] = Field(
        5.0,
        ge=0,
        description=f"how often to look for a new INDEX_DIR/current; 0 = never, else at "
        f"least {MIN_POLL_S:g}",
    )
    admin_token: Annotated[SecretStr | None, AfterValidator(_token)] = Field(
        None, description="bearer token for POST /admin/reload; unset = endpoint disabled"
    )
    model_dir: Path | None = Field(None, description="model weights; empty = shipped weights")
    encoder: str = Field(
        "builtin",
        description="the bi-encoder: builtin (DUET_MODEL_DIR) or a local Hugging "
        "Face CLIP / SigLIP directory",
    )
    reranker: str = Field(
        "ce",
        description="the default request re-ranker and what the index stores for it: ce "
        "(the joint model's cross-encoder; `builtin` is its older name), late, han, none, or "
        "a local Hugging Face BLIP image-text-matching directory (its cross-encoder is ce)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the model runs: auto = a CUDA GPU when torch sees one"
    )
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto",
        description="the builtin cross-encoder's arithmetic: auto = fp16 on a GPU, fp32 on "
        "the CPU; the cache keeps entries per device kind and precision",
    )
    layout: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="how the engine runs: gpu = text queries as one device step per batch "
        "(token ids in, candidates and scores out; the index's vectors and image states "
        "resident on the device; batches cut by pairs), cpu = the host path tuned for CPU "
        "cores; auto = gpu when the model runs on CUDA",
    )
    frontends: Annotated[int | Literal["auto"], BeforeValidator(_frontends)] = Field(
        "auto",
        description="the process layout: N > 0 starts N front processes that serve HTTP "
        "(validation, image checks, tokenising, the cache, JSON) on the public port and hand "
        "the model work to this process, which owns the model and serves every other path; "
        "0 = one process does everything; auto = 0 on the CPU, and with the model on CUDA "
        "outside DUET_LAYOUT=cpu half the cores less one, at most 6 (on an H100 with 16 "
        "cores six fronts served 9.9x the plain script at 64 clients, one process 3.9x)",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Annotated[str, AfterValidator(_log_level)] = "info"
    access_log: bool = Field(
        False,
        description="one log line per HTTP request (method, path, status) from uvicorn",
    )

    redis_url: Annotated[str, AfterValidator(_redis_url)] = Field(
        "", description="empty = in-process LRU cache"
    )
    redis_timeout_ms: int = Field(100, ge=1, description="per Redis call; slower = cache skipped")
    cache_ttl_s: int = Field(3600, ge=1)
    cache_max_entries: int = Field(10_000, ge=1, description="in-process LRU size")

    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1)
    max_image_pixels: int = Field(25_000_000, ge=1)
    max_body_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="request body limit for every route but "
        "/search/image (whose limit follows DUET_MAX_IMAGE_BYTES), counted while it streams in",
    )
    decode_pixels_in_flight: int = Field(
        50_000_000,
        ge=1,
        description="pixels of uploaded images decoded at once, across "
        "requests (bounds decoding memory; at least DUET_MAX_IMAGE_PIXELS)",
    )

    http_header_timeout_s: float = Field(
        10.0, gt=0, description="a connection's request headers must arrive within this (408)"
    )
    http_body_timeout_s: float = Field(
        30.0, gt=0, description="a request's body must arrive within this after its headers"
    )
    http_max_header_bytes: int = Field(
        16 * 1024, ge=1024, description="request line plus headers, at most (431)"
    )
    http_keep_alive_s: float = Field(5.0, gt=0, description="idle keep-alive connections close")
    http_drain_s: float = Field(
        DRAIN_S,
        gt=0,
        description="on SIGTERM, how long the requests under way get to finish; connections "
        "still open then are closed (a stalled upload held the exit for the body timeout). "
        "Give the container's stop grace twice this (owner, then fronts) plus a few seconds",
    )
    http_max_inflight: int = Field(
        MAX_INFLIGHT,
        ge=1,
        description="requests in flight before new ones get 429 ahead of any "
        "parsing (health, readiness and metrics exempt)",
    )
    http_queue_target_ms: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="the in-flight cap follows the process's answer rate: at most rate x this "
        "many ms of requests in flight (Little's law), so an admitted request waits about "
        "this long at most when the HTTP process itself is the bottleneck; 0 = "
        "DUET_HTTP_MAX_INFLIGHT alone; auto = 500 with the model on CUDA (where one "
        "process's HTTP, not the GPU, capped the service), 0 on the CPU (where the engine's "
        "admission prices the bottleneck, the model's cores)",
    )
    http_backlog: int = Field(
        2048, ge=1, description="the listening socket's accept backlog (each front's, with fronts)"
    )
    health_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="duet serve: also answer GET /healthz on this port, from a thread of its "
        "own, so a liveness probe gets its answer at once while the event loop works through "
        "a connection storm (0 = off; the images and manifests use 8001)",
    )
    health_stall_s: float = Field(
        30.0,
        gt=0,
        description="the health port answers 503 when the event loop has not run for this "
        "long (busy still counts as running; blocked does not)",
    )

    rerank_fusion_lambda: float = Field(
        DEFAULT_FUSION_LAMBDA,
        ge=0.0,
        le=1.0,
        description="score = lambda * dot + (1 - lambda) * sigmoid(CE); 0 = CE alone",
    )
    rerank_theta: float = Field(
        DEFAULT_THETA,
        ge=0.0,
        le=1.0,
        description="late re-ranker: S_gl = (1 - theta) * dot + theta * S_l; 0 = dot alone",
    )

    workers: int | None = Field(
        None,
        ge=1,
        description="inference-engine worker threads; empty = one per core this process "
        "may use (affinity and cgroup quota) on the CPU, one on a GPU",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker; empty = the cores shared among the "
        "workers busy at that moment (a lone request uses every core)",
    )
    gc_freeze: bool = Field(
        True,
        description="freeze the start-up heap (gc.freeze) once serving starts, so Python's "
        "full collections skip the ~240,000 objects that live as long as the process (a "
        "full pass over them paused a process 87 ms on a 2-core CPU)",
    )
    cuda_graphs: bool = Field(
        True,
        description="GPU layout on CUDA: each text shape the device step builds at warm-up "
        "is also captured as a CUDA graph and replayed with one launch (the step of the "
        "shipped model is bound by launching kernels); each graph is checked against the "
        "eager step at capture, and one that disagrees turns them off; 0 = eager only",
    )
    request_timeout_ms: float = Field(
        2000.0,
        gt=0,
        description="deadline for a request's model work: refused with 429 when "
        "the queue ahead cannot finish in time, fewer candidates re-ranked when its own "
        "share does not fit (degraded), 429 deadline_exceeded if it passes while queued",
    )
    worker_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="niceness of the engine's worker threads (and torch's "
        "threads they start): above 0 the event loop, which parses requests, answers 429s and "
        "health checks, wins the CPU from model work when both want it",
    )
    max_queue: int = Field(1024, ge=1, description="requests waiting for a worker before 429")
    max_batch: int = Field(64, ge=1, description="requests a worker takes in one batch")
    rerank_max_batch: int | None = Field(
        None,
        ge=1,
        description="pairs per cross-encoder call, across requests; empty = 64 in the "
        "cpu layout (one request's candidates), measured at start in the gpu layout (the "
        "smallest batch within 10 % of the device's best pairs/s)",
    )

    index_factory: str = Field(
        "",
        description="duet build and demo-index only: the FAISS index-factory string; "
        "empty = chosen by corpus size (Flat, IVF, HNSW)",
    )
    index_nprobe: int = Field(
        ann.DEFAULT_NPROBE, ge=1, description="IVF lists searched per query (per call)"
    )
    index_ef_search: int = Field(
        ann.DEFAULT_EF_SEARCH, ge=1, description="HNSW search breadth per query (per call)"
    )
