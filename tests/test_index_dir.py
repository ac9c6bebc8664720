"""What `DUET_INDEX_DIR` (or `duet eval --index`) without a `current` link is told: a
version folder names the folder that holds it, a file is called one (`DUET_INDEX_DIR` set
to the version or to the manifest was told to build with `--out` there)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from store.indexio import IndexLoadError, resolve_current
from tests.conftest import CHILD_PYTHONPATH, DUET


def test_a_version_folder_or_a_file_is_told_what_to_give_instead(index_dir: Path) -> None:
    version = resolve_current(index_dir)
    with pytest.raises(IndexLoadError) as exc:
        resolve_current(version)
    assert f"{version} is one version of an index; give the folder that holds it" in str(exc.value)
    assert str(exc.value).endswith(f"`current` link, {version.parent}")
    with pytest.raises(IndexLoadError, match=r"manifest\.json is a file; give the folder"):
        resolve_current(version / "manifest.json")
    with pytest.raises(IndexLoadError, match="build one with `duet build --corpus MANIFEST"):
        resolve_current(version / "nothing")


def test_duet_serve_says_so_before_loading(index_dir: Path) -> None:
    version = resolve_current(index_dir)
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "DUET_INDEX_DIR": str(version)}
    proc = subprocess.run(
        [*DUET, "serve", "--port", "0"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "is one version of an index" in proc.stderr, proc.stderr
    assert "--out" not in proc.stderr.splitlines()[-1]


def test_building_the_same_again_says_the_new_version_is_a_copy(
    tmp_path: Path, corpus: Path
) -> None:
    """A second run of one build published a copy of the version before without a word."""
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    args = [*DUET, "build", "--corpus", str(corpus), "--out", str(tmp_path / "i")]
    runs = [
        subprocess.run([*args, "--no-progress"], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr
    assert "holds the very files of" not in runs[0].stdout
    first = runs[0].stdout.split("current -> ")[1].split()[0]
    assert f"holds the very files of {first}, which current pointed to before" in runs[1].stdout
