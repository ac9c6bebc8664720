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
import math
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from models import world
from models.builtin import WEIGHTS_FILE, BuiltinModel, pixel_bytes, pixels, save_model
from models.evaluate import evaluate, format_table, partial_precision
from models.han import HAN_CONFIG, HAN_WEIGHTS, save_han
from models.joint import CROSS_ENCODER, JointConfig, JointModel
from models.losses import cmc_loss_from_sim, cmr_loss
from models.tokenizer import WordTokenizer
from models.train_ce import (
    Grounding,
    bce_and_grounding,
    grounding_targets,
    train_cross_encoder,
)
from models.train_han import train_han
from models.trainconfig import HELD_OUT_SEED_BASE, TrainConfig

log = logging.getLogger("duet.train")

N_COLOURS, N_SHAPES, N_SIZES = len(world.COLOURS), len(world.SHAPES), len(world.SIZES)


class PatchHead(torch.nn.Module):
    """Training-only probe on the image states (what the index stores): which object is
    centred in each patch (colour, shape, size; 0 = none) and where in the patch its centre lies.

    Region features in the papers come from a detector trained with object and attribute labels
    (bottom-up attention); this is our world's version of that supervision. It makes the stored
    tokens say what is where, which the cross-encoder and late interaction then read.
    """

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.out = torch.nn.Linear(d, N_COLOURS + 1 + N_SHAPES + 1 + N_SIZES + 1 + 2)

    def loss(self, tokens: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        y = self.out(self.norm(tokens))  # (B, T, classes + 2)
        a, b, c = N_COLOURS + 1, N_COLOURS + N_SHAPES + 2, N_COLOURS + N_SHAPES + N_SIZES + 3
        ce = torch.nn.functional.cross_entropy
        loss = (
            ce(y[..., :a].flatten(0, 1), targets["colour"].flatten())
            + ce(y[..., a:b].flatten(0, 1), targets["shape"].flatten())
            + ce(y[..., b:c].flatten(0, 1), targets["size"].flatten())
        )
        has = targets["colour"] > 0
        if has.any():
            loss = loss + 4.0 * torch.nn.functional.mse_loss(
                y[..., c:][has], targets["offset"][has]
            )
        return loss


def patch_targets(layouts: list[world.Layout], grid: int) -> dict[str, torch.Tensor]:
    """Per-patch labels of the object whose centre lies in the patch (the nearest to the patch
    centre when two do): colour / shape / size class (0 = none) and the centre's offset in
    the patch, in [-0.5, 0.5]."""
    n, t = len(layouts), grid * grid
    cell = world.IMAGE_SIZE / grid
    colours, shapes, sizes = list(world.COLOURS), list(world.SHAPES), list(world.SIZES)
    out = {k: torch.zeros(n, t, dtype=torch.long) for k in ("colour", "shape", "size")}
    offset = torch.zeros(n, t, 2)
    best = torch.full((n, t), float("inf"))
    for i, layout in enumerate(layouts):
        for thing, x, y, _r in layout:
            col, row = min(int(x // cell), grid - 1), min(int(y // cell), grid - 1)
            ox, oy = x / cell - col - 0.5, y / cell - row - 0.5
            p, dist = row * grid + col, ox * ox + oy * oy
            if dist >= best[i, p]:
                continue
            best[i, p] = dist
            out["colour"][i, p] = colours.index(thing.colour) + 1
            out["shape"][i, p] = shapes.index(thing.shape) + 1
            out["size"][i, p] = sizes.index(thing.size) + 1
            offset[i, p] = torch.tensor([ox, oy])
    return {**out, "offset": offset}


def training_captions(
    rng: random.Random,
    samples: Sequence[world.Sample],
    partial: float,
) -> tuple[list[str], list[world.Desc]]:
    """One caption per sample and what it says: with probability `partial` a partial
    description (`world.partial_caption`), else one of the sample's full captions."""
    texts, descs = [], []
    for smp in samples:
        if rng.random() < partial:
            text, desc = world.partial_caption(rng, smp.scene)
        else:
            text, desc = rng.choice(smp.captions), world.full_desc(smp.scene)
        texts.append(text)
        descs.append(desc)
    return texts, descs


def text_negative(
    rng: random.Random, wrong: world.Scene, scene: world.Scene, partial: float, tries: int = 5
) -> str:
    """A caption of `wrong` that `scene` does not fit: partial with probability `partial` when
    one of `tries` partial descriptions says what tells them apart, else a full caption."""
    if rng.random() < partial:
        for _ in range(tries):
            text, desc = world.partial_caption(rng, wrong)
            if not world.satisfies(desc, scene):
                return text
    return world.captions(rng, wrong, 1)[0]


def positives_mask(descs: Sequence[world.Desc], scenes: Sequence[world.Scene]) -> torch.Tensor:
    """(texts, scenes) bool: description i fits scene j (the diagonal always does)."""
    return torch.tensor([[world.satisfies(d, s) for s in scenes] for d in descs], dtype=torch.bool)


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train(
    cfg: TrainConfig, out: Path, progress: bool = True, init_from: Path | None = None
) -> dict[str, object]:
    """Train, save into `out`, return a summary (also written as train.json).

    From scratch by default. With `init_from` (a trained model directory) stage 1 is skipped:
    its towers, shared transformer and projections are kept as they are, so indexes built
    with them keep their vectors and token states, and stages 2 and 3 train on top. With
    `init_from` and `cfg.tune`, stage 1 instead continues from that model's weights for
    `cfg.steps` steps (new captions for the encoders without a run from scratch).
    """
    from tqdm import tqdm

    if cfg.seed >= HELD_OUT_SEED_BASE:
        raise ValueError(f"training seeds must be below {HELD_OUT_SEED_BASE} (held out for tests)")
    if init_from is not None and not cfg.tune and cfg.ce_steps <= 0:
        raise ValueError(
            "--from keeps only the encoders, so the cross-encoder stage must run (--ce-steps > 0)"
        )
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed + 1)
    t0 = time.perf_counter()
    samples = list(
        tqdm(
            world.generate(cfg.images, cfg.seed, n_captions=6),
            total=cfg.images,
            desc="rendering",
            unit="img",
            disable=not progress,
        )
    )
    if cfg.tune and init_from is None:
        raise ValueError("--tune continues a trained model: give --from")
    if init_from is None:
        tok = WordTokenizer(world.vocabulary())
        model = _train_joint(cfg, samples, tok, rng, progress)
    elif cfg.tune:
        model, tok = load_encoders(init_from, keep_cross_encoder=True)
        model = _train_joint(cfg, samples, tok, rng, progress, start=model)
    else:
        model, tok = load_encoders(init_from, keep_cross_encoder=cfg.ce_warm)
    joint_seconds = time.perf_counter() - t0
    if cfg.ce_steps > 0:
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
        )
    ce_seconds = time.perf_counter() - t0 - joint_seconds
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

    save_model(model, tok, out)
    if han is not None:
        save_han(han, out)
    elif (
        init_from is not None
        and not cfg.tune
        and (init_from / HAN_WEIGHTS).is_file()
        and init_from != out
    ):
        # the HAN head reads the towers' features, which --from keeps bit for bit
        for name in (HAN_WEIGHTS, HAN_CONFIG):
            shutil.copyfile(init_from / name, out / name)
    runtime = BuiltinModel.load(out)
    val = list(world.generate(300, HELD_OUT_SEED_BASE - 1, n_captions=5))
    metrics = evaluate(runtime, [s.image for s in val], [s.captions for s in val], candidates=20)
    log.info("validation (300 images, seed %d):\n%s", HELD_OUT_SEED_BASE - 1, format_table(metrics))
    # partial queries from a validation seed (never a test one) over the same images
    partial = partial_precision(
        runtime,
        [s.image for s in val],
        [s.scene for s in val],
        world.partial_queries(300, HELD_OUT_SEED_BASE - 2),
        candidates=50,
    )
    log.info(
        "validation partial queries (300, seed %d, top 50): %s", HELD_OUT_SEED_BASE - 2, partial
    )
    command = (
        f"duet train --out {out} --seed {cfg.seed} --images {cfg.images} "
        f"--tower-steps {cfg.tower_steps} --steps {cfg.steps} --batch {cfg.batch} "
        f"--ce-steps {cfg.ce_steps} "
        f"--han-steps {cfg.han_steps} --ce-lr {cfg.ce_lr}"
        + (" --ce-warm" if cfg.ce_warm else "")
        + (
            f" --tune --lr {cfg.lr} --warmup {cfg.warmup} --easy-steps {cfg.easy_steps}"
            f" --aux-weight {cfg.aux_weight}"
            if cfg.tune
            else ""
        )
    )
    summary: dict[str, object] = {
        "command": command + (f" --from {init_from}" if init_from is not None else ""),
        "config": cfg.__dict__,
        "train_seconds": round(train_seconds, 1),
        "joint_seconds": round(joint_seconds, 1),
        "cross_encoder_seconds": round(ce_seconds, 1),
        "torch": torch.__version__,
        "fingerprint": runtime.fingerprint,
        "validation": metrics,
        "validation_partial": partial,
    }
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


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


def _train_joint(
    cfg: TrainConfig,
    samples: list[world.Sample],
    tok: WordTokenizer,
    rng: random.Random,
    progress: bool,
    start: JointModel | None = None,
) -> JointModel:
    """Stage 1: the joint model, both roles, end to end (from `start` when given)."""
    from tqdm import tqdm

    pix = pixel_bytes([s.image for s in samples], world.IMAGE_SIZE)  # uint8 in memory
    if start is None:
        model = JointModel(JointConfig(vocab_size=tok.vocab_size, stem_norm=1))
    else:
        model = start
    targets = patch_targets([s.layout for s in samples], model.cfg.grid)
    if start is None and cfg.tower_steps > 0:
        _pretrain_tower(model, pix, targets, cfg, rng, progress)
    head = PatchHead(model.cfg.d_model)
    ground = torch.nn.Linear(model.cfg.d_model, 2)  # training-only: noun -> its thing's centre
    params = [
        *model.named_parameters(),
        *(("head." + n, p) for n, p in head.named_parameters()),
        *(("ground." + n, p) for n, p in ground.named_parameters()),
    ]
    decay = [p for n, p in params if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "pos" not in n)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
    )
    order: list[int] = []
    bar = tqdm(range(cfg.steps), desc="training", unit="step", disable=not progress)
    ema: dict[str, float] = {}
    for step in bar:
        if len(order) < cfg.batch:
            order = list(range(len(samples)))
            rng.shuffle(order)
        idx, order = order[: cfg.batch], order[cfg.batch :]
        images = pix[idx].float() / 255.0
        scenes = [samples[i].scene for i in idx]
        texts, descs = training_captions(rng, [samples[i] for i in idx], cfg.partial)
        fits = positives_mask(descs, scenes)
        wrong = [world.negative_scene(rng, sc, d) for sc, d in zip(scenes, descs, strict=True)]
        perturbed = [
            text_negative(rng, w, sc, cfg.partial) for w, sc in zip(wrong, scenes, strict=True)
        ]
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        model.train()
        hard = step >= cfg.easy_steps
        img = model.image_tokens(images)
        aux = head.loss(img, {k: v[idx] for k, v in targets.items()})
        if step % (3 if hard else 2) == 0:  # after the warm-up: two cross-encoder steps in three
            name, loss = (
                "be",
                _bi_encoder_loss(model, tok, img, texts, perturbed, cfg.late_weight, fits),
            )
        else:
            where = grounding_targets(
                texts, [samples[i].scene for i in idx], [samples[i].layout for i in idx]
            )
            if not hard:
                name, loss = (
                    "ce",
                    _cross_encoder_easy_loss(
                        model,
                        tok,
                        img,
                        texts,
                        ground,
                        where,
                        cfg.ground_weight,
                        cfg.ground_layer,
                        fits,
                    ),
                )
            else:
                wrong_px = pixels([world.render(rng, w) for w in wrong], world.IMAGE_SIZE)
                name, loss = (
                    "ce",
                    _cross_encoder_loss(
                        model,
                        tok,
                        img,
                        texts,
                        perturbed,
                        model.image_tokens(wrong_px),
                        ground,
                        where,
                        cfg.ground_weight,
                        cfg.ground_layer,
                        fits,
                    ),
                )
        ema["aux"] = 0.98 * ema.get("aux", aux.item()) + 0.02 * aux.item()
        loss = loss + cfg.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0.0, 4.6)
        ema[name] = 0.98 * ema.get(name, loss.item()) + 0.02 * loss.item()
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()})
    return model


