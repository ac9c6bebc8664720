"""`duet build` and a user's mistakes: each ends in one clear line and exit 2 (130 for Ctrl-C),
never a traceback, and `current` stays as it was. The manifest's format, the output
directory, one build at a time per `--out`, nothing to index, images too large to decode."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest
from PIL import Image

from index_builder import outdir
from index_builder.build import build
from index_builder.corpus import MANIFEST_KEYS, CorpusError, CorpusItem, read_manifest
from index_builder.errors import BuildError
from index_builder.write import IDENTICAL_FILES
from models.builtin import BuiltinModel
from tests.conftest import CHILD_PYTHONPATH, DUET, start_service, stop_service

ENV = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}


def _corpus(src: Path, dst: Path, n: int, extra: list[str] | None = None) -> Path:
    """The first n lines of `src` (images copied) and `extra` lines, as dst/manifest.jsonl."""
    (dst / "images").mkdir(parents=True, exist_ok=True)
    lines = src.read_text().splitlines()[:n]
    for line in lines:
        rel = json.loads(line)["image"]
        (dst / rel).write_bytes((src.parent / rel).read_bytes())
    manifest = dst / "manifest.jsonl"
    manifest.write_text("".join(f"{line}\n" for line in [*lines, *(extra or [])]))
    return manifest


def _duet_build(*args: str | Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    cmd = [*DUET, "build", *map(str, args), "--no-progress", "--workers", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def _said(proc: subprocess.CompletedProcess[str], code: int, *parts: str) -> None:
    """Exit `code`, each of `parts` in stderr, and no traceback."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for part in parts:
        assert part in proc.stderr, proc.stderr


def _entries(tmp_path: Path, data: bytes) -> list[CorpusItem | CorpusError]:
    path = tmp_path / "m.jsonl"
    path.write_bytes(data)
    return list(read_manifest(path))


# -- the manifest's format ------------------------------------------------------------------


def test_unknown_keys_are_errors_naming_line_key_and_format(tmp_path: Path) -> None:
    ok = {"id": "a", "image": "a.png", "captions": ["a red circle"], "meta": {"k": 1}}
    lines = [ok, {"id": "b", "image": "b.png", "caption": ["x"]}, {"id": "c", "path": "c.png"}]
    got = _entries(tmp_path, "".join(json.dumps(x) + "\n" for x in lines).encode())
    assert isinstance(got[0], CorpusItem) and got[0].meta == {"k": 1}
    assert isinstance(got[1], CorpusError) and got[1].line == 2
    assert "m.jsonl:2: " in str(got[1]) and "'caption' (did you mean 'captions'?)" in str(got[1])
    assert '"id", "image", "captions", "meta"' in str(got[1])
    assert isinstance(got[2], CorpusError) and "m.jsonl:3:" in str(got[2])
    assert "'path'" in str(got[2])


def test_utf8_bom_json_array_and_non_utf8_lines(tmp_path: Path) -> None:
    line = json.dumps({"id": "a", "captions": ["a red circle"]}).encode()
    bom = _entries(tmp_path, b"\xef\xbb\xbf" + line + b"\n")
    assert [type(e) for e in bom] == [CorpusItem]
    array = _entries(tmp_path, b"[" + line + b"]\n")
    assert isinstance(array[0], CorpusError) and "one JSON object (JSON Lines)" in str(array[0])
    pretty = _entries(tmp_path, b"[\n  " + line + b"\n]\n")
    assert [type(e) for e in pretty] == [CorpusError, CorpusItem, CorpusError]  # "[", "]"
    assert "a JSON array; each line must be one JSON object (JSON Lines)" in str(pretty[0])
    latin1 = json.dumps({"id": "b", "captions": ["caf\u00e9"]}, ensure_ascii=False)
    mixed = _entries(tmp_path, line + b"\n" + latin1.encode("latin-1") + b"\n" + line + b"\n")
    assert isinstance(mixed[0], CorpusItem) and isinstance(mixed[2], CorpusError)  # dup id
    bad = mixed[1]
    assert isinstance(bad, CorpusError) and bad.line == 2
    assert "m.jsonl:2: not UTF-8 (byte 0xe9" in str(bad) and "must be UTF-8" in str(bad)


