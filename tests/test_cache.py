"""Cache back-ends against a real redis-server; failures degrade to misses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from app.cache import TRIP_AFTER, LRUCache, RedisCache, ResilientCache, cache_key
from app.metrics import Metrics
from tests.conftest import RedisServer, free_port, start_service, stop_service


def _count(m: Metrics, result: str) -> float:
    return m.cache_requests.labels(result=result)._value.get()


def test_key_depends_on_every_part() -> None:
    base = dict(
        model="m", index="v1", endpoint="text", query="a", top_k=10, candidates=50, rerank=True
    )
    keys = {cache_key(**base)}
    for k, v in (
        ("model", "m2"),
        ("index", "v2"),
        ("endpoint", "image"),
        ("query", "b"),
        ("top_k", 5),
        ("candidates", 20),
        ("rerank", False),
    ):
        keys.add(cache_key(**{**base, k: v}))
    assert len(keys) == 8
    assert cache_key(**base) == cache_key(**dict(reversed(list(base.items()))))


async def test_redis_round_trip_and_ttl(redis_server: RedisServer) -> None:
    m = Metrics()
    cache = ResilientCache(RedisCache(redis_server.url, ttl_s=1, timeout_s=0.5), m, 0.5)
    assert await cache.get("k", str) is None
    await cache.set("k", '{"a": 1}')
    assert await cache.get("k", str) == '{"a": 1}'
    assert (_count(m, "hit"), _count(m, "miss"), _count(m, "error")) == (1, 1, 0)
    await asyncio.sleep(1.2)
    assert await cache.get("k", str) is None  # expired
    await cache.close()


async def test_redis_down_is_a_miss_and_an_error_metric(redis_server: RedisServer) -> None:
    m = Metrics()
    cache = ResilientCache(RedisCache(redis_server.url, ttl_s=60, timeout_s=0.2), m, 0.2)
    await cache.set("k", "v")
    redis_server.stop()
    assert await cache.get("k", str) is None
    await cache.set("k", "v")  # does not raise either
    assert _count(m, "error") == 1 and m.cache_write_errors._value.get() == 1
    await cache.close()


async def test_unreachable_redis_never_raises() -> None:
    m = Metrics()
    cache = ResilientCache(RedisCache(f"redis://127.0.0.1:{free_port()}/0", 60, 0.1), m, 0.1)
    assert await cache.get("x", str) is None
    assert _count(m, "error") == 1


async def test_lru_evicts_and_expires() -> None:
    lru = LRUCache(max_entries=2, ttl_s=60)
    await lru.set("a", "1")
    await lru.set("b", "2")
    assert await lru.get("a") == "1"  # a is now most recent
    await lru.set("c", "3")
    assert await lru.get("b") is None and await lru.get("a") == "1"
    short = LRUCache(max_entries=2, ttl_s=0.05)
    await short.set("a", "1")
    await asyncio.sleep(0.1)
    assert await short.get("a") is None


async def test_slow_redis_is_skipped_within_the_timeout() -> None:
    """A server that accepts connections but never answers (a hung Redis)."""
    silent: list[asyncio.StreamWriter] = []

    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        silent.append(w)  # keep the connection open, say nothing

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    m = Metrics()
    cache = ResilientCache(RedisCache(f"redis://127.0.0.1:{port}/0", 60, 0.1), m, 0.1)
    t0 = asyncio.get_running_loop().time()
    assert await cache.get("k", str) is None
    await cache.set("k", "v")
    elapsed = asyncio.get_running_loop().time() - t0
    assert elapsed < 1.0 and _count(m, "error") == 1
    for w in silent:
        w.close()
    server.close()
    await server.wait_closed()
    await cache.close()


@pytest.mark.slow
def test_replicas_of_other_precision_do_not_share_entries(
    index_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    # two real services on one real Redis, the same weights and index, one cross-encoder in
    # fp32 and one in bf16: their scores differ, so neither may answer from the other's entry
    fp32 = start_service(index_dir, tmp_path / "fp32.log", DUET_REDIS_URL=redis_server.url)
    bf16 = start_service(
        index_dir, tmp_path / "bf16.log", DUET_REDIS_URL=redis_server.url, DUET_PRECISION="bf16"
    )
    q = {"query": "a small red circle above a large blue square", "top_k": 5}
    try:
        with fp32.client() as a, bf16.client() as b:
            first = a.post("/search/text", json=q).json()
            other = b.post("/search/text", json=q).json()
            assert first["cached"] is False and other["cached"] is False
            assert [h["score"] for h in other["hits"]] != [h["score"] for h in first["hits"]]
            # each replica still hits its own entry, and one of its own precision's
            assert a.post("/search/text", json=q).json()["cached"] is True
            assert b.post("/search/text", json=q).json()["cached"] is True
    finally:
        stop_service(fp32)
        stop_service(bf16)


async def test_a_hung_redis_is_tried_by_one_call_a_retry_period_not_two_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After TRIP_AFTER time-outs in a row the cache is skipped: twenty requests' look-ups
    and writes wait three time-outs in all, each counted as an error; then, RETRY_S later,
    one call of ten at once tries it again (one new connection), the others skip it."""
    import app.cache

    monkeypatch.setattr(app.cache, "RETRY_S", 0.5)
    silent: list[asyncio.StreamWriter] = []

    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        silent.append(w)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    m = Metrics()
    cache = ResilientCache(RedisCache(f"redis://127.0.0.1:{port}/0", 60, 0.1), m, 0.1)
    clock = asyncio.get_running_loop().time
    t0 = clock()
    for _ in range(20):
        assert await cache.get("k", str) is None
        await cache.set("k", "v")
    assert clock() - t0 < 0.6 and _count(m, "error") == 20
    await asyncio.sleep(0.5)
    opened = len(silent)
    t1 = clock()
    assert await asyncio.gather(*(cache.get("k", str) for _ in range(10))) == [None] * 10
    assert clock() - t1 >= 0.09  # tried again, and timed out again
    await asyncio.sleep(0.05)
    assert len(silent) - opened <= 1 and _count(m, "error") == 30
    for w in silent:
        w.close()
    server.close()
    await server.wait_closed()
    await cache.close()


