"""Progress bars in a log file (stderr no terminal): plain lines, and the last one says the
work was done. `duet eval`'s bars (leave=False) left a log "0%| 0.00/6.06k" and nothing
after it."""

from __future__ import annotations

import io
import sys

import pytest

from models import bars


@pytest.mark.parametrize("leave", [True, False])
def test_a_bar_in_a_log_ends_on_its_last_frame(
    monkeypatch: pytest.MonkeyPatch, leave: bool
) -> None:
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    with bars.tqdm(total=6060, desc="t2i", unit="pair", unit_scale=True, leave=leave) as bar:
        for _ in range(6):
            bar.update(1010)
    lines = log.getvalue().splitlines()
    assert lines and all("\r" not in ln for ln in lines)
    assert "100%" in lines[-1] and "6.06k/6.06k" in lines[-1], lines
