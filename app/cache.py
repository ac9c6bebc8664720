"""Result cache: Redis when DUET_REDIS_URL is set, an in-process LRU otherwise.

Values are JSON text (never pickle). A cache failure never fails a request:
`ResilientCache` turns errors and time-outs into a miss, a log line and a metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from app.metrics import Metrics

log = logging.getLogger("duet.cache")


class CacheBackend(Protocol):
    name: str

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str) -> None: ...

    async def close(self) -> None: ...


def cache_key(**parts: object) -> str:
    """Stable key from the request's identity (model, index version, endpoint, query, options)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    # v2: an entry is the whole response as served, each hit's caption and match in it: a
    # change to how those are chosen (MATCH_THRESHOLD, app.answers.best_caption) for the same
    # model and index needs a new prefix, or replicas sharing a Redis serve the old choice
    return "duet:v2:" + hashlib.sha256(blob.encode()).hexdigest()


class LRUCache:
    """Bounded in-process cache with a TTL; the embedded default."""

    name = "memory"

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self._data: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._max = max_entries
        self._ttl = ttl_s

    async def get(self, key: str) -> str | None:
        got = self._data.get(key)
        if got is None:
            return None
        expires, value = got
        if expires < time.monotonic():
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return value

    async def set(self, key: str, value: str) -> None:
        self._data[key] = (time.monotonic() + self._ttl, value)
        self._data.move_to_end(key)
        while len(self._data) > self._max:
            self._data.popitem(last=False)

    async def close(self) -> None:
        self._data.clear()


class RedisCache:
    """redis.asyncio client with short socket time-outs so a slow Redis cannot stall search."""

    name = "redis"

    def __init__(self, url: str, ttl_s: int, timeout_s: float) -> None:
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            decode_responses=True,
        )
        self._ttl = ttl_s

    async def get(self, key: str) -> str | None:
        value = await self._client.get(key)
        return None if value is None else str(value)

    async def set(self, key: str, value: str) -> None:
        await self._client.set(key, value, ex=self._ttl)

    async def close(self) -> None:
        await self._client.aclose()


_UNBOUNDED = contextlib.nullcontext()  # reusable, also as an async context manager


class ResilientCache:
    """Wraps a backend: bounded time per call; errors become misses, a metric and a log line."""

    def __init__(self, backend: CacheBackend, metrics: Metrics, timeout_s: float) -> None:
        self.backend = backend
        self._metrics = metrics
        self._timeout = timeout_s
        # the in-process LRU's calls never wait: a timer around each (two a request, ~7 us
        # each on the 2-core CPU) would bound nothing
        self._bounded = not isinstance(backend, LRUCache)
        self._last_warning = 0.0

    def _bound(self) -> AbstractAsyncContextManager[object]:
        """What a call runs in: `asyncio.timeout` (not wait_for: no task of its own for each
        call), or nothing for the in-process LRU."""
        return asyncio.timeout(self._timeout) if self._bounded else _UNBOUNDED

    def _failed(self, op: str, exc: BaseException) -> None:
        self._metrics.cache_requests.labels(result="error").inc()
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # one line per 10 s, not one per request
            self._last_warning = now
            log.warning(
                "cache %s %s failed (%s: %s); serving without the cache",
                self.backend.name,
                op,
                type(exc).__name__,
                exc,
            )

    async def get(self, key: str) -> str | None:
        try:
            async with self._bound():
                value = await self.backend.get(key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("get", exc)
            return None
        self._metrics.cache_requests.labels(result="miss" if value is None else "hit").inc()
        return value

    async def set(self, key: str, value: str) -> None:
        try:
            async with self._bound():
                await self.backend.set(key, value)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("set", exc)

    async def close(self) -> None:
        try:
            await self.backend.close()
        except (RedisError, OSError) as exc:  # closing a dead connection is not news
            log.debug("closing cache: %s", exc)
