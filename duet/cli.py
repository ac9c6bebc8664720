"""The `duet` command: serve, build, train, demo-corpus."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("duet")

EXIT_USAGE = 2


def _setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(message: str) -> int:
    print(f"duet: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.config import Settings
    from app.main import create_app, load_resources
    from duet.indexio import IndexLoadError
    from models.builtin import ModelLoadError

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                   ("index_dir", args.index_dir)) if v is not None}
    settings = Settings(**overrides)
    _setup_logging(settings.log_level)
    try:
        resources = load_resources(settings)
    except (IndexLoadError, ModelLoadError) as exc:
        return _fail(str(exc))
    app = create_app(settings, resources)
    log.info("serving on http://%s:%d (index %s)", settings.host, settings.port,
             resources.index.version)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False)
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from index_builder.build import BuildError, build
    from index_builder.corpus import CorpusError
    from index_builder.encode import DeviceError
    from models.builtin import BuiltinModel, ModelLoadError

    _setup_logging()
    if args.corpus and args.append:
        return _fail("give --corpus (a new build) or --append (add to the current version), "
                     "not both")
    if args.corpus and args.delete:
        return _fail("--delete changes the current version: use it alone or with --append")
    corpus = args.corpus or args.append
    if corpus is None and args.delete is None:
        return _fail("give --corpus MANIFEST, --append MANIFEST or --delete IDS_FILE")
    if corpus is not None and not Path(corpus).is_file():
        return _fail(f"corpus manifest {corpus} does not exist")
    try:
        model = BuiltinModel.load(args.model_dir)
        report = build(Path(corpus) if corpus else None, Path(args.out), model,
                       batch_size=args.batch_size, skip_bad=args.skip_bad,
                       progress=not args.no_progress, factory=args.factory or None,
                       shard_size=args.shard_size, workers=args.workers, device=args.device,
                       engine=args.engine, append=args.append is not None,
                       delete=args.delete, ray_actors=args.ray_actors)
    except CorpusError as exc:
        return _fail(f"{exc}\n  fix or remove that line, or pass --skip-bad to skip bad lines")
    except (ModelLoadError, BuildError, DeviceError) as exc:
        return _fail(str(exc))
    m = report.manifest
    print(f"built {report.path} ({report.images} images, {report.texts} texts, "
          f"{m['index_type']}) in {report.seconds:.1f}s; "
          f"{Path(args.out) / 'current'} -> {report.version}")
    print(f"encoded {report.encoded} items in {report.encode_seconds:.1f}s: "
          f"{report.items_per_s:.1f} items/s ({m['build']['engine']} engine, "
          f"{m['build']['device']}); {report.resumed_shards} of {report.shards} shards resumed")
    for name, info in m["indexes"].items():
        print(f"  {name}: {info['factory']}, recall@10 {info['recall_at_10']:.4f} vs exact, "
              f"{info['bytes_per_vector']:.1f} bytes/vector")
    if report.skipped:
        print(f"skipped {len(report.skipped)} bad line(s):")
        for line in report.skipped:
            print(f"  {line}")
    return 0


def cmd_demo_corpus(args: argparse.Namespace) -> int:
    from models.world import write_corpus

    if args.images < 1:
        return _fail("--images must be at least 1")
    manifest = write_corpus(Path(args.out), args.images, args.seed, n_captions=args.captions,
                            progress=not args.no_progress)
    print(f"wrote {args.images} images and {args.images * args.captions} captions: {manifest}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from models.evaluate import format_table
    from models.train import train
    from models.trainconfig import TrainConfig

    _setup_logging()
    cfg = TrainConfig(seed=args.seed, images=args.images, steps=args.steps, batch=args.batch)
    summary = train(cfg, Path(args.out), progress=not args.no_progress)
    print(f"trained in {summary['train_seconds']}s -> {args.out} ({summary['fingerprint']})")
    print(format_table(summary["validation"]))  # type: ignore[arg-type]
    return 0


def parser() -> argparse.ArgumentParser:
    from models.trainconfig import DEFAULT_WEIGHTS, TrainConfig

    p = argparse.ArgumentParser(
        prog="duet", description="Image-text retrieval: encode a corpus into FAISS indexes, "
        "serve text->image and image->text search with cross-encoder re-ranking.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the HTTP service on INDEX_DIR/current",
                       description="Run the HTTP service. Settings come from DUET_* environment "
                       "variables (DUET_INDEX_DIR, DUET_HOST, DUET_PORT, DUET_REDIS_URL, ...); "
                       "the flags below override them.")
    s.add_argument("--host", help="bind address (DUET_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (DUET_PORT, default 8000)")
    s.add_argument("--index-dir", type=Path, help="serves INDEX_DIR/current "
                   "(DUET_INDEX_DIR, default ./indexes)")
    s.set_defaults(fn=cmd_serve)

    b = sub.add_parser("build", help="encode a corpus into a new index version",
                       description="Encode images and captions of a JSONL corpus manifest into "
                       "OUT/<version>/ (FAISS indexes, vectors, item store, manifest.json) and "
                       "atomically point OUT/current at it. Encoding is written in shards under "
                       "OUT/.shards/; run the same command again after a crash to resume.")
    b.add_argument("--corpus", help="manifest.jsonl (one image per line): a fresh build")
    b.add_argument("--append", metavar="CORPUS",
                   help="add this manifest's items to OUT/current as a new version, reusing the "
                   "stored vectors of the old ones (ids must be new)")
    b.add_argument("--delete", type=Path, metavar="IDS_FILE",
                   help="drop these item ids (one per line; an image's captions go with it) "
                   "from OUT/current, alone or with --append")
    b.add_argument("--out", default="indexes", help="index directory (default: ./indexes)")
    b.add_argument("--factory", default=os.environ.get("DUET_INDEX_FACTORY"),
                   help="FAISS index-factory string, inner product: Flat, IVF1024,Flat, "
                   "IVF4096_HNSW32,SQ8, IVF1024,PQ16, HNSW32, ... (DUET_INDEX_FACTORY; default: "
                   "by size, Flat up to 200k vectors, IVF above)")
    b.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
    b.add_argument("--shard-size", type=int, default=1024,
                   help="items per shard; a killed build resumes from the last whole shard")
    b.add_argument("--workers", type=int, default=None,
                   help="image-decoding DataLoader workers (default: on a GPU cores - 1, at "
                   "most 8; on CPU cores / 4, at most 4; 0 = decode in the main process)")
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="encode on (auto: CUDA with autocast when a GPU is present)")
    b.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local: this process; ray: a Ray Data actor pool (RAY_ADDRESS picks "
                   "the cluster; needs the [ray] extra)")
    b.add_argument("--ray-actors", type=int, default=None,
                   help="encoding actors for --engine ray (default: one per GPU, else per 2 CPUs)")
    b.add_argument("--skip-bad", action="store_true",
                   help="skip malformed lines and unreadable images, list them at the end "
                   "(default: stop at the first one)")
    b.add_argument("--model-dir", type=Path, default=None,
                   help=f"model weights directory (default: the shipped {DEFAULT_WEIGHTS})")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(fn=cmd_build)

    d = sub.add_parser("demo-corpus", help="generate a synthetic image-caption corpus",
                       description="Render scenes of coloured shapes with several captions "
                       "each; the same seed gives the same bytes.")
    d.add_argument("--out", required=True, help="directory for manifest.jsonl and images/")
    d.add_argument("--images", type=int, default=2000, help="number of images (default 2000)")
    d.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    d.add_argument("--captions", type=int, default=5, choices=range(3, 7), metavar="{3..6}",
                   help="captions per image (default 5)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(fn=cmd_demo_corpus)

    defaults = TrainConfig()
    t = sub.add_parser("train", help="train duet's own model on the synthetic world",
                       description="Train the joint bi-encoder / cross-encoder from scratch on "
                       "CPU and save safetensors weights, config and vocabulary.")
    t.add_argument("--out", default=str(DEFAULT_WEIGHTS), help="output directory")
    t.add_argument("--seed", type=int, default=defaults.seed)
    t.add_argument("--images", type=int, default=defaults.images, help="training scenes")
    t.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    t.add_argument("--batch", type=int, default=defaults.batch, help="pairs per batch")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(fn=cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
