"""Progress bars (tqdm, on stderr) as the person running a command sees them: on a terminal a
bar redrawn in place; in a file (a log, a CI job, `docker logs`) a plain line at most every
15 s, each on a line of its own. tqdm starts every redraw with a carriage return, which a log
file keeps: a long run's log was one ever longer line of frames, with blank-padded clears."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm as _tqdm

LOG_EVERY_S = 15.0  # how often a bar writes a line where stderr is no terminal


class _Lines:
    """What tqdm writes, for a file: each frame a line, the clears left out."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def write(self, text: str) -> int:
        for frame in text.replace("\n", "\r").split("\r"):
            if frame := frame.rstrip():
                self.out.write(frame + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def tqdm(iterable: Any = None, **options: Any) -> _tqdm:  # type: ignore[type-arg]
    """tqdm's bar as every duet command shows it (`from models.bars import tqdm` in place of
    tqdm's own): on stderr, redrawn in place on a terminal, else a line at most every
    `LOG_EVERY_S`."""
    if not sys.stderr.isatty():
        options["mininterval"] = max(float(options.get("mininterval", 0.0)), LOG_EVERY_S)
        options["file"] = _Lines(sys.stderr)
        # a bar cleared at its end (leave=False) left a log its first frame only, "0%": it
        # writes its last one instead, the 100 % of the work done
        options["leave"] = True
    return _tqdm(iterable, **options)
