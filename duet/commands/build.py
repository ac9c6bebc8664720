"""`duet build`: a corpus into a new index version (`duet demo-corpus` and `duet demo-index`,
registered with it, live in `duet.commands.demo`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from duet.commands.common import (
    EXIT_INTERRUPTED,
    HelpFormatter,
    fail,
    load_settings,
    log,
    model_choices,
    model_options,
    setup_logging,
    unwritable,
)
from index_builder.options import BuildReport, default_batch


def add(sub: Any) -> None:
    """build, demo-corpus, demo-index"""
    from duet.commands import demo

    _add_build(sub)
    demo.add(sub)


def _add_build(sub: Any) -> None:
    from models.trainconfig import DEFAULT_WEIGHTS

    b = sub.add_parser(
        "build",
        formatter_class=HelpFormatter,
        help="encode a corpus into a new index version",
        epilog="examples:\n\n"
        "  duet build --corpus data/demo/manifest.jsonl --out indexes\n"
        "  duet build --append more.jsonl --out indexes     # a new version with them added\n"
        "  duet build --delete gone-ids.txt --out indexes   # one id a line\n"
        "  duet build --corpus dataset_flickr30k.json --split test \\\n"
        "      --images-root flickr30k-images --out idx-f30k-test\n\n"
        "The corpus format, resuming and updating a served index: docs/corpus-and-indexes.md "
        "in duet's repository.",
        description="Encode images and captions of a corpus into "
        "OUT/<version>/ (FAISS indexes, vectors, item store, manifest.json) and "
        "atomically point OUT/current at it. A corpus is a JSONL manifest "
        "(.jsonl, one image per line) or a Karpathy split file (.json: "
        "dataset_flickr30k.json, dataset_coco.json; needs --split). Encoding is "
        "written in shards under OUT/.shards/; run the same command again after a "
        "crash to resume.",
    )
    b.add_argument(
        "--corpus",
        help="manifest.jsonl (one image per line) or a Karpathy dataset_*.json: a fresh build",
    )
    b.add_argument(
        "--append",
        metavar="CORPUS",
        help="add this manifest's items to OUT/current as a new version, reusing the "
        "stored vectors of the old ones (ids must be new)",
    )
    b.add_argument(
        "--delete",
        type=Path,
        metavar="IDS_FILE",
        help="drop these item ids (one per line; an image's captions go with it) "
        "from OUT/current, alone or with --append",
    )
    b.add_argument(
        "--split",
        default=None,
        help="Karpathy .json corpora only, required there: which images to read: "
        "test (the papers' Flickr30k 1k / COCO 5k test set), val, train, restval, "
        "a comma-separated list (train,restval), or all",
    )
    b.add_argument(
        "--images-root",
        type=Path,
        default=None,
        help="Karpathy .json corpora only: the folder holding the images, as "
        "ROOT/<filename> (Flickr30k) or ROOT/<filepath>/<filename> (COCO: "
        "ROOT/val2014/...) (default: the .json file's folder)",
    )
    _add_build_options(b, DEFAULT_WEIGHTS)


def _add_build_options(b: argparse.ArgumentParser, weights: Path) -> None:
    """Where it writes, how it encodes, with which models."""
    b.add_argument("--out", default="indexes", help="index directory (default: ./indexes)")
    b.add_argument(
        "--factory",
        default=None,
        help="FAISS index-factory string, inner product: Flat, IVF1024,Flat, "
        "IVF4096_HNSW32,SQ8, IVF1024,PQ16, HNSW32, ... (DUET_INDEX_FACTORY; default: "
        "by size, Flat up to 200k vectors, IVF{n},Flat below 1M, IVF{n}_HNSW32,SQ8 from 1M)",
    )
    b.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="images per forward pass (default: 256 for duet's builtin model, 64 for Hugging "
        "Face models, whose activations are larger)",
    )
    b.add_argument(
        "--shard-size",
        type=int,
        default=1024,
        help="items per shard; a killed build resumes from the last whole shard",
    )
    b.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes. On a GPU they decode images for it (default: cores - 1, "
        "at most 32); on CPU each decodes and encodes pieces of shards (a batch of images, a "
        "chunk of captions) on one thread (default: one per core, at most 32). 0 = all in "
        "the main process",
    )
    b.add_argument(
        "--decode-jpeg",
        default="cpu",
        metavar="{cpu,gpu,SHARE}",
        help="where a CUDA build decodes JPEGs: cpu (default: in the worker processes, "
        "exactly as the service decodes an upload), gpu (nvJPEG, needs torchvision; its "
        "pixels differ from the CPU's by a level or so), or a share between 0 and 1, e.g. "
        "0.4: that share of them on the GPU, the rest in the workers at the same time",
    )
    b.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="encode on (default: $DUET_DEVICE, else auto: CUDA with autocast when "
        "a GPU is present)",
    )
    b.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: this process; ray: a Ray Data actor pool (RAY_ADDRESS picks "
        "the cluster; needs the [ray] extra)",
    )
    b.add_argument(
        "--ray-actors",
        type=int,
        default=None,
        help="encoding actors for --engine ray (default: one per GPU, else per 2 CPUs)",
    )
    b.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip malformed lines and unreadable images, list them at the end "
        "(default: stop at the first one)",
    )
    b.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help=f"model weights directory (default: $DUET_MODEL_DIR, else the shipped {weights})",
    )
    model_options(b, "encodes")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(fn=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    """`duet build`; Ctrl-C ends it with one line (the shards stay, for the rerun to resume),
    which says so when the version was already published (a Ctrl-C during the clean-up)."""
    before = _current(Path(args.out))
    try:
        return _build(args)
    except KeyboardInterrupt:
        # the DataLoader's workers saw the same Ctrl-C and end; the exception (and with it the
        # loader, which shuts them down) is let go before this returns
        after = _current(Path(args.out))
        if after is not None and after != before:
            done = f"duet: interrupted after publishing version {after}, which is current: "
            print(done + "the build is done, nothing to run again", file=sys.stderr)
        elif any(Path(args.out).glob(".shards/*/shard-*.npy")):
            print(
                f"duet: interrupted; the shards written so far are kept in {Path(args.out)}: "
                "run the same command again to resume",
                file=sys.stderr,
            )
        else:
            print(
                "duet: interrupted before any shard was written; run the same command again",
                file=sys.stderr,
            )
        return EXIT_INTERRUPTED


def _current(out: Path) -> str | None:
    """The version `OUT/current` points at, or None."""
    try:
        return os.readlink(out / "current")
    except OSError:
        return None


def _option_problem(args: argparse.Namespace, device: str) -> str | None:
    """Why the sizes or the engine's options cannot be used, told before the model loads."""
    if args.decode_jpeg != "cpu" and device == "cpu":
        return (
            f"--decode-jpeg {args.decode_jpeg} leaves JPEGs to a CUDA build's GPU, and this "
            "build runs on the CPU (--device cpu or DUET_DEVICE=cpu): leave it out"
        )
    if (args.batch_size is not None and args.batch_size < 1) or args.shard_size < 1:
        return "--batch-size and --shard-size must be at least 1"
    if args.workers is not None and args.workers < 0:
        return "--workers must be 0 or more"
    if why := unwritable("--out", Path(args.out)):
        return why
    if args.delete:
        try:
            listed = Path(args.delete).read_bytes()
        except OSError as exc:
            return f"cannot read ids file {args.delete}: {exc.strerror or exc}"
        # a --factory or DUET_INDEX_FACTORY (the build's factory) makes it a reindex
        if not (args.append or args.factory or os.environ.get("DUET_INDEX_FACTORY")):
            from index_builder.sources import no_ids

            try:  # blank lines only: told before the model loads ("#" lines may be ids)
                if not listed.decode("utf-8-sig").strip():
                    return no_ids(args.delete)
            except UnicodeError:
                pass  # said by the build, which reads the file again
    if args.ray_actors is not None and args.engine != "ray":
        return "--ray-actors applies to --engine ray: leave it out, or add --engine ray"
    return None


