"""An image query's candidate captions: their text states kept between requests
(`models.caption_states`) give the logits a fresh batch gives, and only new captions go
through the text tower."""

from __future__ import annotations

import gc
import io
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models import world
from models.builtin import BuiltinModel
from models.caption_states import CaptionStates
from models.loading import load_models
from models.rerankers import Pairs, menu
from tests.conftest import start_service, stop_service


def _captions(n: int, seed: int = 5) -> list[str]:
    rng = random.Random(seed)
    seen: dict[str, None] = {}
    while len(seen) < n:
        for c in world.captions(rng, world.sample_scene(rng), 5):
            seen.setdefault(c, None)
    return list(seen)[:n]


def _tokens(model: BuiltinModel, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *model.token_shape)).astype(np.float16)


@pytest.fixture
def fresh(model: BuiltinModel) -> BuiltinModel:
    """The session's model with nothing kept (other tests may have kept captions)."""
    model.caption_states = CaptionStates(model._tower)
    return model


def test_kept_states_give_the_fresh_batches_logits(fresh: BuiltinModel) -> None:
    pool = _captions(120)
    rng = random.Random(1)
    states = fresh.caption_states
    distinct = 0
    for round_ in range(6):
        # 50 candidates, some asked twice, in another order and company each time
        texts = rng.sample(pool, 45) + rng.sample(pool[:20], 5)
        img = _tokens(fresh, len(texts), seed=round_)
        before = states.computed
        kept = fresh.score_captions(texts, img)
        distinct += len(set(texts))
        plain = fresh.score_pairs(texts, img)
        assert kept.shape == plain.shape == (len(texts),)
        np.testing.assert_allclose(kept, plain, rtol=0, atol=1e-6)
        if round_ == 0:
            assert states.computed - before == len(set(texts))  # every one through the tower
    # by now most candidates were kept: the tower saw each caption about once
    assert len(pool) * 0.5 < states.computed <= len(pool)
    assert states.kept + states.computed == distinct  # each distinct caption counted once
    asked = rng.sample(pool, 50)
    fresh.score_captions(asked, _tokens(fresh, 50))
    again = states.computed
    fresh.score_captions(asked, _tokens(fresh, 50))
    assert states.computed == again  # all kept: nothing recomputed


def test_the_byte_budget_evicts_the_least_recently_used(model: BuiltinModel) -> None:
    pool = _captions(40)
    sizes = {}
    probe = CaptionStates(model._tower)
    with torch.inference_mode():
        for t in pool:
            s, real = probe.states([t])
            sizes[t] = int(real.sum()) * s.shape[-1] * s.element_size()
    budget = sum(sizes[t] for t in pool[:10])
    states = CaptionStates(model._tower, budget=budget)
    with torch.inference_mode():
        states.states(pool[:10])
        assert len(states) == 10 and states.bytes == budget
        # kept as arrays Python's collector does not walk (a tensor it would)
        assert not any(gc.is_tracked(v) for v in states._kept.values())
        states.states(pool[:1])  # pool[0] used again: pool[1] is now the oldest
        states.states(pool[10:11])
        assert states.bytes <= budget
        computed = states.computed
        states.states(pool[:1])
        assert states.computed == computed  # still kept
        states.states(pool[1:2])
        assert states.computed == computed + 1  # evicted, so computed again
        # padded with zeros past each caption's own length, True only at real positions
        padded, real = states.states(pool[:3])
    for i, t in enumerate(pool[:3]):
        n = int(real[i].sum())
        assert n * padded.shape[-1] * padded.element_size() == sizes[t]
        assert not real[i, n:].any() and bool((padded[i, n:] == 0).all())


def test_concurrent_callers_get_their_own_captions_states(model: BuiltinModel) -> None:
    pool = _captions(60, seed=9)
    states = CaptionStates(model._tower)
    with torch.inference_mode():
        want = {t: model._tower([t])[0][0, : int(model._tower([t])[1].sum())] for t in pool}
    errors: list[BaseException] = []

    def ask(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with torch.inference_mode():
                for _ in range(15):
                    texts = rng.sample(pool, 20)
                    padded, real = states.states(texts)
                    for i, t in enumerate(texts):
                        got = padded[i, : int(real[i].sum())]
                        torch.testing.assert_close(got, want[t], rtol=0, atol=1e-6)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(states) == len(pool)


def test_the_ce_reranker_keeps_an_image_querys_captions_only(fresh: BuiltinModel) -> None:
    score = menu(fresh).scorers["ce"]
    texts = _captions(50, seed=11)
    img = _tokens(fresh, 50)
    dots = np.zeros(50, np.float32)
    image_query = score(Pairs(texts, img, dots, text_query=False))
    assert fresh.caption_states.computed == 50
    # a text query's sentence is not one of the index's captions: not kept
    text_query = score(Pairs(["a red circle"] * 50, img, dots, text_query=True))
    assert fresh.caption_states.computed == 50 and len(fresh.caption_states) == 50
    plain = fresh.score_pairs(texts, img)
    np.testing.assert_allclose(image_query, 1 / (1 + np.exp(-plain)), rtol=0, atol=1e-6)
    assert text_query.shape == (50,)


def test_the_services_models_keep_them_through_the_builtin_cross_encoder() -> None:
    models = load_models(reranker="ce")
    cross = models.cross
    assert isinstance(cross, BuiltinModel)
    texts = _captions(30, seed=13)
    img = _tokens(cross, 30)
    kept = models.score_captions(texts, img)
    np.testing.assert_allclose(kept, models.score_pairs(texts, img), rtol=0, atol=1e-6)
    assert cross.caption_states.computed == 30


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == (f"{name}{{{want}}}" if want else name):
            return float(value)
    raise AssertionError(f"metric {name}{{{want}}} not exported")


def test_a_served_image_querys_captions_are_kept_for_the_next(
    index_dir: Path, corpus: Path, tmp_path: Path
) -> None:
    """Through `duet serve` over a socket: the second upload of one picture (other bytes, so
    not the response cache's) re-ranks its candidates from their kept text states, with the
    same scores, and /metrics says so."""
    pic = Image.open(corpus.parent / "images" / "0005.png").convert("RGB")
    uploads = []
    for level in (1, 9):  # two PNG encodings of one picture
        buf = io.BytesIO()
        pic.save(buf, "PNG", compress_level=level)
        uploads.append(buf.getvalue())
    assert uploads[0] != uploads[1]
    answers, seen = [], []
    service = start_service(index_dir, tmp_path / "serve.log")
    try:
        with service.client() as c:
            for data in uploads:
                files = {"image": ("q.png", data, "image/png")}
                r = c.post("/search/image", files=files, data={"top_k": "10"})
                assert r.status_code == 200, r.text
                assert r.json()["cached"] is False
                answers.append(r.json()["hits"])
                text = c.get("/metrics").text
                seen.append(
                    (
                        _metric(text, "duet_caption_states_total", result="kept"),
                        _metric(text, "duet_caption_states_total", result="computed"),
                    )
                )
    finally:
        stop_service(service)
    assert _metric(text, "duet_caption_states_bytes") > 0
    (kept0, computed0), (kept1, computed1) = seen
    assert kept0 == 0 and 0 < computed0 <= 50  # the first: every distinct candidate computed
    assert computed1 == computed0  # the second: nothing through the text tower
    assert kept1 == computed0
    assert [(h["id"], h["score"]) for h in answers[0]] == [
        (h["id"], h["score"]) for h in answers[1]
    ]
