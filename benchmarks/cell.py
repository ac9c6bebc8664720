"""One benchmark cell's figures (`benchmarks/serve_load.py`): answers' latencies, refusals,
CPU by process and duet's own stage times, summed over rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Cell:
    """One (server, mode, concurrency) measurement, summed over rounds."""

    latencies: list[float] = field(default_factory=list)  # full answers only, seconds
    # open loop: when each of those answers' requests was due, seconds into the run
    due: list[float] = field(default_factory=list)
    seconds: float = 0.0
    degraded: int = 0
    refused: int = 0
    errors: int = 0
    late: int = 0  # open loop: offered in the window, unanswered `grace` seconds after it
    # CPU seconds in the cell: "server" (its process), "fronts" (its children), "load"
    cpu: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0  # seconds the cells took end to end, warm-up included (for `cores`)
    # duet's /metrics around the cell: [seconds, count] per duet_stage_seconds stage and
    stages: dict[str, list[float]] = field(default_factory=dict)  # "request" (/search/*)
    # open loop: duet's own p50 / p99 and queue / device / step p99 (ms), bucket bounds
    own: dict[str, float] = field(default_factory=dict)

    def add_stages(self, before: dict[str, list[float]], after: dict[str, list[float]]) -> None:
        for name, (total, n) in after.items():
            was = before.get(name, [0.0, 0.0])
            acc = self.stages.setdefault(name, [0.0, 0.0])
            acc[0] += total - was[0]
            acc[1] += n - was[1]

    def stage_ms(self, name: str) -> float:
        """Mean milliseconds of `name` per request that went through it (NaN: none did)."""
        total, n = self.stages.get(name, [0.0, 0.0])
        return 1000 * total / n if n else float("nan")

    def add_cpu(self, who: str, seconds: float) -> None:
        self.cpu[who] = self.cpu.get(who, 0.0) + seconds

    def cores(self, who: str) -> float:
        """Cores `who` kept busy over the cells' whole `wall` time (as its CPU seconds)."""
        return self.cpu.get(who, 0.0) / self.wall if self.wall else 0.0

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def tail(self, share: float = 0.01, window: float = 0.1) -> tuple[int, int, int, float]:
        """When the slowest `share` of an open loop's answers were due: (how many they are,
        how many of the run's `window`-second windows hold any of them, how many windows the
        run has, the share of them in the busiest window). A stall (a collection, a new
        kernel, a slow step) puts the tail in a few windows; queueing spreads it."""
        if not self.due or len(self.due) != len(self.latencies):
            return 0, 0, 0, float("nan")
        lat, due = np.asarray(self.latencies), np.asarray(self.due)
        n = max(1, round(share * len(lat)))
        slow = due[np.argsort(lat)[-n:]] - due.min()
        held = np.unique((slow // window).astype(int), return_counts=True)[1]
        windows = int(np.ptp(due) // window) + 1
        return n, len(held), windows, float(held.max()) / n

    def q(self, p: float) -> float:
        return float(np.percentile(self.latencies, p)) * 1000 if self.latencies else float("nan")
