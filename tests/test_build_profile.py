"""Issue 38's builder parts: the stage profile a build records, a photo-sized JPEG corpus
built (its files and options: tests/test_photo_corpus.py), CPU shard workers that write the
same files as one process, captions in long batches, the GPU paths' CPU-testable pieces
(device JPEG decoding's merge and resize, FAISS clustering hook) and recall@10 without a
dense score matrix."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
import torch
from PIL import Image

from app.imaging import decode_image
from index_builder.build import build
from index_builder.decode import DecodedBatch, PlanItem, decode
from index_builder.device_decode import jpeg_decoder, resize, resolve
from index_builder.encode import Encoder, ShardBuilder
from index_builder.stages import EXTRA, STAGES
from index_builder.write import IDENTICAL_FILES
from models.builtin import BuiltinModel, pixel_bytes
from models.world import PhotoStyle, write_corpus
from store import ann


def _small(corpus: Path, dst: Path, n: int) -> Path:
    """The first n items of the session corpus, images copied."""
    (dst / "images").mkdir(parents=True)
    lines = corpus.read_text().splitlines()[:n]
    for line in lines:
        rel = json.loads(line)["image"]
        (dst / rel).write_bytes((corpus.parent / rel).read_bytes())
    (dst / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return dst / "manifest.jsonl"


def test_a_build_records_its_stage_times(tmp_path: Path, corpus: Path, model: BuiltinModel) -> None:
    report = build(_small(corpus, tmp_path / "c", 6), tmp_path / "idx", model, progress=False)
    recorded = json.loads((report.path / "manifest.json").read_text())["build"]["stages"]
    assert list(recorded) == [*STAGES, *EXTRA] and recorded == report.stages
    assert all(v >= 0 for v in recorded.values())
    assert recorded["encode_images"] > 0 and recorded["encode_texts"] > 0
    assert recorded["decode_busy"] > 0 and recorded["write"] > 0
    assert sum(recorded[k] for k in STAGES) <= report.manifest.build_seconds + 0.05


def test_cpu_shard_workers_write_the_same_files_as_one_process(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    manifest = _small(corpus, tmp_path / "c", 12)
    args: dict[str, Any] = {"progress": False, "shard_size": 4, "batch_size": 3, "device": "cpu"}
    one = build(manifest, tmp_path / "one", model, workers=0, **args)
    two = build(manifest, tmp_path / "two", model, workers=2, **args)
    assert two.manifest.build is not None and two.manifest.build.workers == 2
    assert two.shards == 3 and two.encoded == 12
    for name in IDENTICAL_FILES:
        assert (one.path / name).read_bytes() == (two.path / name).read_bytes(), name


def test_captions_in_long_sorted_batches_keep_their_vectors(model: BuiltinModel) -> None:
    texts = [
        "a red circle",
        "a small blue square left of a large green triangle",
        "two yellow diamonds",
        "a large purple circle above a small red square",
        "a green square",
    ] * 3
    shard = ShardBuilder([], Encoder(model, torch.device("cpu")), batch_size=4)
    np.testing.assert_allclose(shard._texts(texts), model.encode_texts(texts), atol=1e-5)
    assert shard._texts([]).shape[0] == 0


# -- the photo-sized corpus -----------------------------------------------------------------


def test_a_jpeg_corpus_builds_and_the_model_sees_its_own_input_size(
    tmp_path: Path, model: BuiltinModel
) -> None:
    manifest = write_corpus(tmp_path / "c", 4, seed=9, progress=False, photo=PhotoStyle(tiles=1))
    report = build(manifest, tmp_path / "idx", model, progress=False, workers=0)
    vecs = np.load(report.path / "image_vectors.npy")
    data = (tmp_path / "c" / "images" / "0002.jpg").read_bytes()  # searched with, as uploaded
    qvec, _ = model.encode_images([decode_image(data, 10**7, 10**8, model.decode_side)])
    np.testing.assert_allclose(vecs[2], qvec[0], atol=1e-5)


# -- the GPU paths, what of them runs on a CPU ----------------------------------------------


def _jpeg(path: Path, size: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def test_device_jpeg_decoding_merges_rows_in_batch_order_and_falls_back(
    tmp_path: Path,
) -> None:
    assert jpeg_decoder(torch.device("cpu")) is None  # only a CUDA build decodes on the GPU
    paths = [tmp_path / "a.jpg", tmp_path / "b.png", tmp_path / "c.jpg", tmp_path / "d.jpg"]
    _jpeg(paths[0], (40, 30), 1)
    Image.new("RGB", (20, 20), (200, 10, 10)).save(paths[1])
    _jpeg(paths[2], (16, 16), 2)
    paths[3].write_bytes(b"\xff\xd8\xff not really a jpeg")
    plan = [PlanItem(i, f"i{i}", str(p), p.name, i + 1, ()) for i, p in enumerate(paths)]
    batch = DecodedBatch.collate([decode(it, 16, defer_jpeg=True) for it in plan])
    assert batch.rows == [1] and [r for r, _ in batch.deferred] == [0, 2, 3]

    def fake_gpu(data: list[torch.Tensor]) -> list[torch.Tensor]:  # fails on the broken one
        try:
            imgs = [Image.open(io.BytesIO(d.numpy().tobytes())).convert("RGB") for d in data]
        except OSError as exc:
            raise RuntimeError(str(exc)) from exc  # as torchvision raises
        return [torch.from_numpy(np.asarray(i).copy()).permute(2, 0, 1) for i in imgs]

    got = resolve(batch, plan, 16, torch.device("cpu"), fake_gpu)
    assert [not d.error for d in got.items] == [True, True, True, False]
    assert "cannot read image 'd.jpg'" in got.items[3].error
    assert got.pixels is not None and got.pixels.shape == (3, 3, 16, 16) and not got.deferred
    cpu = DecodedBatch.collate([decode(it, 16) for it in plan[:3]]).pixels
    assert cpu is not None
    diff = (got.pixels.int() - cpu.int()).abs()
    assert int(diff[1:].max()) == 0  # the PNG and the 16-pixel JPEG: no resize, same pixels
    assert int(diff[0].max()) <= 3 and float(diff[0].float().mean()) < 0.5  # GPU-style resize


def test_the_device_resize_is_pils_bilinear_to_a_level_or_so() -> None:
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 255, (384, 512, 3), dtype=np.uint8)
    pil = pixel_bytes([Image.fromarray(arr)], 64)[0]
    ours = resize(torch.from_numpy(arr).permute(2, 0, 1).contiguous(), 64)
    diff = (pil.int() - ours.int()).abs()
    assert ours.dtype == torch.uint8 and ours.shape == (3, 64, 64)
    assert int(diff.max()) <= 2 and float(diff.float().mean()) < 0.5
    # a batch's pictures of one size are resized in one call, each as it would be alone
    other = torch.from_numpy(rng.integers(0, 255, (3, 384, 512), dtype=np.uint8))
    both = resize(torch.stack([torch.from_numpy(arr).permute(2, 0, 1), other]), 64)
    assert both.shape == (2, 3, 64, 64)
    assert torch.equal(both[0], ours) and torch.equal(both[1], resize(other, 64))


def test_ivf_centroids_made_in_torch_train_an_index_as_good_as_faiss_kmeans() -> None:
    """A CUDA build's k-means (`index_builder.kmeans`, run here on the CPU): the IVF holds
    exactly the centroids it made, FAISS trains only the encoder, the same input gives the
    same bytes, and recall@10 is FAISS's own k-means' to within noise. A pre-transformed IVF
    keeps FAISS's k-means. No GPU, no hook."""
    from index_builder.kmeans import gpu_kmeans, spherical_kmeans

    assert gpu_kmeans("cpu") is None
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((200, 32)).astype(np.float32)
    vecs = centers[rng.integers(0, 200, 6000)] + rng.standard_normal((6000, 32)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    queries = vecs[:300] + 0.1 * rng.standard_normal((300, 32)).astype(np.float32)
    made: list[np.ndarray] = []

    def on_cpu(sample: np.ndarray, k: int, seed: int) -> np.ndarray:
        made.append(spherical_kmeans(sample, k, torch.device("cpu"), seed=seed))
        return made[-1]

    knobs = ann.SearchKnobs(nprobe=4)
    for factory in ("IVF64,Flat", "IVF64_HNSW32,SQ8"):
        plain = ann.build_index(factory, vecs)
        hooked = ann.build_index(factory, vecs, centroids=on_cpu)
        again = ann.build_index(factory, vecs, centroids=on_cpu)
        quantizer = faiss.extract_index_ivf(hooked).quantizer
        assert quantizer.ntotal == 64  # FAISS trained no centroids of its own beside them
        np.testing.assert_array_equal(quantizer.reconstruct_n(0, 64), made[-2])
        assert faiss.serialize_index(hooked).tobytes() == faiss.serialize_index(again).tobytes()
        want = ann.recall_at_k(plain, vecs, queries, 10, knobs)
        got = ann.recall_at_k(hooked, vecs, queries, 10, knobs)
        assert got > want - 0.03, (factory, got, want)
    np.testing.assert_allclose(np.linalg.norm(made[-1], axis=1), 1.0, atol=1e-5)
    calls = len(made)
    ann.build_index("PCA16,IVF16,Flat", vecs, centroids=on_cpu)
    assert len(made) == calls  # its IVF sees PCA's output: FAISS trains it whole
    with pytest.raises(ValueError, match="centroids for 64 lists"):
        ann.build_index("IVF64,Flat", vecs, centroids=lambda s, k, seed: s[: k - 1])


def test_recall_at_k_without_a_dense_matrix_counts_ties_as_before() -> None:
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((500, 16)).astype(np.float32)
    vecs[100:110] = vecs[0]  # ties with row 0
    queries = np.vstack([vecs[:1], rng.standard_normal((20, 16)).astype(np.float32)])
    index = ann.build_index("IVF4,Flat", vecs)

    def dense(knobs: ann.SearchKnobs) -> float:  # the former implementation
        _, got = ann.search(index, queries, 10, knobs)
        scores = queries @ vecs.T
        kth = -np.partition(-scores, 9, axis=1)[:, 9]
        hits = sum(
            min(10, int((s[np.unique(r[r >= 0])] >= b - 1e-6).sum()))
            for s, r, b in zip(scores, got, kth, strict=True)
        )
        return hits / (10 * len(queries))

    for nprobe in (1, 2, 4):
        knobs = ann.SearchKnobs(nprobe=nprobe)
        assert ann.recall_at_k(index, vecs, queries, 10, knobs) == pytest.approx(dense(knobs))


def test_the_gpu_feeder_path_runs_on_cpu_and_encodes_the_same(
    tmp_path: Path, corpus: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_encode_local` (decode workers feeding one encoder, what a CUDA build runs) on the
    CPU, through one DataLoader worker: the same vectors as the CPU shard workers."""
    import index_builder.build as build_module
    from index_builder.encode import _encode_local

    def local(plan, missing, shard_dir, joint, batch, workers, progress, check, stages):  # type: ignore[no-untyped-def]
        _encode_local(
            plan, missing, shard_dir, joint, torch.device("cpu"), batch, 1, progress, check, stages
        )

    manifest = _small(corpus, tmp_path / "c", 6)
    ref = build(manifest, tmp_path / "ref", model, progress=False, workers=0, batch_size=4)
    monkeypatch.setattr(build_module, "encode_cpu_shards", local)
    fed = build(manifest, tmp_path / "fed", model, progress=False, workers=0, batch_size=4)
    assert fed.stages["decode_busy"] > 0 and fed.stages["encode_images"] > 0
    for name in ("image_vectors.npy", "text_vectors.npy"):
        np.testing.assert_allclose(
            np.load(fed.path / name), np.load(ref.path / name), atol=1e-5, err_msg=name
        )
    # shards are written and checked by a thread of their own: an unreadable image in the
    # second of four shards stops the build at the next shard, naming it, with the shards up
    # to its own written and none after it
    eight = _small(corpus, tmp_path / "c8", 8)
    bad = json.loads(eight.read_text().splitlines()[2])["image"]
    (eight.parent / bad).write_bytes(b"not an image")
    from index_builder.corpus import CorpusError

    with pytest.raises(CorpusError, match="cannot read image"):
        build(eight, tmp_path / "bad", model, progress=False, batch_size=1, shard_size=2)
    kept = sorted(p.name for p in (tmp_path / "bad").glob(".shards/*/shard-*.npy"))
    assert kept == ["shard-000000.npy", "shard-000001.npy"]


def test_gpu_jpeg_decoding_is_asked_for_and_keyed_apart(
    tmp_path: Path, corpus: Path, model: BuiltinModel, caplog: pytest.LogCaptureFixture
) -> None:
    """`--decode-jpeg gpu` names other shards (nvJPEG's pixels are not the CPU's); on a CPU
    build it is said and ignored, and the build is the default one, shards and all."""
    from index_builder.corpus import CorpusSelection
    from index_builder.plan import plan_shards

    manifest = _small(corpus, tmp_path / "c", 3)
    sel = CorpusSelection("manifest")
    dirs = {
        (dev, gpu): plan_shards(
            tmp_path / "k", manifest, sel, [], model, torch.device(dev), 4, 8, None, gpu
        ).directory
        for dev, gpu in (("cpu", 0.0), ("cuda", 0.0), ("cuda", 1.0), ("cuda", 0.4))
    }
    assert len(set(dirs.values())) == 4  # a GPU build names where (and what share) it decoded
    with caplog.at_level("WARNING", logger="duet.build"):
        asked = build(manifest, tmp_path / "a", model, progress=False, workers=0, decode_jpeg="gpu")
    assert "JPEGs are decoded on the CPU" in caplog.text
    assert asked.manifest.build is not None and asked.manifest.build.jpeg is None  # CPU build
    plain = build(manifest, tmp_path / "b", model, progress=False, workers=0)
    for name in ("image_vectors.npy", "text_vectors.npy"):
        assert (asked.path / name).read_bytes() == (plain.path / name).read_bytes()
    with pytest.raises(Exception, match="unknown --decode-jpeg"):
        build(manifest, tmp_path / "d", model, progress=False, decode_jpeg="nvjpeg")
    from index_builder.device_decode import gpu_share_of
    from index_builder.errors import BuildError

    with pytest.raises(BuildError, match="builtin model with --engine local"):
        gpu_share_of("gpu", torch.device("cuda"), fast_path=False)  # Ray, or HF models
    assert gpu_share_of("cpu", torch.device("cuda"), fast_path=True) == 0.0


def test_without_a_bar_the_encode_step_logs_how_far_and_how_fast(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--no-progress` (a log, a benchmark that may be cut short): a line every `every`
    seconds with the items done, the rate and the time left; a bar logs nothing."""
    from index_builder.progress import EncodeProgress

    with caplog.at_level("INFO", logger="duet.build"):
        with EncodeProgress(4000, progress=False, every=0.0) as bar:
            bar.update(1000)
        with EncodeProgress(4000, progress=True, every=0.0) as shown:
            shown.update(1000)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("encoding: 1,000 of 4,000 items (25.0 %), ")
    assert "items/s, about" in lines[0] and lines[0].endswith("left")


def test_device_resizes_in_chunks_give_the_same_pixels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pictures of one size are resized a pixel budget at a time (a batch of phone photos
    at once would be tens of GB as floats): one at a time, the same pixels as all at once."""
    import index_builder.device_decode as device_decode

    paths = [tmp_path / f"{i}.jpg" for i in range(3)]
    for i, p in enumerate(paths):
        _jpeg(p, (48, 32), 10 + i)
    plan = [PlanItem(i, f"i{i}", str(p), p.name, i + 1, ()) for i, p in enumerate(paths)]

    def pil(data: list[torch.Tensor]) -> list[torch.Tensor]:  # stands in for nvJPEG
        imgs = [Image.open(io.BytesIO(d.numpy().tobytes())).convert("RGB") for d in data]
        return [torch.from_numpy(np.asarray(i).copy()).permute(2, 0, 1) for i in imgs]

    def run() -> torch.Tensor:
        batch = DecodedBatch.collate([decode(it, 16, defer_jpeg=True) for it in plan])
        got = resolve(batch, plan, 16, torch.device("cpu"), pil)
        assert got.pixels is not None
        return got.pixels

    together = run()
    monkeypatch.setattr(device_decode, "RESIZE_PIXELS", 48 * 32)  # one picture a call
    assert torch.equal(run(), together) and together.shape == (3, 3, 16, 16)


def test_kmeans_splits_empty_clusters_from_populated_ones() -> None:
    """Points that all pick one centroid leave the others empty: each empty one takes half
    of a populated cluster (moved apart by FAISS's epsilon), so none stays empty, zero or
    NaN (without the split, three rows would be zeros)."""
    from index_builder.kmeans import spherical_kmeans

    rng = np.random.default_rng(1)
    base = rng.standard_normal((1, 8)).astype(np.float32)
    x = np.repeat(base / np.linalg.norm(base), 40, axis=0)  # 40 copies of one point
    cent = spherical_kmeans(x, 4, torch.device("cpu"))
    assert cent.shape == (4, 8) and np.isfinite(cent).all()
    np.testing.assert_allclose(np.linalg.norm(cent, axis=1), 1.0, atol=1e-5)
    apart = np.linalg.norm(cent[:, None] - cent[None], axis=-1)
    assert apart.max() > 1e-4  # split apart, not four copies of one
    with pytest.raises(ValueError, match="k-means of 3 vectors into 4"):
        spherical_kmeans(x[:3], 4, torch.device("cpu"))
