"""A build warns when the model reads little of a corpus's captions (a QA's everyday captions
were built without a word, every caption encoded alike, each search in their words then
refused), and stays quiet on the captions the model was made for."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

from PIL import Image

from index_builder.corpus import CorpusItem
from index_builder.vocabulary import unread_words
from models import world
from models.builtin import BuiltinModel
from tests.conftest import CHILD_PYTHONPATH, DUET

EVERYDAY = [
    "a dog sleeping on a sofa",
    "two children playing football in a park",
    "a man riding a bicycle down the street",
    "a bowl of soup on a wooden table",
]


def _items(captions: list[str]) -> list[CorpusItem]:
    return [CorpusItem(i, f"i{i}", None, None, [c]) for i, c in enumerate(captions)]


def test_the_demo_worlds_captions_pass_without_a_word(model: BuiltinModel) -> None:
    rng = random.Random(5)
    said = [c for _ in range(300) for c in world.captions(rng, world.sample_scene(rng), 5)]
    assert unread_words(_items(said), model) is None


def test_everyday_captions_are_told_with_their_unknown_words(model: BuiltinModel) -> None:
    said = unread_words(_items(EVERYDAY * 10), model) or ""
    assert said.startswith("the model cannot read all of these captions: in the captions,")
    assert "dog (10)" in said and "75% of the captions have no word it reads" in said
    assert "CLIP or SigLIP checkpoint (--encoder, docs/models.md)" in said


def test_a_few_unknown_words_in_a_large_corpus_are_no_warning(model: BuiltinModel) -> None:
    rng = random.Random(6)
    said = [c for _ in range(400) for c in world.captions(rng, world.sample_scene(rng), 5)]
    said[::100] = [c + " at dusk" for c in said[::100]]  # a word or two it does not know
    assert unread_words(_items(said), model) is None


def test_a_model_that_cannot_tell_is_not_asked() -> None:
    assert unread_words(_items(EVERYDAY), object()) is None


def test_duet_build_says_it_at_the_end_too(tmp_path: Path) -> None:
    corpus = tmp_path / "photos"
    corpus.mkdir()
    with (corpus / "m.jsonl").open("w") as f:
        for i, caption in enumerate(EVERYDAY * 3):
            Image.new("RGB", (48, 32), (20 * i, 90, 60)).save(corpus / f"{i}.jpg")
            f.write(json.dumps({"id": f"p{i}", "image": f"{i}.jpg", "captions": [caption]}))
            f.write("\n")
    proc = subprocess.run(
        [*DUET, "build", "--corpus", str(corpus / "m.jsonl"), "--out", str(tmp_path / "idx")],
        env={**os.environ, "PYTHONPATH": CHILD_PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "WARNING duet.build: the model cannot read all of these captions" in proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("warning: the model cannot read all") and "sofa (3)" in last


def test_a_large_corpus_is_sampled_and_says_so(model: BuiltinModel, monkeypatch: Any) -> None:
    from index_builder import vocabulary

    monkeypatch.setattr(vocabulary, "SAMPLE", 7)
    said = unread_words(_items(EVERYDAY * 10), model) or ""  # 40 captions: every 6th, 7 read
    assert "in 7 of the 40 captions," in said, said
