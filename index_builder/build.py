"""`duet build`: read a corpus -> encode in shards -> train/fill FAISS -> write a version ->
point `current` at it.

Resumable: encoded shards are written (temp name, fsync, rename) under `OUT/.shards/<key>/`
as they finish, <key> hashing all that decides their contents (model, device and autocast
dtype, batch and shard size, the corpus file's bytes and how it was read, each image's path,
size and mtime, an append's base). A build started again with the same arguments skips the
shards already there; encoding order, batches and the FAISS seed are fixed and no time goes
into the data files, so a resumed build writes the same bytes (IDENTICAL_FILES).
Incremental: `append=True` adds a corpus's items to the current version, `delete` drops ids,
reusing the stored vectors and tokens of everything kept.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index_builder.assemble import assemble
from index_builder.corpus import CorpusError, CorpusItem, CorpusSelection, read_corpus
from index_builder.cpu_encode import encode_cpu_shards
from index_builder.device_decode import gpu_share_of, jpeg_key
from index_builder.encode import (
    _encode_local,
    _encode_rgb,
    autocast_dtype,
    default_workers,
    read_shard,
    shard_path,
)
from index_builder.errors import BuildError
from index_builder.options import DEFAULT_SHARD_SIZE, BuildOptions, BuildReport
from index_builder.outdir import claimed
from index_builder.plan import SHARDS_DIR, plan_shards
from index_builder.publish import publish
from index_builder.roots import rooted
from index_builder.sources import _apply_delete, _check_duplicates, _load_base, decode_after
from index_builder.stages import Stages
from index_builder.vocabulary import unread_words
from index_builder.write import IDENTICAL_FILES, _bytes_per_item, _factories
from models.builtin import BuiltinModel
from models.device import resolve_device
from models.loading import Models, manifest_model
from store import ann, indexio
from store.manifest import (
    BaseRecord,
    BuildSettings,
    Counts,
    ImageTokens,
    IndexStats,
    Manifest,
    ManifestModel,
)

__all__ = ["DEFAULT_SHARD_SIZE", "SHARDS_DIR", "BuildOptions", "BuildReport", "build"]

log = logging.getLogger("duet.build")


def build(
    corpus: Path | None,
    out: Path,
    model: BuiltinModel | Models,
    batch_size: int = 64,
    skip_bad: bool = False,
    progress: bool = True,
    **options: Any,
) -> BuildReport:
    """Encode `corpus` with `model` into `out/<version>/` and make it `out/current`.

    `corpus` is a JSONL manifest or a Karpathy JSON file (`.json`), of which `split` (`test`,
    `train,restval`, `all`) is read, its images under `images_root` (default: its directory).

    With `append`, `corpus` holds only new items, added to the current version; `delete`
    names a file of ids (one per line) to drop from it. Either reuses the stored vectors.

    `model` is duet's joint model, or the `Models` of `models.loading.load_models` (an
    encoder and the re-ranker whose image tokens the index stores). When the joint model is
    both, encoding takes the fast path (decode workers, autocast, Ray); Hugging Face models
    take a plain batched loop in this process, on the device they were loaded on.

    The stages, each a method of `_Build`: check the options -> read the corpus (and the base
    of an append / delete) -> plan the shards (`index_builder.plan`) -> encode the missing
    ones -> assemble rows and arrays (`index_builder.assemble`) -> write the version and
    publish it as `current` (`index_builder.publish`).
    """
    opts = BuildOptions(batch_size=batch_size, skip_bad=skip_bad, progress=progress, **options)
    return _Build(corpus, Path(out), model, opts).run()


class _Build:
    """One build's state as it goes through the stages."""

    def __init__(
        self, corpus: Path | None, out: Path, model: BuiltinModel | Models, opts: BuildOptions
    ) -> None:
        self.t0 = time.perf_counter()
        self.corpus, self.out, self.model, self.opts = corpus, out, model, opts
        self.skipped: list[CorpusError] = []  # told in line order, whichever stage found it
        self.factory = opts.factory
        self.stages = Stages()

    def run(self) -> BuildReport:
        self._check()
        updating = self.opts.append or self.opts.delete is not None
        with claimed(self.out, create=not updating):  # one build at a time into `out`
            with self.stages("read"):
                self._read()
                self._plan_shards()
            self._encode()
            with self.stages("assemble"):
                self._assemble()
            self._refuse_empty(len(self.assembled.image_rows), len(self.assembled.text_rows))
            manifest = publish(
                self.out,
                self.assembled,
                self.factories,
                self.model.token_shape,
                self._manifest,
                self.stages,
                self.dev.type,
            )
            self.shards.remove()
        b = manifest.build or BuildSettings()
        return BuildReport(
            manifest.version,
            self.out / manifest.version,
            len(self.assembled.image_rows),
            len(self.assembled.text_rows),
            manifest.build_seconds,
            manifest,
            [str(e) for e in sorted(self.skipped, key=lambda e: e.line)],
            encoded=b.encoded_items,
            resumed_shards=b.resumed_shards,
            shards=b.shards,
            encode_seconds=self.encode_seconds,
            items_per_s=b.items_per_s,
            stages=self.stages.as_json(),
            unread=self.unread,
        )

    # -- stage 1: the options, the device --------------------------------------------------
    def _check(self) -> None:
        opts, model = self.opts, self.model
        if opts.batch_size < 1 or opts.shard_size < 1:
            raise BuildError("--batch-size and --shard-size must be at least 1")
        if opts.engine not in ("local", "ray"):
            raise BuildError(f"unknown engine {opts.engine!r}: use local or ray")
        # the joint model alone (as encoder and token source) takes the fast path
        self.joint = model if isinstance(model, BuiltinModel) else model.joint
        self.dev = (
            resolve_device(opts.device)
            if self.joint is not None
            else torch.device(str(model.device))
        )
        self.gpu_share = gpu_share_of(
            opts.decode_jpeg, self.dev, self.joint is not None and opts.engine == "local"
        )
        workers = default_workers(self.dev) if opts.workers is None else opts.workers
        if workers < 0:
            raise BuildError("--workers must be 0 or more")
        if self.joint is None:
            if opts.engine == "ray":
                raise BuildError(
                    f"--engine ray encodes with duet's builtin model only; {model.name} "
                    "(Hugging Face checkpoints) builds with --engine local"
                )
            workers = 0  # decoded in this process
        self.workers = workers

    def _refuse_empty(self, images: int, texts: int) -> None:
        """A version with no image and no caption answers every search with no hits, and an
        append of nothing publishes a copy a service swaps to: neither is written, nor made
        `current`."""
        nothing = "--append: nothing to append" if self.opts.append else "nothing to index"
        if (images or texts) and (self.items or not self.opts.append):
            return
        keep = f"{self.out / 'current'} is left as it was"
        if self.base is not None and self.opts.delete is not None and not self.items:
            raise BuildError(
                f"--delete {self.opts.delete} would remove every item of {self.base.path.name}: "
                f"an index needs at least one image or caption ({keep}); keep some items, or "
                "build a fresh index with --corpus"
            )
        if self.skipped:
            self.skipped.sort(key=lambda e: e.line)
            shown = "; ".join(map(str, self.skipped[:3])) + " ..." * (len(self.skipped) > 3)
            raise BuildError(
                f"{nothing}: --skip-bad skipped every entry of {self.corpus} "
                f"({len(self.skipped)} bad: {shown}); fix them and run again ({keep})"
            )
        raise BuildError(
            f"{nothing}: {self.corpus} has no items ({keep}); a manifest holds one "
            'JSON object per line: {"id": "img-1", "image": "images/1.png", "captions": [...]}'
        )

    def _bad(self, err: CorpusError) -> None:
        if not self.opts.skip_bad:
            raise err
        self.skipped.append(err)
        log.warning("skipping %s", err)

    # -- stage 2: the corpus, the base of an append / delete, the index types ----------------
    def _read(self) -> None:
        opts, model = self.opts, self.model
        base = _load_base(self.out) if (opts.append or opts.delete is not None) else None
        if base is not None and (built_by := base.manifest.model.fingerprint) != model.fingerprint:
            raise BuildError(
                f"--append/--delete: {base.path.name} was built by model {built_by!r}"
                f"{base.manifest.model.built_with()}, this build encodes with "
                f"{model.fingerprint!r}; use the models that built it (--encoder, "
                "--reranker, --model-dir) or build a fresh index with --corpus"
            )
        self.base = base
        self.items: list[CorpusItem] = []
        self.selection = CorpusSelection("manifest")
        if self.corpus is not None:
            self.selection, entries = read_corpus(Path(self.corpus), opts.split, opts.images_root)
            for entry in entries:
                if isinstance(entry, CorpusError):
                    self._bad(entry)
                else:
                    self.items.append(entry)
        self.unread = unread_words(self.items, model)  # told before the encoding's wait
        kept_images, self.kept_texts, self.deleted = _apply_delete(base, opts)
        if base is not None:  # before the roots' warnings, about a version never written
            _check_duplicates(self.items, kept_images, self.kept_texts)
        self.roots = rooted(
            base.manifest if base else None, self.corpus, self.selection, self.items
        )
        self.kept_images = self.roots.kept(kept_images)
        if self.factory is None and base is not None and base.manifest.build is not None:
            self.factory = base.manifest.build.factory_arg  # an append keeps the base's choice
        self.decode = decode_after(base, opts.append)
        n_img = len(self.kept_images) + sum(1 for it in self.items if it.image is not None)
        n_txt = len(self.kept_texts) + sum(len(it.captions) for it in self.items)
        self._refuse_empty(n_img, n_txt)  # before anything is encoded
        try:
            self.factories = _factories(self.factory, base, n_img, n_txt, model.dim)
        except ann.FactoryError as exc:
            raise BuildError(str(exc)) from exc

    # -- stage 3: which shards exist, which are missing --------------------------------------
    def _plan_shards(self) -> None:
        opts = self.opts
        self.shards = plan_shards(
            self.out,
            self.corpus,
            self.selection,
            self.items,
            self.model,
            self.dev,
            opts.batch_size,
            opts.shard_size,
            self.base,
            gpu_share=self.gpu_share,
        )
        corpus_path = Path(self.corpus) if self.corpus is not None else Path("-")
        where = {it.line: it.where for it in self.items}
        self.item_error = lambda line, err: CorpusError(corpus_path, line, err, where.get(line))

    def _check_shard(self, k: int, arrays: dict[str, np.ndarray]) -> None:
        """Stop at a shard's first unreadable image unless skipping."""
        if self.opts.skip_bad:
            return
        images = self.shards.image_items(k)
        for p, err in zip(images, arrays["image_error"].tolist(), strict=True):
            if err:
                raise self.item_error(p.line, err)

    # -- stage 4: encode the missing shards ----------------------------------------------------
    def _encode(self) -> None:
        opts, joint, shards = self.opts, self.joint, self.shards
        for k in sorted(shards.done):
            self._check_shard(k, read_shard(shard_path(shards.directory, k), ("image_error",)))
        t_enc = time.perf_counter()
        self.encoded = sum(b - a for _, a, b in shards.missing)
        args = (shards.items, shards.missing, shards.directory)
        if shards.missing and joint is None:
            assert isinstance(self.model, Models)
            _encode_rgb(
                *args, self.model, opts.batch_size, opts.progress, self._check_shard, self.stages
            )
        elif shards.missing and opts.engine == "ray":
            from index_builder.ray_engine import encode_ray

            assert joint is not None
            encode_ray(
                *args,
                joint,
                self.dev,
                opts.batch_size,
                opts.ray_actors,
                opts.progress,
                on_shard=self._check_shard,
            )
        elif shards.missing and self.dev.type == "cpu":
            assert joint is not None
            encode_cpu_shards(
                *args,
                joint,
                opts.batch_size,
                self.workers,
                opts.progress,
                self._check_shard,
                self.stages,
            )
        elif shards.missing:
            assert joint is not None
            _encode_local(
                *args,
                joint,
                self.dev,
                opts.batch_size,
                self.workers,
                opts.progress,
                self._check_shard,
                self.stages,
                gpu_share=self.gpu_share,
            )
        self.encode_seconds = time.perf_counter() - t_enc

    # -- stage 5: kept base rows, then the new items in corpus order ---------------------------
    def _assemble(self) -> None:
        def bad(line: int, err: str) -> None:
            self._bad(self.item_error(line, err))

        args = (self.base, self.kept_images, self.kept_texts, self.deleted, self.model.dim, bad)
        self.assembled = assemble(self.items, self.shards, *args)
        if self.opts.append and not self.assembled.kept:  # every new image failed to decode
            self._refuse_empty(0, 0)
        self.roots.place_new(self.assembled.image_rows, len(self.kept_images))
        kept = {it.id for it in self.assembled.kept}  # what this run encoded and keeps
        items = self.shards.items
        self.encoded = sum(1 for _, a, b in self.shards.missing for p in items[a:b] if p.id in kept)

    # -- stage 6 (`publish`): write the version in a temporary folder, then publish it -------
    def _manifest(self, tmp: Path, version: str, indexes: dict[str, IndexStats]) -> Manifest:
        """manifest.json: what was built, from what, with which models, how."""
        opts, model, factories = self.opts, self.model, self.factories
        contents = self.assembled
        with self.stages("hash"):
            files = {name: indexio.file_sha256(tmp / name) for name in IDENTICAL_FILES}
        seconds = time.perf_counter() - self.t0
        rate = (
            round(self.encoded / self.encode_seconds, 1)
            if self.encoded and self.encode_seconds > 0
            else 0.0
        )
        cuda_joint = self.dev.type == "cuda" and self.joint is not None
        return Manifest(
            version=version,
            # encoder and token source (what the re-ranker reads); the service checks both
            model=ManifestModel.from_json(manifest_model(model)),
            dim=model.dim,
            index_type=(
                factories[0]
                if factories[0] == factories[1]
                else f"image:{factories[0]} text:{factories[1]}"
            ),
            indexes=indexes,
            counts=Counts(len(contents.image_rows), len(contents.text_rows)),
            image_tokens=ImageTokens(list(model.token_shape), "float16"),
            content_hash=contents.digest,
            corpus=self.roots.corpus,
            corpus_selection=self.roots.record,
            built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            build_seconds=round(seconds, 2),
            skipped=len(self.skipped),
            build=BuildSettings(
                engine=opts.engine,
                device=self.dev.type,
                autocast=str(autocast_dtype(self.dev)).replace("torch.", "")
                if cuda_joint
                else None,
                workers=self.workers,
                batch_size=opts.batch_size,
                shard_size=opts.shard_size,
                factory_arg=self.factory,
                shards=len(self.shards.ranges),
                resumed_shards=len(self.shards.done),
                encoded_items=self.encoded,
                encode_seconds=round(self.encode_seconds, 3),
                items_per_s=rate,
                stages=self.stages.as_json(),
                decode=self.decode,
                jpeg=jpeg_key(self.gpu_share) if cuda_joint else None,
            ),
            files=files,
            bytes_per_item=_bytes_per_item(tmp, len(contents.image_rows), len(contents.text_rows)),
            base=None
            if self.base is None
            else BaseRecord(self.base.manifest.version, len(contents.kept), len(self.deleted)),
        )
