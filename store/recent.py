"""A bounded map of the most recently used entries (least recently used out first), for the
item store's per-row look-ups: the same popular items come up in request after request."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most `size` entries. Not locked: its owner calls it under its own lock."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        self._map: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def clear(self) -> None:
        self._map.clear()

    def holds(self, keys: Sequence[K]) -> bool:
        """Whether every one of `keys` is held (their order of use unchanged)."""
        return all(k in self._map for k in keys)

    def peek(self, key: K) -> V | None:
        """The entry of `key` if held, its order of use unchanged."""
        return self._map.get(key)

    def get_many(self, keys: Sequence[K], fetch: Callable[[list[K]], dict[K, V]]) -> dict[K, V]:
        """The entries of `keys`: those held, and the rest from one `fetch(missing)` call
        (keys it does not answer are left out and not remembered)."""
        out: dict[K, V] = {}
        missing: list[K] = []
        for k in dict.fromkeys(keys):
            if k in self._map:
                self._map.move_to_end(k)
                out[k] = self._map[k]
            else:
                missing.append(k)
        if missing:
            got = fetch(missing)
            out.update(got)
            if self.size:
                for k, v in got.items():
                    self._map[k] = v
                while len(self._map) > self.size:
                    self._map.popitem(last=False)
        return out
