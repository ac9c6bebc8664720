"""Training losses, one place (formulas in docs/design.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cmr_loss(
    sim: torch.Tensor,
    extra_text_negatives: torch.Tensor | None = None,
    positives: torch.Tensor | None = None,
) -> torch.Tensor:
    """LightningDOT's CMR: in-batch cross-entropy over rows (text->image) and columns (image->text).

    `sim` is (B, B) text x image with the positives on the diagonal, already scaled by the
    temperature. `extra_text_negatives` (B, K), image x extra texts, widens the image->text side.
    `positives` (B, B) bool, text i fits image j: off-diagonal pairs that also match (a partial
    caption fits many images) are left out of both softmaxes rather than pushed apart.
    """
    target = torch.arange(sim.shape[0], device=sim.device)
    if positives is not None:
        also = positives & ~torch.eye(sim.shape[0], dtype=torch.bool, device=sim.device)
        sim = sim.masked_fill(also, float("-inf"))
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
    weight = torch.cat(
        [
            torch.full_like(pos_logits, neg_logits.numel() / max(pos_logits.numel(), 1)),
            torch.ones_like(neg_logits),
        ]
    )
    return F.binary_cross_entropy_with_logits(logits, labels, weight=weight, reduction="sum") / (
        2 * neg_logits.numel()
    )


def _hinges(sim: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hinges [S_ij - S_ii + m]_+ (rows) and [S_ji - S_ii + m]_+ (columns); diagonal 0."""
    pos = sim.diagonal()
    off = ~torch.eye(sim.shape[0], dtype=torch.bool, device=sim.device)
    rows = (sim - pos[:, None] + margin).clamp(min=0) * off
    cols = (sim - pos[None, :] + margin).clamp(min=0) * off
    return rows, cols.t()


def triplet_sum_loss(sim: torch.Tensor, margin: float = 0.2) -> torch.Tensor:
    """Hinge triplet over every in-batch negative, both directions, mean over the batch."""
    rows, cols = _hinges(sim, margin)
    return (rows.sum(1) + cols.sum(1)).mean()


def triplet_hardest_loss(sim: torch.Tensor, margin: float = 0.1) -> torch.Tensor:
    """Rerank-Smart's bi-encoder triplet (VSE++): only the hardest in-batch negative per side."""
    rows, cols = _hinges(sim, margin)
    return (rows.max(1).values + cols.max(1).values).mean()


def softmax_triplet_loss(sim: torch.Tensor, margin: float = 0.2, p: float = 8.0) -> torch.Tensor:
    """HAN's soft-max triplet: the p-norm of each anchor's hinge terms, both directions.

    p = 1 is `triplet_sum_loss`; as p grows it approaches `triplet_hardest_loss`.
    """
    rows, cols = _hinges(sim, margin)
    return (_pnorm(rows, p) + _pnorm(cols, p)).mean()


def _pnorm(x: torch.Tensor, p: float) -> torch.Tensor:
    """Row-wise p-norm of non-negative x, scaled by the row max so large p cannot overflow."""
    top = x.max(dim=1, keepdim=True).values.clamp(min=1e-12)
    # the epsilon keeps the gradient finite for anchors whose hinges are all zero
    return top.squeeze(1) * (((x / top) ** p).sum(dim=1) + 1e-12) ** (1.0 / p)


def cmc_loss(
    images: torch.Tensor, texts: torch.Tensor, delta: float = 0.2, sigma: float = 0.3
) -> torch.Tensor:
    """TGDT's consistent multimodal contrastive loss L_r + L_a on L2-normalised (B, d) vectors.

    For pair i, l- is the hardest wrong text for image i and v- the hardest wrong image for
    text i; L_r is the inter-modal triplet with margin delta, L_a asks the image-image and
    text-text similarities of the same two pairs to agree within the slack sigma.
    """
    return cmc_loss_from_sim(
        (texts @ images.t()), images @ images.t(), texts @ texts.t(), delta, sigma
    )


def cmc_loss_from_sim(
    s_ti: torch.Tensor,
    s_ii: torch.Tensor,
    s_tt: torch.Tensor,
    delta: float = 0.2,
    sigma: float = 0.3,
    positives: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cmc_loss` from score matrices: s_ti (B, B) text x image (any cross-modal score, e.g.
    TGDT's S_gl), s_ii image x image and s_tt text x text. `positives` (B, B) text x image:
    pairs that match besides the diagonal are never picked as the hardest negative."""
    s_it = s_ti.t()  # S(I_i, T_j)
    b = s_it.shape[0]
    eye = torch.eye(b, dtype=torch.bool, device=s_it.device)
    if positives is not None:
        eye = eye | positives.t()
    rows = torch.arange(b, device=s_it.device)
    neg_l = s_it.masked_fill(eye, float("-inf")).argmax(dim=1)  # hardest text per image
    neg_v = s_it.masked_fill(eye, float("-inf")).argmax(dim=0)  # hardest image per text
    pos = s_it.diagonal()
    l_r = (delta - pos + s_it[rows, neg_l]).clamp(min=0) + (delta - pos + s_it[neg_v, rows]).clamp(
        min=0
    )
    l_a = ((s_ii[rows, neg_l] - s_tt[rows, neg_l]).abs() - sigma).clamp(min=0) + (
        (s_ii[rows, neg_v] - s_tt[rows, neg_v]).abs() - sigma
    ).clamp(min=0)
    return (l_r + l_a).mean()
