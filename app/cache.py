"""Result cache: Redis when DUET_REDIS_URL is set, an in-process LRU otherwise.

Values are JSON text (never pickle). A cache failure never fails a request:
`ResilientCache` turns errors and time-outs into a miss, a log line and a metric, and after
a time-out skips the backend for RETRY_S (a hung Redis costs one time-out a second, not two
a request); an entry that cannot be read is a miss, and the answer then replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.metrics import Metrics

log = logging.getLogger("duet.cache")

RETRY_S = 1.0  # after a call timed out, the backend is left alone this long
T = TypeVar("T")


class CacheBackend(Protocol):
    name: str  # as /readyz names it: memory, redis
    where: str  # as the log names it

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

    name = where = "memory"

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
        )
        self._ttl = ttl_s
        kwargs = self._client.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        self.where = f"redis at {where}"

    async def get(self, key: str) -> str | None:
        value = await self._client.get(key)
        # bytes that are no UTF-8 (another program's value under duet's key) read as text
        # that is no JSON: an unreadable entry, a miss, then overwritten
        if value is None or isinstance(value, str):
            return value
        return bytes(value).decode("utf-8", "replace")

    async def set(self, key: str, value: str) -> None:
        await self._client.set(key, value, ex=self._ttl)

    async def close(self) -> None:
        await self._client.aclose()


_UNBOUNDED = contextlib.nullcontext()  # reusable, also as an async context manager


class ResilientCache:
    """Wraps a backend: bounded time per call; errors become misses, a metric and a log line.
    After a time-out (a hung or far Redis: the costly failure) the backend is skipped for
    RETRY_S, its look-ups counted as errors (the cache did not answer them); a refused
    connection fails at once and is tried again on the next request, which also reopens a
    pool's stale connections after a Redis restart. `duet_cache_requests_total` counts
    look-ups only (hit, miss, error); a failed write, `duet_cache_write_errors_total`."""

    def __init__(self, backend: CacheBackend, metrics: Metrics, timeout_s: float) -> None:
        self.backend = backend
        self._metrics = metrics
        self._timeout = timeout_s
        # the in-process LRU's calls never wait: a timer around each (two a request, ~7 us
        # each on the 2-core CPU) would bound nothing
        self._bounded = not isinstance(backend, LRUCache)
        self._last_warning = 0.0
        self._skip_until = 0.0  # monotonic time the backend is next tried, after a time-out
        self._down = False  # failing since the last answer: its return is logged

    def _bound(self) -> AbstractAsyncContextManager[object]:
        """What a call runs in: `asyncio.timeout` (not wait_for: no task of its own for each
        call), or nothing for the in-process LRU."""
        return asyncio.timeout(self._timeout) if self._bounded else _UNBOUNDED

    def _skipped(self) -> bool:
        return self._down and time.monotonic() < self._skip_until

    def _failed(self, op: str, exc: BaseException) -> None:
        now = time.monotonic()
        timed_out = isinstance(exc, (TimeoutError, RedisTimeoutError))
        if timed_out:
            self._skip_until = now + RETRY_S
        self._down = self._down or not isinstance(exc, ResponseError)  # a full Redis answers
        if now - self._last_warning > 10.0:  # one line per 10 s, not one per request
            self._last_warning = now
            log.warning(
                "cache %s: %s failed (%s: %s); serving without the cache%s (check "
                "DUET_REDIS_URL and the server)",
                self.backend.where,
                op,
                type(exc).__name__,
                str(exc) or "no answer within DUET_REDIS_TIMEOUT_MS",
                f", left alone {RETRY_S:g}s after each time-out" if timed_out else "",
            )

    def _answered(self) -> None:
        if self._down:
            self._down = False
            log.warning("cache %s answers again; serving with the cache", self.backend.where)

    async def get(self, key: str, read: Callable[[str], T]) -> T | None:
        """`read(value)` of the entry at `key`, or None: a miss, a failure, or an entry
        `read` cannot read (it raises ValueError, KeyError or TypeError), counted a miss."""
        if self._skipped():
            self._metrics.cache_requests.labels(result="error").inc()
            return None
        try:
            async with self._bound():
                value = await self.backend.get(key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._metrics.cache_requests.labels(result="error").inc()
            self._failed("get", exc)
            return None
        self._answered()
        if value is None:
            self._metrics.cache_requests.labels(result="miss").inc()
            return None
        try:
            got = read(value)
        except (ValueError, KeyError, TypeError):
            self._metrics.cache_requests.labels(result="miss").inc()
            log.warning("ignoring an unreadable cache entry %s (the answer replaces it)", key)
            return None
        self._metrics.cache_requests.labels(result="hit").inc()
        return got

    async def set(self, key: str, value: str) -> None:
        if self._skipped():
            return
        try:
            async with self._bound():
                await self.backend.set(key, value)
        except (RedisError, OSError, TimeoutError) as exc:
            self._metrics.cache_write_errors.inc()
            self._failed("set", exc)

    async def check(self) -> None:
        """One look-up at start-up: a Redis that does not answer, or refuses duet (a wrong
        password or database), is logged now rather than at the first request."""
        if not self._bounded:
            return
        try:
            async with self._bound():
                await self.backend.get("duet:start-up-check")
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("a first look-up", exc)
        else:
            log.info("cache %s answers", self.backend.where)

    async def close(self) -> None:
        try:
            await self.backend.close()
        except (RedisError, OSError) as exc:  # closing a dead connection is not news
            log.debug("closing cache: %s", exc)
