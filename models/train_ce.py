"""Stage 2 of `duet train`: the cross-encoder, trained afresh on the frozen token states.

After stage 1 the towers and the shared transformer are final (so is every index built with
them); this stage gives the re-ranker many more steps than the joint stage can afford, at a
fraction of the cost, since only the fusion layers learn and every training image's states are
computed once. Per caption (full or, with probability `partial`, partial) the negatives are a
random image, a training image the bi-encoder ranks high for it, at a rank drawn log-uniformly
below `ranks` (over the whole training set: the candidates the service will hand the re-ranker,
from the hardest few to the easy-but-wrong ones deeper in its list), its scene perturbed
(rendered) and a caption of that perturbed scene. `flip` of the perturbations are relation
flips, the mistake the bi-encoder makes most; `count` of the scenes whose group can hold two or
three things get the other count. No negative fits the caption: a partial caption
is only paired with a perturbed image that breaks something it says, and ranked images that
fit it are skipped.

Each shape noun's state after the first `ground_layer` fusion layers regresses the centre of the
thing it names (grounding); the layers above are then free to compare those positions with the
relation words. Measured on validation: grounding at the top layer left flipped relations at
0.55-0.62 pairwise accuracy, grounding at layer 2 of 4 reached 0.88 with the same steps.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models import world
from models.ce_mining import draw_batch, mine_negatives, own_logits
from models.ce_moves import pick_moved, step_layouts
from models.ce_negatives import CePairs, CePool, ce_pairs, ce_pool
from models.joint import CROSS_ENCODER, JointModel
from models.losses import ce_bce_loss
from models.tokenizer import WordTokenizer

log = logging.getLogger("duet.train")

Grounding = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, token positions, centres)


def grounding_targets(
    captions: list[str], scenes: list[world.Scene], layouts: list[world.Layout]
) -> Grounding:
    """(rows, token positions, centres (x, y)) for every shape noun of every caption: where in
    its image the thing the noun names is. Token positions count [CLS] as 0."""
    rows, pos, xy = [], [], []
    for r, (cap, scene, layout) in enumerate(zip(captions, scenes, layouts, strict=True)):
        for word, which in world.grounding(cap, scene):
            thing = scene.a if which == "a" or scene.b is None else scene.b
            rows.append(r)
            pos.append(word + 1)
            xy.append(world.centre(layout, thing))
    return (
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(pos, dtype=torch.long),
        torch.tensor(xy, dtype=torch.float32).reshape(-1, 2),
    )


def bce_and_grounding(
    model: JointModel,
    txt: torch.Tensor,
    pad: torch.Tensor,
    img: torch.Tensor,
    b: int,
    ground: torch.nn.Module,
    where: Grounding,
    ground_weight: float,
    ground_layer: int,
    lists: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, float | None]:
    """(BCE over pairs whose first `b` are the positives (in batch order) plus the grounding
    regression on those positives' shape nouns after the first `ground_layer` fusion layers,
    the grounding MSE alone or None when there was none). Both training stages use it.

    Each of `lists` (n, 1 + k) indexes the pairs' logits, a positive in column 0 and its
    negatives after it (-1: none): a softmax cross-entropy per row is added, so the positive
    must outscore its own negatives, whatever the other rows' scores (BCE alone calibrates
    every pair against one threshold, and a query's ranking is all the service uses).
    `where` and `lists` may be in CPU memory: they go to the logits' device here."""
    h, tapped = model.fused_tap(txt, pad, img, ground_layer)
    logits = model.itm_head(h[:, 0]).squeeze(-1)
    loss = ce_bce_loss(logits[:b], logits[b:])
    dev = logits.device
    for rows in (r.to(dev) for r in lists):
        scores = logits[rows.clamp(min=0)].masked_fill(rows < 0, float("-inf"))
        loss = loss + F.cross_entropy(scores, torch.zeros(len(rows), dtype=torch.long, device=dev))
    rows, pos, xy = (t.to(dev) for t in where)
    if ground_weight > 0 and len(rows):
        g = F.mse_loss(ground(tapped[rows, 1 + pos]), xy)
        return loss + ground_weight * g, g.item()
    return loss, None


def _mine(
    model: JointModel,
    tok: WordTokenizer,
    pool: CePool,
    rng: random.Random,
    progress: bool,
    mine: int,
    mine_index: int,
    hard: float,
    hard_parts: bool,
) -> list[int]:
    """The mining step: `pool.mined` set when `mine` > 0; with `hard` > 0 the training images
    whose own full captions (with `hard_parts`, or one-thing captions) the cross-encoder
    scores below 0 (else none)."""
    if mine > 0:
        pool.mined = mine_negatives(model, tok, pool, mine, rng, progress, index=mine_index)
    if hard <= 0:
        return []
    low = own_logits(model, tok, pool, progress, parts=hard_parts)
    blind: list[int] = (low < 0).nonzero()[:, 0].tolist()
    log.info("stage 2: %d training images score below 0 with a caption of theirs", len(blind))
    return blind


