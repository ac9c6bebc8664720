"""`duet eval`'s tables as a person reads them: a partial-query run in which no query has a
fitting image in the pool says so (its table was a row of "nan")."""

from __future__ import annotations

import math

from models.eval_modes import format_partial


def test_a_partial_run_that_judged_nothing_says_so_instead_of_nan() -> None:
    nothing = {"P@1": math.nan, "P@10": math.nan}
    part = {"queries": 1, "seed": 5, "judged": 0, "candidates": 20, "modes": {"dot": nothing}}
    said = format_partial(part)
    assert "nan" not in said and "No query has a fitting image in this pool" in said
    part = {**part, "judged": 1, "modes": {"dot": {"P@1": 1.0, "P@10": 0.5}}}
    assert "| dot | 1.000 | 0.500 |" in format_partial(part)
