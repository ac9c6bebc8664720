"""Reading a corpus manifest (JSONL, one image per line, paths relative to the manifest)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CorpusError(ValueError):
    """A manifest line is malformed or names an image that cannot be read."""

    def __init__(self, manifest: Path, line: int, message: str) -> None:
        super().__init__(f"{manifest}:{line}: {message}")
        self.manifest = manifest
        self.line = line
        self.reason = message


@dataclass
class CorpusItem:
    """One manifest line: an image with its captions, or only captions, or only an image."""

    line: int
    id: str
    image: Path | None
    image_rel: str | None
    captions: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def read_manifest(manifest: Path) -> Iterator[CorpusItem | CorpusError]:
    """Parse every line; a bad line yields a CorpusError instead of an item (caller decides)."""
    manifest = Path(manifest)
    base = manifest.parent
    seen: set[str] = set()
    with manifest.open(encoding="utf-8") as fh:
        for n, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                item = _parse(json.loads(raw), n, base)
            except (ValueError, TypeError) as exc:
                yield CorpusError(manifest, n, f"malformed line: {exc}")
                continue
            if item.id in seen:
                yield CorpusError(manifest, n, f"duplicate id {item.id!r}")
                continue
            seen.add(item.id)
            yield item


def _parse(obj: Any, line: int, base: Path) -> CorpusItem:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    item_id = obj.get("id")
    if not isinstance(item_id, str) or not item_id:
        raise ValueError('"id" must be a non-empty string')
    image = obj.get("image")
    if image is not None and not isinstance(image, str):
        raise ValueError('"image" must be a path string')
    caps = obj.get("captions", [])
    if not isinstance(caps, list) or not all(isinstance(c, str) and c.strip() for c in caps):
        raise ValueError('"captions" must be a list of non-empty strings')
    if image is None and not caps:
        raise ValueError('a line needs an "image", "captions" or both')
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError('"meta" must be an object')
    return CorpusItem(line, item_id, base / image if image else None, image, list(caps), meta)
