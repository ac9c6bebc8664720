"""`duet train`: duet's own model on the synthetic world."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duet.commands.common import (
    HelpFormatter,
    fail,
    setup_logging,
    unwritable,
)

if TYPE_CHECKING:
    from models.trainconfig import TrainConfig


TRAIN_EXAMPLES = """examples:

  duet train --out my-model                 # from scratch (about 45 min on 2 cores)
  duet train --out my-ce --from models/weights --ce-warm --ce-steps 400
  DUET_MODEL_DIR=my-model duet serve        # serve it (build its index first)

What each stage and option does: docs/design.md ("The model (JOINT+COOP)")."""


def add(sub: Any) -> None:
    """train"""
    from models.trainconfig import DEFAULT_WEIGHTS, TrainConfig

    defaults = TrainConfig()
    t = sub.add_parser(
        "train",
        formatter_class=HelpFormatter,
        help="train duet's own model on the synthetic world",
        epilog=TRAIN_EXAMPLES,
        description="Train duet's model from scratch in four stages "
        "and save safetensors weights, config and vocabulary: (0) the image tower "
        "on the scenes' patch labels, (1) the joint "
        "bi-encoder / cross-encoder, (2) the cross-encoder afresh on the frozen "
        "token states, with many more steps, (3) the HAN head over the frozen "
        "states (han.safetensors). On 2 cores: about 41-45 min in all; --from skips stages 0 "
        "and 1 (about 30 min; with --ce-warm --ce-steps 400, about 8). Stages 0 to 2 run on "
        "a CUDA GPU when torch sees one (--device).",
    )
    t.add_argument(
        "--out",
        required=True,
        help=f"output directory (required: the shipped weights live in {DEFAULT_WEIGHTS}; "
        "name it only to replace them on purpose)",
    )
    seed_help = "draws the training scenes and initial weights"
    t.add_argument("--seed", type=int, default=defaults.seed, help=seed_help)
    t.add_argument("--images", type=int, default=defaults.images, help="training scenes")
    t.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    t.add_argument("--batch", type=int, default=defaults.batch, help="pairs per batch")
    _add_stage_options(t, defaults)
    _add_cross_encoder_options(t, defaults)
    t.add_argument(
        "--from",
        dest="init_from",
        default=None,
        metavar="DIR",
        help="skip stage 1: keep the towers and projections of the trained model in "
        "DIR exactly (same vectors and token states) and train stages 2 and 3 on top",
    )
    t.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=defaults.device,
        help="where stages 0 to 2 train: auto (a CUDA GPU when torch sees one, else the CPU), "
        "cpu, or cuda (an error without a GPU); stage 3 and validation run on the CPU. A seeded "
        "run repeats bit for bit on the CPU only",
    )
    t.add_argument(
        "--val-images",
        type=int,
        default=defaults.val_images,
        help=f"held-out images (and partial queries) validated after training, recorded in "
        f"train.json (default {defaults.val_images}; fewer is quicker, not comparable)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(fn=cmd_train)
    s = sub.add_parser(
        "soup",
        formatter_class=HelpFormatter,
        help="average the cross-encoders of several fine-tunes of one model",
        description="Write a model whose cross-encoder is the mean of the sources' (a model "
        "soup): each a `duet train --from THE_SAME_DIR --ce-warm --han-steps 0` fine-tune, so "
        "everything "
        "but the cross-encoder is identical (refused otherwise). Fewer blind spots than any "
        "one source at the cost of one cross-encoder; validated like `duet train` (about "
        "20 s) and recorded in DIR/train.json with every source's own record.",
    )
    s.add_argument("--out", required=True, metavar="DIR", help="output directory")
    s.add_argument("sources", nargs="+", metavar="SOURCE", help="trained model directories")
    s.add_argument(
        "--val-images",
        type=int,
        default=defaults.val_images,
        help=f"held-out images validated, as duet train's (default {defaults.val_images})",
    )
    s.set_defaults(fn=cmd_soup)


def _add_stage_options(t: argparse.ArgumentParser, defaults: Any) -> None:
    """What each stage does and how long it runs."""
    t.add_argument(
        "--tower-steps",
        type=int,
        default=defaults.tower_steps,
        help="stage 0 (from scratch only): the image tower alone learns which shape, "
        "colour and size is centred where (0 = none)",
    )
    t.add_argument(
        "--han-steps",
        type=int,
        default=defaults.han_steps,
        help="stage 3: HAN head steps (0 = no HAN head; with --from, DIR's head is kept)",
    )
    t.add_argument(
        "--tune",
        action="store_true",
        help="with --from: stage 1 continues from DIR's weights for --steps steps "
        "(encoders included) instead of keeping its encoders",
    )
    t.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        help=f"stage 1: peak learning rate (default {defaults.lr})",
    )
    t.add_argument(
        "--warmup",
        type=int,
        default=defaults.warmup,
        help=f"stage 1: warm-up steps (default {defaults.warmup})",
    )
    t.add_argument(
        "--aux-weight",
        type=float,
        default=defaults.aux_weight,
        help="stage 1: weight of the patch probe's loss on the image states (default "
        f"{defaults.aux_weight}; the probe starts untrained, also with --tune)",
    )
    t.add_argument(
        "--easy-steps",
        type=int,
        default=defaults.easy_steps,
        help="stage 1: steps with random negatives only before the hard ones "
        f"(default {defaults.easy_steps})",
    )


def _add_cross_encoder_options(t: argparse.ArgumentParser, defaults: Any) -> None:
    """Stage 2: the cross-encoder on the frozen states."""
    t.add_argument(
        "--ce-steps",
        type=int,
        default=defaults.ce_steps,
        help="stage 2: cross-encoder steps on the frozen states (0 = keep stage 1's; "
        "not with --from)",
    )
    t.add_argument(
        "--ce-lr",
        type=float,
        default=defaults.ce_lr,
        help=f"stage 2: peak learning rate (default {defaults.ce_lr})",
    )
    t.add_argument(
        "--ce-count",
        type=float,
        default=defaults.ce_count,
        help="stage 2: share of the two-thing scenes whose perturbed negative has another "
        "count of its first thing (one against two or three, two against three)",
    )
    t.add_argument(
        "--ce-typed",
        type=float,
        default=defaults.ce_typed,
        help="stage 2: share of the captions written as people type them (no article 'a', "
        "'and' for 'with')",
    )
    t.add_argument(
        "--ce-mine",
        type=int,
        default=defaults.ce_mine,
        metavar="M",
        help="stage 2: also show each caption the wrong images the cross-encoder itself "
        "scores highest among the bi-encoder's top M, mined once: before the first step "
        "with --ce-warm, else halfway; about 6 min on 2 cores for M = 50 (0 = off)",
    )
    t.add_argument(
        "--ce-mine-index",
        type=int,
        default=defaults.ce_mine_index,
        metavar="N",
        help="stage 2: mine each caption's top M among its own random draw of about N "
        "training images, the depth a served index of N images reaches (1,000: the top 50 "
        "spans the top ~1,000 of 20,000), instead of among all of them (0 = all)",
    )
    t.add_argument(
        "--ce-hard",
        type=float,
        default=defaults.ce_hard,
        metavar="SHARE",
        help="stage 2: from the mining step on (the first with --ce-warm, else halfway), "
        "draw this share (0 to 1) of each batch among the training images whose own captions "
        "the cross-encoder scores below 0, its blind spots (0 = off)",
    )
    t.add_argument(
        "--ce-hard-parts",
        action="store_true",
        help="with --ce-hard: an image is also a blind spot when the cross-encoder scores "
        "below 0 a caption naming one thing of its two ('a small yellow triangle' beside a "
        "large yellow cross), the misreading short queries meet",
    )
    t.add_argument(
        "--ce-move",
        type=float,
        default=defaults.ce_move,
        metavar="SHARE",
        help="stage 2: show this share (0 to 1) of each batch's images moved by up to 4 "
        "pixels (states computed once, about 30 s more on 2 cores), so the cross-encoder "
        "sees each scene at two alignments against the patch grid (0 = off)",
    )
    t.add_argument(
        "--ce-warm",
        action="store_true",
        help="stage 2 fine-tunes the cross-encoder it is given (DIR's with --from, "
        "else stage 1's) instead of training one afresh; with --from DIR --ce-steps 0, "
        "DIR's cross-encoder is kept as it is and only the HAN head trains (about 9 min for "
        "--han-steps 2000 on 2 cores)",
    )


def config_of(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig `duet train`'s options ask for (the rest at their defaults)."""
    from models.trainconfig import TrainConfig

    return TrainConfig(
        seed=args.seed,
        images=args.images,
        steps=args.steps,
        batch=args.batch,
        tower_steps=args.tower_steps,
        ce_steps=args.ce_steps,
        han_steps=args.han_steps,
        ce_lr=args.ce_lr,
        ce_warm=args.ce_warm,
        ce_count=args.ce_count,
        ce_typed=args.ce_typed,
        ce_mine=args.ce_mine,
        ce_mine_index=args.ce_mine_index,
        ce_hard=args.ce_hard,
        ce_hard_parts=args.ce_hard_parts,
        ce_move=args.ce_move,
        tune=args.tune,
        lr=args.lr,
        warmup=args.warmup,
        easy_steps=args.easy_steps,
        aux_weight=args.aux_weight,
        device=args.device,
        val_images=args.val_images,
    )


