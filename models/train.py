"""`duet train`: the joint model on the synthetic world (JOINT+COOP), its cross-encoder, HAN.

Training captions are, with probability `partial`, partial descriptions (`world.partial_desc`:
the size, a count, the second thing or the relation left out), and no image that fits a caption
is ever its negative: the in-batch losses take a positives mask (`world.satisfies` over the
batch), perturbed negatives break something the caption says (`world.negative_scene`).

Stage 1 alternates optimiser steps between the model's two roles:

* bi-encoder steps: CMR in-batch contrastive loss (plus a perturbed caption per image as
  an extra image->text negative), and TGDT's CMC on S_gl = (S_g + S_l) / 2 so late
  interaction is trained;
* cross-encoder steps: BCE, plus grounding (each shape noun's fused state regresses the
  centre of the thing it names). For the first `easy_steps` the negatives are a random wrong
  image and caption per pair: trained from scratch on hard negatives only, the
  cross-encoder sits on the ln 2 plateau for hundreds of steps. After that: a random
  wrong pairing, the in-batch hardest wrong image under the current bi-encoder, a
  perturbed caption and the perturbed scene rendered as an image (mostly binding
  changes: relation flipped, two objects' colours or shapes swapped), and the
  cross-encoder gets two steps in three.

Every step also trains a patch probe on the image states (what is centred where). The probe
and the grounding head are training-only. Stage 2 (`models.train_ce`) trains the cross-encoder
afresh, for many more steps, on the frozen states; stage 3 (`models.train_han`) the HAN head.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from models import world
from models.builtin import WEIGHTS_FILE, BuiltinModel, save_model
from models.device import resolve_device
from models.evaluate import evaluate, format_table, partial_precision
from models.han import HAN_CONFIG, HAN_WEIGHTS, save_han
from models.joint import CROSS_ENCODER, JointConfig, JointModel
from models.tokenizer import WordTokenizer
from models.train_ce import train_cross_encoder
from models.train_han import train_han
from models.train_joint import train_joint
from models.trainconfig import HELD_OUT_SEED_BASE, VAL_IMAGES, TrainConfig

log = logging.getLogger("duet.train")


def train(
    cfg: TrainConfig, out: Path, progress: bool = True, init_from: Path | None = None
) -> dict[str, object]:
    """Train, save into `out`, return a summary (also written as train.json).

    From scratch by default. With `init_from` (a trained model directory) stage 1 is skipped:
    its towers, shared transformer and projections are kept as they are, so indexes built
    with them keep their vectors and token states, and stages 2 and 3 train on top. With
    `init_from` and `cfg.tune`, stage 1 instead continues from that model's weights for
    `cfg.steps` steps (new captions for the encoders without a run from scratch).

    Stages 0 to 2 run on `cfg.device`; stage 3, saving and validation on the CPU (validation's
    figures then compare with a CPU run's). Every random draw is the CPU's, as on a CPU run.
    """
    _check(cfg, init_from)
    device = _device(cfg)  # before the rendering: cuda without a GPU fails fast
    torch.manual_seed(cfg.seed)  # seeds CUDA too
    torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed + 1)
    t0 = time.perf_counter()
    samples = _render(cfg, progress)
    model, tok = _encoders(cfg, samples, rng, progress, init_from, device)
    joint_seconds = time.perf_counter() - t0
    if cfg.ce_steps > 0:
        _cross_encoder_stage(cfg, model, tok, samples, rng, progress, device)
    ce_seconds = time.perf_counter() - t0 - joint_seconds
    model.cpu()  # stage 3 (models.train_han) and saving run on the CPU
    han = None
    if cfg.han_steps > 0:
        han = train_han(
            model,
            tok,
            samples,
            cfg.han_steps,
            cfg.han_batch,
            cfg.han_lr,
            cfg.han_p,
            cfg.han_margin,
            rng,
            progress,
        )
    train_seconds = time.perf_counter() - t0
    _save(model, tok, han, out, cfg, init_from)
    runtime = BuiltinModel.load(out)
    metrics, partial = validate_model(runtime, cfg.val_images)
    summary: dict[str, object] = {
        "command": _command(cfg, out, init_from),
        "config": cfg.__dict__,
        "train_seconds": round(train_seconds, 1),
        "joint_seconds": round(joint_seconds, 1),
        "cross_encoder_seconds": round(ce_seconds, 1),
        "torch": torch.__version__,
        "device": _device_name(device),
        "fingerprint": runtime.fingerprint,
        "validation": metrics,
        "validation_partial": partial,
    }
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _device(cfg: TrainConfig) -> torch.device:
    """`cfg.device` resolved (`models.device.resolve_device`), and logged."""
    device = resolve_device(cfg.device)
    log.info("training on %s", _device_name(device))
    return device


def _device_name(device: torch.device) -> str:
    """cpu, or cuda with the GPU's name (what train.json records)."""
    if device.type != "cuda":
        return device.type
    return f"cuda ({torch.cuda.get_device_name(device)})"


def _cross_encoder_stage(
    cfg: TrainConfig,
    model: JointModel,
    tok: WordTokenizer,
    samples: list[world.Sample],
    rng: random.Random,
    progress: bool,
    device: torch.device,
) -> None:
    """Stage 2 (`models.train_ce`) with `cfg`'s options."""
    train_cross_encoder(
        model,
        tok,
        samples,
        cfg.ce_steps,
        cfg.ce_batch,
        cfg.ce_lr,
        cfg.ce_flip,
        cfg.ce_ranks,
        cfg.ground_weight,
        cfg.ground_layer,
        rng,
        progress,
        partial=cfg.partial,
        reset=not cfg.ce_warm,
        count=cfg.ce_count,
        mine=cfg.ce_mine,
        mine_index=cfg.ce_mine_index,
        hard=cfg.ce_hard,
        move=cfg.ce_move,
        hard_parts=cfg.ce_hard_parts,
        device=device,
        typed=cfg.ce_typed,
    )


def _check(cfg: TrainConfig, init_from: Path | None) -> None:
    if cfg.seed >= HELD_OUT_SEED_BASE:
        raise ValueError(f"training seeds must be below {HELD_OUT_SEED_BASE} (held out for tests)")
    if init_from is not None and not cfg.tune and cfg.ce_steps <= 0 and not cfg.ce_warm:
        raise ValueError(
            "--from keeps only the encoders, so the cross-encoder stage must run "
            "(--ce-steps > 0), or keep DIR's cross-encoder as it is with --ce-warm --ce-steps 0 "
            "(a HAN-only run)"
        )
    if cfg.tune and init_from is None:
        raise ValueError("--tune continues a trained model: give --from")
    if cfg.ce_hard_parts and cfg.ce_hard <= 0:
        raise ValueError(
            "--ce-hard-parts widens the blind spots --ce-hard draws from: give --ce-hard SHARE "
            "too (e.g. --ce-hard 0.25)"
        )


def _render(cfg: TrainConfig, progress: bool) -> list[world.Sample]:
    from models.bars import tqdm

    return list(
        tqdm(
            world.generate(cfg.images, cfg.seed, n_captions=6),
            total=cfg.images,
            desc="rendering",
            unit="img",
            disable=not progress,
        )
    )


def _encoders(
    cfg: TrainConfig,
    samples: list[world.Sample],
    rng: random.Random,
    progress: bool,
    init_from: Path | None,
    device: torch.device,
) -> tuple[JointModel, WordTokenizer]:
    """Stages 0 and 1 from scratch, stage 1 continued (`tune`), or `init_from`'s encoders
    (on the CPU: stage 2 moves them to `device`)."""
    if init_from is None:
        tok = WordTokenizer(world.vocabulary())
        return train_joint(cfg, samples, tok, rng, progress, device=device), tok
    if cfg.tune:
        model, tok = load_encoders(init_from, keep_cross_encoder=True)
        return train_joint(cfg, samples, tok, rng, progress, start=model, device=device), tok
    return load_encoders(init_from, keep_cross_encoder=cfg.ce_warm)


def _save(
    model: JointModel,
    tok: WordTokenizer,
    han: Any,
    out: Path,
    cfg: TrainConfig,
    init_from: Path | None,
) -> None:
    save_model(model, tok, out)
    # the HAN head reads the towers' features, which --from keeps bit for bit (not --tune)
    kept = init_from is not None and not cfg.tune and (init_from / HAN_WEIGHTS).is_file()
    if han is not None:
        save_han(han, out)
    elif kept and init_from != out:
        assert init_from is not None
        for name in (HAN_WEIGHTS, HAN_CONFIG):
            shutil.copyfile(init_from / name, out / name)
    elif not kept:
        # a head an earlier run left in `out` read other towers' features: `--reranker han`
        # would load it beside these weights and score with it, wrongly, without a word
        for name in (HAN_WEIGHTS, HAN_CONFIG):
            (out / name).unlink(missing_ok=True)


def validate_model(
    runtime: BuiltinModel, images: int = VAL_IMAGES
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full-caption recalls (`images` validation images, top 20) and partial-query precision."""
    val = list(world.generate(images, HELD_OUT_SEED_BASE - 1, n_captions=5))
    metrics = evaluate(runtime, [s.image for s in val], [s.captions for s in val], candidates=20)
    log.info(
        "validation (%d images, seed %d):\n%s",
        images,
        HELD_OUT_SEED_BASE - 1,
        format_table(metrics),
    )
    # partial queries from a validation seed (never a test one) over the same images
    partial = partial_precision(
        runtime,
        [s.image for s in val],
        [s.scene for s in val],
        world.partial_queries(images, HELD_OUT_SEED_BASE - 2),
        candidates=50,
    )
    log.info(
        "validation partial queries (%d, seed %d, top 50): %s",
        images,
        HELD_OUT_SEED_BASE - 2,
        partial,
    )
    return metrics, partial


def _command(cfg: TrainConfig, out: Path, init_from: Path | None) -> str:
    """The `duet train` command line that reproduces this run."""
    command = (
        f"duet train --out {out} --seed {cfg.seed} --images {cfg.images} "
        f"--tower-steps {cfg.tower_steps} --steps {cfg.steps} --batch {cfg.batch} "
        f"--ce-steps {cfg.ce_steps} "
        f"--han-steps {cfg.han_steps} --ce-lr {cfg.ce_lr} --ce-count {cfg.ce_count}"
        + (f" --ce-mine {cfg.ce_mine}" if cfg.ce_mine else "")
        + (f" --ce-mine-index {cfg.ce_mine_index}" if cfg.ce_mine_index else "")
        + (f" --ce-hard {cfg.ce_hard}" if cfg.ce_hard else "")
        + (" --ce-hard-parts" if cfg.ce_hard_parts else "")
        + (f" --ce-move {cfg.ce_move}" if cfg.ce_move else "")
        + (f" --ce-typed {cfg.ce_typed}" if cfg.ce_typed else "")
        + (f" --val-images {cfg.val_images}" if cfg.val_images != VAL_IMAGES else "")
        + (" --ce-warm" if cfg.ce_warm else "")
        + (f" --device {cfg.device}" if cfg.device != "auto" else "")
        + (
            f" --tune --lr {cfg.lr} --warmup {cfg.warmup} --easy-steps {cfg.easy_steps}"
            f" --aux-weight {cfg.aux_weight}"
            if cfg.tune
            else ""
        )
    )
    return command + (f" --from {init_from}" if init_from is not None else "")


def load_encoders(
    directory: Path,
    keep_cross_encoder: bool = False,
) -> tuple[JointModel, WordTokenizer]:
    """A trained model's towers, shared transformer and projections, with a fresh cross-encoder
    of this version's shape (the one in `directory` may have another), or with `directory`'s
    own cross-encoder when `keep_cross_encoder` (it must then have this version's shape)."""
    saved = json.loads((directory / "config.json").read_text())
    saved.pop("fusion_layers", None)
    model = JointModel(JointConfig(**saved))
    tok = WordTokenizer.load(directory / "vocab.json")
    state = {
        k: v
        for k, v in load_file(str(directory / WEIGHTS_FILE)).items()
        if keep_cross_encoder or not k.startswith(CROSS_ENCODER)
    }
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        raise ValueError(f"{directory} is not a duet model of this shape: {exc}") from exc
    left = [k for k in missing if keep_cross_encoder or not k.startswith(CROSS_ENCODER)]
    if left or unexpected:
        raise ValueError(
            f"{directory} is not a duet model of this shape: missing {left}, "
            f"unexpected {unexpected}"
        )
    return model, tok
