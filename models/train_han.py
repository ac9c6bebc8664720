"""Second stage of `duet train`: the HAN head over the trained towers' features.

The joint model's towers stay frozen; their outputs are HAN's inputs, as detector region
features and word embeddings are in the paper: words = text tower tokens, regions = image
tower patch tokens (what the index stores). Each batch holds scenes and, beside them, their
perturbed twins (a flipped relation, swapped colours, ...) rendered with a caption, so the
in-batch negatives include the binding mistakes a global embedding makes. Loss: HAN's
soft-max triplet over the batch's (sentence, image) score matrix, exponent p.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from models import world
from models.builtin import pixels
from models.han import HAN, HANConfig
from models.joint import JointModel
from models.losses import softmax_triplet_loss
from models.tokenizer import WordTokenizer


def han_scores(
    head: HAN, words: torch.Tensor, word_mask: torch.Tensor, regions: torch.Tensor
) -> torch.Tensor:
    """(B, B) S_AVG of every sentence (rows) against every image (columns)."""
    b = words.shape[0]
    w = words.repeat_interleave(b, dim=0)
    wm = word_mask.repeat_interleave(b, dim=0)
    r = regions.repeat(b, 1, 1)
    rm = torch.ones(r.shape[:2], dtype=torch.bool)
    return head(w, wm, r, rm).view(b, b)


def train_han(
    model: JointModel,
    tok: WordTokenizer,
    samples: Sequence[world.Sample],
    steps: int,
    batch: int,
    lr: float,
    p: float,
    margin: float,
    rng: random.Random,
    progress: bool = True,
) -> HAN:
    """Train a HAN head for `steps` steps of `batch` pairs (half scenes, half their twins)."""
    from models.bars import tqdm

    head = HAN(HANConfig(word_dim=model.cfg.d_model, region_dim=model.cfg.d_model))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    model.eval()
    ema: float | None = None
    bar = tqdm(range(steps), desc="training HAN", unit="step", disable=not progress)
    for step in bar:
        picked = rng.sample(range(len(samples)), batch // 2)
        scenes = [samples[i].scene for i in picked]
        twins = [world.perturb(rng, s) for s in scenes]
        images = [samples[i].image for i in picked] + [world.render(rng, t) for t in twins]
        texts = [rng.choice(samples[i].captions) for i in picked] + [
            world.captions(rng, t, 1)[0] for t in twins
        ]
        with torch.no_grad():
            ids, pad = tok.batch(texts)
            words = model.text_tokens(ids, pad)
            regions = model.image_tokens(pixels(images, model.cfg.image_size))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (1 - step / steps)
        head.train()
        loss = softmax_triplet_loss(han_scores(head, words, ~pad, regions), margin, p)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    return head.eval()
