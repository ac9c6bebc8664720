"""Reading a search's body: the content type, the JSON (strict UTF-8, every field once, no
field the route does not take), the URL's parameters, and the options; each fault a 4xx that
says what to send. Both search routes read their bodies through here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from app.errors import UnsupportedMediaType, ValidationFailed, describe_errors, faults
from app.schemas import IMAGE_EXAMPLE, SearchOptions, explained

# Unknown fields named one by one at most: a body of a million made-up keys was answered with
# a 324 MB 422, built on the event loop for 20 s while nothing else was served
NAMED_AT_MOST = 10


def media_type(request: Request) -> str:
    """The content type without its parameters, lower-cased (`Application/JSON;
    charset=utf-8` is application/json); "" when none was sent."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def json_body(request: Request) -> None:
    """415 unless the request says its body is JSON: a body sent as a form (curl -d without
    -H) would otherwise be read as a string and refused with a message about dictionaries."""
    ctype = request.headers.get("content-type", "")
    if media_type(request) != "application/json":
        raise UnsupportedMediaType(
            f"content-type {ctype or '(none)'} is not accepted; send the JSON body with the "
            "header content-type: application/json (curl: -H 'content-type: application/json')"
        )


def no_url_parameters(request: Request, fields: Sequence[str]) -> None:
    """422 for parameters in the URL (`?top_k=1`): a search reads its options from the body
    only, and an option given where it is not read would change nothing, unseen."""
    if not request.scope.get("query_string"):
        return  # (the hot path: no parsing)
    names = list(dict.fromkeys(request.query_params))
    if names:
        raise ValidationFailed(
            f"URL parameters {', '.join(names)}: the search routes read their options from "
            f"the body only; send them as fields of it ({', '.join(fields)})",
            loc=("query", names[0]),
        )


def _once(pairs: list[tuple[str, Any]], twice: list[str]) -> dict[str, Any]:
    """A JSON object, each name given more than once noted in `twice`: `{"top_k": 1,
    "top_k": 3}` was read as 3 without a word, where a field the route does not take is
    refused."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for name, _value in pairs:
            if name in seen:
                twice.append(name)
            seen.add(name)
    return obj


def json_object(raw: bytes, fields: Sequence[str], example: str) -> Any:
    """The JSON of a search body, or a 422 saying what is wrong with it: empty, not UTF-8
    (UTF-16 and UTF-32 were read, which api.md says are refused), not JSON, a field twice,
    or fields the route does not take (`fields`; named up to `NAMED_AT_MOST`). What is not
    an object is returned for the route's model to refuse with its own words."""
    if not raw:
        said = f"the body is empty; send a JSON object such as {example}"
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": said}])
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows tools write one) is no JSON
    except UnicodeDecodeError as exc:
        raise ValidationFailed(
            f"body is not valid JSON: it must be UTF-8 encoded (byte {exc.start} is not)"
        ) from exc
    twice: list[str] = []
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _once(pairs, twice))
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error"}]
        ) from exc
    except ValueError as exc:  # an integer past Python's 4,300 digits
        raise ValidationFailed(
            "body is not valid JSON for a search: a number in it has more than 4,300 digits"
        ) from exc
    except RecursionError as exc:  # '[' * 60000: Python's parser gives up, not the caller
        raise ValidationFailed("body is not valid JSON: nested too deeply") from exc
    if isinstance(data, dict):
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise _unknown(unknown, fields)
    if twice:  # a field of the body's own, or a name inside one of its values
        name = twice[0]
        where = ("body", name) if isinstance(data, dict) and name in data else ("body",)
        raise ValidationFailed(
            f"{_shown(name)}: given more than once in one JSON object; give each field once",
            loc=where,
        )
    return data


def _shown(name: str) -> str:
    """A name as a message shows it: quoted when it is not plain, cut at 64 characters (a
    100 kB key was a 100 kB message)."""
    cut = name if len(name) <= 64 else name[:64] + "..."
    return repr(cut) if not cut.isprintable() or not cut or cut != name else cut


def _unknown(names: list[str], fields: Sequence[str]) -> ValidationFailed:
    """The 422 for fields a route does not take: each named, up to `NAMED_AT_MOST`."""
    named = [_shown(n) for n in names[:NAMED_AT_MOST]]
    more = len(names) - len(named)
    said = f"not a field of this route; it takes {', '.join(fields)}"
    details = [{"type": "extra_forbidden", "loc": ["body", n], "msg": said} for n in named]
    listed = ", ".join(named) + (f" and {more:,} more" if more else "")
    return ValidationFailed(
        f"{listed}: {'not fields' if len(names) > 1 else 'not a field'} of this route; it "
        f"takes {', '.join(fields)}",
        details=details,
    )


def options(fields: dict[str, Any], model: type[SearchOptions], takes: list[str]) -> SearchOptions:
    """`fields` as `model`, or a 422 naming each field at fault (`takes`: the route's fields)."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        said = explained(exc, takes, IMAGE_EXAMPLE)
        raise ValidationFailed(describe_errors(said), details=faults(said)) from exc
