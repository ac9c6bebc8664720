"""The errors of reading an index version (re-exported by `store.indexio`)."""

from __future__ import annotations

from models.errors import UserError


class IndexLoadError(UserError, RuntimeError):
    """An index directory is missing, incomplete or unreadable."""


class ModelMismatchError(IndexLoadError):
    """The index was built by a different model than the one loaded."""
