"""Reading a corpus: a JSONL manifest (one image per line, paths relative to the manifest) or
a Karpathy-split JSON file (`dataset_flickr30k.json`, `dataset_coco.json`, ...)."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import UserError

KARPATHY_SPLITS = ("train", "restval", "val", "test")


class CorpusError(UserError, ValueError):
    """A manifest line / Karpathy image entry is malformed or names an unreadable image.

    `line` is the manifest line (1-based) or the index into a Karpathy file's "images" list;
    `where` is how the message names it (`7`, `images[3] (1000092795.jpg)`).
    """

    hint = "fix or remove that entry, or pass --skip-bad to skip bad entries"

    def __init__(self, manifest: Path, line: int, message: str, where: str | None = None) -> None:
        super().__init__(f"{manifest}:{where or line}: {message}")
        self.manifest = manifest
        self.line = line
        self.reason = message


class CorpusFileError(UserError, ValueError):
    """The corpus file as a whole cannot be used (not JSON, wrong shape, no such split)."""


@dataclass
class CorpusItem:
    """One corpus entry: an image with its captions, or only captions, or only an image."""

    line: int
    id: str
    image: Path | None
    image_rel: str | None
    captions: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    where: str | None = None  # how errors name the entry, when not by its line number


@dataclass(frozen=True)
class CorpusSelection:
    """What a corpus file was read as: it keys build shards and is recorded in manifest.json."""

    format: str  # "manifest" or "karpathy"
    dataset: str | None = None
    splits: tuple[str, ...] | None = None
    images_root: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format}
        if self.format == "karpathy":
            out.update(
                dataset=self.dataset,
                split=",".join(self.splits or ()),
                images_root=self.images_root,
            )
        return out


def corpus_format(path: Path) -> str:
    """ "karpathy" for a `.json` file, "manifest" for anything else (`.jsonl`)."""
    return "karpathy" if Path(path).suffix.lower() == ".json" else "manifest"


def read_corpus(
    path: Path, split: str | None = None, images_root: Path | None = None
) -> tuple[CorpusSelection, Iterator[CorpusItem | CorpusError]]:
    """Pick the reader by file: `.json` is a Karpathy file (`split` required, `images_root`
    defaults to the file's directory), anything else a JSONL manifest (neither option).

    Raises CorpusFileError for a file or options that cannot be used at all; per-entry
    problems are yielded as CorpusError (the caller stops or skips)."""
    path = Path(path)
    if corpus_format(path) == "manifest":
        if split is not None or images_root is not None:
            raise CorpusFileError(
                f"{path}: --split and --images-root apply to Karpathy JSON "
                "corpora (.json); a JSONL manifest holds what it holds and "
                "names its images relative to itself"
            )
        return CorpusSelection("manifest"), read_manifest(path)
    return read_karpathy(path, split, images_root)


# -- JSONL manifest ----------------------------------------------------------------------

# the keys a manifest line takes; any other is a user's typo (`caption`, `path`), not ignored
MANIFEST_KEYS = ("id", "image", "captions", "meta")
# what a hit's meta gets from duet (`app.work.items_of`): a manifest's own would be replaced
RESERVED_META = ("image", "text", "image_id")
JSON_LINES = 'each line must be one JSON object (JSON Lines): {"id": ..., "image": ..., ...}'


def read_manifest(manifest: Path) -> Iterator[CorpusItem | CorpusError]:
    """Parse every line; a bad line yields a CorpusError instead of an item (caller decides).
    The file is UTF-8 (a byte-order mark before the first line is allowed); a line that is not
    is a bad line like any other."""
    manifest = Path(manifest)
    base = manifest.parent
    seen: set[str] = set()
    with manifest.open("rb") as fh:
        for n, data in enumerate(fh, start=1):
            try:
                raw = data.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield CorpusError(
                    manifest,
                    n,
                    f"not UTF-8 (byte {data[exc.start]:#04x} at column {exc.start + 1}): a "
                    "manifest must be UTF-8 text; save it as UTF-8",
                )
                continue
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                if _SURROGATE.search(raw) and (why := _unencodable(obj)):
                    raise ValueError(why)
                item = _parse(obj, n, base)
            except (ValueError, TypeError) as exc:
                yield CorpusError(manifest, n, _malformed(raw, exc))
                continue
            if item.id in seen:
                yield CorpusError(manifest, n, f"duplicate id {item.id!r}")
                continue
            seen.add(item.id)
            yield item


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # JSON's escape of a UTF-16 surrogate


def _unencodable(value: Any) -> str | None:
    """Why `value` holds no text (a lone UTF-16 surrogate, JSON's "\\ud800" with no pair:
    no UTF-8 holds it, so it could be neither stored nor served), or None."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        half = exc.object[exc.start : exc.end]
        return f"holds {half!r}, half of a UTF-16 surrogate pair with no other half: not text"
    return None


def _malformed(raw: str, exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        if raw.lstrip().startswith("["):  # a JSON array (or its first line) saved as .jsonl
            return f"malformed line: a JSON array; {JSON_LINES}"
        return f"malformed line: {exc}; {JSON_LINES}"
    return f"malformed line: {exc}"


MAX_ID_CHARS = 1000


def _unservable(item_id: str) -> str | None:
    """Why an id could not be served at its image_url or listed in a --delete file."""
    if item_id in (".", ".."):
        return 'it is "." or ".." (/images/.. is the page\'s own address)'
    if item_id.splitlines() != [item_id] or "\0" in item_id:
        # what str.splitlines breaks on, as a --delete file is read
        return (
            "it holds a line break (\\n, \\r, \\v, \\f, \\x1c-\\x1e, \\x85, \\u2028 or "
            "\\u2029) or a NUL, and a --delete file lists one id a line"
        )
    if len(item_id) > MAX_ID_CHARS:
        return (
            f"it has more than {MAX_ID_CHARS} characters (its image_url would pass the "
            "server's 16 KiB request line)"
        )
    return None


def _shown(item_id: str) -> str:
    return repr(item_id) if len(item_id) <= 80 else f"{item_id[:60]!r}... ({len(item_id)} chars)"


def _parse(obj: Any, line: int, base: Path) -> CorpusItem:
    if isinstance(obj, list):
        raise ValueError(f"a JSON array; {JSON_LINES}")
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object; {JSON_LINES}")
    unknown = [k for k in obj if k not in MANIFEST_KEYS]
    if unknown:
        raise ValueError(_unknown_keys(unknown))
    item_id = obj.get("id")
    if not isinstance(item_id, str) or not item_id:
        raise ValueError('"id" must be a non-empty string')
    if why := _unservable(item_id):
        raise ValueError(f'"id" {_shown(item_id)} could be neither served nor deleted: {why}')
    image = obj.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise ValueError(
            '"image" must be a path string (leave the key out for a captions-only line)'
        )
    caps = obj.get("captions", [])
    if not isinstance(caps, list) or not all(isinstance(c, str) and c.strip() for c in caps):
        raise ValueError('"captions" must be a list of non-empty strings')
    if image is None and not caps:
        raise ValueError('a line needs an "image", "captions" or both')
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError('"meta" must be an object')
    if taken := [k for k in RESERVED_META if k in meta]:
        raise ValueError(
            f'"meta" has {", ".join(map(repr, taken))}, which hits carry as duet\'s own (an '
            "image hit's path, a caption hit's text and image id) and would hide: rename "
            f"{'them' if len(taken) > 1 else 'it'}"
        )
    return CorpusItem(line, item_id, base / image if image else None, image, list(caps), meta)


def _unknown_keys(unknown: list[str]) -> str:
    """What a line with keys the format does not take is told: each, with the likely key."""
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, MANIFEST_KEYS, n=1, cutoff=0.5)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    takes = ", ".join(f'"{k}"' for k in MANIFEST_KEYS)
    return (
        f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(named)}: a manifest line "
        f'takes {takes} (an "image", "captions" or both; put anything else under "meta")'
    )


