"""`duet demo-corpus` (a synthetic image-caption corpus) and `duet demo-index` (the first
run's demo index); registered with `duet build` (`duet.commands.build.add`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from duet.commands.common import HelpFormatter, fail, load_settings, model_choices, setup_logging


def add(sub: Any) -> None:
    """demo-corpus, demo-index"""
    d = sub.add_parser(
        "demo-corpus",
        formatter_class=HelpFormatter,
        help="generate a synthetic image-caption corpus",
        epilog="examples:\n\n"
        "  duet demo-corpus --out data/demo2 --images 500\n"
        "  duet demo-corpus --out /tmp/photos --images 20000 --format jpeg   # photo-sized\n",
        description="Render scenes of coloured shapes with several captions "
        "each; the same seed gives the same bytes.",
    )
    d.add_argument("--out", required=True, help="directory for manifest.jsonl and images/")
    d.add_argument("--images", type=int, default=2000, help="number of images (default 2000)")
    d.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    d.add_argument(
        "--captions",
        type=int,
        default=5,
        choices=range(3, 7),
        metavar="{3..6}",
        help="captions per image (default 5)",
    )
    d.add_argument(
        "--format",
        choices=("png", "jpeg"),
        default="png",
        help="png: the world's own 64-pixel images; jpeg: photo-sized JPEGs with film grain, "
        "which cost what users' photos cost to decode (default png)",
    )
    d.add_argument(
        "--image-size",
        default=None,
        metavar="WxH",
        help="JPEG width x height (default 512x384; --format jpeg only)",
    )
    d.add_argument(
        "--quality", type=int, default=90, help="JPEG quality, 1-95 (default 90; jpeg only)"
    )
    d.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that scale and encode the JPEGs, most of their cost (default: every "
        "core this process may use, one under 256 images; at most the cores; the bytes are "
        "the same whatever the number; jpeg only)",
    )
    d.add_argument(
        "--force",
        action="store_true",
        help="write the corpus into --out even if it holds files no demo corpus wrote (a "
        "demo corpus there is written over without it; its images no longer listed go)",
    )
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(fn=cmd_demo_corpus)

    i = sub.add_parser(
        "demo-index",
        formatter_class=HelpFormatter,
        help="generate the demo corpus and build it, unless OUT/current exists and was built "
        "by the models the service will serve",
        description="First-run convenience used by `make serve` and the "
        "docker-compose index-init job: if OUT/current does not exist, generate a "
        "synthetic corpus and build it into OUT. If it is the demo index built by other "
        "weights, build it again from the same corpus as a new version; otherwise do nothing.",
    )
    i.add_argument("--out", default="indexes", help="index directory (default: ./indexes)")
    i.add_argument(
        "--corpus-out", default=None, help="where the demo images go (default: OUT/../demo-corpus)"
    )
    i.add_argument("--images", type=int, default=2000, help="number of images (default 2000)")
    i.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    i.add_argument("--no-progress", action="store_true", help="no progress bars")
    i.set_defaults(fn=cmd_demo_index)


def _photo_style(args: argparse.Namespace) -> Any:
    """The `PhotoStyle` of --format jpeg (None for png), or a message why the options clash."""
    from models.world import PhotoStyle

    if args.format == "png":
        if args.image_size is not None or args.quality != 90 or args.workers is not None:
            return "--image-size, --quality and --workers apply to --format jpeg"
        return None
    size = PhotoStyle().size
    if args.image_size is not None:
        w, _, h = args.image_size.lower().partition("x")
        if not (w.isdigit() and h.isdigit() and 16 <= int(w) <= 8192 and 16 <= int(h) <= 8192):
            return f"--image-size {args.image_size!r}: give WIDTHxHEIGHT, 16 to 8192 each"
        size = (int(w), int(h))
    if not 1 <= args.quality <= 95:
        return "--quality must be 1 to 95"
    return PhotoStyle(size=size, quality=args.quality)


def _not_ours(
    out: Path, force: str = ", or pass --force to write the corpus over them"
) -> str | None:
    """Why a demo corpus may not be written into `out` (it holds a user's files), or None."""
    from models.world.corpus import foreign_files

    found = foreign_files(out)
    if not found:
        return None
    if not out.is_dir():
        return f"{out} is a file, not a folder: choose a folder for the corpus"
    return (
        f"{out} already holds files no demo corpus wrote ({', '.join(found)}"
        f"{', ...' if len(found) == 5 else ''}): choose a new or empty folder{force}"
    )


def cmd_demo_corpus(args: argparse.Namespace) -> int:
    from models.world import write_corpus

    if args.images < 1:
        return fail("--images must be at least 1")
    if not args.force and (why := _not_ours(Path(args.out))):
        return fail(why)
    photo = _photo_style(args)
    if isinstance(photo, str):
        return fail(photo)
    if args.workers is not None and args.workers < 1:
        return fail("--workers must be at least 1")
    manifest = write_corpus(
        Path(args.out),
        args.images,
        args.seed,
        n_captions=args.captions,
        progress=not args.no_progress,
        photo=photo,
        workers=_corpus_workers(args.workers, args.images) if photo is not None else 1,
    )
    print(f"wrote {args.images} images and {args.images * args.captions} captions: {manifest}")
    return 0


def _corpus_workers(asked: int | None, images: int) -> int:
    """--workers (at most the cores this process may use: more only share them), or by
    default every core; one for a corpus too small to pay for starting processes (about a
    second for 16)."""
    from app.engine import available_cores  # (index_builder's count imports torch)

    cores = available_cores()
    if asked is not None:
        return min(asked, cores)
    return cores if images >= 256 else 1


def cmd_demo_index(args: argparse.Namespace) -> int:
    """First-run convenience (make serve, docker compose): a demo index unless one built by
    the models the service will serve exists. A demo index built by other weights (a pull
    that brought new ones) is built again as a new version; any other index is left alone."""
    import fcntl

    from index_builder.build import build
    from index_builder.options import default_batch
    from models.loading import load_models
    from models.world import write_corpus

    if args.images < 1:
        return fail("--images must be at least 1")
    setup_logging()
    settings = load_settings()
    encoder, reranker, labels = model_choices(args, settings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus_out) if args.corpus_out else out.parent / "demo-corpus"
    # several replicas may start at once on one shared volume (k8s init containers): one builds
    with (out / ".demo-index.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # the models the service will serve (DUET_ENCODER, DUET_RERANKER)
        model = load_models(encoder, reranker, settings.model_dir, settings.device, labels=labels)
        exists = (out / "current").exists()
        if exists and not _stale_demo_index(out, corpus, model.fingerprint):
            return 0
        # a stale demo index is built again from the corpus it was built from, which its
        # version (perhaps still served by older replicas) keeps pointing at: never rewritten;
        # so is a corpus this command finished before (an interrupted first run's): rendered
        # again, its files' times would key new shards and the build would start over
        manifest = corpus / "manifest.jsonl"
        kept = exists or _same_demo_corpus(corpus, args.images, args.seed)
        if not (kept and manifest.is_file()):
            if why := _not_ours(corpus, force=""):
                return fail(f"--corpus-out: {why}")
            print(f"no index in {out}: generating {args.images} demo images in {corpus}")
            manifest = write_corpus(corpus, args.images, args.seed, progress=not args.no_progress)
        elif not exists:
            print(f"no index in {out}: building the demo corpus already in {corpus}")
        report = build(
            manifest,
            out,
            model,
            batch_size=default_batch(model),
            progress=not args.no_progress,
            factory=settings.index_factory or None,
        )
    print(
        f"built {report.path} ({report.images} images, {report.texts} texts) in "
        f"{report.seconds:.1f}s"
    )
    return 0


def _same_demo_corpus(corpus: Path, images: int, seed: int) -> bool:
    """Whether `corpus` holds a finished demo corpus of `images` images drawn with `seed`."""
    from models.world.corpus import demo_images

    listed = demo_images(corpus)
    if listed is None or len(listed) != images or not (corpus / "manifest.jsonl").is_file():
        return False
    with (corpus / "manifest.jsonl").open(encoding="utf-8") as fh:
        return json.loads(fh.readline()).get("meta", {}).get("seed") == seed


def _stale_demo_index(out: Path, corpus: Path, fingerprint: str) -> bool:
    """Whether `out`'s current version is a demo index (built from `corpus`) that other
    models built, so it must be built again; says what it found either way."""
    from models.errors import UserError
    from store.errors import IndexLoadError
    from store.indexio import resolve_current
    from store.manifest import Manifest

    version = resolve_current(out)
    try:
        manifest = Manifest.read(version)
    except IndexLoadError as exc:
        raise UserError(
            f"{exc}; {out / 'current'} is damaged: point it at a sound version (`ln -sfn "
            f"VERSION {out / 'current'}`), or delete {out} to build the demo index anew"
        ) from exc
    built_by = manifest.model.fingerprint
    if built_by == fingerprint:
        print(f"{out / 'current'} exists, built by these models; nothing to do")
        return False
    demo = (corpus / "manifest.jsonl").resolve()
    if manifest.corpus is None or Path(manifest.corpus).resolve() != demo:
        print(
            f"{out / 'current'} ({version.name}) was built by {built_by} from "
            f"{manifest.corpus}, not the demo corpus; left as it is. The service will refuse "
            f"it with the models it loads now ({fingerprint}): rebuild it with `duet build`"
        )
        return False
    print(
        f"{out / 'current'} ({version.name}) is the demo index built by {built_by}; the "
        f"models are now {fingerprint}: building it again as a new version (the old one stays)"
    )
    return True
