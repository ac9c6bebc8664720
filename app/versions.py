"""The served index version, swapped atomically; a replaced version closes once it is idle.

Each request takes a lease on the version that is current when it starts and uses only that
version until it ends, so a swap never mixes two versions inside one response. A swap replaces
the current version for requests that start afterwards; the old one stays open while any
lease on it is held and is closed (its sqlite connection) by the release of the last lease.
Closing explicitly rather than leaving it to garbage collection makes the moment
deterministic: a traceback or a stray reference cannot keep file handles open.

Leases are taken and released on the event loop, or by the process layout's owner on its
socket's threads (`app.owner`), so the counter is guarded by a lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from store.indexio import IndexVersion

log = logging.getLogger("duet.versions")


class ServedIndex:
    """Holds the current `IndexVersion` and counts the requests using each version."""

    def __init__(self, index: IndexVersion) -> None:
        self._current = index
        self._users: dict[int, int] = {}  # id(version) -> requests holding it
        self._retired: dict[int, IndexVersion] = {}  # swapped out, still in use
        self._lock = threading.Lock()

    @property
    def current(self) -> IndexVersion:
        return self._current

    @contextmanager
    def lease(self) -> Iterator[IndexVersion]:
        """The current version, kept open until the `with` block ends."""
        index = self.take()
        try:
            yield index
        finally:
            self.release(index)

    def take(self) -> IndexVersion:
        """A lease without a block, for one that ends on another thread: the current
        version, kept open until `release(version)`."""
        with self._lock:
            index = self._current
            self._users[id(index)] = self._users.get(id(index), 0) + 1
        return index

    def release(self, index: IndexVersion) -> None:
        with self._lock:
            left = self._users[id(index)] - 1
            if left:
                self._users[id(index)] = left
                return
            del self._users[id(index)]
            idle = self._retired.pop(id(index), None)
        if idle is not None:
            self._close(idle)

    def swap(self, new: IndexVersion) -> IndexVersion:
        """Serve `new` from the next request on; return the version it replaced."""
        with self._lock:
            old, self._current = self._current, new
            busy = id(old) in self._users
            if busy:
                self._retired[id(old)] = old
        if not busy:
            self._close(old)
        return old

    def in_use(self, index: IndexVersion) -> int:
        """Requests currently holding `index` (for tests and logs)."""
        with self._lock:
            return self._users.get(id(index), 0)

    @staticmethod
    def _close(index: IndexVersion) -> None:
        index.close()
        log.info("closed index version %s (no request uses it any more)", index.version)