def _step_pairs(
    model: JointModel,
    tok: WordTokenizer,
    pool: CePool,
    idx: torch.Tensor,
    rng: random.Random,
    ranks: int,
    partial: float,
    move: float,
) -> tuple[CePairs, Grounding]:
    """One step's pairs and the grounding targets of its positives (moved where shown moved)."""
    shown = pick_moved(rng, len(idx), move) if pool.moved_states is not None else None
    pairs = ce_pairs(model, tok, pool, idx, rng, ranks, partial, shown)
    picked = idx.tolist()
    layouts = step_layouts(pool.samples, picked, pool.moves, shown)
    return pairs, grounding_targets(pairs.texts, [pool.scenes[i] for i in picked], layouts)


def _to_device(
    model: JointModel, reset: bool, device: torch.device | str | None
) -> torch.device | str:
    """Where stage 2 runs (`device`, else where `model` is), `model` moved there; with `reset`
    its cross-encoder is drawn afresh first, on the CPU with the CPU's random numbers, as a
    CPU-only run draws it."""
    device = device or model.itm_token.device
    if reset:
        model.cpu()
        model.reset_cross_encoder()
    model.to(device)
    return device


def train_cross_encoder(
    model: JointModel,
    tok: WordTokenizer,
    samples: Sequence[world.Sample],
    steps: int,
    batch: int,
    lr: float,
    flip: float,
    ranks: int,
    ground_weight: float,
    ground_layer: int,
    rng: random.Random,
    progress: bool = True,
    partial: float = 0.0,
    reset: bool = True,
    count: float = 0.0,
    mine: int = 0,
    mine_index: int = 0,
    hard: float = 0.0,
    move: float = 0.0,
    hard_parts: bool = False,
    device: torch.device | str | None = None,
    typed: float = 0.0,
) -> None:
    """Train `model`'s cross-encoder in place, re-initialised first unless `reset` is False;
    everything else stays frozen. With `mine` > 0 every image's caption is also shown the
    wrong images the cross-encoder itself scores highest among the bi-encoder's top `mine`
    (`models.ce_mining`), mined once: before the first step when it starts trained (not
    `reset`), else halfway, once its own ranking means something; with `mine_index` > 0
    among a random draw of that many images per caption, as a served index that size would
    (mining again halfway ranked worse: `models/weights/README.md`). With `hard` > 0, from
    that same step on, that share of each batch comes from the images whose own full captions
    (with `hard_parts`, or a one-thing caption of a two-thing scene) the cross-encoder scores
    below 0 (`models.ce_mining.own_logits`): its blind spots, shown as positives more often.
    `move` of each batch's images are shown moved up to 4 pixels (`models.ce_moves`), `typed` of
    its captions as people type them (`world.typed`); on `device` (default: `model`'s)."""
    from models.bars import tqdm

    batch = min(batch, len(samples))
    device = _to_device(model, reset, device)
    model.eval()  # no dropout anywhere; frozen parts stay frozen
    ground = torch.nn.Linear(model.cfg.d_model, 2).to(device)  # training-only: noun -> centre
    trained = [p for n, p in model.named_parameters() if n.startswith(CROSS_ENCODER)]
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(CROSS_ENCODER))
    pool = ce_pool(model, tok, samples, flip, rng, progress, ranks, count, move > 0, typed)
    opt = torch.optim.AdamW([*trained, *ground.parameters()], lr=lr, weight_decay=0.01)
    ema: dict[str, float] = {}
    bar = tqdm(range(steps), desc="training cross-encoder", unit="step", disable=not progress)
    blind: list[int] = []  # training images the cross-encoder judges not to fit their captions
    for step in bar:
        for group in opt.param_groups:
            warm = min(1.0, (step + 1) / 50)
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        if step == (steps // 2 if reset else 0):
            blind = _mine(model, tok, pool, rng, progress, mine, mine_index, hard, hard_parts)
        idx = draw_batch(rng, len(samples), batch, blind, hard)
        pairs, where = _step_pairs(model, tok, pool, idx, rng, ranks, partial, move)
        loss, g = bce_and_grounding(
            model,
            pairs.txt[pairs.t_idx],
            pairs.pad[pairs.t_idx],
            pairs.img,
            batch,
            ground,
            where,
            ground_weight,
            ground_layer,
            pairs.lists,
        )
        if g is not None:
            ema["ground"] = 0.98 * ema.get("ground", g) + 0.02 * g
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        ema["ce"] = 0.98 * ema.get("ce", loss.item()) + 0.02 * loss.item()
        bar.set_postfix({k: f"{v:.4f}" for k, v in ema.items()})
    for p in model.parameters():
        p.requires_grad_(True)