def _out_of_range(args: argparse.Namespace) -> str | None:
    """Why an option of `duet train` is out of its range, or None."""
    at_least = {"images": 2, "batch": 2, "val_images": 1}  # a batch needs a negative
    at_least |= dict.fromkeys(("steps", "tower_steps", "ce_steps", "han_steps", "warmup"), 0)
    at_least |= dict.fromkeys(("easy_steps", "ce_mine", "ce_mine_index"), 0)
    for name, low in at_least.items():
        if getattr(args, name) < low:
            return f"--{name.replace('_', '-')} must be at least {low}"
    for name in ("lr", "ce_lr"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be more than 0"
    if not args.aux_weight >= 0:
        return "--aux-weight must be 0 or more"
    for name in ("ce_count", "ce_typed", "ce_hard", "ce_move"):
        if not 0 <= getattr(args, name) <= 1:
            return f"--{name.replace('_', '-')} is a share: 0 to 1"
    return None


def cmd_train(args: argparse.Namespace) -> int:
    from models.evaluate import format_table
    from models.train import train

    if why := _out_of_range(args):  # before any work: torch's or numpy's words otherwise
        return fail(why)
    if why := unwritable("--out", Path(args.out)):
        return fail(why)
    setup_logging()
    cfg = config_of(args)
    if args.tune and not args.init_from:
        return fail("--tune continues the model of --from DIR: give --from")
    init_from = Path(args.init_from) if args.init_from else None
    if init_from is not None and not (init_from / "config.json").is_file():
        return fail(f"--from {init_from} is not a trained model directory (no config.json)")
    try:
        summary = train(cfg, Path(args.out), progress=not args.no_progress, init_from=init_from)
    except ValueError as exc:
        return fail(str(exc))
    print(f"trained in {summary['train_seconds']}s -> {args.out} ({summary['fingerprint']})")
    print(format_table(summary["validation"]))  # type: ignore[arg-type]
    return 0


def cmd_soup(args: argparse.Namespace) -> int:
    from models.evaluate import format_table
    from models.soup import soup

    setup_logging()
    if args.val_images < 1:
        return fail("--val-images must be at least 1")
    if why := unwritable("--out", Path(args.out)):
        return fail(why)
    summary = soup(Path(args.out), [Path(p) for p in args.sources], args.val_images)
    print(f"averaged {len(args.sources)} cross-encoders -> {args.out} ({summary['fingerprint']})")
    print(format_table(summary["validation"]))
    return 0
