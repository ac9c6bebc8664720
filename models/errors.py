"""The one base of every failure a user can fix from the command line or the settings."""

from __future__ import annotations


class UserError(Exception):
    """A wrong path, setting, choice or file, not a bug: `duet` prints the message (and
    `hint`, when a class has one) and exits 2, without a traceback. The command-specific
    classes (IndexLoadError, ModelLoadError, CorpusError, ...) derive from it, so the CLI
    catches them once, in `duet.cli.main`."""

    hint = ""
