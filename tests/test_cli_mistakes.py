"""What the commands do with a user's mistakes and interruptions, run as a user runs them (the
real `duet` in a subprocess): a demo corpus never written over a user's files, Ctrl-C and a
failing disk told in one line (no traceback), and options checked before any work."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from app.schemas import image_url
from index_builder import outdir
from models.builtin import BuiltinModel
from models.world import write_corpus
from tests.conftest import DUET, start_service, stop_service


def _duet(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DUET, *args], capture_output=True, text=True, timeout=timeout)


def test_demo_corpus_never_writes_over_a_users_files_unless_forced(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    (mine / "images").mkdir(parents=True)
    line = '{"id": "mine", "image": "images/0000.png", "captions": ["my photo"]}\n'
    (mine / "manifest.jsonl").write_text(line)
    (mine / "images" / "0000.png").write_bytes(b"my own picture")
    refused = _duet("demo-corpus", "--out", str(mine), "--images", "3", "--no-progress")
    assert refused.returncode == 2, refused.stderr
    assert "already holds files no demo corpus wrote (images, manifest.jsonl)" in refused.stderr
    assert "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert (mine / "manifest.jsonl").read_text() == line
    assert (mine / "images" / "0000.png").read_bytes() == b"my own picture"
    forced = _duet("demo-corpus", "--out", str(mine), "--images", "3", "--no-progress", "--force")
    assert forced.returncode == 0, forced.stderr
    assert len((mine / "manifest.jsonl").read_text().splitlines()) == 3


def test_a_demo_corpus_written_again_smaller_leaves_none_of_its_old_images(
    tmp_path: Path,
) -> None:
    """Over a demo corpus (no --force needed): the images the new manifest no longer lists
    go, and a file the old corpus did not list stays."""
    out = tmp_path / "demo"
    write_corpus(out, 6, seed=3, progress=False)
    (out / "notes.txt").write_text("kept")
    again = _duet("demo-corpus", "--out", str(out), "--images", "2", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (out / "images").iterdir()) == ["0000.png", "0001.png"]
    assert (out / "notes.txt").read_text() == "kept"
    # lines naming other files (outside the folder, or not as the corpus names its images)
    # added to its manifest: never removed with the corpus's own images
    (tmp_path / "my_photo.jpg").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "cat.jpg").write_text("mine")
    with (out / "manifest.jsonl").open("a") as fh:
        for rel in ("../my_photo.jpg", "mine/cat.jpg", str(tmp_path / "my_photo.jpg")):
            fh.write(json.dumps({"id": rel, "image": rel, "captions": ["x"]}) + "\n")
    assert _duet("demo-corpus", "--out", str(out), "--images", "1").returncode == 0
    assert (tmp_path / "my_photo.jpg").is_file() and (out / "mine" / "cat.jpg").is_file()
    assert sorted(p.name for p in (out / "images").iterdir()) == ["0000.png"]


def test_ctrl_c_ends_a_command_with_one_line_saying_what_it_left(tmp_path: Path) -> None:
    out = tmp_path / "big"
    proc = subprocess.Popen(
        [*DUET, "demo-corpus", "--out", str(out), "--images", "200000", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (out / "manifest.jsonl.partial").is_file() or not any((out / "images").iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith("duet: interrupted; the corpus in --out is")
    assert not (out / "manifest.jsonl").exists()  # nothing a build would take for a corpus


def test_a_failing_file_system_is_one_line_naming_the_path_not_a_traceback() -> None:
    res = _duet("demo-corpus", "--out", "/proc/duet-cannot-be-here", "--images", "2", "--force")
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("duet: error: ") and "/proc/duet-cannot-be-here" in res.stderr
    assert "Traceback" not in res.stderr


def test_options_are_checked_before_any_work(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", 2, seed=3, progress=False)
    build = ["build", "--corpus", str(corpus), "--out", str(tmp_path / "b")]
    for args, says in (
        (["eval", "--index", str(tmp_path), "--candidates", "0"], "--candidates must be at"),
        (["eval", "--index", str(tmp_path), "--theta", "5"], "--theta must be 0 to 1"),
        (["eval", "--index", str(tmp_path), "--modes", " , "], "--modes names no mode"),
        (["train", "--out", str(tmp_path / "t"), "--batch", "0"], "--batch must be at least 2"),
        ([*build, "--ray-actors", "3"], "--ray-actors applies to --engine ray"),
        ([*build, "--decode-jpeg", "gpu", "--device", "cpu"], "this build runs on the CPU"),
        ([*build, "--workers", "-1"], "--workers must be 0 or more"),
        (["train", "--out", str(tmp_path / "t"), "--lr", "-1"], "--lr must be more than 0"),
        (["train", "--out", str(tmp_path / "t"), "--ce-hard", "2"], "--ce-hard is a share"),
        (["demo-index", "--out", str(tmp_path / "i"), "--images", "0"], "--images must be"),
        (["healthcheck", "--url", "notaurl"], "give an http:// or https:// URL"),
        (["healthcheck", "--timeout", "-1"], "--timeout must be more than 0"),
        (["serve", "--host", "999.1.1.1", "--port", "18999"], "cannot listen on 999.1.1.1"),
        (["demo-corpus", "--out", str(tmp_path / "f.txt"), "--images", "1"], "is a file, not"),
        # trained for its whole run (45 min by default), then failed on the file
        (["train", "--out", str(tmp_path / "f.txt")], "f.txt is a file: give a folder"),
        (["train", "--out", str(tmp_path / "f.txt" / "m")], "f.txt is a file, so no folder"),
        (["soup", "--out", str(tmp_path / "f.txt"), "a", "b"], "f.txt is a file: give a folder"),
        # told after the model had loaded
        (["build", "--delete", str(tmp_path / "no.txt"), "--out", str(tmp_path / "b")], "no.txt"),
    ):
        if "f.txt" in args[2] and not (tmp_path / "f.txt").exists():
            (tmp_path / "f.txt").write_text("x")
        res = _duet(*args)
        assert res.returncode == 2 and says in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "i").exists()  # demo-index made no folder for nothing
    assert not (tmp_path / "t").exists() and not (tmp_path / "b").exists()  # nor train, build


def test_demo_index_keeps_a_finished_corpus_of_its_size_and_seed(tmp_path: Path) -> None:
    """An interrupted first `duet demo-index` run's finished corpus is built as it is (its
    files rendered again would key new shards, and the build would start over)."""
    from duet.commands.demo import _same_demo_corpus

    corpus = tmp_path / "demo-corpus"
    write_corpus(corpus, 4, seed=7, progress=False)
    assert _same_demo_corpus(corpus, 4, 7)
    assert not _same_demo_corpus(corpus, 5, 7) and not _same_demo_corpus(corpus, 4, 8)
    (corpus / "manifest.jsonl").rename(corpus / "manifest.jsonl.partial")  # cut short
    assert not _same_demo_corpus(corpus, 4, 7)


def test_progress_in_a_log_file_is_lines_not_carriage_returns(tmp_path: Path) -> None:
    """stderr a pipe (a log, CI, `docker logs`): each progress line on a line of its own; tqdm's
    redraws-in-place made one ever longer line of frames."""
    res = _duet("demo-corpus", "--out", str(tmp_path / "c"), "--images", "50")
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stderr, repr(res.stderr)
    lines = res.stderr.splitlines()
    assert lines[-1].startswith("rendering: 100%") and "50/50" in lines[-1], lines


def test_demo_index_over_a_damaged_current_version_says_how_to_mend_it(tmp_path: Path) -> None:
    out = tmp_path / "indexes"
    first = _duet("demo-index", "--out", str(out), "--images", "12", "--no-progress")
    assert first.returncode == 0, first.stderr
    (out / "current" / "manifest.json").write_text("{bad")
    again = _duet("demo-index", "--out", str(out), "--images", "12", "--no-progress")
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert f"{out / 'current'} is damaged: point it at a sound version" in again.stderr


def test_a_build_that_writes_nothing_leaves_no_out_folder_it_made(tmp_path: Path) -> None:
    """A build that fails before writing (a bad model, a corpus it cannot read) removes the
    --out it made; a folder the user made, or one holding a shard, stays."""
    made = tmp_path / "new" / "idx"
    with pytest.raises(RuntimeError), outdir.claimed(made):
        raise RuntimeError("the build failed")
    assert not made.exists() and made.parent.is_dir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    with outdir.claimed(theirs):
        pass
    assert theirs.is_dir() and not list(theirs.iterdir())
    kept = tmp_path / "kept"
    with pytest.raises(RuntimeError), outdir.claimed(kept):
        (kept / "shard").write_text("work to resume from")
        raise RuntimeError("interrupted")
    assert (kept / "shard").read_text() == "work to resume from"


def test_ctrl_c_after_the_version_is_published_says_the_build_is_done(
    tmp_path: Path,
    corpus: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Ctrl-C while the build cleans up its shards comes after `current` moved: the line
    says the version is published, not that shards are kept for a rerun."""
    from duet import cli
    from index_builder.plan import ShardPlan

    def ctrl_c(self: ShardPlan) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardPlan, "remove", ctrl_c)
    out = tmp_path / "idx"
    argv = ["build", "--corpus", str(corpus), "--out", str(out), "--device", "cpu"]
    assert cli.main([*argv, "--no-progress", "--workers", "0"]) == 130
    version = (out / "current").readlink()
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("duet:")]
    assert said == [
        f"duet: interrupted after publishing version {version}, which is current: the build "
        "is done, nothing to run again"
    ]


