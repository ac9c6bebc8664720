"""`duet eval`: recall (and partial-query precision) of an index's corpus per re-ranking mode."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from duet.commands.common import (
    HelpFormatter,
    fail,
    index_corpus,
    load_settings,
    model_choices,
    model_options,
    setup_logging,
)


def add(sub: Any) -> None:
    """eval"""
    from models.late import DEFAULT_THETA

    e = sub.add_parser(
        "eval",
        formatter_class=HelpFormatter,
        help="recall@1/5/10 of an index's corpus per re-ranking mode",
        description="Evaluate retrieval on an index's own image-caption pairs, "
        "as the papers do: every caption finds its image (t2i), every image "
        "finds any of its captions (i2t). Modes: dot (bi-encoder), coop (dot "
        "top-M then the cross-encoder), late (dot top-M then TGDT's global + "
        "token-level S_gl), han (dot top-M then the HAN head), ce-full (the "
        "cross-encoder over the "
        "whole pool, on a query sample; pools of at most 1000 images). The pool is "
        "what the index holds: for a benchmark split, build that split into its "
        "own index (duet build --corpus dataset_flickr30k.json --split test "
        "--out idx-f30k-test), then evaluate it.",
    )
    e.add_argument(
        "--index", required=True, help="index directory (its `current`) or one version directory"
    )
    e.add_argument(
        "--split",
        default=None,
        help="check that the index was built from this Karpathy split (e.g. test) "
        "and stop with an error otherwise; the pool is always the index's items",
    )
    e.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    e.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (by default each re-ranker's scoring shows one on stderr)",
    )
    e.add_argument(
        "--modes",
        default=None,
        help="comma-separated: dot, coop, late, han, ce-full (default: all; han "
        "when the model has a HAN head)",
    )
    e.add_argument(
        "--theta",
        type=float,
        default=DEFAULT_THETA,
        help=f"late: S_gl = (1 - theta) * dot + theta * S_l (default {DEFAULT_THETA})",
    )
    e.add_argument(
        "--candidates",
        type=int,
        default=20,
        help="M, candidates the cross-encoder re-ranks (default 20)",
    )
    e.add_argument("--m-sweep", action="store_true", help="also coop with M = 10, 20, 50, 100")
    e.add_argument(
        "--fusion-sweep",
        action="store_true",
        help="also ADD_lambda and NORM_ADD_lambda fusion, lambda = 0.1, 0.5, 0.9, and "
        "ADD at the service default (DUET_RERANK_FUSION_LAMBDA's default)",
    )
    _add_pool_options(e)
    e.set_defaults(fn=cmd_eval)


def _add_pool_options(e: argparse.ArgumentParser) -> None:
    """Partial queries, distractors, the models and the device."""
    from models.trainconfig import PARTIAL_SEED

    e.add_argument(
        "--partial",
        type=int,
        default=0,
        metavar="N",
        help='also N partial text queries ("a red circle", "two blue squares"), '
        "judged by whether each hit's scene fits: P@1 and P@10 per mode and for the "
        "service default (needs scene meta: a duet demo-corpus index; default 0)",
    )
    e.add_argument(
        "--partial-seed",
        type=int,
        default=PARTIAL_SEED,
        help=f"world seed the partial queries are drawn with, held out from training "
        f"(default {PARTIAL_SEED})",
    )
    e.add_argument(
        "--distractors",
        type=Path,
        default=None,
        help="another index whose items join the pool (queries stay the same)",
    )
    e.add_argument(
        "--ce-full-queries",
        type=int,
        default=100,
        help="queries per direction that ce-full scores against the whole pool (default 100)",
    )
    e.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="model weights directory (default: $DUET_MODEL_DIR, else the shipped weights)",
    )
    model_options(e, "scores")
    e.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="run the models on (default: $DUET_DEVICE, else auto: CUDA when a GPU is present)",
    )


def eval_modes() -> tuple[str, ...]:
    """`duet eval --modes`: the dot product, the cross-encoder alone over the top M (coop),
    each registered re-ranker `duet eval` can run (`models.rerankers`), every pair (ce-full)."""
    from models.rerankers import REGISTRY

    return ("dot", "coop", *(n for n, e in REGISTRY.items() if e.evaluate), "ce-full")


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from duet.evaluation import evaluate_index, evaluate_partial, load_pool
    from models.eval_modes import M_SWEEP, format_tables
    from models.eval_pool import TextTokens
    from models.loading import check_choices, load_models
    from models.world import partial_queries

    if args.candidates < 1:  # before any work: a wrong figure fails fast, not after it
        return fail("--candidates must be at least 1 (M, the candidates each query re-ranks)")
    if not 0.0 <= args.theta <= 1.0:
        return fail("--theta must be 0 to 1 (S_gl = (1 - theta) * dot + theta * S_l)")
    setup_logging("warning")
    settings = load_settings(model_dir=args.model_dir, device=args.device)
    encoder, reranker, labels = model_choices(args, settings)
    modes = _modes(args, reranker, labels[1])
    check_choices(encoder, reranker, labels=labels)  # before the index: a typo fails fast
    corpus = index_corpus(Path(args.index))  # before the model: a wrong index fails fast
    _check_split(args, corpus)
    if args.partial:
        _check_scenes(Path(args.index))
    model = load_models(
        encoder,
        reranker,
        settings.model_dir,
        settings.device,
        labels=labels,
        precision=settings.precision,  # DUET_PRECISION: what the service would score with
    )
    scorers = _token_scorers(args, model, modes, settings.model_dir)
    version, pool = load_pool(Path(args.index), model.fingerprint, args.distractors)
    say = (lambda _: None) if args.json else (lambda m: print(m, file=sys.stderr))
    if scorers:
        say(f"token features of {len(pool.texts)} texts for {', '.join(scorers)}")
    result = evaluate_index(
        pool,
        model if model.cross is not None else None,
        candidates=args.candidates,
        modes=modes,
        m_sweep=M_SWEEP if args.m_sweep else (),
        fusion_sweep=args.fusion_sweep,
        ce_full_queries=args.ce_full_queries,
        progress=say,
        bars=not args.no_progress,
        token_scorers=scorers,
        text_tokens=TextTokens.of(model.joint, pool.texts) if model.joint and scorers else None,
    )
    if args.partial:
        say(f"{args.partial} partial queries (seed {args.partial_seed})")
        result["partial"] = {
            "seed": args.partial_seed,
            **evaluate_partial(
                pool,
                model,
                model if model.cross is not None else None,
                partial_queries(args.partial, args.partial_seed),
                candidates=args.candidates,
                modes=modes,
                token_scorers=scorers,
                token_encoder=model.joint,
                bars=not args.no_progress,
            ),
        }
    result["index_version"] = version
    result["corpus"] = corpus
    if args.distractors:  # the pool is the index's and these: said with the tables
        result["distractors"] = str(args.distractors)
    if "late" in modes:
        result["theta"] = args.theta
    result["models"] = model.parts()
    print(json.dumps(result) if args.json else format_tables(result))
    return 0


def _modes(args: argparse.Namespace, reranker: str, label: str) -> list[str]:
    """The modes to run (--modes, else every one), checked against the options and the
    configured re-ranker; a UserError says what to change."""
    from models.errors import UserError
    from models.trainconfig import HELD_OUT_SEED_BASE

    if args.partial < 0:
        raise UserError("--partial must be 0 (none) or more queries")
    if args.partial and args.partial_seed < HELD_OUT_SEED_BASE:
        raise UserError(
            f"--partial-seed must be at least {HELD_OUT_SEED_BASE}: seeds below are training's"
        )
    known = eval_modes()
    if args.modes is not None and not args.modes.strip(", "):
        raise UserError(f"--modes names no mode; choose from {', '.join(known)} (or leave it out)")
    modes = [m.strip() for m in (args.modes or ",".join(known)).split(",") if m.strip()]
    if unknown := set(modes) - set(known):
        raise UserError(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(known)}")
    if reranker == "late":
        raise UserError(
            f"{label}=late: duet eval re-ranks with a cross-encoder (coop, "
            "ce-full); late interaction is the mode `late` (--modes dot,late) with "
            "--reranker ce"
        )
    if reranker == "none":
        if args.modes and set(modes) != {"dot"}:
            raise UserError(f"{label}=none: only --modes dot runs without a re-ranker")
        modes = ["dot"]
    return modes


def _check_split(args: argparse.Namespace, corpus: dict[str, Any] | None) -> None:
    """--split: the index must have been built from that Karpathy split."""
    from models.errors import UserError

    corpus = corpus or {}
    if args.split is None or (corpus.get("split") == args.split and "changed_from" not in corpus):
        return
    built = (
        f"split {corpus['split']!r} of {corpus['path']}"
        if corpus.get("split")
        else f"{corpus.get('path', 'no corpus file')} (no Karpathy split)"
    )
    if "changed_from" in corpus:  # its `corpus` is the last --append's file, not the whole
        built = (
            f"version {corpus['changed_from']} by an --append or --delete (the last read "
            f"{built}), so its items are not one split's"
        )
    raise UserError(
        f"--split {args.split}: index {args.index} was built from {built}; "
        f"build that split into its own index first: duet build --corpus "
        f"dataset_....json --split {args.split} --out DIR, then duet eval "
        "--index DIR"
    )


def _check_scenes(index: Path) -> None:
    """--partial judges hits by their image's scene: an index without one (any corpus but
    the demo world's) is refused now, not after the whole evaluation has been scored."""
    from models.errors import UserError
    from store.indexio import ITEMS, version_dir
    from store.items import ItemStore

    store = ItemStore(version_dir(index) / ITEMS)
    try:
        first = store.images([0])
    except KeyError:  # no image at all
        first = []
    finally:
        store.close()
    if not first or "scene" not in first[0].meta:
        raise UserError(
            "--partial judges each hit by its image's scene (meta.scene, as a `duet "
            f"demo-corpus` corpus has); {index}'s images have none: leave --partial out"
        )


def _token_scorers(
    args: argparse.Namespace, model: Any, modes: list[str], model_dir: Path | None
) -> dict[str, Any]:
    """`duet eval`'s scorer of each registered re-ranker among `modes` that has one; a mode
    the models cannot run is an error when asked for by name, else left out of `modes`."""
    from models.errors import UserError
    from models.rerankers import REGISTRY
    from models.trainconfig import DEFAULT_WEIGHTS

    scorers: dict[str, Any] = {}
    for name, entry in REGISTRY.items():
        if name not in modes or entry.evaluate is None:
            continue
        scorer = entry.evaluate(model, args.theta)
        if isinstance(scorer, str):
            if args.modes:
                raise UserError(f"mode {name}: {scorer} ({model_dir or DEFAULT_WEIGHTS})")
            modes.remove(name)
            continue
        scorers[name] = scorer
    return scorers
