"""The wire between the process layout's fronts and its owner. The owner serves the fronts'
socket on threads (`app.owner`): a search goes from the socket onto the engine's queue, and
the worker that answers it writes the answer. Here with a real pipeline, real FAISS and a
real Unix socket, the front's side spoken by the front's own client
(`app.remote.RemoteEngine`), which posts a turn's messages in one write."""

from __future__ import annotations

import asyncio
import functools
import pickle
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import pytest

from app.errors import ShuttingDown
from app.owner import EngineServer, Peer, raise_error
from app.remote import RemoteEngine, post
from app.schemas import SearchOptions
from models.builtin import BuiltinModel
from store import indexio
from tests.conftest import in_process_pipeline


def _read(sock: socket.socket, n: int) -> list[Any]:
    """`n` length-prefixed pickles off `sock`, as a front's reader takes them."""
    f = sock.makefile("rb")
    out = []
    for _ in range(n):
        size = int.from_bytes(f.read(4), "little")
        out.append(pickle.loads(f.read(size)))
    return out


def test_a_peer_does_not_block_on_a_front_that_is_slow_to_read() -> None:
    """What the socket does not take at once waits for the writer thread: the sender (the
    engine's worker, in the owner) goes on, and every message arrives whole and in order."""
    owner_side, front_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    owner_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    peer = Peer(owner_side, "front1")
    msgs = [
        {"op": "answer", "id": i, "pad": bytes(50_000 if i % 3 == 0 else 10)} for i in range(60)
    ]

    def send_all() -> None:
        for m in msgs:
            peer.send(m)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    sender.join(10)
    assert not sender.is_alive()  # ~1 MB sent into a 16 KB buffer nobody reads yet
    assert peer._backlog or peer._writing  # the rest waits for the writer
    assert _read(front_side, len(msgs)) == msgs
    peer.close()
    peer.send({"op": "answer", "id": 99})  # a closed peer takes no more, and raises nothing
    assert front_side.recv(1) == b""  # the front sees the connection end
    front_side.close()


def test_a_peer_reads_whole_messages_and_says_when_the_front_is_gone() -> None:
    owner_side, front_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = Peer(owner_side, "front1")
    data = pickle.dumps({"op": "observe", "items": []})
    frame = len(data).to_bytes(4, "little") + data
    front_side.sendall(frame[:3])  # a message arriving in pieces
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(peer.recv()), daemon=True)
    reader.start()
    front_side.sendall(frame[3:])
    reader.join(10)
    assert got == [{"op": "observe", "items": []}]
    front_side.sendall(frame[:10])  # then the front goes away mid-message
    front_side.close()
    with pytest.raises(EOFError):
        peer.recv()
    peer.close()


