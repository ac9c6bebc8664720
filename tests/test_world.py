"""The synthetic world: deterministic, varied, and specific enough that binding matters."""

from __future__ import annotations

import json
import random
from pathlib import Path

from models import world
from models.tokenizer import UNK, WordTokenizer
from models.world import Scene, Thing


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = world.write_corpus(tmp_path / "a", 12, seed=3, progress=False)
    b = world.write_corpus(tmp_path / "b", 12, seed=3, progress=False)
    c = world.write_corpus(tmp_path / "c", 12, seed=4, progress=False)
    assert a.read_bytes() == b.read_bytes()
    for png in sorted((tmp_path / "a" / "images").iterdir()):
        assert png.read_bytes() == (tmp_path / "b" / "images" / png.name).read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_manifest_lines_follow_the_contract(tmp_path: Path) -> None:
    manifest = world.write_corpus(tmp_path, 30, seed=1, n_captions=5, progress=False)
    lines = [json.loads(x) for x in manifest.read_text().splitlines()]
    assert len(lines) == 30
    for line in lines:
        assert set(line) == {"id", "image", "captions", "meta"}
        assert (tmp_path / line["image"]).is_file()
        assert len(set(line["captions"])) == 5  # all different


def test_scenes_cover_the_grammar() -> None:
    rng = random.Random(0)
    scenes = [world.sample_scene(rng) for _ in range(3000)]
    things = [t for s in scenes for t in (s.a, s.b) if t is not None]
    assert {t.shape for t in things} == set(world.SHAPES) and len(world.SHAPES) >= 4
    assert {t.colour for t in things} == set(world.COLOURS) and len(world.COLOURS) >= 6
    assert {t.size for t in things} == set(world.SIZES)
    assert {t.count for t in things} == {1, 2, 3}
    assert {s.relation for s in scenes if s.relation} == set(world.RELATIONS)
    assert {s.position for s in scenes if s.position} == set(world.POSITIONS)


def test_binding_swaps_change_the_caption_not_the_words() -> None:
    a = Scene(
        "pair",
        Thing("circle", "red", "small"),
        Thing("square", "blue", "small"),
        relation="left of",
    )
    b = Scene(
        "pair",
        Thing("circle", "blue", "small"),
        Thing("square", "red", "small"),
        relation="left of",
    )
    ca = world.captions(random.Random(5), a, 6)
    cb = world.captions(random.Random(5), b, 6)
    assert ca != cb
    assert sorted(ca[0].split()) == sorted(cb[0].split())  # same bag of words
    assert any(c.startswith("a small red circle") or "red circle" in c for c in ca)


def test_perturbed_scene_differs_in_one_detail() -> None:
    rng = random.Random(2)
    for _ in range(200):
        s = world.sample_scene(rng)
        p = world.perturb(rng, s)
        assert p != s


def test_vocabulary_covers_every_caption() -> None:
    tok = WordTokenizer(world.vocabulary())
    for sample in world.generate(300, seed=9, n_captions=6):
        for cap in sample.captions:
            assert tok.stoi[UNK] not in tok.ids(cap), cap


def test_relations_hold_in_pixels() -> None:
    """Rendered objects sit where the caption says (checked on the sampled placement)."""
    rng = random.Random(11)
    for _ in range(200):
        s = world.sample_scene(rng)
        placed = world.rendering._place(random.Random(rng.random()), s)
        if s.kind != "pair":
            continue
        bx, by = placed[0][1], placed[0][2]
        for _t, x, y, _r in placed[1:]:
            dx, dy = x - bx, y - by
            assert {"left of": dx < 0, "right of": dx > 0, "above": dy < 0, "below": dy > 0}[
                s.relation or ""
            ]


def test_grounding_names_each_nouns_thing() -> None:
    red_circle, blue_square = Thing("circle", "red", "small"), Thing("square", "blue", "large")
    scene = Scene("pair", red_circle, blue_square, relation="left of")
    # word order differs between templates; the words before each noun decide
    assert world.grounding("a small red circle left of a big blue square", scene) == [
        (3, "a"),
        (9, "b"),
    ]
    assert world.grounding("a large blue square with a tiny red circle to its left", scene) == [
        (3, "b"),
        (8, "a"),
    ]
    # only the colour tells two circles apart; a plural names the group
    twins = Scene(
        "pair",
        Thing("circle", "red", "small", 2),
        Thing("circle", "green", "small"),
        relation="above",
    )
    assert world.grounding("two small red circles above a small green circle", twins) == [
        (3, "a"),
        (8, "b"),
    ]
    single = Scene("single", red_circle, position="top")
    assert world.grounding("a small red circle at the top", single) == [(3, "a")]


def test_grounding_holds_on_generated_captions() -> None:
    """Every pair caption names both things once; the centres are inside the picture."""
    for s in world.generate(300, seed=21, n_captions=6):
        for cap in s.captions:
            named = world.grounding(cap, s.scene)
            want = ["a"] if s.scene.b is None else ["a", "b"]
            assert sorted(w for _, w in named) == want, cap
            for which in want:
                thing = s.scene.a if which == "a" else s.scene.b
                assert thing is not None
                x, y = world.centre(s.layout, thing)
                assert 0 < x < 1 and 0 < y < 1
