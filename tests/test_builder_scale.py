"""The builder at scale through real builds: every index family built and served, bad
factories refused before encoding, resumable and incremental builds, the Ray engine.
The ANN layer on its own is tested in test_builder_ann.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from index_builder.build import build
from index_builder.corpus import CorpusError
from index_builder.errors import BuildError
from index_builder.write import IDENTICAL_FILES
from models.builtin import BuiltinModel
from store import ann, indexio
from tests.builder_helpers import FAMILIES, reindexed
from tests.conftest import CHILD_PYTHONPATH, DUET

ENV = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}


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
    report = reindexed(tmp_path, index_dir, model, factory)
    assert report.encoded == 0
    m = report.manifest.to_json()  # as manifest.json holds it
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


def test_a_damaged_shard_is_encoded_again_or_stops_the_build_before_it_publishes(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    """A shard cut short (a full disk) is encoded again when the build resumes, where every
    rerun used to fail in its assembly; one whose vectors were overwritten (NaN) stops the
    build with what to delete, where it used to publish a version the service refuses."""
    from index_builder.shard import read_shard, shard_bytes, shard_whole

    manifest = _corpus(corpus, tmp_path / "c", _lines(corpus)[:4])
    img = tmp_path / "c" / json.loads(_lines(corpus)[3])["image"]
    img.write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # the first run fails: its shards stay
    kw: dict[str, Any] = {"progress": False, "shard_size": 2, "workers": 0}
    for name in ("cut", "nan"):
        with pytest.raises(CorpusError):
            build(manifest, tmp_path / name, model, **kw)
    cut = sorted((tmp_path / "cut").glob(".shards/*/shard-*.npy"))[0]
    assert shard_whole(cut)
    cut.write_bytes(cut.read_bytes()[:-100])
    assert not shard_whole(cut)
    again = build(manifest, tmp_path / "cut", model, skip_bad=True, **kw)
    assert again.resumed_shards == 1 and again.encoded == 2 and again.images == 3

    nan = sorted((tmp_path / "nan").glob(".shards/*/shard-*.npy"))[0]
    arrays = read_shard(nan)
    arrays["image_vectors"][0, 0] = np.nan
    nan.write_bytes(shard_bytes(arrays))
    assert shard_whole(nan)  # its headers are sound: only its values are not
    with pytest.raises(BuildError, match=r"NaN or infinite values at row 0.*damaged.*rm -r"):
        build(manifest, tmp_path / "nan", model, skip_bad=True, **kw)
    assert not (tmp_path / "nan" / "current").exists()
    arrays["image_vectors"][0, 0] = 0.0  # a sound norm below 1.01 again; the tokens not
    arrays["image_tokens"][0, 0, 0] = np.inf
    nan.write_bytes(shard_bytes(arrays))
    with pytest.raises(BuildError, match=r"image tokens holds NaN or infinite.*rm -r"):
        build(manifest, tmp_path / "nan", model, skip_bad=True, **kw)
    assert not (tmp_path / "nan" / "current").exists()


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
    assert deleted.manifest.index_type == factory  # the base's factory carries over
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
    (tmp_path / "none.txt").write_text("\n")
    none = subprocess.run(
        [*DUET, "build", "--delete", str(tmp_path / "none.txt"), "--out", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert none.returncode == 2 and "lists no ids" in none.stderr, none.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([first.version, "current"])


def test_an_append_or_delete_on_a_damaged_version_is_refused_naming_the_damage(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    """The base is proved whole first, as the service proves a version: a changed vector
    file used to pass into a new version the service then refused, a damaged item store to
    end the build in a traceback."""
    lines = _lines(corpus)
    base = _corpus(corpus, tmp_path / "c", lines[:4], "base.jsonl")
    more = _corpus(corpus, tmp_path / "c", lines[4:6], "more.jsonl")
    (tmp_path / "gone.txt").write_text(json.loads(lines[0])["id"] + "\n")
    for damage in ("vectors", "items"):
        out = tmp_path / damage
        first = build(base, out, model, progress=False, workers=0)
        if damage == "vectors":
            vecs = np.load(first.path / indexio.IMAGE_VECTORS)
            vecs[2] *= 2
            np.save(first.path / indexio.IMAGE_VECTORS, vecs)
        else:
            with (first.path / indexio.ITEMS).open("r+b") as fh:
                fh.seek(4096)
                fh.write(b"\xff" * 512)
        for asked in ({"append": True}, {"delete": tmp_path / "gone.txt"}):
            corpus_arg = more if "append" in asked else None
            with pytest.raises(BuildError, match="which is damaged"):
                build(corpus_arg, out, model, progress=False, workers=0, **asked)
        assert indexio.resolve_current(out) == first.path  # nothing was published


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
    assert (
        remote.encoded == 12
        and remote.manifest.build is not None
        and remote.manifest.build.engine == "ray"
    )
    _same_files(local.path, remote.path)


def test_the_cli_builds_the_builtin_model_256_images_a_pass_unless_told(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    """`--batch-size` left out: 256 for duet's builtin model (a quarter of the GPU's launches,
    fewer CPU seconds), 64 for a Hugging Face model; given, as given."""
    from types import SimpleNamespace

    from index_builder.options import default_batch

    assert default_batch(SimpleNamespace(joint=None)) == 64  # Hugging Face parts
    assert default_batch(model) == 256 and default_batch(SimpleNamespace(joint=model)) == 256
    manifest = _corpus(corpus, tmp_path / "c", _lines(corpus)[:3])
    zero = [*DUET, "build", "--corpus", str(manifest), "--out", str(tmp_path / "z")]
    proc = subprocess.run([*zero, "--batch-size", "0"], env=ENV, capture_output=True, text=True)
    assert (
        proc.returncode == 2 and "--batch-size and --shard-size must be at least 1" in proc.stderr
    )
    for args, want in (([], 256), (["--batch-size", "2"], 2)):
        out = tmp_path / f"idx{want}"
        cmd = [*DUET, "build", "--corpus", str(manifest), "--out", str(out), "--no-progress"]
        proc = subprocess.run([*cmd, *args], env=ENV, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        got = json.loads((out / "current" / "manifest.json").read_text())["build"]
        assert got["batch_size"] == want