def test_an_append_of_nothing_publishes_nothing(tmp_path: Path, corpus: Path) -> None:
    """An empty manifest, or one whose every line --skip-bad skips, appended: refused, and
    `current` stays (it published a copy, which a running service swapped to)."""
    out = tmp_path / "idx"
    first = _duet("build", "--corpus", str(corpus), "--out", str(out), "--no-progress")
    assert first.returncode == 0, first.stderr
    before = (out / "current").readlink()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "new-1", "image": "missing.png", "captions": ["a red circle"]}\n')
    for manifest, extra in ((empty, []), (bad, ["--skip-bad"])):
        got = _duet("build", "--append", str(manifest), "--out", str(out), "--no-progress", *extra)
        assert got.returncode == 2, got.stderr
        assert "--append: nothing to append" in got.stderr and "Traceback" not in got.stderr
        assert (out / "current").readlink() == before


def test_a_delete_file_names_ids_as_written(tmp_path: Path, corpus: Path) -> None:
    """Ids a manifest takes can be deleted: one starting with "#" (read as a comment before)
    and one with spaces around it (taken off before); a "#" line naming no id is a comment.
    Ids "." and ".." and ids with line breaks are refused when read (never servable or
    deletable), and the route serves an id with a "/" in it."""
    lines = corpus.read_text().splitlines()[:3]
    items = [json.loads(ln) for ln in lines]
    (tmp_path / "images").mkdir()
    longest = "a/b" + "\U0001d11e" * 997  # the longest id: 12 characters each when quoted
    for item, new_id in zip(items, ["#tag", " padded ", longest], strict=True):
        item["id"] = new_id
        (tmp_path / item["image"]).write_bytes((corpus.parent / item["image"]).read_bytes())
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(it) + "\n" for it in items))
    out = tmp_path / "idx"
    built = _duet("build", "--corpus", str(manifest), "--out", str(out), "--no-progress")
    assert built.returncode == 0, built.stderr
    gone = tmp_path / "gone.txt"
    # "#tag" alone: the check before the model loads took it for a comment, a file of none
    # "\ufeff": a byte-order mark (Notepad's) is no part of the first id
    tried = (("\ufeff# a comment\n#tag\n", 0), ("# names none\n", 2), (" padded \n", 0))
    for listed, status in tried:
        gone.write_text(listed)
        before = (out / "current").readlink()
        deleted = _duet("build", "--delete", str(gone), "--out", str(out), "--no-progress")
        assert deleted.returncode == status, deleted.stderr
        if status:
            assert "lists no ids" in deleted.stderr and "Traceback" not in deleted.stderr
            assert (out / "current").readlink() == before
    gone.write_text(f"{longest}#0\n")  # a caption hit's id: said only "not in VERSION"
    deleted = _duet("build", "--delete", str(gone), "--out", str(out), "--no-progress")
    assert deleted.returncode == 2 and "#0' name captions: --delete takes the id of an item" in (
        deleted.stderr
    )
    from store.indexio import IndexVersion

    version = IndexVersion.open(out / "current")
    assert [r.id for r in version.store.images(range(version.image_index.ntotal))] == [longest]
    version.close()
    svc = start_service(out, tmp_path / "serve.log", DUET_IMAGES_DIR=str(tmp_path))
    try:
        url = svc.url + str(image_url(longest))
        r = httpx.get(url, timeout=10)
        assert r.status_code == 200 and r.content == (tmp_path / items[2]["image"]).read_bytes()
    finally:
        stop_service(svc)
    # every break str.splitlines takes, as a --delete file is read: such ids were served
    # and could never be deleted
    from index_builder.corpus import CorpusError, read_corpus

    for bad in ("..", "x" * 1001, *(f"a{c}b" for c in "\n\r\v\f\x1c\x85\u2028\u2029\0")):
        manifest.write_text(json.dumps({**items[2], "id": bad}) + "\n")
        [read] = read_corpus(manifest, None, None)[1]
        assert isinstance(read, CorpusError) and "neither served nor deleted" in str(read), bad
    manifest.write_text(json.dumps({**items[2], "id": "."}) + "\n")
    refused = _duet("build", "--corpus", str(manifest), "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "could be neither served nor deleted" in refused.stderr


def test_a_pipe_or_an_empty_file_named_as_an_image_is_a_bad_entry(
    tmp_path: Path, corpus: Path
) -> None:
    """A named pipe is never read (the build waited on it for ever, --skip-bad or not), and
    an empty file is called one (it was "not a PNG, JPEG, ... file")."""
    import os

    good = json.loads(corpus.read_text().splitlines()[0])
    (tmp_path / "images").mkdir()
    (tmp_path / good["image"]).write_bytes((corpus.parent / good["image"]).read_bytes())
    os.mkfifo(tmp_path / "images" / "pipe.png")
    (tmp_path / "images" / "empty.png").write_bytes(b"")
    lines = [good] + [
        {"id": name, "image": f"images/{name}.png", "captions": ["a red circle"]}
        for name in ("pipe", "empty")
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    args = ["build", "--corpus", str(manifest), "--out", str(tmp_path / "idx"), "--no-progress"]
    got = _duet(*args, "--skip-bad", "--workers", "0", timeout=120)
    assert got.returncode == 0, got.stderr
    assert "not a regular file" in got.stderr and "empty file" in got.stderr


def test_meta_keys_a_hit_carries_as_duets_own_are_refused(tmp_path: Path) -> None:
    """A manifest's meta "image", "text" or "image_id" was replaced in hits by duet's own
    (an image hit's path, a caption hit's text and image id), differently per hit kind."""
    from index_builder.corpus import CorpusError, CorpusItem, read_corpus

    manifest = tmp_path / "m.jsonl"
    for meta, names in (
        ({"image": "evil/path.jpg"}, "'image'"),
        ({"text": "x", "image_id": "q", "mine": 1}, "'text', 'image_id'"),
    ):
        manifest.write_text(json.dumps({"id": "a", "captions": ["a red circle"], "meta": meta}))
        [read] = read_corpus(manifest, None, None)[1]
        assert isinstance(read, CorpusError), meta
        assert f'"meta" has {names}, which hits carry as duet\'s own' in str(read), str(read)
    manifest.write_text(json.dumps({"id": "a", "captions": ["x"], "meta": {"images": 2}}))
    [fine] = read_corpus(manifest, None, None)[1]
    assert isinstance(fine, CorpusItem) and fine.meta == {"images": 2}


def test_partial_queries_on_an_index_without_scenes_are_refused_before_the_work(
    tmp_path: Path, model: BuiltinModel
) -> None:
    """They were refused only after both directions had been scored (minutes on a large
    index): every partial query is judged by its hit's meta.scene."""
    from PIL import Image

    from index_builder.build import build

    (tmp_path / "c").mkdir()
    lines = []
    for i in range(3):
        Image.new("RGB", (16, 16), (80 * i, 0, 0)).save(tmp_path / "c" / f"{i}.png")
        lines.append(json.dumps({"id": f"p{i}", "image": f"{i}.png", "captions": ["a red one"]}))
    (tmp_path / "c" / "m.jsonl").write_text("\n".join(lines) + "\n")
    build(tmp_path / "c" / "m.jsonl", tmp_path / "idx", model, progress=False, workers=0)
    res = _duet("eval", "--index", str(tmp_path / "idx"), "--partial", "5", "--modes", "dot")
    assert res.returncode == 2 and "images have none: leave --partial out" in res.stderr
    assert "Traceback" not in res.stderr and "t2i" not in res.stderr
