"""The `duet` command: serve, build, train, demo-corpus."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.config import Settings


def eval_modes() -> tuple[str, ...]:
    """`duet eval --modes`: the dot product, the cross-encoder alone over the top M (coop),
    each registered re-ranker `duet eval` can run (`models.rerankers`), every pair (ce-full)."""
    from models.rerankers import REGISTRY

    return ("dot", "coop", *(n for n, e in REGISTRY.items() if e.evaluate), "ce-full")


log = logging.getLogger("duet")

EXIT_USAGE = 2


def _setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _settings(**overrides: Any) -> Settings:
    """The one configuration of every command: DUET_* from the environment or .env
    (`app.config.Settings`), a command's flags given as `overrides`."""
    from pydantic import ValidationError

    from app.config import Settings
    from models.errors import UserError

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        bad = "; ".join(
            f"DUET_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        raise UserError(f"invalid setting(s): {bad} (see .env.example for every setting)") from exc


def _model_choices(
    args: argparse.Namespace, settings: Settings
) -> tuple[str, str, tuple[str, str]]:
    """(encoder, reranker, their labels for errors): --encoder / --reranker, else DUET_ENCODER /
    DUET_RERANKER (the service's settings, so a build matches what is served)."""
    enc_flag, rr_flag = getattr(args, "encoder", None), getattr(args, "reranker", None)
    return (
        enc_flag or settings.encoder,
        rr_flag or settings.reranker,
        ("--encoder" if enc_flag else "DUET_ENCODER", "--reranker" if rr_flag else "DUET_RERANKER"),
    )


def _fail(message: str) -> int:
    print(f"duet: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.limits import uvicorn_options
    from app.main import create_app, load_resources

    settings = _settings(host=args.host, port=args.port, index_dir=args.index_dir)
    _setup_logging(settings.log_level)
    resources = load_resources(settings)
    app = create_app(settings, resources)
    log.info(
        "serving on http://%s:%d (index %s, model on %s)",
        settings.host,
        settings.port,
        resources.index.version,
        getattr(resources.model, "device", "cpu"),
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        **uvicorn_options(settings),
    )
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from index_builder.build import build
    from models.loading import load_models

    _setup_logging()
    if args.corpus and args.append:
        return _fail(
            "give --corpus (a new build) or --append (add to the current version), not both"
        )
    if args.corpus and args.delete:
        return _fail("--delete changes the current version: use it alone or with --append")
    corpus = args.corpus or args.append
    if corpus is None and args.delete is None:
        return _fail("give --corpus MANIFEST, --append MANIFEST or --delete IDS_FILE")
    if corpus is not None and not Path(corpus).is_file():
        return _fail(f"corpus manifest {corpus} does not exist")
    if corpus is None and (args.split is not None or args.images_root is not None):
        return _fail("--split and --images-root select from a --corpus or --append file")
    settings = _settings(model_dir=args.model_dir, device=args.device, index_factory=args.factory)
    encoder, reranker, labels = _model_choices(args, settings)
    model = load_models(encoder, reranker, settings.model_dir, settings.device, labels=labels)
    log.info(
        "encoder %s, image tokens for %s (%s, shape %s)",
        model.encoder_part.fingerprint,
        model.token_part.fingerprint,
        model.name,
        model.token_shape,
    )
    report = build(
        Path(corpus) if corpus else None,
        Path(args.out),
        model,
        batch_size=args.batch_size,
        skip_bad=args.skip_bad,
        progress=not args.no_progress,
        factory=settings.index_factory or None,
        shard_size=args.shard_size,
        workers=args.workers,
        device=settings.device,
        engine=args.engine,
        append=args.append is not None,
        delete=args.delete,
        ray_actors=args.ray_actors,
        split=args.split,
        images_root=args.images_root,
    )
    m = report.manifest
    print(
        f"built {report.path} ({report.images} images, {report.texts} texts, "
        f"{m['index_type']}) in {report.seconds:.1f}s; "
        f"{Path(args.out) / 'current'} -> {report.version}"
    )
    print(
        f"encoded {report.encoded} items in {report.encode_seconds:.1f}s: "
        f"{report.items_per_s:.1f} items/s ({m['build']['engine']} engine, "
        f"{m['build']['device']}); {report.resumed_shards} of {report.shards} shards resumed"
    )
    for name, info in m["indexes"].items():
        print(
            f"  {name}: {info['factory']}, recall@10 {info['recall_at_10']:.4f} vs exact, "
            f"{info['bytes_per_vector']:.1f} bytes/vector"
        )
    if report.skipped:
        print(f"skipped {len(report.skipped)} bad entries:")
        for line in report.skipped:
            print(f"  {line}")
    return 0


def cmd_demo_corpus(args: argparse.Namespace) -> int:
    from models.world import write_corpus

    if args.images < 1:
        return _fail("--images must be at least 1")
    manifest = write_corpus(
        Path(args.out),
        args.images,
        args.seed,
        n_captions=args.captions,
        progress=not args.no_progress,
    )
    print(f"wrote {args.images} images and {args.images * args.captions} captions: {manifest}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from duet.evaluation import (
        M_SWEEP,
        TextTokens,
        TokenScorer,
        evaluate_index,
        evaluate_partial,
        format_tables,
        load_pool,
    )
    from models.loading import check_choices, load_models
    from models.trainconfig import DEFAULT_WEIGHTS, HELD_OUT_SEED_BASE
    from models.world import partial_queries

    _setup_logging("warning")
    if args.partial < 0:
        return _fail("--partial must be 0 (none) or more queries")
    if args.partial and args.partial_seed < HELD_OUT_SEED_BASE:
        return _fail(
            f"--partial-seed must be at least {HELD_OUT_SEED_BASE}: seeds below are training's"
        )
    from models.rerankers import REGISTRY

    known = eval_modes()
    modes = [m.strip() for m in (args.modes or ",".join(known)).split(",") if m.strip()]
    if unknown := set(modes) - set(known):
        return _fail(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(known)}")
    settings = _settings(model_dir=args.model_dir, device=args.device)
    encoder, reranker, labels = _model_choices(args, settings)
    if reranker == "late":
        return _fail(
            f"{labels[1]}=late: duet eval re-ranks with a cross-encoder (coop, "
            "ce-full); late interaction is the mode `late` (--modes dot,late) with "
            "--reranker ce"
        )
    if reranker == "none":
        if args.modes and set(modes) != {"dot"}:
            return _fail(f"{labels[1]}=none: only --modes dot runs without a re-ranker")
        modes = ["dot"]
    check_choices(encoder, reranker, labels=labels)  # before the index: a typo fails fast
    corpus = _index_corpus(Path(args.index))  # before the model: a wrong index fails fast
    if args.split is not None and (corpus or {}).get("split") != args.split:
        built = (
            f"split {corpus['split']!r} of {corpus['path']}"
            if corpus and corpus.get("split")
            else f"{(corpus or {}).get('path', 'no corpus file')} (no Karpathy split)"
        )
        return _fail(
            f"--split {args.split}: index {args.index} was built from {built}; "
            f"build that split into its own index first: duet build --corpus "
            f"dataset_....json --split {args.split} --out DIR, then duet eval "
            "--index DIR"
        )
    model = load_models(encoder, reranker, settings.model_dir, settings.device, labels=labels)
    scorers: dict[str, TokenScorer] = {}
    for name, entry in REGISTRY.items():  # the registered re-rankers duet eval can run
        if name not in modes or entry.evaluate is None:
            continue
        scorer = entry.evaluate(model, args.theta)
        if isinstance(scorer, str):
            if args.modes:
                return _fail(f"mode {name}: {scorer} ({settings.model_dir or DEFAULT_WEIGHTS})")
            modes.remove(name)
            continue
        scorers[name] = scorer
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
            ),
        }
    result["index_version"] = version
    result["corpus"] = corpus
    result["models"] = model.parts()
    print(json.dumps(result) if args.json else format_tables(result))
    return 0


