"""The count figure of issue 37 (`models.count_eval`): queries that name a count, each beside a
twin of its image with another count, served as the service serves them; validation seeds only
unless a final test read is asked for."""

from __future__ import annotations

from dataclasses import replace

import pytest

from models import world
from models.builtin import BuiltinModel
from models.count_eval import (
    KINDS,
    count_cases,
    count_gallery,
    count_split,
    main,
)
from models.evaluate import partial_precision
from models.fusion import DEFAULT_FUSION_LAMBDA
from models.trainconfig import HELD_OUT_SEED_BASE

VAL = HELD_OUT_SEED_BASE - 1


def test_twin_counts_stay_in_the_world() -> None:
    def t(count: int, size: str) -> world.Thing:
        return world.Thing("circle", "red", size, count)

    other_counts = world.other_counts
    assert other_counts(t(1, "large")) == (2,)  # three large things never fit
    assert other_counts(t(1, "small")) == (2, 3)
    assert other_counts(t(2, "small")) == (1, 3)
    assert other_counts(t(2, "large")) == (1,)
    assert other_counts(t(3, "small")) == (1, 2)


def test_typed_drops_articles_but_keeps_a_pair() -> None:
    typed = world.typed
    assert typed("there is a green square with a red triangle") == (
        "there is green square and red triangle"
    )
    assert typed("a pair of blue squares with a circle") == "a pair of blue squares and circle"


def test_each_query_names_its_count_and_its_twin_breaks_only_that() -> None:
    scenes = [s.scene for s in world.generate(200, VAL, n_captions=1)]
    cases = count_cases(scenes, 150, VAL)
    assert len(cases) == 150 and {c.kind for c in cases} == set(KINDS)
    assert cases == count_cases(scenes, 150, VAL)  # the same queries every run
    for c in cases:
        assert c.scene in scenes and c.scene.b is not None
        assert c.twin == replace(c.scene, a=replace(c.scene.a, count=c.twin.a.count))
        assert c.twin.a.count != c.scene.a.count
        assert world.satisfies(c.text, c.scene) and not world.satisfies(c.text, c.twin)
        said = world.parse(c.text)  # the group may come first or second in the words
        assert said is not None and c.desc.a.count == c.scene.a.count
        assert c.desc.a in (said.a, said.b)
    # "a" / "one" against "two" / "three" is most of it
    assert sum(c.kind == "one vs more" for c in cases) > len(cases) / 3


def test_served_p1_is_the_shared_evaluators(model: BuiltinModel) -> None:
    """The served P@1 is what `models.evaluate.partial_precision` (the validation and
    `tune_fusion` path) reads for the same gallery and queries at the default λ."""
    samples = list(world.generate(40, VAL, n_captions=1))
    got = count_split(model, samples, VAL, queries=20, candidates=10)
    cases = count_cases([s.scene for s in samples], 20, VAL)
    images, scenes = count_gallery(samples, cases, VAL)
    assert got["images"] == 40 + len(cases) and got["queries"] == len(cases)
    ref = partial_precision(model, images, scenes, [(c.text, c.desc) for c in cases], candidates=10)
    assert got["P"]["served"] == ref[f"ADD_{DEFAULT_FUSION_LAMBDA}"]
    assert got["P"]["ce_only"] == ref["ce_only"] and got["P"]["dot"] == ref["dot"]
    assert sum(k["queries"] for k in got["kinds"].values()) == len(cases)
    assert 0 <= got["served first is the twin"] <= len(cases)


def test_a_test_split_needs_asking_for() -> None:
    with pytest.raises(ValueError, match="not a validation seed"):
        main(["--seed", str(HELD_OUT_SEED_BASE + 2026), "--no-full"])
