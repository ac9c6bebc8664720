"""What decides the trained weights (kept free of torch so `duet --help` is fast)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from models.shipped import DEFAULT_WEIGHTS

__all__ = [
    "DEFAULT_WEIGHTS",
    "HELD_OUT_SEED_BASE",
    "PARTIAL_SEED",
    "VAL_IMAGES",
    "TrainConfig",
    "check_validation_seeds",
]

# World seeds at or above this are never used for training; tests draw their splits there.
HELD_OUT_SEED_BASE = 1_000_000
# `duet eval --partial`'s queries are drawn with this world seed, apart from the test splits'
PARTIAL_SEED = HELD_OUT_SEED_BASE + 13_000
# held-out images (and partial queries) a trained model is validated on, recorded in train.json
VAL_IMAGES = 300


def check_validation_seeds(seeds: Iterable[int]) -> None:
    """ValueError unless every seed is a validation split's (below HELD_OUT_SEED_BASE): what
    chooses a model or a setting never reads a test split."""
    for seed in seeds:
        if seed >= HELD_OUT_SEED_BASE:
            raise ValueError(
                f"world seed {seed} is a test split's, not a validation seed (they are below "
                f"{HELD_OUT_SEED_BASE:,}); use validation seeds only"
            )


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights."""

    seed: int = 0
    images: int = 20_000
    steps: int = 1_300
    batch: int = 112
    lr: float = 8e-4
    warmup: int = 150
    weight_decay: float = 0.02
    threads: int = 2
    # validation after training (the figures train.json records): this many held-out images
    # and as many partial queries; fewer is quicker, and its figures are not comparable
    val_images: int = VAL_IMAGES
    # auto (a CUDA GPU when torch sees one, else the CPU), cpu or cuda: where stages 0 to 2
    # train (models.device.resolve_device); stage 3 (HAN) and validation run on the CPU
    device: str = "auto"
    ground_weight: float = 4.0  # cross-encoder: each noun's fused state -> its thing's centre
    ground_layer: int = 2  # ... after this many fusion layers (the rest compare positions)
    late_weight: float = 0.5  # TGDT: CMC on S_gl = (S_g + S_l) / 2 in bi-encoder steps
    aux_weight: float = 0.5  # patch supervision (what is centred where) on the image tokens
    partial: float = 0.5  # share of training captions that leave things out (world.partial_desc)
    # stage 0 (from scratch only): the image tower alone learns what is centred where (the
    # patch labels), as the papers' region features come from a detector trained on object
    # and attribute labels; stage 1 then starts from a tower that tells the shapes apart
    tower_steps: int = 1_500
    tower_batch: int = 64
    easy_steps: int = 300  # cross-encoder sees random in-batch negatives first, hardest after
    # second stage: the cross-encoder afresh on the frozen states (models.train_ce)
    ce_steps: int = 2_000
    ce_batch: int = 64
    ce_lr: float = 1e-3
    ce_warm: bool = False  # stage 2 fine-tunes the cross-encoder it is given instead of afresh
    tune: bool = False  # with --from: stage 1 continues from that model for `steps` steps
    ce_flip: float = 0.5  # share of the perturbed negatives that are relation flips
    # share of the two-thing scenes whose perturbed negative has another count of its first
    # thing (world.count_twin: one against two or three, two against three; world.perturb alone
    # changes a count for about 120 of 20,000 twins, and only two against three). Until issue 37
    # it swapped two and three only; tried so (0.3 afresh, 0.5 as a fine-tune) it changed
    # nothing beyond a few queries of 5,000 (models/weights/README.md, "Tried and not shipped")
    ce_count: float = 0.0
    # share of stage 2's captions written as people type them (world.typed: no article "a",
    # "and" for "with"); 0 = off
    ce_typed: float = 0.0
    # with this > 0, stage 2 also shows each caption the wrong images its cross-encoder scores
    # highest among the bi-encoder's top `ce_mine` (models.ce_mining); 0 = off
    ce_mine: int = 0
    # > 0: each mined list is the top `ce_mine` of a random draw of this many training images
    # (the band a served index of that size reaches), not of all of them; 0 = all
    ce_mine_index: int = 0
    # share of each stage-2 batch drawn, from the mining step on, among the training images
    # whose own full captions the cross-encoder scores below 0 (models.ce_mining); 0 = off
    ce_hard: float = 0.0
    # the blind spots ce_hard draws from also count one-thing captions of two-thing scenes
    ce_hard_parts: bool = False
    # share of each stage-2 batch's images shown moved by up to 4 pixels (models.ce_moves):
    # the same scene at another alignment against the patch grid; 0 = off
    ce_move: float = 0.0
    # a hard negative's rank among the bi-encoder's training images, drawn log-uniformly below
    # this: the top 50 of a 1,000-2,000 image index is the top 500-1,000 of 20,000 training
    # images, and a cross-encoder that only ever saw the top 8 ranked the easy-but-wrong
    # candidates deeper in the list above the right one (coop R@1 fell from M = 10 to M = 50)
    ce_ranks: int = 1_000
    # third stage: the HAN head over the frozen towers (soft-max triplet, exponent p)
    han_steps: int = 400
    han_batch: int = 32
    han_lr: float = 1e-3
    han_p: float = 8.0
    han_margin: float = 0.2
