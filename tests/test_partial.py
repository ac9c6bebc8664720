"""Partial descriptions: what people type, judged against scenes; the training negatives and the
evaluation that rest on that judgement."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from duet.evaluation import evaluate_partial, load_pool
from models import world
from models.builtin import BuiltinModel
from models.ce_negatives import caption_beside_twin, ranked_negative, twin_text
from models.eval_metrics import fit_matrix, precision
from models.fusion import DEFAULT_FUSION_LAMBDA
from models.losses import cmr_loss
from models.tokenizer import UNK, WordTokenizer, unknown_words
from models.train_joint import positives_mask, text_negative, training_captions
from models.trainconfig import HELD_OUT_SEED_BASE
from models.world import Desc, Part, Scene, Thing
from tests.conftest import REPO

RED_PAIR = Scene(
    "pair",
    Thing("circle", "red", "small", 2),
    Thing("diamond", "blue", "large"),
    relation="left of",
)


@pytest.mark.parametrize(
    ("query", "fits"),
    [
        ("a red circle", False),  # a singular noun is one thing; the scene has two
        ("red circles", True),
        ("some small red circles", True),  # "some" is not in the vocabulary; the parser reads it
        ("two red circles", True),
        ("three red circles", False),
        ("a blue diamond", True),
        ("a small blue diamond", False),
        ("red circles left of a diamond", True),
        ("a diamond right of two red circles", True),
        ("a blue diamond with two red circles to its left", True),
        ("a blue diamond with two red circles to its right", False),
        ("red circles above a diamond", False),
        ("two red circles and a blue diamond", True),
        ("a blue diamond and a red square", False),
        ("a blue diamond in the top left", False),  # only single-object scenes have a position
        ("a dog", False),
    ],
)
def test_satisfies_by_hand(query: str, fits: bool) -> None:
    assert world.satisfies(query, RED_PAIR) is fits


def test_positions_and_parse_of_what_people_type() -> None:
    single = Scene("single", Thing("square", "red", "large"), position="top left")
    assert world.satisfies("a red square in the upper left corner", single)
    assert world.satisfies("a big red square", single)
    assert not world.satisfies("a red square at the bottom", single)
    assert world.parse("a green cross left of a diamond") == Desc(
        Part("cross", "green"), Part("diamond", None), "left of"
    )
    assert world.parse("two green circles and a red diamond") == Desc(
        Part("circle", "green", None, 2), Part("diamond", "red")
    )
    assert world.parse("a circle, a square and a cross") is None  # three things: not the grammar
    with_its = world.parse("a red square with a blue circle to its left")
    assert with_its == Desc(Part("circle", "blue"), Part("square", "red"), "left of")
    assert world.parse("a red square and a blue circle to its left") == with_its


def test_every_caption_fits_its_scene_and_no_perturbation() -> None:
    rng = random.Random(4)
    tok = WordTokenizer(world.vocabulary())
    for sample in world.generate(300, HELD_OUT_SEED_BASE + 71, n_captions=6):
        scene = sample.scene
        for cap in sample.captions:
            assert world.satisfies(cap, scene), cap
            assert len(world.grounding(cap, scene)) == (1 if scene.b is None else 2), cap
            for _ in range(3):
                assert not world.satisfies(cap, world.perturb(rng, scene)), cap
        for _ in range(8):
            text, desc = world.partial_caption(rng, scene)
            assert tok.stoi[UNK] not in tok.ids(text), text
            assert world.satisfies(desc, scene) and world.satisfies(text, scene), text
            # the words say what the description says: the same verdict on other scenes
            for _ in range(10):
                other = world.sample_scene(rng)
                assert world.satisfies(text, other) == world.satisfies(desc, other), (text, other)
            assert not world.satisfies(desc, world.negative_scene(rng, scene, desc)), text


def test_partials_leave_things_out() -> None:
    rng = random.Random(8)
    descs = [world.partial_desc(rng, world.sample_scene(rng)) for _ in range(2000)]
    parts = [p for d in descs for p in (d.a, d.b) if p is not None]
    assert any(p.size is None for p in parts) and any(p.size is not None for p in parts)
    assert any(p.count is None for p in parts) and any(p.colour is None for p in parts)
    assert any(d.b is None for d in descs) and any(d.b and d.relation is None for d in descs)
    assert any(d.relation for d in descs) and any(d.position for d in descs)


def test_partial_grounding_names_only_what_it_can() -> None:
    assert world.grounding("a blue diamond", RED_PAIR) == [(2, "b")]
    assert world.grounding("a diamond with red circles to its left", RED_PAIR) == [
        (1, "b"),
        (4, "a"),
    ]
    twin = Scene(
        "pair", Thing("circle", "red", "small"), Thing("circle", "blue", "large"), relation="above"
    )
    assert world.grounding("a circle", twin) == []  # both fit: no target rather than a guess


def test_partial_queries_are_deterministic() -> None:
    assert world.partial_queries(50, HELD_OUT_SEED_BASE + 5) == world.partial_queries(
        50, HELD_OUT_SEED_BASE + 5
    )
    assert world.partial_queries(50, HELD_OUT_SEED_BASE + 5) != world.partial_queries(
        50, HELD_OUT_SEED_BASE + 6
    )


def test_scene_json_round_trip() -> None:
    for s in (RED_PAIR, Scene("single", Thing("cross", "green", "small"), position="center")):
        assert Scene.from_json(s.to_json()) == s


def test_training_negatives_never_fit_their_caption() -> None:
    rng = random.Random(3)
    samples = list(world.generate(200, HELD_OUT_SEED_BASE + 72, n_captions=6))
    scenes = [s.scene for s in samples]
    texts, descs = training_captions(rng, samples, 0.5)
    assert all(world.satisfies(t, s) for t, s in zip(texts, scenes, strict=True))
    assert any(d != world.full_desc(s) for d, s in zip(descs, scenes, strict=True))
    fits = positives_mask(descs, scenes)
    assert fits.diagonal().all() and fits.sum() > len(samples)  # partials fit other images too
    for smp, desc in zip(samples, descs, strict=True):
        wrong = world.negative_scene(rng, smp.scene, desc)
        assert not world.satisfies(desc, wrong)
        assert not world.satisfies(text_negative(rng, wrong, smp.scene, 1.0), smp.scene)
        twin = world.perturb(rng, smp.scene)
        text, d = caption_beside_twin(rng, smp, twin, 1.0)
        assert world.satisfies(text, smp.scene) and not world.satisfies(d, twin)
        full = world.captions(rng, twin, 1)[0]
        assert not world.satisfies(twin_text(rng, twin, full, smp.scene, 1.0), smp.scene)
    # ranked negatives skip images that fit, whatever rank is drawn
    generic = Desc(Part(scenes[0].a.shape))
    ranked = list(range(len(scenes)))
    picks = [ranked_negative(rng, ranked, generic, scenes) for _ in range(300)]
    assert all(p < 0 or not world.satisfies(generic, scenes[p]) for p in picks)
    deep = [p for p in picks if p >= 50]
    assert deep and len(deep) < len(picks)  # across the ranks, not only the top few


def test_cmr_positives_mask_ignores_other_matches() -> None:
    torch.manual_seed(0)
    sim = torch.randn(4, 4)
    mask = torch.eye(4, dtype=torch.bool)
    mask[0, 2] = True
    bumped = sim.clone()
    bumped[0, 2] = 50.0  # a second match scored high must not count against either side
    assert cmr_loss(bumped, positives=mask).item() == pytest.approx(
        cmr_loss(sim, positives=mask).item(), rel=1e-6
    )
    assert cmr_loss(bumped).item() > cmr_loss(sim).item()


def test_precision_by_hand() -> None:
    fit = np.array(
        [[True, False, True, False], [False, False, False, False], [False, True, False, False]]
    )
    ranked = np.array([[1, 0, 2, 3], [0, 1, 2, 3], [1, 0, 2, 3]])
    # query 0: miss then two fits, 2 fit in the pool; query 1: nothing fits, left out
    got = precision(ranked, fit)
    assert got["P@1"] == pytest.approx((0 + 1) / 2)
    assert got["P@10"] == pytest.approx((2 / 2 + 1 / 1) / 2)


def test_evaluate_partial_matches_brute_force(index_dir: Path, model: BuiltinModel) -> None:
    _, pool = load_pool(index_dir, model.fingerprint)
    queries = world.partial_queries(30, HELD_OUT_SEED_BASE + 73)
    res = evaluate_partial(pool, model, model, queries, candidates=40)
    assert res["queries"] == 30
    assert set(res["modes"]) == {"dot", "coop", f"ADD_{DEFAULT_FUSION_LAMBDA}"}
    fit = fit_matrix([d for _t, d in queries], [s for s in pool.scenes if s is not None])
    assert res["judged"] == int((fit.sum(axis=1) > 0).sum())
    qv = model.encode_texts([t for t, _d in queries])
    ranked = np.argsort(-(qv @ pool.image_vecs.T), axis=1, kind="stable")
    assert res["modes"]["dot"] == precision(ranked[:, :40], fit)
    # coop re-ranks all 40 images: its order is the cross-encoder's own over the whole pool
    logits = np.stack([model.score_pairs([t] * 40, pool.image_tokens) for t, _d in queries])
    assert res["modes"]["coop"]["P@1"] == pytest.approx(
        precision(np.argsort(-logits, axis=1, kind="stable"), fit)["P@1"], abs=1e-4
    )


def test_cli_partial(index_dir: Path) -> None:
    run = [
        sys.executable,
        "-m",
        "duet.cli",
        "eval",
        "--index",
        str(index_dir),
        "--modes",
        "dot,coop",
        "--candidates",
        "10",
    ]
    done = subprocess.run([*run, "--partial", "20"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "partial queries: 20" in done.stdout and "| coop |" in done.stdout
    bad = subprocess.run(
        [*run, "--partial", "5", "--partial-seed", "7"], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--partial-seed" in bad.stderr


def test_unknown_words() -> None:
    tok = WordTokenizer(world.vocabulary())
    assert tok.unknown_words("A red Circle next to the dog, the DOG!") == ["next", "dog"]
    assert tok.unknown_words("two small blue squares above a cross") == []
    assert unknown_words("a purple elephant") == ["elephant"]  # the shipped vocab.json


def test_and_is_read_as_with() -> None:
    """People join two things with "and", the grammar with "with": the tokenizer reads one as
    the other, so "and" is neither [UNK] nor reported, and the two queries are one to the
    model; a vocabulary without "with" (or a tokenizer without aliases) still reports it."""
    tok = WordTokenizer(world.vocabulary())
    assert "and" not in world.vocabulary()
    typed, written = "two green circles and a red diamond", "two green circles with a red diamond"
    assert tok.ids(typed) == tok.ids(written) and tok.stoi[UNK] not in tok.ids(typed)
    assert tok.unknown_words(typed) == [] and unknown_words(typed) == []
    assert WordTokenizer(world.vocabulary(), aliases={}).unknown_words(typed) == ["and"]
    no_with = [w for w in world.vocabulary() if w != "with"]
    assert WordTokenizer(no_with).unknown_words(typed) == ["and"]
    assert len(tok.itos) == len(WordTokenizer(world.vocabulary(), aliases={}).itos)
    # the reading (the cache's key) follows the ids: one reading exactly when one alias applies
    assert tok.reading(typed) == written
    assert WordTokenizer(no_with).reading(typed) == typed
    assert WordTokenizer([*world.vocabulary(), "and"]).reading(typed) == typed


def test_tune_fusion_averages_validation_splits(model: BuiltinModel) -> None:
    """`tune_fusion --seeds a,b` reports each figure as the mean of the splits' figures, and
    refuses a seed that is not a validation seed (the test split never chooses λ)."""
    from models.tune_fusion import sweep

    a, b = HELD_OUT_SEED_BASE - 1, HELD_OUT_SEED_BASE - 3
    one = [sweep(model, 30, 4, queries=30, seeds=(s,)) for s in (a, b)]
    both = sweep(model, 30, 4, queries=30, seeds=(a, b))
    assert one[0] != one[1]  # the splits differ, so the mean says something
    for key in ("ADD_0.5", "ce_only", "dot"):
        for m in ("t2i R@1", "i2t R@1", "P@1", "P@10"):
            assert both[key][m] == pytest.approx((one[0][key][m] + one[1][key][m]) / 2, abs=1e-3)
    with pytest.raises(ValueError, match="not a validation seed"):
        sweep(model, 12, 4, queries=20, seeds=(HELD_OUT_SEED_BASE + 2026,))