# -- Karpathy split JSON --------------------------------------------------------------------


def parse_splits(split: str | None, path: Path, counts: dict[str, int]) -> tuple[str, ...]:
    """`test`, `train,restval` or `all` -> the split names, checked against the file."""
    have = ", ".join(f"{s} {n}" for s, n in counts.items()) or "none"
    if split is None:
        raise CorpusFileError(
            f"{path} is a Karpathy JSON corpus: choose its split with --split "
            f"test (the papers' test set), or train, val, restval, a "
            f"comma-separated list, or all (this file has: {have})"
        )
    names = [s.strip() for s in split.split(",") if s.strip()]
    if names == ["all"]:
        return tuple(counts)
    unknown = [s for s in names if s not in KARPATHY_SPLITS]
    if unknown or not names:
        raise CorpusFileError(
            f"unknown split {', '.join(unknown) or repr(split)}: use "
            f"{', '.join(KARPATHY_SPLITS)}, a comma-separated list, or all "
            f"(this file has: {have})"
        )
    empty = [s for s in names if not counts.get(s)]
    if empty:
        raise CorpusFileError(
            f"{path} has no images in split {', '.join(empty)} (this file has: {have})"
        )
    return tuple(dict.fromkeys(names))


def read_karpathy(
    path: Path, split: str | None, images_root: Path | None = None
) -> tuple[CorpusSelection, Iterator[CorpusItem | CorpusError]]:
    """The images of `split` in file order. Ids are `<dataset>-<filename stem>` (e.g.
    `flickr30k-1000092795`, `coco-COCO_val2014_000000391895`); captions are every
    `sentences[].raw`; the image is ROOT/filename, or ROOT/filepath/filename when the entry
    has a "filepath" (COCO)."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8-sig") as fh:  # a byte-order mark is allowed
            doc = json.load(fh)
    except UnicodeDecodeError as exc:
        raise CorpusFileError(f"{path} is not UTF-8 text: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CorpusFileError(
            f"{path} is not valid JSON ({exc}); a Karpathy corpus is one "
            'object {"images": [...], "dataset": ...}; a JSONL manifest '
            "must be named .jsonl"
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise CorpusFileError(
            f'{path}: expected a Karpathy JSON object with an "images" list '
            '({"images": [...], "dataset": "flickr30k"}); a JSONL manifest '
            "must be named .jsonl"
        )
    dataset = doc.get("dataset")
    if not isinstance(dataset, str) or not dataset.strip():
        raise CorpusFileError(
            f'{path}: "dataset" must be a non-empty string '
            '("flickr30k", "coco", ...); it prefixes every item id'
        )
    images: list[Any] = doc["images"]
    counts: dict[str, int] = {}
    for entry in images:
        s = entry.get("split") if isinstance(entry, dict) else None
        if isinstance(s, str):
            counts[s] = counts.get(s, 0) + 1
    splits = parse_splits(split, path, counts)
    root = Path(images_root) if images_root is not None else path.parent
    if not root.is_dir():
        raise CorpusFileError(
            f"images root {root} is not a directory (--images-root; default: "
            "the JSON file's directory)"
        )
    selection = CorpusSelection("karpathy", dataset, splits, str(root.resolve()))
    return selection, _karpathy_items(path, dataset, images, set(splits), root)


def _karpathy_items(
    path: Path, dataset: str, images: list[Any], splits: set[str], root: Path
) -> Iterator[CorpusItem | CorpusError]:
    seen: set[str] = set()
    for i, entry in enumerate(images):
        name = entry.get("filename") if isinstance(entry, dict) else None
        where = f"images[{i}]" + (f" ({name})" if isinstance(name, str) else "")
        if isinstance(entry, dict) and entry.get("split") not in splits:
            if "split" not in entry or not isinstance(entry["split"], str):
                yield CorpusError(path, i, 'no "split" string', where)
            continue
        try:
            item = _karpathy_item(entry, i, dataset, root, where)
        except (ValueError, TypeError) as exc:
            yield CorpusError(path, i, f"malformed entry: {exc}", where)
            continue
        if item.id in seen:
            yield CorpusError(
                path, i, f"duplicate id {item.id!r} (two entries with this filename)", where
            )
            continue
        seen.add(item.id)
        yield item


def _karpathy_item(entry: Any, i: int, dataset: str, root: Path, where: str) -> CorpusItem:
    if not isinstance(entry, dict):
        raise ValueError("expected a JSON object")
    name = entry.get("filename")
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError('"filename" must be a file name')
    folder = entry.get("filepath")
    if folder is not None and (
        not isinstance(folder, str) or folder.startswith("/") or ".." in Path(folder).parts
    ):
        raise ValueError('"filepath" must be a relative folder')
    rel = f"{folder}/{name}" if folder else name
    sentences = entry.get("sentences")
    if not isinstance(sentences, list) or not sentences:
        raise ValueError('"sentences" must be a non-empty list')
    caps: list[str] = []
    for s in sentences:
        raw = s.get("raw") if isinstance(s, dict) else None
        if not isinstance(raw, str) or not raw.strip():
            raise ValueError('every sentence needs a non-empty "raw" string')
        caps.append(raw.strip())
    if why := _unencodable([rel, caps]):
        raise ValueError(why)
    meta: dict[str, Any] = {"dataset": dataset, "split": entry["split"], "filename": name}
    for key in ("imgid", "cocoid", "sentids"):
        if key in entry:
            meta[key] = entry[key]
    return CorpusItem(i, f"{dataset}-{Path(name).stem}", root / rel, rel, caps, meta, where)