async def test_the_owner_answers_a_fronts_searches_from_its_worker_threads(
    index_dir: Path, model: BuiltinModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    senders: list[tuple[str, str]] = []  # (op, the thread that wrote it)
    real_send = Peer.send

    def send(self: Peer, msg: Any) -> None:
        senders.append((msg["op"], threading.current_thread().name))
        real_send(self, msg)

    monkeypatch.setattr(Peer, "send", send)
    index = indexio.IndexVersion.open(indexio.resolve_current(index_dir))
    pipeline = in_process_pipeline(model, index, timeout_s=30.0, workers=2)
    await pipeline.start()
    app = SimpleNamespace(
        state=SimpleNamespace(
            pipeline=pipeline, metrics=pipeline.metrics, decoder=SimpleNamespace(side=64)
        )
    )
    server = EngineServer(cast(Any, app), str(tmp_path / "engine.sock"))
    await server.start()
    remote = RemoteEngine(server.path)
    try:
        await remote.connect(wait_s=10)
        assert remote.info["version"] == index.version and remote.info["decode_side"] == 64
        plan = pipeline.plan(SearchOptions(top_k=5, candidates=20))
        texts = ["two blue squares", "a red circle", "a green triangle left of a square"] * 4
        replies = await asyncio.gather(
            *(remote.search(kind="text", text=t, plan=plan, m=20, top_k=5) for t in texts)
        )
        for text, reply in zip(texts, replies, strict=True):
            whole, version = await pipeline.run(index, "text", text, None, plan, 20, 5)
            assert reply["version"] == version and reply["path"] == str(index.path)
            got = reply["answer"].ranked  # the same answer as in-process (batched apart)
            assert [r[0] for r in got] == [r[0] for r in whole.ranked]
            flat = [x for r in got for x in r[1:]]
            assert flat == pytest.approx([x for r in whole.ranked for x in r[1:]], abs=1e-5)
            assert reply["answer"].meta == []  # the front looks the hits' items up itself
        # the hello by the front's thread; each answer by the engine's worker that made it
        assert senders[0] == ("hello", "duet-wire-front1")
        answered = [name for op, name in senders if op == "answer"]
        assert len(answered) == len(texts)
        assert all(name.startswith("duet-engine-") for name in answered), answered
        for _ in range(100):  # every search's lease ends, just after its answer leaves
            if pipeline.indexes.in_use(index) == 0:
                break
            await asyncio.sleep(0.02)
        assert pipeline.indexes.in_use(index) == 0
        # a refused search comes back as its error, which the front raises as the owner would
        await asyncio.to_thread(pipeline.engine.stop)
        reply = await remote.search(kind="text", text="one red circle", plan=plan, m=20, top_k=5)
        with pytest.raises(ShuttingDown):
            raise_error(reply["error"])
        for _ in range(100):  # a lease ends just after its answer leaves
            if pipeline.indexes.in_use(index) == 0:
                break
            await asyncio.sleep(0.02)
        assert pipeline.indexes.in_use(index) == 0
    finally:
        await server.stop()
        for _ in range(100):  # the front's reader sees the owner close its socket
            if remote._io is None:
                break
            await asyncio.sleep(0.05)
        assert remote._io is None
        await remote.close()
        await pipeline.stop()
        index.close()


async def test_messages_posted_in_one_turn_leave_in_one_write(tmp_path: Path) -> None:
    """A front's searches posted in one turn of its event loop reach the owner in one write,
    whole and in order; each turn's in a write of its own."""
    got: asyncio.Queue[object] = asyncio.Queue()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                size = int.from_bytes(await reader.readexactly(4), "little")
                await got.put(pickle.loads(await reader.readexactly(size)))
            except asyncio.IncompleteReadError:
                return

    path = str(tmp_path / "s.sock")
    server = await asyncio.start_unix_server(peer, path)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_unix_connection(asyncio.Protocol, path)
    writes: list[int] = []
    real = transport.write

    def counted(data: bytes | bytearray | memoryview) -> None:
        writes.append(len(data))
        real(data)

    transport.write = counted  # type: ignore[method-assign]
    msgs = [{"op": "search", "id": i, "ids": list(range(i))} for i in range(5)]
    for m in msgs:
        post(transport, m)
    assert writes == []  # nothing leaves before the turn ends
    received = [await asyncio.wait_for(got.get(), 5) for _ in range(5)]
    assert received == msgs and len(writes) == 1  # the five in one write
    post(transport, {"op": "observe"})  # a later turn's: a write of its own
    assert await asyncio.wait_for(got.get(), 5) == {"op": "observe"} and len(writes) == 2
    transport.close()
    server.close()


def test_a_fronts_link_cuts_messages_out_of_chunks_of_any_size() -> None:
    """The owner's answers arrive in whatever chunks the socket gives: one cut in the length,
    one in the body, several in one chunk; each message is handed on whole, in order, once."""
    from app.remote import _Link

    msgs = [{"op": "answer", "id": i, "pad": "x" * (i * 37)} for i in range(12)]
    stream = b""
    for m in msgs:
        data = pickle.dumps(m)
        stream += len(data).to_bytes(4, "little") + data
    for sizes in ([1], [3, 5], [7, 200], [len(stream)]):
        got: list[Any] = []
        lost: list[bool] = []
        link = _Link(got.append, functools.partial(lost.append, True))
        at, i = 0, 0
        while at < len(stream):
            n = sizes[i % len(sizes)]
            link.data_received(stream[at : at + n])
            at, i = at + n, i + 1
        assert got == msgs and not link._buf, sizes
        link.connection_lost(None)
        assert lost == [True]


def test_answers_from_several_workers_at_once_arrive_whole_and_in_each_ones_order() -> None:
    owner_side, front_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    owner_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    peer = Peer(owner_side, "front1")
    per = 300

    def worker(w: int) -> None:
        for i in range(per):
            peer.send({"op": "answer", "id": (w, i), "pad": bytes((i * 97) % 9000)})

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    got = _read(front_side, 4 * per)  # read while they send (the buffer holds a few only)
    for t in threads:
        t.join(10)
    for w in range(4):
        mine = [m["id"][1] for m in got if m["id"][0] == w]
        assert mine == list(range(per)), w
    assert all(len(m["pad"]) == (m["id"][1] * 97) % 9000 for m in got)
    peer.close()
    front_side.close()


def test_a_search_admitted_while_the_engine_stops_is_refused_not_lost() -> None:
    """`Engine.stop` on one thread, a search admitted on another (the owner's socket threads):
    the search is refused (ShuttingDown) or answered, never left in a stopped queue. Made
    certain here by holding the admitting thread just before it takes the engine's lock."""
    from app.engine import Engine

    def answer(tickets: Any) -> None:
        for t in tickets:
            t.resolve(1)

    engine: Engine[str, int] = Engine(answer, workers=1, max_batch=4, max_queue=10, timeout_s=5)
    engine.start()
    real = engine._cond

    class Late:
        def __enter__(self) -> Any:
            if threading.current_thread().name == "admitting":
                time.sleep(0.2)  # engine.stop runs whole meanwhile
            return real.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return real.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    engine._cond = Late()  # type: ignore[assignment]
    outcome: list[object] = []

    def admit() -> None:
        try:
            engine.enqueue("q", 0.0, lambda r, e: outcome.append((r, e)))
        except ShuttingDown as exc:
            outcome.append(exc)

    t = threading.Thread(target=admit, name="admitting")
    t.start()
    time.sleep(0.05)
    engine.stop(timeout_s=2)
    t.join(5)
    assert len(outcome) == 1 and isinstance(outcome[0], ShuttingDown), outcome
    assert not engine._queue


async def test_a_front_fails_its_waiting_searches_when_the_owner_goes_or_loses_one(
    tmp_path: Path,
) -> None:
    """The front's searches never wait forever: a 503 when the owner closes its socket, and
    one past `answer_s` when the owner lost an answer."""
    from app.errors import NotReady

    path = str(tmp_path / "owner.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(2)
    close_after_search = threading.Event()

    def owner() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            peer = Peer(conn, "front")
            while True:
                try:
                    msg = peer.recv()
                except EOFError:
                    break
                if msg["op"] == "hello":
                    peer.send({"op": "hello", "info": {"version": "v1", "timeout_s": 0.01}})
                elif msg["op"] == "search" and close_after_search.is_set():
                    peer.close()  # gone without answering
                    break
                # else: the search is never answered (an answer lost)

    threading.Thread(target=owner, daemon=True).start()
    lost = RemoteEngine(path)
    await lost.connect(wait_s=5)
    assert lost.answer_s == 30.0  # a few deadlines, at least the floor
    lost.answer_s = 0.3
    with pytest.raises(NotReady, match="did not answer"):
        await asyncio.wait_for(lost.search(kind="text", text="a"), 10)
    assert not lost._pending  # each search's future and send time, one map
    await lost.close()
    close_after_search.set()
    gone = RemoteEngine(path)
    await gone.connect(wait_s=5)
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(gone.search(kind="text", text="b"), 10)
    assert gone._io is None
    with pytest.raises(ShuttingDown):  # and later searches are refused at once
        await gone.search(kind="text", text="c")
    await gone.close()
    listener.close()


async def test_a_lone_search_is_written_at_once_and_never_ahead_of_this_turns_others(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "s.sock")
    server = await asyncio.start_unix_server(lambda r, w: None, path)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_unix_connection(asyncio.Protocol, path)
    writes: list[bytes] = []
    transport.write = writes.append  # type: ignore[method-assign,assignment]
    post(transport, {"op": "search", "id": 1}, alone=True)
    assert len(writes) == 1  # at once, not at the end of the turn
    post(transport, {"op": "observe"})
    post(transport, {"op": "search", "id": 2}, alone=True)  # behind the turn's other message
    assert len(writes) == 1
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(writes) == 2
    frames, at = [], 0
    while at < len(writes[1]):
        size = int.from_bytes(writes[1][at : at + 4], "little")
        frames.append(pickle.loads(writes[1][at + 4 : at + 4 + size]))
        at += 4 + size
    assert frames == [{"op": "observe"}, {"op": "search", "id": 2}]
    transport.close()
    server.close()


async def test_a_late_answer_on_a_swapped_out_version_does_not_take_a_front_back(
    index_dir: Path,
) -> None:
    """The owner's workers write answers and the swap its announcement in no set order: an
    answer that ran on the old version and arrives after the announcement must not make the
    front key its cache by the old version again (its repeated queries would then hit the
    old entry for ever); an answer on a version not yet announced still moves it on."""
    from app.batch import Answer
    from app.fronts import FrontPipeline
    from app.metrics import Metrics

    path = str(indexio.resolve_current(index_dir))
    replies: list[str] = []

    class Owner:
        info: ClassVar[dict[str, Any]] = {
            "fingerprint": "f", "numerics": None, "vocab": None, "by_words": False,
            "fusion_lambda": 0.1, "theta": 1.0, "rerankers": ["none"],
            "default_reranker": "none", "unavailable": {}, "version": "v1", "path": path,
        }  # fmt: skip
        on_version: Any = None

        async def search(self, **_: Any) -> dict[str, Any]:
            answer = Answer([], [], {}, None, degraded=False, captions={})
            return {"version": replies.pop(0), "path": path, "answer": answer}

    front = FrontPipeline(cast(Any, Owner()), None, Metrics())
    plan = cast(Any, None)
    front._swapped("v2", path)  # the announcement first
    for late, then in (("v1", "v2"), ("v3", "v3"), ("v2", "v3")):
        replies.append(late)
        await front.run(front.index, "text", "a", None, plan, 5, 5)
        assert front.index.version == then, late
    front._swapped("v1", path)  # a reload back to v1 serves it again
    assert front.index.version == "v1"
    front.stores.close()
