"""Stage 2's mined negatives (models.ce_mining) and the depth report (models.ce_depth), on the
shipped model and small held-out worlds."""

from __future__ import annotations

import random

import pytest
import torch

from models import world
from models.builtin import BuiltinModel
from models.ce_depth import depth_report, depth_split
from models.ce_mining import draw_batch, mine_negatives, one_thing_captions, own_logits
from models.ce_negatives import CePool, ce_pairs, ce_pool
from models.trainconfig import HELD_OUT_SEED_BASE


@pytest.fixture(scope="module")
def pool_and_model() -> tuple[CePool, BuiltinModel, list[world.Sample]]:
    model = BuiltinModel.load()
    samples = list(world.generate(60, HELD_OUT_SEED_BASE + 70_000))
    pool = ce_pool(model.model, model.tokenizer, samples, 0.5, random.Random(0), False, 20)
    return pool, model, samples


def test_mined_negatives_are_the_cross_encoders_top_wrong_candidates(
    pool_and_model: tuple[CePool, BuiltinModel, list[world.Sample]],
) -> None:
    pool, model, samples = pool_and_model
    jm, tok = model.model, model.tokenizer
    mined = mine_negatives(jm, tok, pool, depth=10, rng=random.Random(5), progress=False, keep=3)
    drawn = random.Random(5)
    texts = [drawn.choice(s.captions) for s in samples]  # the captions mining used
    assert mined.shape == (60, 3)
    with torch.no_grad():
        ids, pad = tok.batch(texts)
        txt = jm.text_tokens(ids, pad)
        sims = jm.embed_texts(txt, pad) @ pool.vecs.t()
        for i, s in enumerate(samples):
            sims[i, i] = float("-inf")
            top = sims[i].topk(10).indices.tolist()
            wrong = [
                j for j in top if not world.satisfies(world.full_desc(s.scene), samples[j].scene)
            ]
            logits = jm.itm_logits(
                txt[[i] * len(wrong)], pad[[i] * len(wrong)], pool.states[wrong].float()
            )
            want = [wrong[k] for k in logits.argsort(descending=True)[:3].tolist()]
            got = [j for j in mined[i].tolist() if j >= 0]
            assert got == want, i  # the training forward agrees with the runtime mining used
            assert all(j != i for j in got)


def test_mining_from_a_drawn_index_reaches_past_the_whole_pools_top(
    pool_and_model: tuple[CePool, BuiltinModel, list[world.Sample]],
) -> None:
    pool, model, samples = pool_and_model
    jm, tok = model.model, model.tokenizer

    def mine(index: int) -> list[list[int]]:
        got = mine_negatives(jm, tok, pool, 3, random.Random(5), False, keep=3, index=index)
        return [[j for j in row if j >= 0] for row in got.tolist()]

    whole, drawn = mine(0), mine(12)
    assert mine(60) == whole  # a draw as large as the pool is the pool, with the same captions
    chose = random.Random(5)
    texts = [chose.choice(s.captions) for s in samples]  # the captions mining used
    with torch.no_grad():
        ids, pad = tok.batch(texts)
        sims = jm.embed_texts(jm.text_tokens(ids, pad), pad) @ pool.vecs.t()
    sims.fill_diagonal_(float("-inf"))
    order = sims.argsort(dim=1, descending=True).tolist()
    deepest = {name: 0 for name in ("whole", "drawn")}
    for name, lists in (("whole", whole), ("drawn", drawn)):
        for i, row in enumerate(lists):
            desc = world.full_desc(samples[i].scene)
            assert all(j != i and not world.satisfies(desc, samples[j].scene) for j in row)
            deepest[name] = max([deepest[name], *(order[i].index(j) for j in row)])
    assert deepest["whole"] < 3  # the top 3 of all 60 images
    assert deepest["drawn"] >= 6  # the top 3 of ~12 drawn: the band a small index reaches
    assert sum(map(len, drawn)) >= 150  # most captions still find 3 wrong images in their draw


def test_own_logits_are_each_images_lowest_over_its_captions(
    pool_and_model: tuple[CePool, BuiltinModel, list[world.Sample]],
) -> None:
    pool, model, samples = pool_and_model
    jm, tok = model.model, model.tokenizer
    lows = own_logits(jm, tok, pool, progress=False, chunk=7)  # chunks across images' captions
    with torch.no_grad():
        for i in (0, 13, 59):
            ids, pad = tok.batch(samples[i].captions)
            txt = jm.text_tokens(ids, pad)
            want = jm.itm_logits(txt, pad, pool.states[[i] * len(ids)].float()).min()
            assert torch.isclose(lows[i], want, atol=1e-4), i
    assert lows.shape == (60,) and (lows > 0).float().mean() > 0.8  # the shipped model sees most


