"""The builder's error a user can fix (bad options, factory, ids, base version)."""

from __future__ import annotations

from models.errors import UserError


class BuildError(UserError, ValueError):
    """A build that cannot start or finish as asked (bad factory, duplicate ids, ...)."""
