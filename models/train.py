"""`duet train`: train the joint model on the synthetic world (JOINT+COOP).

Optimiser steps alternate between the two roles of the shared transformer:

* bi-encoder steps: CMR in-batch contrastive loss (plus a perturbed caption per image as
  an extra image->text negative);
* cross-encoder steps: BCE. For the first `easy_steps` the negatives are a random wrong
  image and caption per pair: trained from scratch on hard negatives only, the
  cross-encoder sits on the ln 2 plateau for hundreds of steps. After that: a random
  wrong pairing, the in-batch hardest wrong image under the current bi-encoder, a
  perturbed caption and the perturbed scene rendered as an image (mostly binding
  changes: relation flipped, two objects' colours or shapes swapped), and the
  cross-encoder gets two steps in three.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from models import world
from models.builtin import BuiltinModel, pixel_bytes, pixels, save_model
from models.evaluate import evaluate, format_table
from models.joint import JointConfig, JointModel
from models.losses import ce_bce_loss, cmr_loss
from models.tokenizer import WordTokenizer
from models.trainconfig import HELD_OUT_SEED_BASE, TrainConfig

log = logging.getLogger("duet.train")

def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig, out: Path, progress: bool = True) -> dict[str, object]:
    """Train from scratch, save into `out`, return a summary (also written as train.json)."""
    from tqdm import tqdm

    if cfg.seed >= HELD_OUT_SEED_BASE:
        raise ValueError(f"training seeds must be below {HELD_OUT_SEED_BASE} (held out for tests)")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed + 1)
    t0 = time.perf_counter()
    samples = list(tqdm(world.generate(cfg.images, cfg.seed, n_captions=6), total=cfg.images,
                        desc="rendering", unit="img", disable=not progress))
    pix = pixel_bytes([s.image for s in samples], world.IMAGE_SIZE)  # uint8 in memory
    tok = WordTokenizer(world.vocabulary())
    model = JointModel(JointConfig(vocab_size=tok.vocab_size))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    order: list[int] = []
    bar = tqdm(range(cfg.steps), desc="training", unit="step", disable=not progress)
    ema: dict[str, float] = {}
    for step in bar:
        if len(order) < cfg.batch:
            order = list(range(cfg.images))
            rng.shuffle(order)
        idx, order = order[: cfg.batch], order[cfg.batch :]
        images = pix[idx].float() / 255.0
        texts = [rng.choice(samples[i].captions) for i in idx]
        wrong = [world.perturb(rng, samples[i].scene) for i in idx]
        perturbed = [world.captions(rng, w, 1)[0] for w in wrong]
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        model.train()
        hard = step >= cfg.easy_steps
        if step % (3 if hard else 2) == 0:  # after the warm-up: two cross-encoder steps in three
            name, loss = "be", _bi_encoder_loss(model, tok, images, texts, perturbed)
        elif not hard:
            name, loss = "ce", _cross_encoder_easy_loss(model, tok, images, texts)
        else:
            wrong_px = pixels([world.render(rng, w) for w in wrong], world.IMAGE_SIZE)
            name, loss = "ce", _cross_encoder_loss(model, tok, images, texts, perturbed, wrong_px)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0.0, 4.6)
        ema[name] = 0.98 * ema.get(name, loss.item()) + 0.02 * loss.item()
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()})
    train_seconds = time.perf_counter() - t0

    save_model(model, tok, out)
    runtime = BuiltinModel.load(out)
    val = list(world.generate(300, HELD_OUT_SEED_BASE - 1, n_captions=5))
    metrics = evaluate(runtime, [s.image for s in val], [s.captions for s in val], candidates=20)
    log.info("validation (300 images, seed %d):\n%s", HELD_OUT_SEED_BASE - 1, format_table(metrics))
    summary: dict[str, object] = {
        "command": f"duet train --out {out} --seed {cfg.seed} --images {cfg.images} "
                   f"--steps {cfg.steps} --batch {cfg.batch}",
        "config": cfg.__dict__,
        "train_seconds": round(train_seconds, 1),
        "torch": torch.__version__,
        "fingerprint": runtime.fingerprint,
        "validation": metrics,
    }
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _bi_encoder_loss(model: JointModel, tok: WordTokenizer, images: torch.Tensor,
                     texts: list[str], perturbed: list[str]) -> torch.Tensor:
    ids, pad = tok.batch(texts + perturbed)
    et_all = model.embed_texts(model.text_tokens(ids, pad), pad)
    ei = model.embed_images(model.image_tokens(images))
    b = len(texts)
    scale = model.logit_scale.exp()
    sim = scale * et_all[:b] @ ei.t()
    # image i against perturbed caption i (its own hard negative) as an extra column
    hard = scale * (ei * et_all[b:]).sum(-1, keepdim=True)
    return cmr_loss(sim, extra_text_negatives=hard)


def _cross_encoder_easy_loss(model: JointModel, tok: WordTokenizer, images: torch.Tensor,
                             texts: list[str]) -> torch.Tensor:
    """Warm-up: a random wrong image and a random wrong caption per pair (escapes ln 2)."""
    ids, pad = tok.batch(texts)
    txt, img = model.text_tokens(ids, pad), model.image_tokens(images)
    rows = torch.arange(len(texts))
    shift = torch.roll(rows, 1)
    t_idx, i_idx = torch.cat([rows, rows, shift]), torch.cat([rows, shift, rows])
    logits = model.itm_logits(txt[t_idx], pad[t_idx], img[i_idx])
    return ce_bce_loss(logits[: len(texts)], logits[len(texts) :])


def _cross_encoder_loss(model: JointModel, tok: WordTokenizer, images: torch.Tensor,
                        texts: list[str], perturbed: list[str],
                        perturbed_images: torch.Tensor) -> torch.Tensor:
    """Positives vs a random pairing, the in-batch hardest wrong image, a perturbed caption and
    the perturbed scene's image.

    The random pairing stays in after the warm-up: without it the cross-encoder forgets gross
    mismatches (measured: it then preferred two-object images for one-object captions).
    """
    ids, pad = tok.batch(texts + perturbed)
    b = len(texts)
    txt = model.text_tokens(ids, pad)
    img = model.image_tokens(torch.cat([images, perturbed_images]))
    with torch.no_grad():  # mine the in-batch hardest wrong image with the current bi-encoder
        sim = model.embed_texts(txt[:b], pad[:b]) @ model.embed_images(img[:b]).t()
        same = torch.tensor([[a == c for c in texts] for a in texts])
        sim.masked_fill_(torch.eye(b, dtype=torch.bool) | same, -1e4)
        neg_img = sim.argmax(dim=1)
    rows = torch.arange(b)
    t_idx = torch.cat([rows, rows, rows, rows + b, rows])
    i_idx = torch.cat([rows, torch.roll(rows, 1), neg_img, rows, rows + b])
    logits = model.itm_logits(txt[t_idx], pad[t_idx], img[i_idx])
    return ce_bce_loss(logits[:b], logits[b:])
