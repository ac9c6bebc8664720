"""The CPU build's pieces of work (`index_builder.cpu_encode`): batches of a shard's images
and chunks of its captions spread over the workers, put together into the very shards a
whole-shard encoder writes: images that fail to decode, items without an image or without
captions, and a shard of several caption chunks included."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence, Set
from pathlib import Path

import numpy as np
import pytest
import torch

from index_builder.cpu_encode import Units, _one_thread, encode_cpu_shards
from index_builder.decode import CaptionIds, PlanItem, decode, shard_batches
from index_builder.encode import (
    SHARD_FIELDS,
    Encoder,
    ShardBuilder,
    _encode_local,
    read_shard,
    shard_path,
)
from index_builder.stages import Stages
from models.builtin import BuiltinModel


def _plan(corpus: Path, n: int, tmp: Path, broken: Set[int] = frozenset()) -> list[PlanItem]:
    """n items cycling through the corpus's; those in `broken` point at a broken file; item 6
    has no image, item 7 no captions."""
    lines = [json.loads(x) for x in corpus.read_text().splitlines()]
    bad = tmp / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    plan = []
    for i in range(n):
        x = lines[i % len(lines)]
        image: str | None = str(bad if i in broken else corpus.parent / x["image"])
        caps = tuple(x["captions"])
        if i == 6:
            image = None
        if i == 7:
            caps = ()
        plan.append(PlanItem(i, f"{x['id']}-{i}", image, x["image"], i + 1, caps))
    return plan


def _whole_shard(
    plan: list[PlanItem], a: int, b: int, model: BuiltinModel, batch: int
) -> dict[str, np.ndarray]:
    """A shard as one process encodes it in one go (as the Ray engine's actors do)."""
    shard = ShardBuilder(plan[a:b], Encoder(model, torch.device("cpu")), batch)
    with _one_thread():
        for positions in shard_batches(plan, a, b, batch):
            shard.add([decode(plan[p], model.model.cfg.image_size) for p in positions])
        return shard.finish(model.dim, model.token_shape)


@pytest.mark.parametrize("workers", [0, 2])
def test_units_put_together_are_the_whole_shards_bytes(
    tmp_path: Path, corpus: Path, model: BuiltinModel, workers: int
) -> None:
    # shard 1 loses one image, shard 2 every image; shard 3 has 1,100+ captions (two chunks)
    plan = _plan(corpus, 250, tmp_path, broken={5, 8, 9})
    missing = [(0, 0, 4), (1, 4, 8), (2, 8, 10), (3, 10, 250)]
    units = Units.of(plan, missing, 3)
    assert units.counts == [2 + 1, 1 + 1, 1 + 1, 80 + 2] and len(units) == sum(units.counts)
    assert [units.where(i)[0] for i in range(len(units))] == sorted(
        s for s, c in enumerate(units.counts) for _ in range(c)
    )
    assert [i for i in range(len(units)) if units.is_captions(i)] == [2, 4, 6, 87, 88]
    stages = Stages()
    checked: list[int] = []
    encode_cpu_shards(
        plan, missing, tmp_path, model, 3, workers, False, lambda k, _: checked.append(k), stages
    )
    assert checked == [0, 1, 2, 3]
    assert stages.seconds["encode_texts"] > 0 and stages.seconds["decode_busy"] > 0
    for k, a, b in missing:
        got, want = read_shard(shard_path(tmp_path, k)), _whole_shard(plan, a, b, model, 3)
        for name in SHARD_FIELDS:
            assert got[name].dtype == want[name].dtype, (k, name)
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"shard {k} {name}")
    one = read_shard(shard_path(tmp_path, 1))  # items 4-7: 5 broken, 6 no image, 7 no captions
    assert one["image_ok"].tolist() == [True, False, True] and len(one["image_vectors"]) == 2
    assert len(one["text_vectors"]) == 2 * 5  # item 4's and item 6's
    assert read_shard(shard_path(tmp_path, 2))["text_vectors"].shape == (0, model.dim)


