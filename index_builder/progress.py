"""The encode step's progress, as the person running the build sees it: a tqdm bar on a
terminal, or, with the bar off (`--no-progress`: a log file, a CI job, a benchmark), one log
line every half minute with the items done, the rate and the time left, so a long build that
is stopped or killed still says how far it got and how fast."""

from __future__ import annotations

import logging
import time
from types import TracebackType

from models.bars import tqdm

log = logging.getLogger("duet.build")

EVERY_S = 30.0


class EncodeProgress:
    """`with EncodeProgress(total, progress) as bar: ... bar.update(n)`."""

    def __init__(
        self, total: int, progress: bool, desc: str = "encoding", every: float = EVERY_S
    ) -> None:
        self.total, self.progress, self.desc, self.every = total, progress, desc, every
        self.bar = tqdm(total=total, desc=desc, unit="item", disable=not progress)
        self.done = 0
        self.t0 = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.bar.update(n)
        self.done += n
        now = time.perf_counter()
        if not self.progress and now - self.last >= self.every:
            self.last = now
            log.info("%s", self.line(now))

    def line(self, now: float) -> str:
        """ "encoding: 120,000 of 1,000,000 items (12.0 %), 1,650 items/s, about 9 min left"."""
        rate = self.done / max(now - self.t0, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        when = f"about {left / 60:.0f} min left" if left >= 90 else f"about {left:.0f} s left"
        share = 100.0 * self.done / self.total if self.total else 100.0
        return (
            f"{self.desc}: {self.done:,} of {self.total:,} items ({share:.1f} %), "
            f"{rate:,.0f} items/s, {when}"
        )

    def __enter__(self) -> EncodeProgress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.bar.close()
