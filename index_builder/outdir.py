"""A build's claim on its output directory: made if missing (or a clear error saying why it
cannot be), then held by an exclusive lock on `OUT/.build.lock` for the whole build, so a
second `duet build` into the same `--out` stops at once instead of colliding with the first
over its shards and versions. The kernel drops the lock with its process, however that
process ends (Ctrl-C, SIGKILL, the OOM killer): a lock nobody holds means nobody builds."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from index_builder.errors import BuildError

LOCK = ".build.lock"


def _unusable(out: Path, exc: OSError) -> BuildError:
    """Why `out` cannot hold an index, and what to do about it."""
    what = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError) or (out.exists() and not out.is_dir()):
        return BuildError(
            f"--out {out} is a file, not a directory: give a directory for the index "
            "versions (it is made if missing)"
        )
    if isinstance(exc, NotADirectoryError):
        return BuildError(
            f"--out {out}: a part of that path is a file, not a directory ({what}); give a "
            "directory path"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return BuildError(
            f"--out {out} is not writable ({what}): give a directory you can write to, or "
            "fix its permissions"
        )
    return BuildError(
        f"cannot make or write --out {out} ({what}): give a directory you can write to"
    )


def _open(lock: Path) -> int:
    """The lock file itself, never what a link there points at (whoever can write a shared
    --out could otherwise have a build truncate any file its user can write)."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BuildError(
                f"{lock} is a symbolic link, not duet's lock file: remove it and build again"
            ) from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BuildError(f"{lock} is not a regular file: remove it and build again")
    return fd


def _holder(lock: Path) -> str:
    """The pid a lock file names, for the message ("?" when it cannot be read)."""
    try:
        pid = lock.read_text().strip()
    except OSError:
        return "?"
    return pid if pid.isdigit() else "?"


_HELD: set[int] = set()  # descriptors of the locks this process holds (`claimed`)


def let_go(_worker: int = 0) -> None:
    """In a forked worker (a DataLoader's `worker_init_fn`): close its copies of the held
    locks. A flock lasts while any descriptor of it is open, so workers that outlived a
    build killed alone (`kill`, the OOM killer) held `--out` locked for good, and the same
    command run again was told another build was writing there, naming the dead pid."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


def _lock(out: Path, lock: Path) -> int:
    """A descriptor of `lock` holding its exclusive flock, taken without waiting. A build
    removes the file when it ends: a lock taken on a file removed meanwhile is let go and
    taken again on the file now there, so two builds never hold two files."""
    while True:
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = _open(lock)  # a directory we cannot write fails here, before any work
        except OSError as exc:
            raise _unusable(out, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BuildError(
                f"another duet build is writing to {out} (pid {_holder(lock)}); wait for it "
                "to finish or use another --out"
            ) from None
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(lock)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextlib.contextmanager
def claimed(out: Path, create: bool = True) -> Iterator[None]:
    """Hold `out` for one build: made first when `create` (a fresh build; an append or delete
    needs it to exist), locked until the block ends, the lock file removed then, and a folder
    this build made removed too when nothing was written in it (a build that failed at once
    leaves no empty --out behind). Raises BuildError, never OSError, when `out` cannot be
    used or another build holds it."""
    if not create and not out.is_dir():
        raise BuildError(
            f"--append/--delete need a current version: {out} is not a directory "
            "(build one with --corpus first)"
        )
    lock = out / LOCK
    made = not out.exists()  # a build that leaves nothing removes the folder it made
    fd = _lock(out, lock)
    _HELD.add(fd)
    try:
        with contextlib.suppress(OSError):  # the pid only names the holder to a second build
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # while still held: the next build makes a fresh one
        _HELD.discard(fd)
        os.close(fd)
        if made:
            with contextlib.suppress(OSError):  # only when empty: shards or a version stay
                out.rmdir()
