"""The engine's cost models, which its admission reads (`app.engine`): seconds per unit of
work on the host path (`Throughput`) and a device batch's fixed and per-item seconds
(`BatchCost`), both kept up to date from the batches the workers run."""

from __future__ import annotations

import math
import threading

import numpy as np


class Throughput:
    """Exponentially weighted seconds per unit of each kind of work (a query, a pair)."""

    def __init__(self, seconds_per: dict[str, float], alpha: float = 0.2) -> None:
        self._per = dict(seconds_per)
        self._alpha = alpha
        self._lock = threading.Lock()

    def observe(self, kind: str, units: int, seconds: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        with self._lock:
            old = self._per.get(kind, seconds / units)
            self._per[kind] = (1 - self._alpha) * old + self._alpha * seconds / units

    def seconds(self, kind: str, units: float = 1.0) -> float:
        """Estimated seconds for `units` of `kind`; a kind not yet seen costs what its
        family does ("pair/late" -> "pair") until it is measured."""
        return self._per.get(kind, self._per.get(kind.split("/")[0], 0.0)) * units

    def per_second(self, kind: str) -> float:
        per = self.seconds(kind)
        return math.inf if per <= 0 else 1.0 / per


class BatchCost:
    """Seconds a batch takes as a fixed part plus a part per query and per pair,
    `a + b * queries + c * pairs`, fitted by exponentially weighted least squares over the
    batches run (the GPU layout's cost model: on a device a batch of 64 queries costs little
    more than one, so a per-request price alone over-counts the queue ahead)."""

    def __init__(self, fixed_s: float, per_query_s: float, per_pair_s: float) -> None:
        self._coef = np.array([fixed_s, per_query_s, per_pair_s])
        # sufficient statistics, seeded with a weak prior at the starting coefficients
        self._xtx = np.eye(3) * 1e-3
        self._xty = self._xtx @ self._coef
        self._decay = 0.98  # an observation's weight halves after ~35 batches
        self._lock = threading.Lock()

    def observe(self, queries: int, pairs: int, seconds: float) -> None:
        if queries <= 0 or seconds <= 0:
            return
        x = np.array([1.0, queries, pairs])
        with self._lock:
            self._xtx = self._decay * self._xtx + np.outer(x, x)
            self._xty = self._decay * self._xty + x * seconds
            try:  # a small ridge keeps it solvable while the batches all look alike
                coef = np.linalg.solve(self._xtx + np.eye(3) * 1e-6, self._xty)
            except np.linalg.LinAlgError:
                return
            self._coef = np.maximum(coef, 0.0)  # no part of the work is free time back

    @property
    def fixed_s(self) -> float:
        return float(self._coef[0])

    def ticket_s(self, pairs: int) -> float:
        """One request's own share: its query and its pairs (the batch's fixed part apart)."""
        return float(self._coef[1] + self._coef[2] * pairs)

    def batch_s(self, queries: int, pairs: int) -> float:
        return float(self._coef @ np.array([1.0, queries, pairs]))
