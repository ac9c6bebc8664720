"""POST /search/text and POST /search/image."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.answers import refuse_if_not_understood
from app.bodies import json_body, json_object, media_type, no_url_parameters, options
from app.deps import PipelineDep, SettingsDep, get_pipeline
from app.errors import (
    ClientGone,
    UnsupportedMediaType,
    ValidationFailed,
    documented,
)
from app.imaging import b64_image
from app.limits import GONE
from app.pipeline import Served
from app.schemas import (
    FUSIONS,
    IMAGE_EXAMPLE,
    TEXT_EXAMPLE,
    ImageSearchJSON,
    SearchOptions,
    SearchResponse,
    TextSearchRequest,
    explained,
    field_names,
)
from models import rerankers

router = APIRouter(tags=["search"])
T = TypeVar("T")
log = logging.getLogger("duet.app")


def _image_body() -> dict[str, Any]:
    bounds = {  # the form's numbers have the JSON body's bounds (SearchOptions)
        name: {k: v for k, v in prop.items() if k in ("minimum", "maximum")}
        for name, prop in SearchOptions.model_json_schema()["properties"].items()
    }
    return {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["image"],
                    "additionalProperties": False,  # a field it does not take is a 422
                    "properties": {
                        "image": {"type": "string", "format": "binary"},
                        "top_k": {"type": "integer", "default": 10, **bounds["top_k"]},
                        "candidates": {
                            "type": "integer",
                            "default": 50,
                            **bounds["candidates"],
                        },
                        "rerank": {"type": "boolean", "default": True},
                        "reranker": {"type": "string", "enum": list(rerankers.names())},
                        "fusion": {"type": "string", "enum": list(FUSIONS)},
                        "lambda": {"type": "number", "minimum": 0, "maximum": 1},
                        "theta": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                }
            },
            "application/json": {"schema": ImageSearchJSON.model_json_schema()},
        },
    }


_IMAGE_BODY_DOC: dict[str, Any] = {"requestBody": _image_body()}
# the text route reads its body itself (`_text_request`); the document still names the model
# (`document_bodies` adds its schema to the document's components)
_TEXT_BODY_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/TextSearchRequest"}}
        },
    }
}


def document_bodies(app: FastAPI) -> None:
    """Put `TextSearchRequest` in `app`'s OpenAPI components, where the text route's body
    schema points: FastAPI adds only the models its routes take as parameters, and that
    route reads its body itself (`_text_request`). The schema is FastAPI's own, made from a
    route that takes the model, as the text route did."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        doc = generate()  # made once, then kept by FastAPI (app.openapi_schema)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        _no_default_422(doc)
        if "TextSearchRequest" not in schemas:
            shape = APIRouter()

            @shape.post("/")
            async def takes(body: TextSearchRequest) -> None: ...

            made = get_openapi(title="", version="", routes=shape.routes)
            schemas["TextSearchRequest"] = made["components"]["schemas"]["TextSearchRequest"]
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _no_default_422(doc: dict[str, Any]) -> None:
    """Drop the 422 FastAPI documents for every route with parameters, in its own error
    shape (`HTTPValidationError`): duet answers every error as `ErrorResponse`, and the
    routes that can refuse a body say so with `documented(422)`. Where it stays (/images,
    /admin/reload: a string path parameter, an optional header) no 422 can happen."""
    for item in doc.get("paths", {}).values():
        for op in item.values():
            answer = op.get("responses", {}).get("422", {})
            if "HTTPValidationError" in str(answer.get("content", "")):
                del op["responses"]["422"]
    schemas = doc.get("components", {}).get("schemas", {})
    if "HTTPValidationError" not in str(doc.get("paths", {})):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)


def refresh_docs() -> None:
    """Re-read the re-ranker registry into the image route's hand-written body schema (a
    re-ranker registered after import is then documented by the next app made)."""
    _IMAGE_BODY_DOC["requestBody"] = _image_body()


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, cancelling it if the client disconnects first: its queued model work is
    then skipped by the engine instead of computed for nobody (499). duet's HTTP protocol
    says when a client has gone (`app.limits.GONE`): the request's task is cancelled then,
    at no cost before. Under another server, a task watches the request's `receive` (two
    tasks and a wait a request: ~60 us in-process, ~20 us of a front's CPU under load)."""
    hooks: list[Callable[[], None]] | None = request.scope.get(GONE)
    if hooks is None:
        return await _watched(request, work)
    me = asyncio.current_task()
    assert me is not None
    gone = False

    def cancel() -> None:
        nonlocal gone
        gone = True
        me.cancel()

    hooks.append(cancel)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        me.uncancel()
        raise ClientGone("the client closed the connection before the answer was ready") from None
    finally:
        hooks.remove(cancel)


async def _watched(request: Request, work: Coroutine[Any, Any, T]) -> T:
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone("the client closed the connection before the answer was ready")
    return task.result()


def _json(served: Served) -> Response:
    """The response as the pipeline rendered it: FastAPI's dump-validate-serialise of
    `response_model` (kept for the OpenAPI document) would only repeat the work."""
    return Response(served.json, media_type="application/json")


