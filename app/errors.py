"""One exception tree for the caller-visible failures, mapped to HTTP in one place."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

log = logging.getLogger("duet.app")

# in a request's scope: duet's HTTP protocol closed the connection because the body did not
# arrive within DUET_HTTP_BODY_TIMEOUT_S (`app.limits`), so the body's read ended in a 408
BODY_TIMED_OUT = "duet.body_timed_out"
SHUT_DOWN = "duet.shut_down"  # closed mid-body at the drain's end (app.limits): a 503


class DuetError(Exception):
    """Base: a code, a message for the caller, an HTTP status."""

    status = 400
    code = "bad_request"
    headers: ClassVar[dict[str, str] | None] = None

    def __init__(self, message: str, *, retry_after: int | None = None, **extra: object) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.extra = extra  # more fields of the error body (e.g. the refused version)

    def response_headers(self) -> dict[str, str] | None:
        """The class's headers plus Retry-After (seconds) when the error carries one."""
        if self.retry_after is None:
            return self.headers
        return {**(self.headers or {}), "Retry-After": str(self.retry_after)}


class ValidationFailed(DuetError):
    """A 422 from the service's own checks (pydantic's arrive as `RequestValidationError`),
    with `details` as pydantic's 422s have them: by default one fault, at `loc`."""

    status = 422
    code = "validation_error"

    def __init__(
        self,
        message: str,
        *,
        loc: Sequence[str | int] = ("body",),
        details: list[dict[str, Any]] | None = None,
        **extra: object,
    ) -> None:
        if details is None:
            details = [{"loc": list(loc), "msg": message, "type": "value_error"}]
        super().__init__(message, retry_after=None, details=details, **extra)


class RerankerUnavailable(DuetError):
    """A re-ranker the API names but this deployment (or its model) cannot run."""

    status = 422
    code = "reranker_unavailable"


class InvalidImage(DuetError):
    status = 400
    code = "invalid_image"


class ImageTooLarge(DuetError):
    status = 413
    code = "image_too_large"


class UnsupportedMediaType(DuetError):
    status = 415
    code = "unsupported_media_type"


class Overloaded(DuetError):
    status = 429
    code = "overloaded"


class Unauthorized(DuetError):
    status = 401
    code = "unauthorized"
    headers: ClassVar[dict[str, str] | None] = {"WWW-Authenticate": "Bearer"}


class AdminDisabled(DuetError):
    status = 403
    code = "admin_disabled"


class IndexRefused(DuetError):
    """/admin/reload found the new version broken; the old one keeps serving."""

    status = 409
    code = "index_refused"


class ImageNotFound(DuetError):
    """GET /images/{id}: no such image in the served index, or its file is not readable."""

    status = 404
    code = "not_found"


class RangeNotSatisfiable(DuetError):
    """GET /images/{id} with a Range header none of whose byte ranges lies in the file."""

    status = 416
    code = "range_not_satisfiable"

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size

    def response_headers(self) -> dict[str, str]:
        return {"Content-Range": f"bytes */{self.size}"}  # RFC 9110: the file's length


class NotReady(DuetError):
    status = 503
    code = "not_ready"


class ClientGone(DuetError):
    """The client disconnected while its request waited (nginx's 499; nobody reads it)."""

    status = 499
    code = "client_closed_request"


class ShuttingDown(DuetError):
    """The service stopped taking work while this request waited."""

    status = 503
    code = "shutting_down"

    def __init__(
        self,
        message: str = "the service is shutting down; retry on another replica",
        *,
        retry_after: int | None = None,
        **extra: object,
    ) -> None:
        super().__init__(message, retry_after=retry_after, **extra)


class IndexUnreadable(DuetError):
    """The served version's item store failed to read (its files damaged in place, after
    the checks that let it serve): a 503 that says so, where it was a 500 with a traceback."""

    status = 503
    code = "index_unreadable"


class DeadlineExceeded(DuetError):
    """The request's deadline (DUET_REQUEST_TIMEOUT_MS) passed while it waited for a worker:
    load shedding like a refusal at the door, so a 429 with Retry-After (not a 5xx: nothing
    failed, the service was busy)."""

    status = 429
    code = "deadline_exceeded"


class PayloadTooLarge(DuetError):
    """A request body over its route's limit (app.limits.BodyLimit answers before routing;
    the class is here so the error table and the OpenAPI document name it)."""

    status = 413
    code = "payload_too_large"


def error_body(code: str, message: str, **extra: object) -> dict[str, object]:
    return {"error": {"code": code, "message": message, **extra}}


def error_bytes(code: str, message: str) -> bytes:
    """`error_body` as the bytes a `JSONResponse` sends (compact, UTF-8), for the errors
    written below the app (a 413, 431 or 400 from the HTTP protocol, a paced 429): every
    error body reads the same, whichever layer wrote it."""
    body = error_body(code, message)
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def describe_errors(errors: Sequence[Mapping[str, object]]) -> str:
    """One line from pydantic errors: `field: message; ...`. A location's first part when it
    says where the field was (FastAPI's "body", "query", "path", "header") is left out, not a
    field of that name: a text search's own `query` field is named."""
    parts = []
    for e in errors:
        where = list(e.get("loc", ()))  # type: ignore[call-overload]
        if where and where[0] in ("body", "query", "path", "header"):
            where = where[1:]
        loc = ".".join(str(p) for p in where)
        msg = str(e.get("msg")).removeprefix("Value error, ")
        if e.get("type") == "json_invalid":  # FastAPI's location is the character's offset
            at = f" at character {where[0]}" if where else ""
            parts.append(f"body is not valid JSON{at} ({msg}); send a JSON object")
            continue
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