def _pretrain_tower(
    model: JointModel,
    pix: torch.Tensor,
    targets: dict[str, torch.Tensor],
    cfg: TrainConfig,
    rng: random.Random,
    progress: bool,
) -> None:
    """Stage 0: the image tower alone, supervised by the patch labels (`patch_targets`)."""
    from tqdm import tqdm

    tower, head = model.image_tower, PatchHead(model.cfg.d_model)
    opt = torch.optim.AdamW([*tower.parameters(), *head.parameters()], lr=cfg.lr)
    tower.train()
    bar = tqdm(range(cfg.tower_steps), desc="image tower", unit="step", disable=not progress)
    ema = None
    for step in bar:
        for group in opt.param_groups:  # short warm-up, then cosine to a tenth
            warm = min(1.0, (step + 1) / 50)
            group["lr"] = cfg.lr * warm * (0.55 + 0.45 * math.cos(math.pi * step / cfg.tower_steps))
        idx = rng.sample(range(len(pix)), min(cfg.tower_batch, len(pix)))
        loss = head.loss(tower(pix[idx].float() / 255.0), {k: v[idx] for k, v in targets.items()})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")


def _bi_encoder_loss(
    model: JointModel,
    tok: WordTokenizer,
    img: torch.Tensor,
    texts: list[str],
    perturbed: list[str],
    late_weight: float,
    fits: torch.Tensor,
) -> torch.Tensor:
    ids, pad = tok.batch(texts + perturbed)
    txt = model.text_tokens(ids, pad)
    et_all = model.embed_texts(txt, pad)
    ei = model.embed_images(img)
    b = len(texts)
    scale = model.logit_scale.exp()
    sim = scale * et_all[:b] @ ei.t()
    # image i against perturbed caption i (its own hard negative) as an extra column
    hard = scale * (ei * et_all[b:]).sum(-1, keepdim=True)
    loss = cmr_loss(sim, extra_text_negatives=hard, positives=fits)
    if late_weight > 0:  # TGDT: the global score refined by token-level S_l, trained jointly
        s_gl = 0.5 * (et_all[:b] @ ei.t()) + 0.5 * _local_sim(txt[:b], ~pad[:b], img)
        loss = loss + late_weight * cmc_loss_from_sim(
            s_gl, ei @ ei.t(), et_all[:b] @ et_all[:b].t(), positives=fits
        )
    return loss