async def _text_request(request: Request) -> TextSearchRequest:
    """The body of a text search, read and checked as FastAPI checks a `TextSearchRequest`
    parameter: the same 422s, located under "body". Done here rather than by FastAPI's
    parameter and dependency solving, which was 52 of the HTTP stack's 282 us around a
    search, in-process (a front spent ~1.1 ms a request in all; docs/serving.md). One
    change: FastAPI parsed the JSON before its dependencies ran, so a body that is no JSON
    was a 422 even while loading (now 503) or sent as another JSON type (now 415)."""
    data = json_object(await request.body(), _TEXT_FIELDS, TEXT_EXAMPLE)
    try:
        # from_attributes as FastAPI validates: a body that is no object is told so plainly
        return TextSearchRequest.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError(explained(exc, _TEXT_FIELDS, TEXT_EXAMPLE)) from exc


_TEXT_FIELDS = ["query", *field_names(SearchOptions)]
_IMAGE_FIELDS = ["image_b64", *field_names(SearchOptions)]
_FORM_FIELDS = ["image", *field_names(SearchOptions)]


@router.post(
    "/search/text",
    response_model=SearchResponse,
    responses=documented(408, 413, 415, 422, 429, 499, 503),
    openapi_extra=_TEXT_BODY_DOC,
)
async def search_text(request: Request) -> Response:
    """A sentence finds images (the body as `content-type: application/json`)."""
    # 415, 503, then the body's 422 (FastAPI's order, but for a body that is no JSON at all)
    json_body(request)
    no_url_parameters(request, _TEXT_FIELDS)
    pipeline = await get_pipeline(request)
    body = await _text_request(request)
    refuse_if_not_understood(pipeline.model, body.query)
    opts = body.options()
    return _json(await _unless_gone(request, pipeline.search_text(body.query, opts)))


class TextSearchASGI:
    """POST /search/text answered by `search_text` without FastAPI's routing and request
    handling: the route is the service's hottest path, and the router, the exception
    middleware and FastAPI's endpoint wrapper were ~13 % of a front's event loop under load
    (py-spy, GPU layout on the CPU, dot-only). Everything else goes to `app` unchanged.

    Sits inside the service's own middleware (`BodyLimit`, `_ObserveRequests`), which see the
    request as before (`scope["route"]` is the route, as the router would set it). An error
    the app has a handler for (a `DuetError`, a 422, an `HTTPException`) is answered by that
    handler, so every body is the same; anything else propagates to Starlette's server-error
    middleware, as from the route. The route stays registered for the OpenAPI document.
    Served under a root path (`--root-path`), requests take the router. Not seen by FastAPI's
    own OpenTelemetry hooks (its route attribute), which duet does not configure."""

    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app = app
        self.fastapi = fastapi
        self.route = next(r for r in router.routes if getattr(r, "path", "") == "/search/text")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != "/search/text"
            or scope["method"] != "POST"
            or scope.get("root_path")
        ):
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        request = Request(scope, receive, send)
        try:
            response = await search_text(request)
        except Exception as exc:
            response = await self._handled(request, exc)
        await response(scope, receive, send)

    async def _handled(self, request: Request, exc: Exception) -> Response:
        """The app's answer to `exc` as Starlette's exception middleware gives it (the most
        specific handler by class; `Exception`'s is the server-error middleware's), or `exc`
        raised again when it has none."""
        handlers = self.fastapi.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers and cls is not Exception:
                answer = handlers[cls](request, exc)
                return await answer if inspect.isawaitable(answer) else answer
        raise exc


@router.post(
    "/search/image",
    response_model=SearchResponse,
    openapi_extra=_IMAGE_BODY_DOC,
    responses=documented(400, 408, 413, 415, 422, 429, 499, 503),
)
async def search_image(request: Request, pipeline: PipelineDep, settings: SettingsDep) -> Response:
    """An image finds captions: multipart field `image`, or JSON `image_b64`; same options."""
    max_bytes = settings.max_image_bytes  # the body itself is bounded by app.limits.BodyLimit
    ctype = request.headers.get("content-type", "")
    media = media_type(request)
    no_url_parameters(request, _FORM_FIELDS if media == "multipart/form-data" else _IMAGE_FIELDS)
    if media == "multipart/form-data":
        try:
            form = await request.form(max_files=1, max_fields=16)
        except StarletteHTTPException as exc:  # Starlette's 400 for a body it cannot cut up
            raise ValidationFailed(
                f'multipart body: {exc.detail} Send one file field named "image" and the '
                "options as text fields (curl: -F image=@photo.jpg -F top_k=5)"
            ) from exc
        upload = form.get("image")
        if not isinstance(upload, UploadFile):
            raise ValidationFailed(
                'multipart body needs a file field named "image" (the body may also have '
                "ended before its closing boundary)",
                loc=("body", "image"),
            )
        data = await upload.read(max_bytes + 1)
        fields = {k: v for k, v in form.items() if k != "image" and isinstance(v, str)}
        opts = options(fields, SearchOptions, _FORM_FIELDS)
    elif media == "application/json":
        payload = json_object(await request.body(), _IMAGE_FIELDS, IMAGE_EXAMPLE)
        if not isinstance(payload, dict):
            raise ValidationFailed(f"the body must be a JSON object such as {IMAGE_EXAMPLE}")
        req = options(payload, ImageSearchJSON, _IMAGE_FIELDS)
        assert isinstance(req, ImageSearchJSON)
        data = b64_image(req.image_b64)
        opts = req.options()
    else:
        raise UnsupportedMediaType(
            f"content-type {ctype or '(none)'} is not accepted; send multipart/form-data with "
            'a file field "image", or application/json with "image_b64"'
        )
    image = await request.app.state.decoder.decode(data)
    return _json(await _unless_gone(request, pipeline.search_image(data, image, opts)))