def test_every_caption_is_encoded_and_a_failed_images_dropped_after(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    """A shard encodes all of its captions, in the chunks a clean shard has, and drops a
    failed image's after: no caption's vector depends on another item's image failing."""
    plan, clean = _plan(corpus, 12, tmp_path, broken={2}), _plan(corpus, 12, tmp_path)
    encoded: list[list[str]] = []

    class Recording(Encoder):
        def texts(self, texts: Sequence[str]) -> np.ndarray:
            encoded.append(list(texts))
            return super().texts(texts)

    shard = ShardBuilder(plan, Recording(model, torch.device("cpu")), 4)
    for positions in shard_batches(plan, 0, 12, 4):
        shard.add([decode(plan[p], model.model.cfg.image_size) for p in positions])
    failed = shard.finish(model.dim, model.token_shape)
    assert encoded == [sorted((c for it in clean for c in it.captions), key=len)]
    whole = _whole_shard(clean, 0, 12, model, 4)
    drop = np.repeat(np.arange(12) == 2, [len(it.captions) for it in clean])
    np.testing.assert_array_equal(failed["text_vectors"], whole["text_vectors"][~drop])


def test_a_build_says_which_other_builds_shards_wait_beside_its_own(
    tmp_path: Path, corpus: Path, model: BuiltinModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Shards of a build never finished with other arguments stay (it may resume), but a
    build says they are there, how big, and how to delete them."""
    from index_builder.build import build

    lines = corpus.read_text().splitlines()[:4]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "\n".join(
            json.dumps({**json.loads(x), "image": str(corpus.parent / json.loads(x)["image"])})
            for x in lines
        )
        + "\n"
    )
    stale = tmp_path / "idx" / ".shards" / "0123abcd"
    stale.mkdir(parents=True)
    (stale / "shard-000000.npy").write_bytes(b"\0" * 2_000_000)
    (stale.parent / "no-shard-yet").mkdir()  # a build stopped before its first: nothing to say
    with caplog.at_level("WARNING", logger="duet.build"):
        build(manifest, tmp_path / "idx", model, progress=False, workers=0)
    said = [r.getMessage() for r in caplog.records if "other build(s)' shards" in r.getMessage()]
    assert len(said) == 1 and "1 other build(s)' shards (1 files, 2.0 MB)" in said[0]
    assert f"rm -r {stale}" in said[0] and stale.is_dir()  # told, not deleted
    caplog.clear()
    with caplog.at_level("WARNING", logger="duet.build"):
        build(manifest, tmp_path / "clean", model, progress=False, workers=0)
    assert not any("other build" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("workers", [0, 2])
def test_captions_tokenised_in_the_loader_workers_make_the_same_shards(
    tmp_path: Path,
    corpus: Path,
    model: BuiltinModel,
    workers: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU build's loop (run on the CPU): its loader workers tokenise each batch's
    captions, and the shards it writes are the bytes a whole-shard encoder writes, its
    captions given to the model as the very rows `WordTokenizer.batch` makes of their texts
    (failed images, an item without an image and one without captions, two caption chunks)."""
    plan = _plan(corpus, 250, tmp_path, broken={5, 8, 9})
    missing = [(0, 0, 4), (1, 4, 8), (2, 8, 10), (3, 10, 250)]
    given: list[np.ndarray] = []
    tokenised_here: list[list[str]] = []

    class Recording(Encoder):
        def texts(self, texts: Sequence[str]) -> np.ndarray:
            tokenised_here.append(list(texts))
            return super().texts(texts)

        def token_ids(self, ids: np.ndarray | torch.Tensor) -> np.ndarray:
            given.append(np.asarray(ids))
            return super().token_ids(ids)

    import index_builder.encode as encode_mod

    monkeypatch.setattr(encode_mod, "Encoder", Recording)
    _encode_local(
        plan,
        missing,
        tmp_path,
        model,
        torch.device("cpu"),
        3,
        workers,
        False,
        lambda k, _: None,
        Stages(),
    )
    assert tokenised_here == []  # every caption came tokenised from the loader
    chunks = []
    for _, a, b in missing:
        texts = [c for it in plan[a:b] for c in it.captions]
        order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
        chunks += [[texts[j] for j in order[i : i + 1024]] for i in range(0, len(order), 1024)]
    assert len(given) == len(chunks) == 5
    for rows, texts in zip(given, chunks, strict=True):
        padded = model.tokenizer.batch(texts)[0].numpy()
        assert rows.dtype == padded.dtype
        np.testing.assert_array_equal(rows, padded)
    with _one_thread():
        for k, a, b in missing:
            got, want = read_shard(shard_path(tmp_path, k)), _whole_shard(plan, a, b, model, 3)
            for name in SHARD_FIELDS:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"shard {k} {name}")


def test_caption_ids_pad_as_the_tokenizer_batches_them(model: BuiltinModel) -> None:
    texts = ["a red circle", "", "two big blue squares left of a tiny green triangle " * 3]
    ids = CaptionIds.of(texts, model.tokenizer)
    assert ids.lengths.tolist() == [len(model.tokenizer.ids(t)) for t in texts]
    for which in ([0, 1, 2], [2, 0], [1], []):
        got = ids.padded(which)
        if which:
            want = model.tokenizer.batch([texts[i] for i in which])[0].numpy()
            np.testing.assert_array_equal(got, want)
        else:
            assert got.shape == (0, 0)
    parts = ids.split([2, 0, 1])
    assert [len(p) for p in parts] == [2, 0, 1]
    back = CaptionIds.joined(parts)
    np.testing.assert_array_equal(back.ids, ids.ids)
    np.testing.assert_array_equal(back.lengths, ids.lengths)
    # the encoder's rows in, the tokenizer's own ids and padding mask's vectors out
    from models.builtin import encode_ids

    with _one_thread():
        got_vecs = Encoder(model, torch.device("cpu")).token_ids(ids.padded([0, 1, 2]))
        want_vecs = encode_ids(model.model, *model.tokenizer.batch(texts))
    np.testing.assert_array_equal(got_vecs, want_vecs)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_full_disk_is_an_oserror_naming_the_file_not_a_sigbus_or_a_traceback() -> None:
    """/dev/full answers every write "No space left on device". The tokens were written
    through a memory map, and a full disk killed the build with SIGBUS (exit 135, no word);
    FAISS's write failed as a RuntimeError (a traceback). Both are the OSError the CLI
    reports in one line, with the path."""
    import errno

    import faiss
    import numpy as np

    from index_builder.write import _write_faiss, _write_npy

    index = faiss.IndexFlatIP(8)  # small: FAISS's own file failed only at its close, and
    index.add(np.ones((10, 8), np.float32))  # that printed a line and went on
    rows = [np.zeros((10, 16, 8), np.float16)]
    for write in (
        lambda: _write_faiss(index, Path("/dev/full")),
        lambda: _write_npy(Path("/dev/full"), rows, (10, 16, 8), np.float16),
    ):
        with pytest.raises(OSError) as raised:
            write()
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == "/dev/full"


def test_the_tokens_file_is_what_numpy_saves(tmp_path: Path) -> None:
    """Written chunk by chunk, byte for byte the file `np.save` writes (the same header)."""
    import numpy as np

    from index_builder.write import _write_npy

    tokens = np.random.default_rng(0).random((10, 16, 8)).astype(np.float16)
    _write_npy(tmp_path / "a.npy", [tokens[:3], tokens[3:]], tokens.shape, np.float16)
    np.save(tmp_path / "b.npy", tokens)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()


def test_a_worker_that_outlives_a_killed_build_does_not_hold_its_lock(tmp_path: Path) -> None:
    """DataLoader workers are forks, with the build's --out lock open: killed alone (`kill`,
    the OOM killer), the build left them running, and the same command again was told that
    "another duet build is writing" there, naming the dead pid. They close it at start."""
    import signal
    import subprocess
    import sys
    import time

    from index_builder.errors import BuildError
    from index_builder.outdir import claimed

    script = """
import sys, time, torch
import contextlib
import os
from pathlib import Path
from typing import Any
from index_builder.outdir import claimed, let_go

class Slow(torch.utils.data.Dataset):
    def __len__(self): return 100
    def __getitem__(self, i): time.sleep(0.5); return i

with claimed(Path(sys.argv[1])):
    loader = torch.utils.data.DataLoader(Slow(), num_workers=1, worker_init_fn=let_go)
    for _ in loader:
        print("working", flush=True)
"""
    out = tmp_path / "out"
    kids: list[str] = []
    build = subprocess.Popen(
        [sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert build.stdout is not None and build.stdout.readline() == "working\n"
        kids = subprocess.run(
            ["pgrep", "-P", str(build.pid)], capture_output=True, text=True
        ).stdout.split()
        assert kids, "no worker"
        build.send_signal(signal.SIGKILL)  # the build alone, its worker left running
        build.wait(timeout=10)
        time.sleep(0.2)
        try:
            with claimed(out, create=False):  # the lock is free, the worker still there
                pass
        except BuildError as exc:
            pytest.fail(f"the worker kept the lock: {exc}")
    finally:
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_a_shard_that_cannot_be_written_names_its_file(tmp_path: Path) -> None:
    """`write_atomic` (the shards, the manifest): a failed write's OSError named no file, so a
    build that filled the disk said "No space left on device" and not where. A file-size
    limit fails the write the same way (EFBIG) in a process of its own."""
    import subprocess
    import sys

    script = """
import resource, sys
from pathlib import Path
from store.files import write_atomic
resource.setrlimit(resource.RLIMIT_FSIZE, (5, 5))
try:
    write_atomic(Path(sys.argv[1]), b"x" * 100)
except OSError as exc:
    print(exc.errno, exc.filename)
"""
    target = tmp_path / "shard-00000.npz"
    said = subprocess.run(
        [sys.executable, "-c", script, str(target)], capture_output=True, text=True, timeout=60
    )
    assert said.stdout.split() == ["27", str(target)], said.stdout + said.stderr  # EFBIG
    assert list(tmp_path.iterdir()) == []  # its temp file removed
