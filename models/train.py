"""`duet train`: train the joint model on the synthetic world (JOINT+COOP).

Steps alternate between the two roles of the shared transformer:

* even steps, bi-encoder: CMR in-batch contrastive loss (plus perturbed captions as
  extra image->text negatives);
* odd steps, cross-encoder: BCE over the positives, the in-batch hardest negatives
  mined with the current bi-encoder (a wrong image per caption, a wrong caption per
  image) and one perturbed caption per image (one binding detail changed).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from models import world
from models.builtin import BuiltinModel, save_model
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
    pix = torch.from_numpy(np.stack([np.asarray(s.image) for s in samples])).permute(0, 3, 1, 2)
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
        perturbed = [world.captions(rng, world.perturb(rng, samples[i].scene), 1)[0] for i in idx]
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        model.train()
        if step % 2 == 0:
            name, loss = "be", _bi_encoder_loss(model, tok, images, texts, perturbed)
        else:
            name, loss = "ce", _cross_encoder_loss(model, tok, images, texts, perturbed,
                                                   hard=step >= cfg.easy_steps)
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
    val = list(world.generate(500, HELD_OUT_SEED_BASE - 1, n_captions=5))
    metrics = evaluate(runtime, [s.image for s in val], [s.captions for s in val], candidates=20)
    log.info("validation (500 images, seed %d):\n%s", HELD_OUT_SEED_BASE - 1, format_table(metrics))
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


def _cross_encoder_loss(model: JointModel, tok: WordTokenizer, images: torch.Tensor,
                        texts: list[str], perturbed: list[str], hard: bool) -> torch.Tensor:
    ids, pad = tok.batch(texts + perturbed)
    b = len(texts)
    txt = model.text_tokens(ids, pad)
    img = model.image_tokens(images)
    rows = torch.arange(b)
    if not hard:  # warm-up: a random wrong image and a random wrong caption per pair
        shift = torch.roll(rows, 1)
        logits = model.itm_logits(txt[torch.cat([rows, rows, shift])],
                                  pad[torch.cat([rows, rows, shift])],
                                  img[torch.cat([rows, shift, rows])])
        return ce_bce_loss(logits[:b], logits[b:])
    with torch.no_grad():  # mine in-batch hardest negatives with the current bi-encoder
        sim = model.embed_texts(txt[:b], pad[:b]) @ model.embed_images(img).t()
        same = torch.tensor([[a == c for c in texts] for a in texts])
        sim.masked_fill_(torch.eye(b, dtype=torch.bool) | same, -1e4)
        neg_img = sim.argmax(dim=1)  # hardest wrong image per caption
        neg_txt = sim.argmax(dim=0)  # hardest wrong caption per image
    t_idx = torch.cat([rows, rows, neg_txt, rows + b])
    i_idx = torch.cat([rows, neg_img, rows, rows])
    logits = model.itm_logits(txt[t_idx], pad[t_idx], img[i_idx])
    return ce_bce_loss(logits[:b], logits[b:])