async def test_a_redis_slow_now_and_then_is_not_left_alone(redis_server: RedisServer) -> None:
    """One time-out among answers (Redis busy 0.3 s: DEBUG SLEEP) is one error, and the
    cache is not skipped for it: the look-ups after it are hits."""
    import redis.asyncio as aioredis

    direct = aioredis.Redis.from_url(redis_server.url)
    m = Metrics()
    cache = ResilientCache(RedisCache(redis_server.url, 60, 0.1), m, 0.1)
    await cache.set("k", "v")
    busy = asyncio.create_task(direct.execute_command("DEBUG", "SLEEP", "0.3"))
    await asyncio.sleep(0.05)
    assert await cache.get("k", str) is None  # timed out
    await busy
    assert [await cache.get("k", str) for _ in range(5)] == ["v"] * 5
    assert (_count(m, "hit"), _count(m, "error")) == (5, 1)
    await direct.aclose()
    await cache.close()


async def test_redis_back_after_a_failure_is_used_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused connection is no time-out: the next call tries again, and the first to be
    answered logs the cache's return."""
    from tests.conftest import start_redis

    server = start_redis(tmp_path)
    m = Metrics()
    cache = ResilientCache(RedisCache(server.url, 60, 0.5), m, 0.5)
    try:
        server.stop()
        assert await cache.get("k", str) is None
        assert "redis at 127.0.0.1:" in caplog.text and "get failed" in caplog.text
        server = start_redis(tmp_path, port=server.port)
        await cache.set("k", "v")
        assert await cache.get("k", str) == "v"
        assert "answers again" in caplog.text
    finally:
        server.stop()
        await cache.close()


async def test_an_entry_that_cannot_be_read_is_a_miss_and_the_answer_replaces_it(
    redis_server: RedisServer,
) -> None:
    """Another program's value under duet's key (bytes that are no UTF-8, text that is no
    JSON): a miss, not a hit and not an error, and the next write replaces it."""
    import json

    import redis

    direct = redis.Redis.from_url(redis_server.url)
    m = Metrics()
    cache = ResilientCache(RedisCache(redis_server.url, 60, 0.5), m, 0.5)
    for junk in (b"\xff\xfe\x00garbage", b"not json"):
        direct.set("k", junk)
        assert await cache.get("k", json.loads) is None
        await cache.set("k", '{"a": 1}')
        assert await cache.get("k", json.loads) == {"a": 1}
    assert (_count(m, "hit"), _count(m, "miss"), _count(m, "error")) == (2, 2, 0)
    direct.close()
    await cache.close()


