"""Training losses, one place (formulas in docs/design.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cmr_loss(sim: torch.Tensor, extra_text_negatives: torch.Tensor | None = None) -> torch.Tensor:
    """LightningDOT's CMR: in-batch cross-entropy over rows (text->image) and columns (image->text).

    `sim` is (B, B) text x image with the positives on the diagonal, already scaled by the
    temperature. `extra_text_negatives` (B, K), image x extra texts, widens the image->text side.
    """
    target = torch.arange(sim.shape[0], device=sim.device)
    t2i = F.cross_entropy(sim, target)
    i2t_logits = sim.t()
    if extra_text_negatives is not None:
        i2t_logits = torch.cat([i2t_logits, extra_text_negatives], dim=1)
    i2t = F.cross_entropy(i2t_logits, target)
    return (t2i + i2t) / 2


def ce_bce_loss(pos_logits: torch.Tensor, neg_logits: torch.Tensor) -> torch.Tensor:
    """Rerank-Smart's cross-encoder loss: BCE with label 1 for matches and 0 for negatives.

    Positives are weighted so both classes count equally whatever the negative count.
    """
    logits = torch.cat([pos_logits, neg_logits])
    labels = torch.cat([torch.ones_like(pos_logits), torch.zeros_like(neg_logits)])
    weight = torch.cat([
        torch.full_like(pos_logits, neg_logits.numel() / max(pos_logits.numel(), 1)),
        torch.ones_like(neg_logits),
    ])
    return F.binary_cross_entropy_with_logits(logits, labels, weight=weight, reduction="sum") / (
        2 * neg_logits.numel()
    )