def _local_sim(words: torch.Tensor, mask: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
    """S_l for every (sentence, image) pair of a batch: (B, B), as `models.late` computes it."""
    w = torch.nn.functional.normalize(words, dim=-1)
    v = torch.nn.functional.normalize(img, dim=-1)
    best = torch.einsum("ild,jtd->ijlt", w, v).amax(dim=3)  # (B, B, L)
    keep = mask.to(best.dtype)[:, None, :]
    return (best * keep).sum(-1) / keep.sum(-1).clamp(min=1.0)


def _cross_encoder_easy_loss(
    model: JointModel,
    tok: WordTokenizer,
    img: torch.Tensor,
    texts: list[str],
    ground: torch.nn.Module,
    where: Grounding,
    ground_weight: float,
    ground_layer: int,
    fits: torch.Tensor,
) -> torch.Tensor:
    """Warm-up: a random wrong image and a random wrong caption per pair (escapes ln 2); a
    pairing whose caption fits the image anyway is no negative and is left out."""
    ids, pad = tok.batch(texts)
    txt = model.text_tokens(ids, pad)
    rows = torch.arange(len(texts))
    shift = torch.roll(rows, 1)
    neg_t, neg_i = torch.cat([rows, shift]), torch.cat([shift, rows])
    keep = ~fits[neg_t, neg_i]
    t_idx, i_idx = torch.cat([rows, neg_t[keep]]), torch.cat([rows, neg_i[keep]])
    return bce_and_grounding(
        model,
        txt[t_idx],
        pad[t_idx],
        img[i_idx],
        len(texts),
        ground,
        where,
        ground_weight,
        ground_layer,
    )[0]


def _cross_encoder_loss(
    model: JointModel,
    tok: WordTokenizer,
    images: torch.Tensor,
    texts: list[str],
    perturbed: list[str],
    perturbed_images: torch.Tensor,
    ground: torch.nn.Module,
    where: Grounding,
    ground_weight: float,
    ground_layer: int,
    fits: torch.Tensor,
) -> torch.Tensor:
    """Positives vs a random pairing, the in-batch hardest wrong image, a perturbed caption and
    the perturbed scene's image (`images` and `perturbed_images` are image states). On the
    positive pairs each shape noun's fused state must also say where its thing is (`where`,
    from `grounding_targets`): word-to-region grounding, which the relation words compare.

    The random pairing stays in after the warm-up: without it the cross-encoder forgets gross
    mismatches (measured: it then preferred two-object images for one-object captions).
    `fits` (B, B), caption i fits image j: such images are never negatives. The perturbed
    caption and image come from `world.negative_scene` and `text_negative`, so they never fit.
    """
    ids, pad = tok.batch(texts + perturbed)
    b = len(texts)
    txt = model.text_tokens(ids, pad)
    img = torch.cat([images, perturbed_images])
    with torch.no_grad():  # mine the in-batch hardest wrong image with the current bi-encoder
        sim = model.embed_texts(txt[:b], pad[:b]) @ model.embed_images(img[:b]).t()
        sim.masked_fill_(torch.eye(b, dtype=torch.bool) | fits, -1e4)
        neg_img = sim.argmax(dim=1)
    rows = torch.arange(b)
    shift = torch.roll(rows, 1)
    keep_shift, keep_hard = ~fits[rows, shift], ~fits[rows, neg_img]
    t_idx = torch.cat([rows, rows[keep_shift], rows[keep_hard], rows + b, rows])
    i_idx = torch.cat([rows, shift[keep_shift], neg_img[keep_hard], rows, rows + b])
    return bce_and_grounding(
        model, txt[t_idx], pad[t_idx], img[i_idx], b, ground, where, ground_weight, ground_layer
    )[0]
