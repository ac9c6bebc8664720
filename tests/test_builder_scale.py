"""The builder at scale: index types, per-call search parameters, recall, resumable and
incremental builds, the Ray engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
import torch

from index_builder.build import build
from index_builder.corpus import CorpusError
from index_builder.encode import autocast_dtype
from index_builder.errors import BuildError
from index_builder.write import IDENTICAL_FILES
from models.builtin import BuiltinModel
from models.device import DeviceError, resolve_device
from store import ann, indexio
from tests.conftest import DUET, REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
FAMILIES = ["Flat", "IVF4,Flat", "IVF4_HNSW32,SQ8", "IVF4,PQ8x4", "HNSW32"]


def _unit(n: int, d: int = 32, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _corpus(src: Path, dst: Path, lines: list[str], name: str = "manifest.jsonl") -> Path:
    """A manifest of `lines` (JSON) in dst, their images copied from src's directory."""
    (dst / "images").mkdir(parents=True, exist_ok=True)
    for line in lines:
        rel = json.loads(line)["image"]
        if not (dst / rel).exists():
            (dst / rel).write_bytes((src.parent / rel).read_bytes())
    manifest = dst / name
    manifest.write_text("".join(line + "\n" for line in lines))
    return manifest


def _lines(corpus: Path) -> list[str]:
    return corpus.read_text().splitlines()


def _same_files(a: Path, b: Path) -> None:
    for name in IDENTICAL_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# -- store.ann ------------------------------------------------------------------------------


def test_default_factory_follows_faiss_guidance() -> None:
    assert ann.default_factory(40) == "Flat"
    assert ann.default_factory(ann.FLAT_MAX) == "Flat"
    ivf = ann.default_factory(500_000)
    nlist = int(ivf[3 : ivf.index(",")])
    assert ivf.endswith(",Flat") and 4 * 500_000**0.5 <= nlist <= 16 * 500_000**0.5
    assert ann.default_factory(5_000_000).endswith("_HNSW32,SQ8")
    index = ann.make_index("IVF1024,Flat", 32)
    assert 30 * 1024 <= ann.training_size(index, 10**7) <= 256 * 1024
    assert ann.training_size(index, 5000) == 5000


def test_recall_matches_brute_force() -> None:
    vecs, queries = _unit(3000), _unit(200, seed=1)
    index = ann.build_index("IVF32,Flat", vecs)
    truth = np.argsort(-(queries @ vecs.T), axis=1)[:, :10]
    for nprobe in (1, 4, 32):
        knobs = ann.SearchKnobs(nprobe=nprobe)
        params = ann.search_params(index, knobs)
        assert params is not None
        _, got = index.search(queries, 10, params=params.params)
        expected = np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth, strict=True)])
        assert ann.recall_at_k(index, vecs, queries, 10, knobs) == pytest.approx(expected)
    assert ann.recall_at_k(index, vecs, queries, 10, ann.SearchKnobs(nprobe=32)) == 1.0
    assert ann.recall_at_k(index, vecs, queries, 10, ann.SearchKnobs(nprobe=1)) < 0.9