async def test_a_full_redis_refusing_writes_still_answers_look_ups(
    redis_server: RedisServer,
) -> None:
    """A Redis at maxmemory without eviction refuses writes but answers reads: the failed
    writes count apart from the look-ups, and the look-ups go on."""
    import redis

    direct = redis.Redis.from_url(redis_server.url)
    direct.set("old", "kept")
    direct.config_set("maxmemory", 1)  # below what it uses: every write refused
    m = Metrics()
    cache = ResilientCache(RedisCache(redis_server.url, 60, 0.5), m, 0.5)
    for _ in range(3):
        await cache.set("k", "v")
        assert await cache.get("old", str) == "kept"
    assert m.cache_write_errors._value.get() == 3
    assert (_count(m, "hit"), _count(m, "error")) == (3, 0)
    direct.config_set("maxmemory", 0)
    direct.close()
    await cache.close()


async def test_the_start_up_check_tells_of_a_redis_that_does_not_answer(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Logged at start, with the address and the setting to check, not at the first request;
    and no look-up is counted for it."""
    caplog.set_level("INFO", "duet.cache")
    m = Metrics()
    down = ResilientCache(RedisCache(f"redis://127.0.0.1:{free_port()}/0", 60, 0.2), m, 0.2)
    await down.check()
    assert "cache redis at 127.0.0.1:" in caplog.text and "a first look-up failed" in caplog.text
    assert "DUET_REDIS_URL" in caplog.text
    wrong_db = ResilientCache(
        RedisCache(redis_server.url.rsplit("/", 1)[0] + "/99", 60, 0.2), m, 0.2
    )
    await wrong_db.check()
    assert "DB index is out of range" in caplog.text
    up = ResilientCache(RedisCache(redis_server.url, 60, 0.5), m, 0.5)
    await up.check()
    assert f"cache redis at 127.0.0.1:{redis_server.port} answers" in caplog.text
    assert sum(_count(m, r) for r in ("hit", "miss", "error")) == 0
    for cache in (down, wrong_db, up):
        await cache.close()


async def test_answers_tells_readyz_whether_the_cache_answers_now(
    redis_server: RedisServer,
) -> None:
    """What /readyz says of the cache: asked of Redis itself (a start-up check is old news),
    not counted as a look-up, and no while a run of time-outs leaves Redis alone."""
    m = Metrics()
    up = ResilientCache(RedisCache(redis_server.url, 60, 0.5), m, 0.5)
    lru = ResilientCache(LRUCache(8, 60), m, 0.5)
    assert await up.answers() and await lru.answers()
    redis_server.stop()
    assert not await up.answers()
    tripped = ResilientCache(RedisCache(redis_server.url, 60, 0.5), m, 0.5)
    tripped._timeouts, tripped._skip_until = TRIP_AFTER, float("inf")  # as after time-outs
    assert not await tripped.answers()
    assert sum(_count(m, r) for r in ("hit", "miss", "error")) == 0
    for cache in (up, lru, tripped):
        await cache.close()


async def test_a_burst_past_redis_pys_pool_of_100_still_reads_the_cache(
    redis_server: RedisServer,
) -> None:
    """400 look-ups at once, as 400 searches under way make them: redis-py's pool stops at
    100 connections and raised "Too many connections" for the rest, counted as cache errors
    (and a re-ranking each) with Redis healthy. The service's pool makes them wait for one."""
    import redis

    from app.config import Settings
    from app.main import _cache_backend

    direct = redis.Redis.from_url(redis_server.url)
    direct.set("warm", json.dumps({"a": 1}))
    m = Metrics()
    settings = Settings(redis_url=redis_server.url, redis_timeout_ms=2000)
    cache = ResilientCache(_cache_backend(settings), m, 2.0)
    got = await asyncio.gather(*(cache.get("warm", json.loads) for _ in range(400)))
    assert got == [{"a": 1}] * 400
    assert (_count(m, "hit"), _count(m, "error")) == (400, 0)
    direct.close()
    await cache.close()
