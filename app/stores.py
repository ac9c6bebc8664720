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
        self._users: dict[str, int] = {}

    @contextlib.contextmanager
    def use(self, path: str) -> Iterator[ItemStore]:
        store = self._open.get(path)
        if store is None:
            try:
                store = self._open[path] = ItemStore(Path(path) / ITEMS)
            except sqlite3.Error as exc:
                raise NotReady(f"the index version at {path} can no longer be read; retry") from exc
        self._users[path] = self._users.get(path, 0) + 1
        try:
            yield store
        finally:
            self._users[path] -= 1
            self._close_unused()

    def swapped(self, path: str) -> None:
        """The owner serves the version at `path` from now on."""
        self.current = path
        self._close_unused()

    def _close_unused(self) -> None:
        for path in [p for p in self._open if p != self.current and not self._users.get(p)]:
            self._users.pop(path, None)
            self._open.pop(path).close()

    def close(self) -> None:
        for store in self._open.values():
            store.close()
        self._open.clear()