def _corpus_problem(corpus: str) -> str | None:
    """Why a --corpus / --append path is not a corpus file, or None."""
    path = Path(corpus)
    if path.is_dir():
        inside = path / "manifest.jsonl"
        hint = f" ({inside}?)" if inside.is_file() else ""
        return (
            f"corpus {corpus} is a directory: give the manifest file itself{hint}, a .jsonl "
            "with one image per line (or a Karpathy .json)"
        )
    if not path.is_file():
        return f"corpus manifest {corpus} does not exist"
    return None


def _build(args: argparse.Namespace) -> int:
    from index_builder.build import build
    from models.loading import load_models

    setup_logging()
    if args.corpus and args.append:
        return fail(
            "give --corpus (a new build) or --append (add to the current version), not both"
        )
    if args.corpus and args.delete:
        return fail("--delete changes the current version: use it alone or with --append")
    corpus = args.corpus or args.append
    if corpus is None and args.delete is None:
        return fail("give --corpus MANIFEST, --append MANIFEST or --delete IDS_FILE")
    if corpus is not None and (problem := _corpus_problem(corpus)):
        return fail(problem)
    if corpus is None and (args.split is not None or args.images_root is not None):
        return fail("--split and --images-root select from a --corpus or --append file")
    settings = load_settings(
        model_dir=args.model_dir, device=args.device, index_factory=args.factory
    )
    if problem := _option_problem(args, settings.device):
        return fail(problem)
    encoder, reranker, labels = model_choices(args, settings)
    model = load_models(encoder, reranker, settings.model_dir, settings.device, labels=labels)
    log.info(
        "encoder %s, image tokens for %s (%s, shape %s)",
        model.encoder_part.fingerprint,
        model.token_part.fingerprint,
        model.name,
        model.token_shape,
    )
    before = _current_manifest(Path(args.out))
    report = build(
        Path(corpus) if corpus else None,
        Path(args.out),
        model,
        batch_size=default_batch(model) if args.batch_size is None else args.batch_size,
        skip_bad=args.skip_bad,
        progress=not args.no_progress,
        factory=settings.index_factory or None,
        shard_size=args.shard_size,
        workers=args.workers,
        decode_jpeg=args.decode_jpeg,
        device=settings.device,
        engine=args.engine,
        append=args.append is not None,
        delete=args.delete,
        ray_actors=args.ray_actors,
        split=args.split,
        images_root=args.images_root,
    )
    _summary(report, Path(args.out), before)
    return 0