class ErrorBody(BaseModel):
    """What went wrong: a code to branch on and a message that says what to do; a 422 from
    validation adds `details`, and some errors add fields of their own (a refused index
    version's, say)."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str
    details: list[dict[str, Any]] | None = Field(
        None,
        description="422 validation_error only (every one): each fault, with `loc` "
        "(where: the field, where there is one), `msg` and `type`, as pydantic reports it",
    )


class ErrorResponse(BaseModel):
    """Every non-2xx answer: {"error": {"code", "message", ...}}."""

    error: ErrorBody


_WHY = {
    400: "the upload is not a readable image",
    401: "missing or wrong admin token",
    403: "the admin endpoint is disabled (no DUET_ADMIN_TOKEN)",
    404: "no such item in the served index, or its image file is not readable here",
    408: "request headers or body not received in time (DUET_HTTP_HEADER_TIMEOUT_S, "
    "DUET_HTTP_BODY_TIMEOUT_S)",
    409: "the index version was refused; the old one keeps serving",
    413: "body or image over its limit (DUET_MAX_BODY_BYTES, DUET_MAX_IMAGE_BYTES, "
    "DUET_MAX_IMAGE_PIXELS)",
    416: "a Range header none of whose byte ranges lies in the image file",
    415: "a content-type the route does not take (/search/text: application/json; "
    "/search/image: multipart/form-data or application/json)",
    422: "the body or its options are invalid, or the query has no readable words",
    429: "overloaded, or the deadline passed while queued: retry after Retry-After seconds",
    431: "request headers too large (DUET_HTTP_MAX_HEADER_BYTES)",
    499: "the client closed the connection first (nobody reads it)",
    503: "not ready yet, shutting down, or the served index's files were damaged on disk",
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each status it can answer besides 200, with the error body's
    schema (the OpenAPI document then lists every real status code)."""
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


# what a route that takes only POST wants instead of the method it got (405)
_HOW = {
    "/search/text": 'use POST with a JSON body {"query": "a red circle"} and the header '
    "content-type: application/json",
    "/search/image": 'use POST with the image as a multipart file field "image" (curl -F '
    'image=@photo.png) or as base64 in a JSON body {"image_b64": "..."}',
}


def _allowed(request: Request) -> str:
    """The methods every route at this path takes (`Allow` of a 405): Starlette's router
    names only the first route's, so a path whose HEAD is a route of its own (/readyz,
    /metrics) said `Allow: GET`."""
    order = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
    routes = request.app.router.routes
    return ", ".join(
        m
        for m in order
        if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)
    )


def _not_allowed(request: Request, allow: str) -> str:
    path = request.scope["path"]
    how = _HOW.get(path) or f"it takes {allow or 'other methods'}"
    return f"{request.method} {path} is not allowed; {how}"


def _no_route(request: Request) -> str:
    """404 for a path no route serves: the routes there are (the OpenAPI document's, and the
    page), and where each is described."""
    verbs = ("get", "post", "put", "patch", "delete")
    routes = ["GET / (the search page)"]
    for path, item in request.app.openapi().get("paths", {}).items():
        methods = "/".join(m.upper() for m in item if m in verbs)
        routes.append(f"{methods} {path}")
    return (
        f"no route {request.method} {request.scope['path']}; the routes are "
        f"{', '.join(routes)}; GET /openapi.json describes each (GET /docs shows it)"
    )


def faults(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """A 422's `details`: each of pydantic's errors as its `loc`, `msg` and `type`."""
    return [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors]


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as {"error": {"code", "message"}}; no bad input becomes a 500."""

    @app.exception_handler(DuetError)
    async def _duet(_: Request, exc: DuetError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, exc.message, **exc.extra),
            status_code=exc.status,
            headers=exc.response_headers(),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = faults(exc.errors())
        return JSONResponse(
            error_body("validation_error", describe_errors(errors), details=errors), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's word for a body that is not UTF-8: the same 422 as malformed JSON
            said = "body is not valid JSON (it must be UTF-8 encoded)"
            return JSONResponse(
                error_body(
                    "validation_error",
                    said,
                    details=faults([{"loc": ["body"], "msg": said, "type": "value_error"}]),
                ),
                status_code=422,
            )
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # the router's: no such route
            message = _no_route(request)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed(request)}
            message = _not_allowed(request, headers["Allow"])
        return JSONResponse(error_body(code, message), status_code=exc.status_code, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> JSONResponse:
        """The body stopped before its end: the client closed the connection (499, as for a
        client gone while its search waited), or duet closed it when the rest did not come
        in time (408). Nothing failed here: no 5xx, no traceback; nobody reads the answer."""
        if request.scope.get(SHUT_DOWN):  # answered by the protocol; counted as what it sent
            return JSONResponse(error_body(ShuttingDown.code, "shut down"), status_code=503)
        if request.scope.get(BODY_TIMED_OUT):
            timeout = request.app.state.settings.http_body_timeout_s
            return JSONResponse(
                error_body(
                    "request_timeout",
                    f"request body not received within {timeout:g} s (DUET_HTTP_BODY_TIMEOUT_S)",
                ),
                status_code=408,
            )
        return JSONResponse(
            error_body(ClientGone.code, "the client closed the connection before its body arrived"),
            status_code=ClientGone.status,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        # Starlette re-raises the error after this answer and uvicorn then closes the socket:
        # saying so keeps a client from sending its next request down a dead connection
        return JSONResponse(
            error_body("internal_error", "internal error; see the service log"),
            status_code=500,
            headers={"Connection": "close"},
        )