def test_per_call_params_do_not_touch_the_shared_index() -> None:
    vecs, queries = _unit(4000), _unit(50, seed=2)
    ivf = ann.build_index("IVF64,Flat", vecs)
    hnsw: Any = ann.build_index("HNSW32", vecs)
    own_nprobe, own_ef = faiss.extract_index_ivf(ivf).nprobe, hnsw.hnsw.efSearch
    cases = [
        (ivf, ann.SearchKnobs(nprobe=1)),
        (ivf, ann.SearchKnobs(nprobe=64)),
        (hnsw, ann.SearchKnobs(ef_search=16)),
        (hnsw, ann.SearchKnobs(ef_search=256)),
    ]
    expected = [ann.search(index, queries, 10, knobs)[1] for index, knobs in cases]
    assert not np.array_equal(expected[0], expected[1])  # nprobe matters here
    results: dict[int, list[np.ndarray]] = {i: [] for i in range(len(cases))}
    start = threading.Barrier(len(cases))

    def run(i: int) -> None:
        start.wait()
        for _ in range(30):
            results[i].append(ann.search(cases[i][0], queries, 10, cases[i][1])[1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, got in results.items():
        assert all(np.array_equal(g, expected[i]) for g in got), cases[i][1]
    assert faiss.extract_index_ivf(ivf).nprobe == own_nprobe
    assert hnsw.hnsw.efSearch == own_ef


def test_service_search_uses_its_settings_per_call() -> None:
    from types import SimpleNamespace

    from app.batch import BatchWorker
    from app.config import Settings

    settings = Settings(index_nprobe=1, index_ef_search=8)
    vecs, query = _unit(4000), _unit(1, seed=3)
    index = ann.build_index("IVF64,Flat", vecs)
    faiss.extract_index_ivf(index).nprobe = 64  # what the pipeline must not rely on or touch
    fake = SimpleNamespace(
        search_knobs=ann.SearchKnobs(settings.index_nprobe, settings.index_ef_search)
    )
    cand = BatchWorker.top(fake, query, index, 10)  # type: ignore[arg-type]
    _, want = ann.search(index, query, 10, ann.SearchKnobs(nprobe=1))
    assert cand.rows.tolist() == want[0][want[0] >= 0].tolist()
    assert faiss.extract_index_ivf(index).nprobe == 64
    assert Settings().index_nprobe == ann.DEFAULT_NPROBE


def test_ivf_hnsw_quantizer_gets_ef_search_per_call() -> None:
    index = ann.build_index("IVF16_HNSW32,SQ8", _unit(2000))
    params = ann.search_params(index, ann.SearchKnobs(nprobe=8, ef_search=40))
    assert params is not None and params.params.nprobe == 8
    assert params.params.quantizer_params is not None and params.keep[0].efSearch == 40
    assert ann.search_params(ann.build_index("Flat", _unit(10)), ann.SearchKnobs()) is None


def test_same_vectors_same_index_bytes() -> None:
    vecs = _unit(400)
    for factory in FAMILIES:
        a = faiss.serialize_index(ann.build_index(factory, vecs))
        b = faiss.serialize_index(ann.build_index(factory, vecs))
        assert a.tobytes() == b.tobytes(), factory


def test_device_selection() -> None:
    assert resolve_device("cpu").type == "cpu"
    assert autocast_dtype(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(DeviceError):
            resolve_device("cuda")


def test_autocast_path_matches_fp32(model: BuiltinModel, corpus: Path) -> None:
    """The GPU path's autocast code, run on CPU in bf16: same shapes, dtypes, close vectors."""
    from index_builder.encode import Encoder, PlanItem, decode

    items = [
        PlanItem(i, str(i), str(corpus.parent / f"images/{i:04d}.png"), None, i + 1, ())
        for i in range(4)
    ]
    pixels = torch.stack([p for p in (decode(it, 64).pixels for it in items) if p is not None])
    exact = Encoder(model, torch.device("cpu"))
    mixed = Encoder(model, torch.device("cpu"))
    mixed.dtype = torch.bfloat16
    (v32, t32), (v16, t16) = exact.images(pixels), mixed.images(pixels)
    assert v16.dtype == np.float32 and t16.dtype == np.float16 and t16.shape == t32.shape
    np.testing.assert_allclose(np.linalg.norm(v16, axis=1), 1.0, atol=1e-5)
    assert (v16 * v32).sum(axis=1).min() > 0.98
    texts = ["a small red circle", "two blue squares"]
    assert (mixed.texts(texts) * exact.texts(texts)).sum(axis=1).min() > 0.98
    np.testing.assert_allclose(exact.texts(texts), model.encode_texts(texts), atol=1e-5)


# -- factories through `duet build` --------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("IVF,Bogus", "cannot build index factory string 'IVF,Bogus'"),
        ("IVF1024,Flat", "needs at least 1024 training vectors"),
    ],
)
def test_bad_factory_exits_2_before_encoding(
    tmp_path: Path, corpus: Path, factory: str, message: str
) -> None:
    manifest = _corpus(corpus, tmp_path / "c", _lines(corpus)[:3])
    proc = subprocess.run(
        [
            *DUET,
            "build",
            "--corpus",
            str(manifest),
            "--out",
            str(tmp_path / "idx"),
            "--no-progress",
            "--factory",
            factory,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "idx" / "current").exists()
    assert not list((tmp_path / "idx").glob(".shards/*/shard-*"))  # nothing was encoded


@pytest.mark.parametrize("factory", FAMILIES)
def test_each_family_builds_and_serves(
    tmp_path: Path, index_dir: Path, model: BuiltinModel, factory: str
) -> None:
    """Re-index the session index's stored vectors with each factory (--delete of nothing)."""
    out = tmp_path / "idx"
    out.mkdir()
    base = indexio.resolve_current(index_dir)
    (out / base.name).symlink_to(base)
    indexio.point_current(out, base.name)
    (tmp_path / "none.txt").write_text("")
    report = build(None, out, model, progress=False, factory=factory, delete=tmp_path / "none.txt")
    assert report.encoded == 0
    m = report.manifest
    assert m["index_type"] == factory and m["counts"] == {"images": 40, "texts": 200}
    for name in ("image", "text"):
        info = m["indexes"][name]
        assert info["factory"] == factory and 0.0 < info["recall_at_10"] <= 1.0
        assert info["bytes_per_vector"] > 0
    if factory in ("Flat", "HNSW32", "IVF4,Flat"):
        assert m["indexes"]["image"]["recall_at_10"] >= 0.95
    loaded = indexio.IndexVersion.open(report.path, expect_fingerprint=model.fingerprint)
    vecs = np.load(report.path / indexio.IMAGE_VECTORS)
    _, rows = ann.search(loaded.image_index, vecs[:5], 3, ann.SearchKnobs(nprobe=4))
    assert rows.shape == (5, 3) and (rows >= 0).all()
    if factory != "IVF4,PQ8x4":  # 4-bit PQ is too coarse to promise self-retrieval
        assert rows[:, 0].tolist() == [0, 1, 2, 3, 4]


# -- resumable builds -----------------------------------------------------------------------

RESUME_ARGS = [
    "--factory",
    "IVF4,Flat",
    "--shard-size",
    "4",
    "--batch-size",
    "4",
    "--workers",
    "0",
    "--no-progress",
]


@pytest.mark.slow
def test_killed_build_resumes_to_identical_files(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    manifest = _corpus(corpus, tmp_path / "c", _lines(corpus))
    ref = build(
        manifest,
        tmp_path / "ref",
        model,
        batch_size=4,
        progress=False,
        factory="IVF4,Flat",
        shard_size=4,
        workers=0,
    )
    out = tmp_path / "idx"
    cmd = [*DUET, "build", "--corpus", str(manifest), "--out", str(out), *RESUME_ARGS]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while not list(out.glob(".shards/*/shard-*.npy")):
            assert proc.poll() is None, "the build ended before it wrote a shard"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    shards = list(out.glob(".shards/*/shard-*.npy"))
    assert 1 <= len(shards) < 10 and not (out / "current").exists()
    again = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    resumed = json.loads((out / "current" / "manifest.json").read_text())["build"]
    assert resumed["resumed_shards"] >= len(shards) and resumed["encoded_items"] < 40
    _same_files(ref.path, out / "current")
    assert not list(out.glob(".shards/*/shard-*"))  # cleaned up after success


def test_failed_build_resumes_but_a_changed_corpus_does_not(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    manifest = _corpus(corpus, tmp_path / "c", _lines(corpus)[:4])
    img = tmp_path / "c" / json.loads(_lines(corpus)[3])["image"]
    good = img.read_bytes()
    img.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    kw: dict[str, Any] = {"progress": False, "shard_size": 2, "workers": 0}
    with pytest.raises(CorpusError):  # both shards are written, the second names the bad image
        build(manifest, tmp_path / "a", model, **kw)
    assert len(list((tmp_path / "a").glob(".shards/*/shard-*.npy"))) == 2
    skipping = build(manifest, tmp_path / "a", model, skip_bad=True, **kw)
    assert skipping.resumed_shards == 2 and skipping.encoded == 0 and skipping.images == 3

    with pytest.raises(CorpusError):
        build(manifest, tmp_path / "b", model, **kw)
    img.write_bytes(good)  # the corpus changed: its old shards must not be used
    fixed = build(manifest, tmp_path / "b", model, **kw)
    assert fixed.resumed_shards == 0 and fixed.encoded == 4 and fixed.images == 4


# -- incremental builds ---------------------------------------------------------------------


def _hits(version: Path, model: BuiltinModel, queries: list[str]) -> list[list[tuple[str, float]]]:
    loaded = indexio.IndexVersion.open(version)
    scores, rows = ann.search(
        loaded.image_index, model.encode_texts(queries), 5, ann.SearchKnobs(nprobe=4)
    )
    out = []
    for s, r in zip(scores, rows, strict=True):
        ids = [row.id for row in loaded.store.images([int(x) for x in r])]
        out.append(list(zip(ids, s.tolist(), strict=True)))
    tscores, trows = ann.search(
        loaded.text_index,
        np.load(version / indexio.IMAGE_VECTORS)[:3],
        5,
        ann.SearchKnobs(nprobe=4),
    )
    for s, r in zip(tscores, trows, strict=True):
        ids = [row.id for row in loaded.store.texts([int(x) for x in r])]
        out.append(list(zip(ids, s.tolist(), strict=True)))
    loaded.store.close()
    return out


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_append_then_delete_matches_a_fresh_build(
    tmp_path: Path, corpus: Path, model: BuiltinModel, factory: str
) -> None:
    lines = _lines(corpus)
    c = tmp_path / "c"
    base = _corpus(corpus, c, lines[:20], "base.jsonl")
    more = _corpus(corpus, c, lines[20:30], "more.jsonl")
    gone = [json.loads(line)["id"] for line in lines[3:8]]
    fresh = _corpus(corpus, c, lines[:3] + lines[8:30], "fresh.jsonl")
    (tmp_path / "gone.txt").write_text("\n".join(gone) + "\n")

    out = tmp_path / "idx"
    build(base, out, model, progress=False, factory=factory, workers=0)
    added = build(more, out, model, progress=False, append=True, workers=0)
    assert added.encoded == 10 and added.images == 30  # only the new items were encoded
    deleted = build(None, out, model, progress=False, delete=tmp_path / "gone.txt")
    assert deleted.encoded == 0 and deleted.images == 25 and deleted.texts == 125
    assert deleted.manifest["index_type"] == factory  # the base's factory carries over
    ref = build(fresh, tmp_path / "ref", model, progress=False, factory=factory, workers=0)

    queries = ["a small red circle", "two blue squares", "a green triangle above a circle"]
    got, want = _hits(deleted.path, model, queries), _hits(ref.path, model, queries)
    for g, w in zip(got, want, strict=True):
        assert [i for i, _ in g] == [i for i, _ in w]
        np.testing.assert_allclose([s for _, s in g], [s for _, s in w], atol=1e-5)
    store = indexio.IndexVersion.open(deleted.path).store
    assert {r.id for r in store.images(list(range(25)))}.isdisjoint(gone)


def test_append_with_duplicate_ids_exits_2_and_writes_nothing(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    lines = _lines(corpus)
    c = tmp_path / "c"
    base = _corpus(corpus, c, lines[:4], "base.jsonl")
    dup = _corpus(corpus, c, lines[3:6], "dup.jsonl")
    out = tmp_path / "idx"
    first = build(base, out, model, progress=False, workers=0)
    with pytest.raises(BuildError, match="already in the current version"):
        build(dup, out, model, progress=False, append=True)
    proc = subprocess.run(
        [*DUET, "build", "--append", str(dup), "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 2 and "already in the current version" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([first.version, "current"])
    (tmp_path / "unknown.txt").write_text("no-such-id\n")
    with pytest.raises(BuildError, match="no-such-id"):
        build(None, out, model, progress=False, delete=tmp_path / "unknown.txt")


# -- Ray --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ray_engine_writes_the_same_index_as_local(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    ray = pytest.importorskip("ray")
    manifest = _corpus(corpus, tmp_path / "c", _lines(corpus)[:12])
    local = build(
        manifest, tmp_path / "local", model, batch_size=4, progress=False, shard_size=4, workers=0
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        remote = build(
            manifest,
            tmp_path / "ray",
            model,
            batch_size=4,
            progress=False,
            shard_size=4,
            engine="ray",
            ray_actors=2,
        )
    finally:
        ray.shutdown()
    assert remote.encoded == 12 and remote.manifest["build"]["engine"] == "ray"
    _same_files(local.path, remote.path)