def _summary(report: BuildReport, out: Path, before: Any) -> None:
    """What a build made, as it ends: the version, the rate, the indexes, what it skipped,
    and what it warns of (`before`: the manifest current pointed to before, or None)."""
    from store.manifest import BuildSettings

    m = report.manifest
    b = m.build or BuildSettings()
    print(
        f"built {report.path} ({report.images} images, {report.texts} texts, "
        f"{m.index_type}) in {report.seconds:.1f}s; "
        f"{out / 'current'} -> {report.version}"
    )
    resumed = f"{report.resumed_shards} of {report.shards} shards resumed"
    if report.encoded:
        print(
            f"encoded {report.encoded} items in {report.encode_seconds:.1f}s: "
            f"{report.items_per_s:.1f} items/s ({b.engine} engine, {b.device}); {resumed}"
        )
    else:  # every shard resumed, or a --delete: no rate to tell
        print(f"encoded nothing new ({resumed})")
    for name, info in m.indexes.items():
        print(
            f"  {name}: {info.factory}, recall@10 {info.recall_at_10:.4f} vs exact, "
            f"{info.bytes_per_vector:.1f} bytes/vector"
        )
    if report.skipped:
        n = len(report.skipped)
        print(f"skipped {n} bad {'entry' if n == 1 else 'entries'}:")
        for line in report.skipped:
            print(f"  {line}")
    if report.unread:  # said before the encoding too; again here, past the progress bars
        print(f"warning: {report.unread}")
    if before is not None and before.version != report.version and before.files == m.files:
        print(  # a second run of one build: a copy, without a word before
            f"note: {report.version} holds the very files of {before.version}, which current "
            "pointed to before (the corpus, models and index choices are unchanged); the older "
            "one can be deleted"
        )


def _current_manifest(out: Path) -> Any:
    """The manifest of the version OUT/current points to, or None (none yet, or unreadable:
    the build says what is wrong with it where that matters)."""
    from store.indexio import Manifest, version_dir

    try:
        return Manifest.read(version_dir(out))
    except Exception:  # only a note depends on it
        return None
