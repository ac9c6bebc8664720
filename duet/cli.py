"""The `duet` command: serve, build, eval, train, soup, demo-corpus, demo-index, healthcheck.

Each group of sub-commands lives in `duet/commands/` (its options and what it runs); this
module assembles the parser and catches, once, every failure a user can fix.
"""

from __future__ import annotations

import argparse
import sys

from duet.commands import build, evaluate, serve, train
from duet.commands.common import HelpFormatter, fail
from duet.commands.evaluate import eval_modes

__all__ = ["eval_modes", "main", "parser"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("duet")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duet",
        description="Image-text retrieval: encode a corpus into FAISS indexes, "
        "serve text->image and image->text search with cross-encoder re-ranking.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"duet {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (serve, build, evaluate, train):
        group.add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure a user can fix (`models.errors.UserError`: a wrong
    path, setting, choice or file) is caught here, once: its message, exit status 2."""
    from models.errors import UserError

    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except UserError as exc:
        return fail(f"{exc}\n  {exc.hint}" if exc.hint else str(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
