"""Result cache: Redis when DUET_REDIS_URL is set, an in-process LRU otherwise.

Values are JSON text (never pickle). A cache failure never fails a request:
`ResilientCache` turns errors and time-outs into a miss, a log line and a metric, and after
TRIP_AFTER time-outs in a row tries the backend with one call every RETRY_S (a hung Redis
costs a time-out a second, not two a request); an entry that cannot be read is a miss, and
the answer then replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.metrics import Metrics

log = logging.getLogger("duet.cache")

# connections to Redis per process: warm ones a burst waits for (`RedisCache`)
REDIS_CONNECTIONS = 64
TRIP_AFTER = 3  # time-outs in a row after which the backend is left alone
RETRY_S = 1.0  # then tried by one call this often
T = TypeVar("T")
V = TypeVar("V")


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

    def __init__(
        self, url: str, ttl_s: int, timeout_s: float, connections: int = REDIS_CONNECTIONS
    ) -> None:
        # A burst of more searches than a pool holds waits for its connections: redis-py's
        # default pool stops at 100 and then raises ("Too many connections"), which lost the
        # cache for the rest of a burst, Redis healthy; one as large as the in-flight cap
        # opened hundreds at once, each a few round trips on the busy event loop, and most
        # of the burst's look-ups outlasted DUET_REDIS_TIMEOUT_MS. A call waits for one
        # less long than the cache's time bound: then "No connection available", an error
        # but no time-out of Redis's, which would count towards leaving Redis alone.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=connections,
            timeout=timeout_s * 0.8,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
        )
        self._client = aioredis.Redis.from_pool(pool)  # closed with the client
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
    After TRIP_AFTER time-outs in a row (a hung or far Redis: the costly failure) the backend
    is left alone RETRY_S at a time: one call then tries it while the others skip it, their
    look-ups counted as errors (the cache did not answer them). A refused connection fails at
    once and is tried again on the next request, which also reopens a pool's stale
    connections after a Redis restart. `duet_cache_requests_total` counts look-ups only (hit,
    miss, error); a failed write, `duet_cache_write_errors_total`."""

    def __init__(self, backend: CacheBackend, metrics: Metrics, timeout_s: float) -> None:
        self.backend = backend
        self._metrics = metrics
        self._timeout = timeout_s
        # the in-process LRU's calls never wait: a timer around each (two a request, ~7 us
        # each on the 2-core CPU) would bound nothing
        self._bounded = not isinstance(backend, LRUCache)
        self._last_warning = 0.0
        self._failures = 0  # calls failed so far: a success of a call begun earlier is old news
        self._timeouts = 0  # time-outs with no answer within a bound of them
        self._answered_at = 0.0  # monotonic time the backend last answered a call
        self._skip_until = 0.0  # monotonic time the backend is next tried, once tripped
        self._down = False  # failing since the last answer
        self._told = False  # a failure was logged since: the return is logged too

    def _bound(self) -> AbstractAsyncContextManager[object]:
        """What a call runs in: `asyncio.timeout` (not wait_for: no task of its own for each
        call), or nothing for the in-process LRU."""
        return asyncio.timeout(self._timeout) if self._bounded else _UNBOUNDED

    def _skipped(self) -> bool:
        if self._timeouts < TRIP_AFTER:
            return False
        now = time.monotonic()
        if now < self._skip_until:
            return True
        self._skip_until = now + RETRY_S  # this call tries it; the others skip meanwhile
        return False

    async def _call(self, op: str, call: Callable[[], Awaitable[V]]) -> tuple[bool, V | None]:
        """(True, what `call` returned), or (False, None) when it failed, told and counted."""
        failures = self._failures
        try:
            async with self._bound():
                value = await call()
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(op, exc)
            return False, None
        self._answered_at = time.monotonic()
        if failures == self._failures:  # nothing failed since it began: the backend answers
            self._answered()
        return True, value

    def _failed(self, op: str, exc: BaseException) -> None:
        now = time.monotonic()
        if "No connection available" in str(exc):  # this process's pool, Redis is fine
            if now - self._last_warning > 10.0:
                self._last_warning = now
                log.warning(
                    "cache %s: every connection of this process's pool (%d) was busy for a "
                    "%s; skipped the cache (a burst of more searches than the pool holds)",
                    self.backend.where,
                    REDIS_CONNECTIONS,
                    op,
                )
            return
        self._failures += 1
        # a time-out while other calls are answered is this process's own queue (a burst of
        # searches on a busy event loop), not a hung Redis: leaving Redis alone then cost
        # the cache most of a burst of 500 (890 look-ups of 1,500 counted errors)
        if isinstance(exc, (TimeoutError, RedisTimeoutError)) and (
            now - self._answered_at > self._timeout
        ):
            self._timeouts += 1
            if self._timeouts >= TRIP_AFTER:
                self._skip_until = now + RETRY_S
        self._down = self._down or not isinstance(exc, ResponseError)  # a full Redis answers
        if now - self._last_warning > 10.0:  # one line per 10 s, not one per request
            self._last_warning = now
            self._told = self._down
            log.warning(
                "cache %s: %s failed (%s: %s); serving without the cache%s (check "
                "DUET_REDIS_URL and the server)",
                self.backend.where,
                op,
                type(exc).__name__,
                str(exc) or "no answer within DUET_REDIS_TIMEOUT_MS",
                f", trying it every {RETRY_S:g}s" if self._timeouts >= TRIP_AFTER else "",
            )

    def _answered(self) -> None:
        self._timeouts = 0
        self._skip_until = 0.0
        if self._down:
            self._down = False
            if self._told:
                self._told = False
                log.warning("cache %s answers again; serving with the cache", self.backend.where)

    async def get(self, key: str, read: Callable[[str], T]) -> T | None:
        """`read(value)` of the entry at `key`, or None: a miss, a failure, or an entry
        `read` cannot read (it raises ValueError, KeyError or TypeError), counted a miss."""
        ok, value = (
            (False, None)
            if self._skipped()
            else await self._call("get", lambda: self.backend.get(key))
        )
        if not ok:
            self._metrics.cache_requests.labels(result="error").inc()
            return None
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
        ok, _ = await self._call("set", lambda: self.backend.set(key, value))
        if not ok:
            self._metrics.cache_write_errors.inc()

    async def check(self) -> None:
        """One look-up at start-up: a Redis that does not answer, or refuses duet (a wrong
        password or database), is logged now rather than at the first request."""
        if self._bounded and await self.answers("a first look-up"):
            log.info("cache %s answers", self.backend.where)

    async def answers(self, op: str = "a readiness look-up") -> bool:
        """Whether the backend answers now (for /readyz, and `check`): no while a run of
        time-outs leaves it alone, else one bounded look-up (not counted as a request; a
        failure is logged as any other, as `op`)."""
        if not self._bounded:
            return True
        if self._skipped():
            return False
        ok, _ = await self._call(op, lambda: self.backend.get("duet:ready"))
        return ok

    async def close(self) -> None:
        try:
            await self.backend.close()
        except (RedisError, OSError) as exc:  # closing a dead connection is not news
            log.debug("closing cache: %s", exc)
