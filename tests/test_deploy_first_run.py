"""First run: `duet demo-index`, what the compose and Kubernetes init containers run, builds
the demo index once even when two replicas start it at once on one volume."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO


def test_demo_index_builds_once_even_when_started_twice_at_once(tmp_path: Path) -> None:
    """Two replicas' init containers on one volume: one builds, the other waits and skips.
    The test holds the lock while both start, so both reach it before either has built."""
    out = tmp_path / "indexes"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "duet.cli",
        "demo-index",
        "--out",
        str(out),
        "--images",
        "12",
        "--no-progress",
    ]
    with (out / ".demo-index.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        time.sleep(3)  # both import and wait on the lock
        assert not (out / "current").exists() and all(p.poll() is None for p in procs)
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("nothing to do" in stdout for stdout, _ in outputs) == 1
    assert (out / "current" / "manifest.json").is_file()
    assert (tmp_path / "demo-corpus" / "manifest.jsonl").is_file()
    versions = [d for d in out.iterdir() if d.is_dir() and not d.is_symlink()]
    assert versions == [(out / "current").resolve()]
