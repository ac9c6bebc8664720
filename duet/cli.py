"""The `duet` command: serve, build, eval, bench, train, soup, demo-corpus, demo-index,
healthcheck.

Each group of sub-commands lives in `duet/commands/` (its options and what it runs); this
module assembles the parser and catches, once, every failure a user can fix.
"""

from __future__ import annotations

import argparse
import os
import sys

# the commands (numpy, torch, ...) are imported inside `main`'s Ctrl-C handling: a Ctrl-C
# while a front or a command starts was a KeyboardInterrupt traceback
from duet.commands.common import EXIT_INTERRUPTED, HelpFormatter, fail

__all__ = ["main", "parser"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("duet")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def parser() -> argparse.ArgumentParser:
    from duet.commands import bench, build, evaluate, serve, train

    p = argparse.ArgumentParser(
        prog="duet",
        description="Image-text retrieval: encode a corpus into FAISS indexes, "
        "serve text->image and image->text search with cross-encoder re-ranking.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"duet {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (serve, build, evaluate, bench, train):
        group.add(sub)
    return p


TRACEBACK_ENV = "DUET_TRACEBACK"  # set: a file-system error's traceback, not one line

# what Ctrl-C leaves, by command (`duet build` says it itself; `serve` shuts down cleanly)
AFTER_CTRL_C = {
    "demo-corpus": "the corpus in --out is incomplete (it has no manifest.jsonl yet): run "
    "the same command again; it writes the same bytes",
    "demo-index": "run the same command again: it keeps a finished corpus and resumes the "
    "build from the shards written so far",
    "eval": "nothing was written",
    "bench": "nothing was written; the cells measured so far were not printed",
    "train": "a model is written to --out only once training ends (stopped in the final "
    "validation, it is there without its train.json); training does not resume: run it "
    "again",
    "soup": "--out may hold a part of the averaged model: run the same command again",
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure a user can fix (`models.errors.UserError`: a wrong
    path, setting, choice or file) is caught here, once: its message, exit status 2. Ctrl-C
    ends a command with one line saying what it left (status 130), and a failure of the
    machine's files (a full disk, a read-only folder, a file where a folder goes) with the
    system's own message and the path (status 1), not a traceback."""
    try:
        from models.errors import UserError

        args = parser().parse_args(argv)
    except KeyboardInterrupt:
        print("duet: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        return int(args.fn(args))
    except UserError as exc:
        return fail(f"{exc}\n  {exc.hint}" if exc.hint else str(exc))
    except KeyboardInterrupt:
        left = AFTER_CTRL_C.get(args.command)
        print(f"duet: interrupted{f'; {left}' if left else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if os.environ.get(TRACEBACK_ENV):  # a failure that is duet's own, for its report
            raise
        where = f": {exc.filename}" if exc.filename else ""
        why = exc.strerror or str(exc) or type(exc).__name__
        print(
            f"duet: error: {why}{where} (duet {args.command} stopped; {TRACEBACK_ENV}=1 shows "
            "where)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