def _index_corpus(index: Path) -> dict[str, object] | None:
    """What `duet eval` evaluated: the corpus file an index was built from and its split."""
    from store.indexio import read_manifest, version_dir

    manifest = read_manifest(version_dir(index))
    corpus = manifest.get("corpus")
    if corpus is None:
        return None
    return {"path": corpus, **(manifest.get("corpus_selection") or {"format": "manifest"})}


def cmd_demo_index(args: argparse.Namespace) -> int:
    """First-run convenience (make serve, docker compose): a demo index unless one exists."""
    import fcntl

    from index_builder.build import build
    from models.loading import load_models
    from models.world import write_corpus

    _setup_logging()
    settings = _settings()
    encoder, reranker, labels = _model_choices(args, settings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # several replicas may start at once on one shared volume (k8s init containers): one builds
    with (out / ".demo-index.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "current").exists():
            print(f"{out / 'current'} exists; nothing to do")
            return 0
        corpus = Path(args.corpus_out) if args.corpus_out else out.parent / "demo-corpus"
        print(f"no index in {out}: generating {args.images} demo images in {corpus} and building")
        manifest = write_corpus(corpus, args.images, args.seed, progress=not args.no_progress)
        # the models the service will serve (DUET_ENCODER, DUET_RERANKER)
        model = load_models(encoder, reranker, settings.model_dir, settings.device, labels=labels)
        report = build(
            manifest,
            out,
            model,
            progress=not args.no_progress,
            factory=settings.index_factory or None,
        )
    print(
        f"built {report.path} ({report.images} images, {report.texts} texts) in "
        f"{report.seconds:.1f}s"
    )
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the service answers /healthz with 200 (Docker HEALTHCHECK, k8s exec probes)."""
    import urllib.error
    import urllib.request

    url = args.url or f"http://127.0.0.1:{_settings().port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"duet: unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


def cmd_train(args: argparse.Namespace) -> int:
    from models.evaluate import format_table
    from models.train import train
    from models.trainconfig import TrainConfig

    _setup_logging()
    cfg = TrainConfig(
        seed=args.seed,
        images=args.images,
        steps=args.steps,
        batch=args.batch,
        ce_steps=args.ce_steps,
        han_steps=args.han_steps,
        ce_lr=args.ce_lr,
        ce_warm=args.ce_warm,
        tune=args.tune,
        lr=args.lr,
        warmup=args.warmup,
        easy_steps=args.easy_steps,
        aux_weight=args.aux_weight,
    )
    if args.tune and not args.init_from:
        return _fail("--tune continues the model of --from DIR: give --from")
    init_from = Path(args.init_from) if args.init_from else None
    if init_from is not None and not (init_from / "config.json").is_file():
        return _fail(f"--from {init_from} is not a trained model directory (no config.json)")
    try:
        summary = train(cfg, Path(args.out), progress=not args.no_progress, init_from=init_from)
    except ValueError as exc:
        return _fail(str(exc))
    print(f"trained in {summary['train_seconds']}s -> {args.out} ({summary['fingerprint']})")
    print(format_table(summary["validation"]))  # type: ignore[arg-type]
    return 0


def _model_options(p: argparse.ArgumentParser, verb: str) -> None:
    """--encoder and --reranker: the same choices as DUET_ENCODER and DUET_RERANKER."""
    p.add_argument(
        "--encoder",
        default=None,
        help=f"the bi-encoder it {verb} with: builtin (duet's model, --model-dir) or a "
        "local Hugging Face CLIP / SigLIP directory (default: $DUET_ENCODER, else "
        "builtin)",
    )
    p.add_argument(
        "--reranker",
        default=None,
        help="the re-ranker whose image tokens the index stores and that re-ranks: "
        "ce (duet's cross-encoder; builtin is its older name), late, han, none, or a local "
        "Hugging Face BLIP image-text-matching directory (default: $DUET_RERANKER, else ce)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("duet")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def parser() -> argparse.ArgumentParser:
    from models.late import DEFAULT_THETA
    from models.trainconfig import DEFAULT_WEIGHTS, PARTIAL_SEED, TrainConfig

    p = argparse.ArgumentParser(
        prog="duet",
        description="Image-text retrieval: encode a corpus into FAISS indexes, "
        "serve text->image and image->text search with cross-encoder re-ranking.",
    )
    p.add_argument("--version", action="version", version=f"duet {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="run the HTTP service on INDEX_DIR/current",
        description="Run the HTTP service. Settings come from DUET_* environment "
        "variables (DUET_INDEX_DIR, DUET_HOST, DUET_PORT, DUET_ENCODER, "
        "DUET_RERANKER, DUET_REDIS_URL, ...); the flags below override them.",
    )
    s.add_argument("--host", help="bind address (DUET_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (DUET_PORT, default 8000)")
    s.add_argument(
        "--index-dir",
        type=Path,
        help="serves INDEX_DIR/current (DUET_INDEX_DIR, default ./indexes)",
    )
    s.set_defaults(fn=cmd_serve)

    b = sub.add_parser(
        "build",
        help="encode a corpus into a new index version",
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
    b.add_argument("--out", default="indexes", help="index directory (default: ./indexes)")
    b.add_argument(
        "--factory",
        default=None,
        help="FAISS index-factory string, inner product: Flat, IVF1024,Flat, "
        "IVF4096_HNSW32,SQ8, IVF1024,PQ16, HNSW32, ... (DUET_INDEX_FACTORY; default: "
        "by size, Flat up to 200k vectors, IVF above)",
    )
    b.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
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
        help="image-decoding DataLoader workers (default: on a GPU cores - 1, at "
        "most 8; on CPU cores / 4, at most 4; 0 = decode in the main process)",
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
        help=f"model weights directory (default: $DUET_MODEL_DIR, else the shipped "
        f"{DEFAULT_WEIGHTS})",
    )
    _model_options(b, "encodes")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(fn=cmd_build)

    d = sub.add_parser(
        "demo-corpus",
        help="generate a synthetic image-caption corpus",
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
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(fn=cmd_demo_corpus)

    e = sub.add_parser(
        "eval",
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
    _model_options(e, "scores")
    e.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="run the models on (default: $DUET_DEVICE, else auto: CUDA when a GPU is present)",
    )
    e.set_defaults(fn=cmd_eval)

    i = sub.add_parser(
        "demo-index",
        help="generate the demo corpus and build it, unless OUT/current exists",
        description="First-run convenience used by `make serve` and the "
        "docker-compose index-init job: if OUT/current does not exist, generate a "
        "synthetic corpus and build it into OUT; otherwise do nothing.",
    )
    i.add_argument("--out", default="indexes", help="index directory (default: ./indexes)")
    i.add_argument(
        "--corpus-out", default=None, help="where the demo images go (default: OUT/../demo-corpus)"
    )
    i.add_argument("--images", type=int, default=2000, help="number of images (default 2000)")
    i.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    i.add_argument("--no-progress", action="store_true", help="no progress bars")
    i.set_defaults(fn=cmd_demo_index)

    h = sub.add_parser(
        "healthcheck",
        help="exit 0 if the service answers /healthz",
        description="Probe a running service: exit 0 when GET /healthz answers "
        "200, else 1. Used by the Docker HEALTHCHECK.",
    )
    h.add_argument(
        "--url", default=None, help="URL to probe (default: http://127.0.0.1:$DUET_PORT/healthz)"
    )
    h.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    h.set_defaults(fn=cmd_healthcheck)

    defaults = TrainConfig()
    t = sub.add_parser(
        "train",
        help="train duet's own model on the synthetic world",
        description="Train duet's model from scratch on CPU in three stages "
        "and save safetensors weights, config and vocabulary: (1) the joint "
        "bi-encoder / cross-encoder, (2) the cross-encoder afresh on the frozen "
        "token states, with many more steps, (3) the HAN head over the frozen "
        "states (han.safetensors). --from skips stage 1.",
    )
    t.add_argument(
        "--out",
        required=True,
        help=f"output directory (required: the shipped weights live in {DEFAULT_WEIGHTS}; "
        "name it only to replace them on purpose)",
    )
    t.add_argument("--seed", type=int, default=defaults.seed)
    t.add_argument("--images", type=int, default=defaults.images, help="training scenes")
    t.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    t.add_argument("--batch", type=int, default=defaults.batch, help="pairs per batch")
    t.add_argument(
        "--ce-steps",
        type=int,
        default=defaults.ce_steps,
        help="stage 2: cross-encoder steps on the frozen states (0 = keep stage 1's; "
        "not with --from)",
    )
    t.add_argument(
        "--han-steps",
        type=int,
        default=defaults.han_steps,
        help="stage 3: HAN head steps (0 = no HAN head; with --from, DIR's head is kept)",
    )
    t.add_argument(
        "--ce-lr",
        type=float,
        default=defaults.ce_lr,
        help=f"stage 2: peak learning rate (default {defaults.ce_lr})",
    )
    t.add_argument(
        "--ce-warm",
        action="store_true",
        help="stage 2 fine-tunes the cross-encoder it is given (DIR's with --from, "
        "else stage 1's) instead of training one afresh",
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
    t.add_argument(
        "--from",
        dest="init_from",
        default=None,
        metavar="DIR",
        help="skip stage 1: keep the towers and projections of the trained model in "
        "DIR exactly (same vectors and token states) and train stages 2 and 3 on top",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(fn=cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure a user can fix (`models.errors.UserError`: a wrong
    path, setting, choice or file) is caught here, once: its message, exit status 2."""
    from models.errors import UserError

    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except UserError as exc:
        return _fail(f"{exc}\n  {exc.hint}" if exc.hint else str(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
