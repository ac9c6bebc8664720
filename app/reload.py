"""Zero-downtime index swap: notice a new INDEX_DIR/current, load and check it off the event
loop, then swap it in; refuse a broken one and keep serving the old.

Triggered by a poller (DUET_INDEX_POLL_S) and by POST /admin/reload. A version is identified on
disk by its resolved path and its files' names, sizes, mtimes and inodes (`probe`), so a
refused version is not retried (nor logged again) by the poller until its files change;
/admin/reload always retries.

The served version's own files are watched the same way: changed in place (damaged, or put
back) and still so a poll later, they are checked again, and reopened when whole (SQLite
reads a version's item store as immutable: a mended file was not read again until a
restart) or, when not, said to be damaged (`damaged`: /readyz, the log,
`duet_index_served_damaged`) while the version serves on what it still reads.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from app.metrics import Metrics
from app.pipeline import SearchPipeline
from models.protocols import JointEncoder
from store.indexio import CURRENT, IndexLoadError, IndexVersion, resolve_current

log = logging.getLogger("duet.reload")

SMOKE_QUERY = "a red circle"


@dataclass(frozen=True)
class Outcome:
    """What one reload attempt did; `version` is the one now served, or the one refused."""

    result: Literal["swapped", "current", "refused"]
    version: str
    path: str
    at: str  # UTC, ISO 8601
    reason: str | None = None
    previous: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def probe(index_dir: Path) -> tuple[Path, object]:
    """The version directory `current` points at, and its files' stamp: each one's name,
    size, mtime and inode (a file put back with its old mtime, as `cp -p` and `tar x` do, is
    a change all the same; the newest mtime alone missed it)."""
    path = resolve_current(index_dir)
    if not path.is_dir():
        raise IndexLoadError(f"{Path(index_dir) / CURRENT} points at {path}, not a directory")
    return path, _stamp(path)


def _stamp(path: Path) -> object:
    files = []
    for f in path.iterdir():
        st = f.stat()
        files.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return path.stat().st_mtime_ns, tuple(sorted(files))


def smoke_test(index: IndexVersion, model: JointEncoder) -> None:
    """Search both FAISS indexes with a real query and read back what a request would read."""
    for name, faiss_index in (("image", index.image_index), ("text", index.text_index)):
        if faiss_index.d != model.dim:
            raise IndexLoadError(
                f"{name} index has dimension {faiss_index.d}, the model {model.dim}"
            )
    if tuple(index.image_tokens.shape[1:]) != tuple(model.token_shape):
        raise IndexLoadError(
            f"image tokens have shape {index.image_tokens.shape[1:]}, the model "
            f"needs {model.token_shape}"
        )
    vec = np.ascontiguousarray(model.encode_texts([SMOKE_QUERY]), dtype=np.float32)
    for faiss_index, lookup in (
        (index.image_index, index.store.images),
        (index.text_index, index.store.texts),
    ):
        n = faiss_index.ntotal
        if n == 0:
            continue
        _, rows = faiss_index.search(vec, 1)
        top = int(rows[0][0])
        if not 0 <= top < n:
            raise IndexLoadError(f"a test search returned row {top} of {n}")
        lookup([top, 0, n - 1])  # the last row too: the item store covers every FAISS row
    if len(index.image_tokens):
        np.asarray(index.image_tokens[[0, -1]])


def load_checked(path: Path, model: JointEncoder) -> IndexVersion:
    """Open a version (fingerprint and counts are checked there), prove its files whole
    (`IndexVersion.verify`), then smoke-test it."""
    index = IndexVersion.open(
        path, expect_fingerprint=model.fingerprint, device=str(getattr(model, "device", "cpu"))
    )
    try:
        index.verify()
        smoke_test(index, model)
    except Exception as exc:
        index.close()
        if isinstance(exc, IndexLoadError):
            raise
        raise IndexLoadError(
            f"index {path} failed a test search: {type(exc).__name__}: {exc}"
        ) from exc
    return index


class IndexReloader:
    """Loads, checks and swaps in new versions for one `SearchPipeline`; one attempt at a time."""

    def __init__(
        self,
        pipeline: SearchPipeline,
        index_dir: Path,
        metrics: Metrics,
        poll_s: float,
        images_unserved: Callable[[IndexVersion], str | None] = lambda _index: None,
    ) -> None:
        # why GET /images cannot serve a version's images here: a swap warns as start-up does
        self._images_unserved = images_unserved
        self._pipeline = pipeline
        self._index_dir = Path(index_dir)
        self._metrics = metrics
        self.poll_s = poll_s
        self._lock = asyncio.Lock()
        self._refused: dict[Path, tuple[object, Outcome]] = {}  # path -> (stamp, outcome)
        self.last_swap: Outcome | None = None
        self.last_refused: Outcome | None = None
        self._served_stamp: object = None  # the served version's files' stamp, as checked
        self._seen_stamp: object = None  # a change seen once: checked when it holds a poll
        self.damaged: str | None = None  # why the served version failed its checks again

    async def remember_served(self) -> None:
        """The served version's files as start-up checked them: a later change is checked."""
        try:
            path, stamp = await asyncio.to_thread(probe, self._index_dir)
        except (IndexLoadError, OSError):
            return
        if path == Path(self._pipeline.index.path):
            self._served_stamp = stamp

    @property
    def serving(self) -> str:
        """The version requests starting now get."""
        return self._pipeline.index.version

    async def reload(self, *, force: bool) -> Outcome:
        """Swap to INDEX_DIR/current if it is new and sound; `force` retries a refused one."""
        async with self._lock:
            served = self._pipeline.index
            link = self._index_dir / CURRENT
            try:
                path, stamp = await asyncio.to_thread(probe, self._index_dir)
            except (IndexLoadError, OSError) as exc:
                return self._refuse(link, str(exc), str(exc), force)
            same = path == Path(served.path)  # both resolved: load_resources and probe resolve
            if same:
                self._metrics.index_current_refused.set(0)  # current put back, say
                if (kept := self._served_kept(path, stamp, force)) is not None:
                    return kept
                self._cache(False)  # not while it is checked, nor after unless it passes
                log.warning("the served index %s changed on disk: checking it again", path)
            else:
                await self._served_back(served)
                if (known := self._known_refusal(path, stamp, force)) is not None:
                    return known
            try:
                new = await asyncio.to_thread(load_checked, path, self._pipeline.model)
                await asyncio.to_thread(self._pipeline.prepare, new)  # device tables
            except Exception as exc:  # anything that stops a load refuses the version
                reason = (
                    str(exc)
                    if isinstance(exc, IndexLoadError)
                    else (f"{type(exc).__name__}: {exc}")
                )
                if same:  # it serves on, said to be damaged, until its files change again
                    return self._damaged(path, reason, stamp)
                return self._refuse(path, reason, stamp, force)
            self._pipeline.swap_index(new)
            self._refused.pop(path, None)
            self._metrics.index_current_refused.set(0)
            self._metrics.index_served_damaged.set(0)
            self._served_stamp, self.damaged = stamp, None
            self._cache(True)
            self._metrics.index_reloads.labels(result="ok").inc()
            self.last_swap = Outcome(
                "swapped", new.version, str(path), _now(), previous=served.version
            )
            log.info(
                "%s index %s -> %s (%d images, %d texts)",
                "reopened, whole again," if same else "swapped",
                served.version,
                new.version,
                new.image_index.ntotal,
                new.text_index.ntotal,
            )
            if why := self._images_unserved(new):
                log.warning("GET /images/{id} cannot serve this version's images: %s", why)
            return self.last_swap

    def _served_kept(self, path: Path, stamp: object, force: bool) -> Outcome | None:
        """What a look at the served version's own files answers without checking them, or
        None to check them: unchanged since checked (or since found damaged), or changed
        and seen once (a copy under way changes them poll after poll: checked once the
        change holds for a poll, or at once when `force`d)."""
        served = self._pipeline.index
        if self._served_stamp is None:  # no start-up record: taken as checked
            self._served_stamp = stamp
        left = self._refused.get(path) if self.damaged else None  # (stamp, outcome)
        now = left[1] if left else Outcome("current", served.version, str(path), _now())
        if stamp == (left[0] if left else self._served_stamp):
            self._seen_stamp = None  # a change seen again is held a poll again
            if not self.damaged:
                self._cache(True)  # a change that went back before it was checked
            return None if force and self.damaged else now
        if not force and stamp != self._seen_stamp:
            self._seen_stamp = stamp
            self._cache(False)  # suspect until checked: no answer of it cached meanwhile
            return now
        return None

    async def _served_back(self, served: IndexVersion) -> None:
        """While `current` names another version: the served one's files, suspect (changed,
        not checked yet), back as they were checked? Caching resumes then; `current` moved
        on, nothing else would look at them again."""
        if self._pipeline.caching or self.damaged or self._served_stamp is None:
            return
        try:
            stamp = await asyncio.to_thread(_stamp, Path(served.path))
        except OSError:
            return
        if stamp == self._served_stamp:
            self._seen_stamp = None
            self._cache(True)

    def _cache(self, on: bool) -> None:
        """Whether the served version's answers are cached, here and in every front."""
        p = self._pipeline
        if p.caching != on:
            p.caching = on
            for listener in p.swap_listeners:  # the fronts hear it with the version
                listener(p.index.version)

    def _damaged(self, path: Path, reason: str, stamp: object) -> Outcome:
        """The served version's files failed their checks again: it serves on (what it still
        reads; a failed read is a 503 `index_unreadable`), told by /readyz, the log and
        `duet_index_served_damaged`, until its files change again."""
        self.damaged = reason
        self._metrics.index_served_damaged.set(1)
        self._metrics.index_reloads.labels(result="refused").inc()
        outcome = Outcome("refused", path.name, str(path), _now(), reason=reason)
        self._refused[path] = (stamp, outcome)
        self.last_refused = outcome
        log.error(
            "the served index %s changed on disk and fails its checks: %s; it serves on what "
            "it still reads: restore its files or build it again",
            path,
            reason,
        )
        return outcome

    def _known_refusal(self, path: Path, stamp: object, force: bool) -> Outcome | None:
        """The earlier refusal of these very files, unless `force` asks to try again."""
        remembered = self._refused.get(path)
        if force or remembered is None or remembered[0] != stamp:
            return None
        self._metrics.index_current_refused.set(1)  # still what current names
        return remembered[1]

    def _refuse(self, path: Path, reason: str, stamp: object, force: bool) -> Outcome:
        if (known := self._known_refusal(path, stamp, force)) is not None:
            return known
        outcome = Outcome("refused", path.name, str(path), _now(), reason=reason)
        self._metrics.index_current_refused.set(1)
        self._refused[path] = (stamp, outcome)
        self.last_refused = outcome
        self._metrics.index_reloads.labels(result="refused").inc()
        log.error("refused index %s: %s; still serving %s", path, reason, self.serving)
        return outcome

    async def poll_forever(self) -> None:
        """Check INDEX_DIR/current every `poll_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.reload(force=False)
            except Exception:  # the poller must outlive any one bad attempt
                log.exception("index poll failed")

    def status(self) -> dict[str, Any]:
        """For /readyz (unauthenticated): poll interval, the last swap and the last refusal,
        without the host's file paths (/admin/reload and the log have them in full)."""
        return {
            "poll_s": self.poll_s,
            "last_swap": self._public(self.last_swap),
            "last_refused": self._public(self.last_refused),
            # the served version's own files changed on disk and fail their checks: it serves
            # on what it still reads (a readiness 503 took every replica of a shared volume
            # out of service at once, for files most requests never read)
            "served_damaged": self.damaged is not None,
            # its answers are not cached while its files are changed and not yet checked
            "answers_cached": self._pipeline.caching,
        }

    def _public(self, outcome: Outcome | None) -> dict[str, Any] | None:
        if outcome is None:
            return None
        shown = outcome.as_json()
        shown.pop("path", None)
        if outcome.reason is not None:
            reason = outcome.reason.replace(str(self._index_dir.resolve()), "INDEX_DIR")
            reason = reason.replace(str(self._index_dir), "INDEX_DIR")
            # any other absolute path (a library's source file in an error) -> its last part
            shown["reason"] = re.sub(r"(?<![\w.])/(?:[^\s/:'\"]+/)+([^\s/:'\"]+)", r"\1", reason)
        return shown