def test_one_thing_captions_fit_their_scene_and_join_the_blind_spot_test(
    pool_and_model: tuple[CePool, BuiltinModel, list[world.Sample]],
) -> None:
    pool, model, samples = pool_and_model
    parts = one_thing_captions(samples)
    pairs = [i for i, s in enumerate(samples) if s.scene.b is not None]
    assert [i for i, _ in parts] == [i for i in pairs for _ in range(2)]  # each of two things
    for i, text in parts:
        assert world.satisfies(text, samples[i].scene), text  # a positive, never a negative
        desc = world.parse(text)
        assert desc is not None and desc.b is None, text  # names one thing only
    assert one_thing_captions(samples) == parts  # the same wording every run
    jm, tok = model.model, model.tokenizer
    full = own_logits(jm, tok, pool, progress=False)
    both = own_logits(jm, tok, pool, progress=False, chunk=11, parts=True)
    single = [i for i, s in enumerate(samples) if s.scene.b is None]
    # nothing more to read in a one-thing scene
    assert torch.allclose(both[single], full[single], atol=1e-4)
    i = parts[0][0]
    with torch.no_grad():
        ids, pad = tok.batch([text for j, text in parts if j == i])  # its two things
        ones = jm.itm_logits(jm.text_tokens(ids, pad), pad, pool.states[[i, i]].float())
    assert torch.isclose(both[i], torch.minimum(full[i], ones.min()), atol=1e-4)
    assert bool((both <= full + 1e-4).all())  # a minimum over more captions


def test_draw_batch_takes_its_share_of_hard_images_else_the_plain_draw() -> None:
    plain = draw_batch(random.Random(3), 100, 10, [], 0.5)
    assert plain.tolist() == random.Random(3).sample(range(100), 10)
    assert draw_batch(random.Random(3), 100, 10, [1, 2], 0.0).tolist() == plain.tolist()
    hard = [5, 50, 95]
    for seed in range(20):
        idx = draw_batch(random.Random(seed), 100, 10, hard, 0.5).tolist()
        assert len(set(idx)) == 10 and set(hard) <= set(idx) and all(0 <= i < 100 for i in idx)
    many = list(range(40))
    idx = draw_batch(random.Random(1), 100, 10, many, 0.5).tolist()
    assert len(set(idx[:5]) & set(many)) == 5  # half the batch from the hard ones
    assert len(draw_batch(random.Random(1), 100, 10, many, 2.0)) == 10  # never more than asked


def test_mined_negatives_join_the_captions_lists(
    pool_and_model: tuple[CePool, BuiltinModel, list[world.Sample]],
) -> None:
    pool, model, samples = pool_and_model
    plain = ce_pairs(model.model, model.tokenizer, pool, torch.arange(8), random.Random(1), 20, 0.5)
    pool.mined = mine_negatives(model.model, model.tokenizer, pool, 10, random.Random(5), False)
    pool_mined = pool.mined
    try:
        idx = torch.arange(8, 16)
        pairs = ce_pairs(model.model, model.tokenizer, pool, idx, random.Random(1), 20, 0.5)
    finally:
        pool.mined = None
    assert plain.lists[0].shape[1] == 5 and pairs.lists[0].shape[1] == 6
    column = pairs.lists[0][:, 5]
    assert (column >= 0).sum() >= 4  # most captions have a wrong image the CE likes
    mined = pool_mined[idx].tolist()
    for r, at in enumerate(column.tolist()):
        if at < 0:
            continue
        # the pair at that logit reads row r's caption and one of its image's mined images,
        # which that caption (full or partial) does not fit
        assert pairs.t_idx[at] == r
        shown = [
            j for j in mined[r] if j >= 0 and torch.equal(pairs.img[at], pool.states[j].float())
        ]
        desc = world.parse(pairs.texts[r])
        assert shown and desc is not None
        assert not world.satisfies(desc, samples[shown[0]].scene)


def test_depth_report_counts_agree(model: BuiltinModel) -> None:
    samples = list(world.generate(40, HELD_OUT_SEED_BASE - 1))
    split = depth_split(model, samples, depths=(1, 3, 10))
    dot = (
        model.encode_texts([c for s in samples for c in s.captions])
        @ model.encode_images([s.image for s in samples])[0].T
    ).argmax(axis=1)
    owner = [i for i, s in enumerate(samples) for _c in s.captions]
    # at depth 1 the cross-encoder has one candidate: the dot product's first
    assert split["t2i"]["R@1"][1] == round(100 * float((dot == owner).mean()), 2)
    for name, r in split.items():
        moved = (r["R@1"][10] - r["R@1"][1]) * r["queries"] / 100
        assert round(moved) == len(r["won"]) - len(r["lost"]), name
        assert all(isinstance(row["fits"], bool) for row in r["lost"] + r["won"])
    with pytest.raises(ValueError, match="test split"):
        depth_report(model, [HELD_OUT_SEED_BASE + 2026], 10)


@pytest.mark.parametrize("tool", ["models.ce_depth", "models.tune_fusion"])
def test_validation_tools_take_a_device(
    tool: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--device` picks where the model runs (the GPU rounds of models/weights/README.md);
    cuda on a machine without one is refused with what to do, a made-up device by argparse."""
    import importlib

    from models.device import DeviceError

    main = importlib.import_module(tool).main
    args = [tool, "--images", "12", "--seeds", str(HELD_OUT_SEED_BASE - 1)]
    monkeypatch.setattr("sys.argv", [*args, "--device", "gpu"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    monkeypatch.setattr("sys.argv", [*args, "--device", "cuda"])
    if torch.cuda.is_available():
        main()  # on a GPU host: the GPU runs it
    else:
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            main()
    capsys.readouterr()
    monkeypatch.setattr("sys.argv", [*args, "--device", "cpu"])
    main()
    out = capsys.readouterr().out
    assert "| t2i | 60 |" in out if tool.endswith("depth") else '"mode": "ce_only"' in out
