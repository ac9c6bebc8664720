"""A front's item stores (`app.fronts`): the process layout's fronts look the hits' items up
themselves, in the store of the index version each answer ran on."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from app.errors import NotReady
from store.indexio import ITEMS, ItemStore


class Stores:
    """A front's item stores, one per index version its answers name (by the version's
    path): the current version's stays open; another's is open while an answer uses it and
    closed once none does, so a swapped-out version's file and decoded rows go as the
    owner's do."""

    def __init__(self, current: str) -> None:
        self.current = current
        self._open: dict[str, ItemStore] = {}
        self._users: dict[ItemStore, int] = {}
        self._stale: list[ItemStore] = []  # the current path's earlier store, still in use

    @contextlib.contextmanager
    def use(self, path: str) -> Iterator[ItemStore]:
        store = self._open.get(path)
        if store is None:
            try:
                store = self._open[path] = ItemStore(Path(path) / ITEMS)
            except sqlite3.Error as exc:
                raise NotReady(f"the index version at {path} can no longer be read; retry") from exc
        self._users[store] = self._users.get(store, 0) + 1
        try:
            yield store
        finally:
            self._users[store] -= 1
            self._close_unused()

    def swapped(self, path: str) -> None:
        """The owner serves the version at `path` from now on; the same path again when it
        reopened it (its files changed on disk and passed the checks): this store is opened
        afresh too, since SQLite reads it as immutable and would not see the mended file."""
        if path == self.current and path in self._open:
            self._stale.append(self._open.pop(path))
        self.current = path
        self._close_unused()

    def _close_unused(self) -> None:
        for path in [p for p in self._open if p != self.current]:
            if not self._users.get(self._open[path]):
                self._stale.append(self._open.pop(path))
        for store in [s for s in self._stale if not self._users.get(s)]:
            self._stale.remove(store)
            self._users.pop(store, None)
            store.close()

    def close(self) -> None:
        for store in [*self._open.values(), *self._stale]:
            store.close()
        self._open.clear()
        self._stale.clear()
