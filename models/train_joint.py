"""Stages 0 and 1 of `duet train`: the image tower on the patch labels, then the joint model.

Stage 0 trains the image tower alone to say which shape, colour and size is centred in each
patch (`PatchHead`, `patch_targets`). Stage 1 alternates optimiser steps between the model's
two roles (bi-encoder steps: CMR plus TGDT's CMC on S_gl; cross-encoder steps: BCE plus
grounding), each with the patch probe on the image states; see `models.train` for the whole.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from models import world
from models.builtin import pixel_bytes, pixels
from models.ce_negatives import token_batch
from models.joint import JointConfig, JointModel
from models.losses import cmc_loss_from_sim, cmr_loss
from models.tokenizer import WordTokenizer
from models.train_ce import Grounding, bce_and_grounding, grounding_targets
from models.trainconfig import TrainConfig

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

    def _outputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per patch: colour, shape and size logits and the centre's offset."""
        y = self.out(self.norm(tokens))  # (B, T, classes + 2)
        a, b, c = N_COLOURS + 1, N_COLOURS + N_SHAPES + 2, N_COLOURS + N_SHAPES + N_SIZES + 3
        return {
            "colour": y[..., :a],
            "shape": y[..., a:b],
            "size": y[..., b:c],
            "offset": y[..., c:],
        }

    def loss(self, tokens: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        y = self._outputs(tokens)
        ce = torch.nn.functional.cross_entropy
        loss = (
            ce(y["colour"].flatten(0, 1), targets["colour"].flatten())
            + ce(y["shape"].flatten(0, 1), targets["shape"].flatten())
            + ce(y["size"].flatten(0, 1), targets["size"].flatten())
        )
        has = targets["colour"] > 0
        if has.any():
            loss = loss + 4.0 * torch.nn.functional.mse_loss(
                y["offset"][has], targets["offset"][has]
            )
        return loss

    def read(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per patch, the colour, shape and size classes it reads (0 = none)."""
        y = self._outputs(tokens)
        return {k: y[k].argmax(-1) for k in ("colour", "shape", "size")}


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


def train_joint(
    cfg: TrainConfig,
    samples: list[world.Sample],
    tok: WordTokenizer,
    rng: random.Random,
    progress: bool,
    start: JointModel | None = None,
    device: torch.device | str = "cpu",
) -> JointModel:
    """Stage 1: the joint model, both roles, end to end (from `start` when given), on `device`."""
    from models.bars import tqdm

    pix = pixel_bytes([s.image for s in samples], world.IMAGE_SIZE).to(device)  # uint8
    new = JointConfig(vocab_size=tok.vocab_size, stem_norm=1)
    model = (JointModel(new) if start is None else start).to(device)  # drawn on the CPU first
    targets = patch_targets([s.layout for s in samples], model.cfg.grid)
    targets = {k: v.to(device) for k, v in targets.items()}
    if start is None and cfg.tower_steps > 0:
        _pretrain_tower(model, pix, targets, cfg, rng, progress)
    head = PatchHead(model.cfg.d_model).to(device)
    ground = torch.nn.Linear(model.cfg.d_model, 2).to(device)  # training-only: noun -> centre
    opt = _optimizer(model, head, ground, cfg)
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
        fits = positives_mask(descs, scenes).to(device)
        wrong = [world.negative_scene(rng, sc, d) for sc, d in zip(scenes, descs, strict=True)]
        perturbed = [
            text_negative(rng, w, sc, cfg.partial) for w, sc in zip(wrong, scenes, strict=True)
        ]
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        model.train()
        img = model.image_tokens(images)
        aux = head.loss(img, {k: v[idx] for k, v in targets.items()})
        batch = [samples[i] for i in idx]
        name, loss = _step_loss(
            model, tok, img, batch, texts, perturbed, wrong, fits, ground, cfg, rng, step
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


def _optimizer(
    model: JointModel, head: PatchHead, ground: torch.nn.Module, cfg: TrainConfig
) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices but not on positions, norms and biases."""
    params = [
        *model.named_parameters(),
        *(("head." + n, p) for n, p in head.named_parameters()),
        *(("ground." + n, p) for n, p in ground.named_parameters()),
    ]
    decay = [p for n, p in params if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "pos" not in n)]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
    )


def _step_loss(
    model: JointModel,
    tok: WordTokenizer,
    img: torch.Tensor,
    batch: list[world.Sample],
    texts: list[str],
    perturbed: list[str],
    wrong: list[world.Scene],
    fits: torch.Tensor,
    ground: torch.nn.Module,
    cfg: TrainConfig,
    rng: random.Random,
    step: int,
) -> tuple[str, torch.Tensor]:
    """("be" | "ce", this step's loss): a bi-encoder step, or a cross-encoder step with random
    negatives during the warm-up and hard ones after it (two cross-encoder steps in three)."""
    hard = step >= cfg.easy_steps
    if step % (3 if hard else 2) == 0:
        return "be", _bi_encoder_loss(model, tok, img, texts, perturbed, cfg.late_weight, fits)
    where = grounding_targets(texts, [s.scene for s in batch], [s.layout for s in batch])
    if not hard:
        return "ce", _cross_encoder_easy_loss(
            model, tok, img, texts, ground, where, cfg.ground_weight, cfg.ground_layer, fits
        )
    wrong_px = pixels([world.render(rng, w) for w in wrong], world.IMAGE_SIZE).to(img.device)
    return "ce", _cross_encoder_loss(
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
    )


def _pretrain_tower(
    model: JointModel,
    pix: torch.Tensor,
    targets: dict[str, torch.Tensor],
    cfg: TrainConfig,
    rng: random.Random,
    progress: bool,
) -> None:
    """Stage 0: the image tower alone, supervised by the patch labels (`patch_targets`)."""
    from models.bars import tqdm

    tower, head = model.image_tower, PatchHead(model.cfg.d_model).to(pix.device)
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
    ids, pad = token_batch(tok, texts + perturbed, img.device)
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
    ids, pad = token_batch(tok, texts, img.device)
    txt = model.text_tokens(ids, pad)
    rows = torch.arange(len(texts), device=img.device)
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
    ids, pad = token_batch(tok, texts + perturbed, images.device)
    b = len(texts)
    txt = model.text_tokens(ids, pad)
    img = torch.cat([images, perturbed_images])
    with torch.no_grad():  # mine the in-batch hardest wrong image with the current bi-encoder
        sim = model.embed_texts(txt[:b], pad[:b]) @ model.embed_images(img[:b]).t()
        sim.masked_fill_(torch.eye(b, dtype=torch.bool, device=sim.device) | fits, -1e4)
        neg_img = sim.argmax(dim=1)
    rows = torch.arange(b, device=images.device)
    shift = torch.roll(rows, 1)
    keep_shift, keep_hard = ~fits[rows, shift], ~fits[rows, neg_img]
    t_idx = torch.cat([rows, rows[keep_shift], rows[keep_hard], rows + b, rows])
    i_idx = torch.cat([rows, shift[keep_shift], neg_img[keep_hard], rows, rows + b])
    return bce_and_grounding(
        model, txt[t_idx], pad[t_idx], img[i_idx], b, ground, where, ground_weight, ground_layer
    )[0]