def test_cli_misspelled_key_and_non_utf8_exit_2(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a", "caption": ["a red circle"]}) + "\n")
    _said(
        _duet_build("--corpus", tmp_path / "a.jsonl", "--out", tmp_path / "idx"),
        2,
        "a.jsonl:1: malformed line: unknown key 'caption' (did you mean 'captions'?)",
        "--skip-bad",
    )
    (tmp_path / "b.jsonl").write_bytes(b'{"id": "b", "captions": ["caf\xe9"]}\n')
    _said(_duet_build("--corpus", tmp_path / "b.jsonl", "--out", tmp_path / "idx"), 2, "b.jsonl:1")
    assert not (tmp_path / "idx" / "current").exists()
    _said(_duet_build("--corpus", tmp_path, "--out", tmp_path / "idx"), 2, "is a directory")


# -- nothing to index --------------------------------------------------------------------------


def test_cli_refuses_an_empty_version_and_keeps_current(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    out = tmp_path / "idx"
    first = build(_corpus(corpus, tmp_path / "c", 3), out, model, progress=False, workers=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _said(_duet_build("--corpus", empty, "--out", out), 2, "nothing to index", "has no items")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{not json\n{"id": "x", "image": "missing.png"}\n{"id": "y", "path": "p"}\n')
    proc = _duet_build("--corpus", bad, "--out", out, "--skip-bad")
    _said(proc, 2, "--skip-bad skipped every entry", "3 bad", "bad.jsonl:1:", "current is left")
    said = proc.stderr.partition("error:")[2]  # line 2 failed to decode after 3 was read
    told = [said.index(f"bad.jsonl:{n}:") for n in (1, 2, 3)]
    assert told == sorted(told), said
    assert os.readlink(out / "current") == first.version
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == {
        "current",
        first.version,
    }


def test_delete_of_everything_and_all_images_bad_are_refused(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    out = tmp_path / "idx"
    manifest = _corpus(corpus, tmp_path / "c", 2)
    first = build(manifest, out, model, progress=False, workers=0)
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(json.loads(ln)["id"] + "\n" for ln in manifest.read_text().splitlines()))
    with pytest.raises(BuildError, match="would remove every item"):
        build(None, out, model, progress=False, delete=ids)
    only_images = tmp_path / "c" / "images.jsonl"  # images only, all of them unreadable
    only_images.write_text(json.dumps({"id": "z", "image": "images/nope.png"}) + "\n")
    with pytest.raises(BuildError, match="skipped every entry"):
        build(only_images, out, model, progress=False, workers=0, skip_bad=True)
    assert os.readlink(out / "current") == first.version


def test_skip_bad_counts_what_was_built(tmp_path: Path, corpus: Path, model: BuiltinModel) -> None:
    manifest = _corpus(corpus, tmp_path / "c", 6)
    (tmp_path / "c" / "images" / "0002.png").write_bytes(b"not a png")
    report = build(manifest, tmp_path / "idx", model, progress=False, workers=0, skip_bad=True)
    assert report.images == 5 and report.encoded == 5 and len(report.skipped) == 1


# -- images too large ---------------------------------------------------------------------------


def test_an_image_past_the_bomb_limit_is_one_clear_bad_image(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    manifest = _corpus(corpus, tmp_path / "c", 2, [json.dumps({"id": "big", "image": "big.png"})])
    Image.new("L", (10000, 10000)).save(tmp_path / "c" / "big.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's warning would fail the test
        with pytest.raises(CorpusError) as err:
            build(manifest, tmp_path / "a", model, progress=False, workers=0)
        assert err.value.line == 3 and "100,000,000 pixels" in str(err.value)
        assert "scale it down" in str(err.value)
        report = build(manifest, tmp_path / "b", model, progress=False, workers=0, skip_bad=True)
    assert report.images == 2 and len(report.skipped) == 1


# -- the output directory, one build at a time -------------------------------------------------


def test_unusable_out_is_one_clear_error(
    tmp_path: Path, model: BuiltinModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "captions": ["a red circle"]}) + "\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (afile, "is a file, not a directory"),
        (afile / "sub", "a part of that path is a file"),
        (Path("/proc/duet-x"), "cannot make or write --out /proc/duet-x"),
    ]
    for out, message in cases:
        with pytest.raises(BuildError, match=message):
            build(manifest, out, model, progress=False, workers=0)

    def read_only(lock: Path) -> int:  # as root (CI) a chmod would not stop us: the errors
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(outdir, "_open", read_only)
    with pytest.raises(BuildError, match=r"is not writable \(Read-only file system\): give a"):
        build(manifest, tmp_path / "ro", model, progress=False, workers=0)

    def denied(lock: Path) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(outdir, "_open", denied)
    with pytest.raises(BuildError, match=r"is not writable \(Permission denied\)"):
        build(manifest, tmp_path / "ro", model, progress=False, workers=0)


def test_cli_out_is_a_file(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "captions": ["a red circle"]}) + "\n")
    (tmp_path / "afile").write_text("x")
    proc = _duet_build("--corpus", manifest, "--out", tmp_path / "afile")
    _said(proc, 2, f"--out {tmp_path / 'afile'} is a file: give a folder to write into")
    assert "image tokens for" not in proc.stderr  # told before the model loads


def test_a_second_build_into_the_same_out_stops(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    out = tmp_path / "idx"
    manifest = _corpus(corpus, tmp_path / "c", 3)
    holder = subprocess.Popen(  # a build in progress, as a build holds the lock
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from index_builder.outdir import claimed\n"
            "with claimed(Path(sys.argv[1])):\n"
            "    print('holding', flush=True); sys.stdin.read()\n",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=ENV,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"holding\n"
        proc = _duet_build("--corpus", manifest, "--out", out)
        _said(proc, 2, f"another duet build is writing to {out} (pid {holder.pid}); wait for it")
        assert not (out / "current").exists() and not (out / ".shards").exists()
    finally:
        holder.kill()  # dies holding it: the kernel lets go
        holder.wait()
    assert build(manifest, out, model, progress=False, workers=0).images == 3


def test_a_held_lock_stops_an_append(tmp_path: Path, corpus: Path, model: BuiltinModel) -> None:
    out = tmp_path / "idx"
    build(_corpus(corpus, tmp_path / "c", 2), out, model, progress=False, workers=0)
    assert not (out / outdir.LOCK).exists()  # removed by the build that held it
    fd = os.open(out / outdir.LOCK, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(BuildError, match="another duet build is writing to"):
            build(None, out, model, progress=False, delete=tmp_path / "none.txt")
    finally:
        os.close(fd)


def test_a_link_at_the_lock_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    """Whoever can write a shared --out could put a link where the lock goes: the build
    refuses it rather than truncate, and write its pid into, the file it points at."""
    out = tmp_path / "idx"
    out.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (out / outdir.LOCK).symlink_to(victim)
    with pytest.raises(BuildError, match="symbolic link"), outdir.claimed(out):
        pass
    assert victim.read_text() == "keep me"
    assert (out / outdir.LOCK).is_symlink()


# -- Ctrl-C ----------------------------------------------------------------------------------


def _group_alive(pgid: int) -> list[int]:
    """The processes still in process group `pgid`."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def test_ctrl_c_is_one_line_exit_130_and_the_rerun_resumes(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    lines = corpus.read_text().splitlines()
    manifest = _corpus(corpus, tmp_path / "c", 40)
    many = [
        json.dumps({**json.loads(ln), "id": f"r{k}-{n}"})
        for k in range(10)
        for n, ln in enumerate(lines)
    ]
    manifest.write_text("".join(f"{ln}\n" for ln in many))  # 400 items, 50 shards
    args = ["--batch-size", "8", "--shard-size", "8", "--factory", "Flat"]
    ref = build(
        manifest,
        tmp_path / "ref",
        model,
        progress=False,
        batch_size=8,
        shard_size=8,
        factory="Flat",
        workers=0,
    )
    out = tmp_path / "idx"
    cmd = [
        *DUET,
        "build",
        "--corpus",
        str(manifest),
        "--out",
        str(out),
        *args,
        "--workers",
        "2",
        "--no-progress",
    ]
    # a terminal's Ctrl-C: SIGINT to the whole foreground group, the loader's workers too.
    # The build starts with SIGINT's default action, as from a terminal: a suite started in
    # the background (`make test &`) passes SIGINT on ignored, and an ignored Ctrl-C is no
    # interruption
    sigint = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    sigint += "os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", sigint, *cmd],
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not list(out.glob(".shards/*/shard-*.npy")):
        assert proc.poll() is None, "the build ended before it wrote a shard"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    said = [ln for ln in err.splitlines() if " INFO " not in ln]
    assert said == [
        f"duet: interrupted; the shards written so far are kept in {out}: run the same "
        "command again to resume"
    ]
    time.sleep(0.5)
    assert _group_alive(proc.pid) == []  # no worker left behind
    again = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "current" / "manifest.json").read_text())["build"]["resumed_shards"]
    for name in IDENTICAL_FILES:
        assert (ref.path / name).read_bytes() == (out / "current" / name).read_bytes(), name


# -- what docs/corpus-and-indexes.md tells a user ---------------------------------------------

DOC = (Path(__file__).resolve().parent.parent / "docs" / "corpus-and-indexes.md").read_text()


def test_the_doc_lists_the_manifest_keys_and_lines_with_one_of_image_or_captions() -> None:
    sentence = DOC.split("A line takes these keys and no others:", 1)[1].split(".", 1)[0]
    assert [k for k in MANIFEST_KEYS if f"`{k}`" in sentence] == list(MANIFEST_KEYS)
    assert "only an `image`" in DOC and "only `captions`" in DOC


def test_the_docs_serve_example_serves_images_of_a_corpus_kept_elsewhere(
    tmp_path: Path, corpus: Path, model: BuiltinModel
) -> None:
    """Corpus in one folder, index in another, served as the doc says: GET /images/{id}
    answers the image (without DUET_IMAGES_DIR it answered 404, the page's thumbnails broke)."""
    line = next(ln for ln in DOC.splitlines() if ln.startswith("DUET_INDEX_DIR=/srv/indexes"))
    env = dict(w.split("=", 1) for w in line.split() if "=" in w)
    assert env == {"DUET_INDEX_DIR": "/srv/indexes", "DUET_IMAGES_DIR": "/data/corpus"}
    manifest = _corpus(corpus, tmp_path / "data" / "corpus", 2)
    build(manifest, tmp_path / "srv" / "indexes", model, progress=False, workers=0)
    svc = start_service(
        tmp_path / "srv" / "indexes", tmp_path / "serve.log", DUET_IMAGES_DIR=str(manifest.parent)
    )
    try:
        item = json.loads(manifest.read_text().splitlines()[0])
        r = httpx.get(f"{svc.url}/images/{item['id']}", timeout=10)
        assert r.status_code == 200, r.text[:200]
        assert r.content == (manifest.parent / item["image"]).read_bytes()
        assert httpx.get(f"{svc.url}/readyz").json()["images"] == "served"
        assert "cannot serve this version's images" not in (tmp_path / "serve.log").read_text()
        # HEAD as GET, without the body: a link checker can test an image_url, a probe /readyz
        for path in (f"/images/{item['id']}", "/readyz"):
            got, head = httpx.get(svc.url + path), httpx.head(svc.url + path)
            assert head.status_code == got.status_code == 200 and head.content == b"", path
            assert head.headers["content-type"] == got.headers["content-type"]
        assert httpx.head(f"{svc.url}/images/nope").status_code == 404
    finally:
        stop_service(svc)
