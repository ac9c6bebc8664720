"""A Range header on GET /images/{id}, judged before the file answers (RFC 9110 section 14).
Starlette's FileResponse serves byte ranges but answers a Range it cannot read with a
plain-text 400 (another unit, "bytes=5-2") and one outside the file with an empty
plain-text 416; a client gets duet's JSON errors everywhere else. Here: a header that is
not one valid byte-range set is ignored (the whole file, 200, as RFC 9110 lets a server
do), the ranges wholly outside the file are dropped, and none left is a JSON 416."""

from __future__ import annotations

import re

_SPEC = re.compile(r"[ \t]*([0-9]{0,18})[ \t]*-[ \t]*([0-9]{0,18})[ \t]*")  # past 10**18: ignored


def satisfiable(value: str, size: int) -> str | None:
    """The byte ranges of the Range header `value` that lie in a file of `size` bytes, as a
    Range header again ("" when none does), or None when the header is to be ignored."""
    unit, eq, spec = value.partition("=")
    if not eq or unit.strip().lower() != "bytes":
        return None  # another unit (RFC 9110: ignored), or no "=" at all
    kept = []
    for part in spec.split(","):
        if not part.strip():
            continue  # "bytes=0-1, ,2-3": an empty element is allowed
        m = _SPEC.fullmatch(part)
        if m is None or not (m[1] or m[2]) or (m[1] and m[2] and int(m[2]) < int(m[1])):
            return None  # not a range-spec, or last before first: the set is invalid
        if (int(m[1]) < size) if m[1] else (int(m[2]) > 0 and size > 0):
            kept.append(f"{m[1]}-{m[2]}")
    if not kept and not any(p.strip() for p in spec.split(",")):
        return None  # "bytes=": no range at all
    return "bytes=" + ",".join(kept) if kept else ""
