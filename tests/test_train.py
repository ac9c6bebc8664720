"""`duet train` end to end at toy size: the three stages, `--from`, and the cross-encoder stage's
pieces (fusion tap, fresh cross-encoder, flipped twins)."""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import world
from models.builtin import WEIGHTS_FILE, BuiltinModel
from models.ce_negatives import perturbed_twin
from models.joint import CROSS_ENCODER, JointConfig, JointModel
from models.tokenizer import WordTokenizer
from models.train import load_encoders, train
from models.trainconfig import TrainConfig
from tests.conftest import CHILD_PYTHONPATH

REPO = Path(__file__).resolve().parents[1]
TINY = TrainConfig(
    images=48,
    steps=4,
    batch=8,
    warmup=1,
    easy_steps=2,
    ce_steps=3,
    ce_batch=8,
    han_steps=2,
    han_batch=4,
    tower_steps=2,  # stage 0's default 1,500 steps took most of this module's minutes
    val_images=24,  # validation's figures are not what these tests check
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    out = tmp_path_factory.mktemp("scratch")
    return out, train(TINY, out, progress=False)


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / WEIGHTS_FILE))


def test_train_from_scratch_writes_a_loadable_model(
    scratch: tuple[Path, dict[str, object]],
) -> None:
    out, summary = scratch
    for name in ("model.safetensors", "config.json", "vocab.json", "han.safetensors", "train.json"):
        assert (out / name).is_file(), name
    loaded = BuiltinModel.load(out)
    assert loaded.fingerprint == summary["fingerprint"]
    recorded = json.loads((out / "train.json").read_text())
    assert "--ce-steps 3" in recorded["command"] and "--from" not in recorded["command"]
    assert recorded["cross_encoder_seconds"] > 0
    assert set(recorded["validation"]) == {"dot", "ce_only", "rerank"}
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("model.safetensors", "han.safetensors", "config.json"):  # as umask says,
        # not safetensors' own 0600: the service's user must read what the trainer wrote
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_a_model_trained_over_another_leaves_no_head_of_the_other(
    scratch: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    """A new model (no HAN stage) written where a model with a head was: the old head read
    the old towers' features, so it goes rather than load beside the new weights."""
    src, _ = scratch
    out = tmp_path / "over"
    out.mkdir()
    for name in ("han.safetensors", "han.json"):
        (out / name).write_bytes((src / name).read_bytes())
    train(replace(TINY, han_steps=0, seed=3), out, progress=False)
    assert (out / "model.safetensors").is_file()
    assert not (out / "han.safetensors").exists() and not (out / "han.json").exists()


def test_from_keeps_the_encoders_and_retrains_the_cross_encoder(
    scratch: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    src, summary = scratch
    out = tmp_path / "again"
    again = train(TINY, out, progress=False, init_from=src)
    before, after = _weights(src), _weights(out)
    assert before.keys() == after.keys()
    kept = [k for k in before if not k.startswith(CROSS_ENCODER)]
    changed = [k for k in before if k.startswith(CROSS_ENCODER)]
    assert kept and changed
    for k in kept:  # the bi-encoder and the stored token states are exactly the source's
        assert torch.equal(before[k], after[k]), k
    assert not all(torch.equal(before[k], after[k]) for k in changed)
    assert again["fingerprint"] != summary["fingerprint"]
    assert f"--from {src}" in json.loads((out / "train.json").read_text())["command"]
    old, new = BuiltinModel.load(src), BuiltinModel.load(out)
    imgs = [s.image for s in world.generate(3, 1_000_123)]
    assert (old.encode_images(imgs)[1] == new.encode_images(imgs)[1]).all()


def test_ce_warm_fine_tunes_the_source_cross_encoder_and_keeps_its_han(
    scratch: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    src, _ = scratch
    still = replace(TINY, ce_lr=1e-12, han_steps=0)  # a step this small leaves the start visible
    warm = train(replace(still, ce_warm=True), tmp_path / "warm", progress=False, init_from=src)
    train(still, tmp_path / "cold", progress=False, init_from=src)
    before, w, c = _weights(src), _weights(tmp_path / "warm"), _weights(tmp_path / "cold")
    ce = [k for k in before if k.startswith(CROSS_ENCODER)]
    assert all(torch.allclose(before[k], w[k], atol=1e-6) for k in ce)
    assert not all(torch.allclose(before[k], c[k], atol=1e-6) for k in ce)  # afresh: reset
    assert "--ce-warm" in str(warm["command"])
    for d in ("warm", "cold"):  # HAN reads the kept towers' features: the source's head stays
        assert (tmp_path / d / "han.safetensors").read_bytes() == (
            src / "han.safetensors"
        ).read_bytes()


def test_ce_mine_mines_first_when_warm_else_halfway(
    scratch: tuple[Path, dict[str, object]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models.train_ce as train_ce
    from models.ce_mining import draw_batch, mine_negatives, own_logits

    src, _ = scratch
    calls: list[int] = []
    scored: list[torch.Tensor] = []
    batches: list[tuple[list[int], list[int]]] = []

    def counted(*args: Any, **kw: Any) -> torch.Tensor:  # the real mining, its calls counted
        mined = mine_negatives(*args, **kw)
        calls.append(int((mined >= 0).sum()))
        return mined

    def scoring(*args: Any, **kw: Any) -> torch.Tensor:
        # the tiny model's logits all sit near 0.3: centred, half its images are blind spots
        assert kw["parts"] is True  # --ce-hard-parts reaches the blind-spot test
        lows = own_logits(*args, **kw)
        scored.append(lows - lows.median())
        return scored[-1]

    def drawing(rng: Any, n: int, batch: int, hard: list[int], share: float) -> torch.Tensor:
        idx = draw_batch(rng, n, batch, hard, share)
        batches.append((idx.tolist(), hard))
        return idx

    monkeypatch.setattr(train_ce, "mine_negatives", counted)
    monkeypatch.setattr(train_ce, "own_logits", scoring)
    monkeypatch.setattr(train_ce, "draw_batch", drawing)
    mining = replace(TINY, ce_mine=10, ce_steps=4, han_steps=0)
    hard = replace(mining, ce_warm=True, ce_mine_index=20, ce_hard=0.5, ce_hard_parts=True)
    warm = train(hard, tmp_path / "w", progress=False, init_from=src)
    assert len(calls) == 1 and calls[0] > 0  # before step 0
    assert "--ce-mine 10" in str(warm["command"]) and "--ce-hard 0.5" in str(warm["command"])
    assert "--ce-hard-parts" in str(warm["command"])
    blind = (scored[0] < 0).nonzero()[:, 0].tolist()
    assert len(scored) == 1 and blind
    for idx, given in batches:  # every step draws half its batch among them
        assert given == blind and len(set(idx)) == len(idx)
        assert len(set(idx) & set(blind)) >= min(len(blind), TINY.ce_batch // 2)
    calls.clear()
    scored.clear()
    train(mining, tmp_path / "c", progress=False, init_from=src)
    assert len(calls) == 1  # afresh: at step 2, once its own ranking means something
    assert not scored  # no blind spots asked for


def test_load_encoders_takes_an_older_cross_encoder_shape(tmp_path: Path) -> None:
    """A model saved with two fusion layers and no fusion positions (duet before the
    cross-encoder stage) gives its encoders to a model of this version's shape."""
    tok = WordTokenizer(world.vocabulary())
    old = JointModel(JointConfig(vocab_size=tok.vocab_size, fusion_layers=2))
    state = {k: v.contiguous() for k, v in old.state_dict().items() if k != "fusion_pos"}
    save_file(state, str(tmp_path / WEIGHTS_FILE))
    (tmp_path / "config.json").write_text(json.dumps(old.cfg.to_json()))
    tok.save(tmp_path / "vocab.json")
    model, _ = load_encoders(tmp_path)
    assert len(model.fusion.layers) == JointConfig(vocab_size=1).fusion_layers
    assert torch.equal(model.image_tower.pos, old.image_tower.pos)
    assert torch.equal(model.text_proj.weight, old.text_proj.weight)


def test_load_encoders_refuses_another_shape(tmp_path: Path) -> None:
    tok = WordTokenizer(world.vocabulary())
    other = JointModel(JointConfig(vocab_size=tok.vocab_size, d_model=64, n_heads=4, embed_dim=64))
    save_file(
        {k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / WEIGHTS_FILE)
    )
    cfg = {**other.cfg.to_json(), "d_model": 128, "embed_dim": 128}  # config and weights disagree
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tok.save(tmp_path / "vocab.json")
    with pytest.raises(ValueError, match="not a duet model of this shape"):
        load_encoders(tmp_path)


def test_from_without_the_cross_encoder_stage_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="--ce-steps"):
        train(replace(TINY, ce_steps=0), tmp_path / "o", progress=False, init_from=tmp_path)


def test_hard_parts_without_hard_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--ce-hard SHARE"):
        train(replace(TINY, ce_hard_parts=True), tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()  # refused before any work


def test_han_only_run_keeps_every_model_byte_and_trains_a_new_head(
    scratch: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    # --from DIR --ce-warm --ce-steps 0: the same fingerprint (indexes stay valid), a new head
    src, summary = scratch
    out = tmp_path / "han"
    got = train(replace(TINY, ce_steps=0, ce_warm=True), out, progress=False, init_from=src)
    assert (out / WEIGHTS_FILE).read_bytes() == (src / WEIGHTS_FILE).read_bytes()
    assert got["fingerprint"] == summary["fingerprint"]
    assert (out / "han.safetensors").read_bytes() != (src / "han.safetensors").read_bytes()
    assert "--ce-steps 0" in str(got["command"]) and "--ce-warm" in str(got["command"])


def test_fused_tap_is_the_sequence_after_that_many_layers() -> None:
    torch.manual_seed(0)
    model = JointModel(JointConfig(vocab_size=20)).eval()
    txt, img = torch.randn(2, 5, 128), torch.randn(2, 16, 128)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        final, tapped0 = model.fused_tap(txt, pad, img, 0)
        assert torch.equal(final, model.fused(txt, pad, img))
        _, tapped2 = model.fused_tap(txt, pad, img, 2)
        x = tapped0
        mask = torch.cat(
            [torch.zeros(2, 1, dtype=torch.bool), pad, torch.zeros(2, 16, dtype=torch.bool)], dim=1
        )
        for layer in model.fusion.layers[:2]:
            x = layer(x, src_key_padding_mask=mask)
        assert torch.allclose(tapped2, x)
        assert not torch.allclose(tapped2, tapped0)
        moved = img.clone()
        moved[:, [0, 1]] = img[:, [1, 0]]  # two image states trade places: fusion can tell
        assert not torch.allclose(model.fused(txt, pad, moved)[:, 0], final[:, 0])


def test_reset_cross_encoder_touches_only_the_cross_encoder() -> None:
    torch.manual_seed(0)
    model = JointModel(JointConfig(vocab_size=20))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.reset_cross_encoder()
    after = model.state_dict()
    for k, v in before.items():
        same = torch.equal(v, after[k])
        if k.startswith(CROSS_ENCODER) and v.numel() > 1 and "norm" not in k and "bias" not in k:
            assert not same, k
        elif not k.startswith(CROSS_ENCODER):
            assert same, k


def test_perturbed_twin_flips_relations_at_the_asked_rate() -> None:
    rng = random.Random(3)
    scenes = [s.scene for s in world.generate(200, 1_000_321)]
    pairs = [s for s in scenes if s.relation is not None]
    assert all(
        perturbed_twin(rng, s, 1.0).relation == world.INVERSE[s.relation or ""] for s in pairs
    )
    assert all(perturbed_twin(rng, s, 1.0) != s for s in scenes)  # singles: world.perturb
    flipped = sum(perturbed_twin(rng, s, 0.0).relation != s.relation for s in pairs)
    assert flipped < len(pairs)  # flip=0 leaves it to world.perturb, which flips only some


def test_perturbed_twin_changes_counts_at_the_asked_rate() -> None:
    rng = random.Random(5)
    scenes = [world.sample_scene(rng) for _ in range(3000)]
    pairs = [s for s in scenes if s.b is not None]
    for s in pairs:
        twin = perturbed_twin(rng, s, 0.5, count=1.0)
        assert twin.a.count != s.a.count and twin == replace(s, a=replace(s.a, count=twin.a.count))
        assert twin.a.count < 3 or s.a.size == "small"  # three large things would not fit
        assert not world.satisfies(world.full_desc(s), twin)  # a true negative
    kinds = {(s.a.count, perturbed_twin(rng, s, 0.5, count=1.0).a.count) for s in pairs}
    assert {(1, 2), (1, 3), (2, 1), (3, 1), (2, 3), (3, 2)} <= kinds  # "a" against "two" too
    singles = [s for s in scenes if s.b is None]
    assert all(perturbed_twin(rng, s, 0.5, count=1.0).a.count == 1 for s in singles)
    recounted = sum(perturbed_twin(rng, s, 0.0, count=0.3).a.count != s.a.count for s in pairs)
    assert 0.2 * len(pairs) < recounted < 0.45 * len(pairs)
    groups = [s for s in scenes if world.recountable(s)]
    rare = sum(perturbed_twin(rng, s, 0.5).a.count != s.a.count for s in groups)
    assert rare < 0.1 * len(groups)  # world.perturb alone: one option of six, outside the swaps


def test_the_recorded_command_asks_for_the_same_config() -> None:
    from duet.cli import parser
    from duet.commands.train import config_of
    from models.train import _command

    cfg = replace(
        TrainConfig(),
        ce_warm=True,
        ce_steps=400,
        ce_lr=3e-4,
        ce_count=0.5,
        ce_typed=0.25,
        ce_mine=50,
        ce_mine_index=1_000,
        ce_hard=0.25,
        ce_hard_parts=True,
        ce_move=0.5,
        han_steps=0,
        seed=3,
        val_images=50,
    )
    argv = shlex.split(_command(cfg, Path("/tmp/out"), Path("models/weights")))
    assert argv[:2] == ["duet", "train"] and "--ce-count" in argv and "--ce-mine" in argv
    assert "--ce-mine-index" in argv and "--ce-move" in argv and "--ce-hard-parts" in argv
    assert "--ce-typed" in argv and "--val-images" in argv
    assert config_of(parser().parse_args(argv[1:])) == cfg
    tuned = replace(cfg, tune=True, lr=1e-4, warmup=10, easy_steps=0, aux_weight=0.25)
    argv = shlex.split(_command(tuned, Path("/tmp/out"), Path("models/weights")))
    assert config_of(parser().parse_args(argv[1:])) == tuned


def test_cli_from_needs_a_model_directory(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet.cli",
            "train",
            "--out",
            str(tmp_path / "o"),
            "--from",
            str(tmp_path / "nothing"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--from" in proc.stderr and "config.json" in proc.stderr
