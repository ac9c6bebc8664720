"""The page at / (a search box, an image upload, the results as a grid) and the images the
index names, so a person can see what duet does. Offline: no CDN, no build step. Also the
API's pages, /docs and /redoc: FastAPI's, whose scripts come from a CDN, so each says what
to read instead when the browser cannot reach it (an offline or firewalled network)."""

from __future__ import annotations

import os
from html import escape as html_escape
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from app.errors import ImageNotFound, NotReady, RangeNotSatisfiable, documented
from app.ranges import satisfiable

if TYPE_CHECKING:
    from app.config import Settings
    from store.indexio import IndexVersion

router = APIRouter(tags=["ui"])
STATIC = Path(__file__).resolve().parent.parent / "static"
PAGE = STATIC / "index.html"
ICON = STATIC / "favicon.png"  # 32x32: a red circle and a blue square, the page's tab icon


def _plain(path: Path) -> Path:
    """`path` made absolute and normalised as written: `..` taken out, links not followed."""
    return Path(os.path.normpath(os.path.abspath(path)))


def _leads_out(root: Path, rel: str) -> bool:
    """Whether `root / rel`, as written (normalised, links not followed), leaves `root`: a
    ".." or an absolute path in a manifest, which is never served."""
    return not _plain(root / rel).is_relative_to(_plain(root))


def inside(root: Path, rel: str) -> Path | None:
    """`root / rel` as written (normalised, links not followed) if it stays inside `root` and
    names an existing file, else None: a manifest's path never leads out of its corpus
    folder (`_leads_out`). The file may be a link, or lie in a linked folder (an images
    folder kept on another disk): `allowed` then judges where it really is."""
    path = _plain(root / rel)
    return None if _leads_out(root, rel) or not path.is_file() else path


# HEAD as GET without the body (the server leaves it out): a link checker or a probe that
# sends HEAD gets the page's status and headers, not a 405
@router.api_route(
    "/", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False
)
async def page() -> HTMLResponse:
    """The search page."""
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))


@router.api_route(
    "/favicon.ico", methods=["GET", "HEAD"], response_class=FileResponse, include_in_schema=False
)
async def favicon() -> FileResponse:
    """The tab icon (a PNG: browsers take one at this path, and the page links it)."""
    return FileResponse(
        ICON, media_type="image/png", headers={"Cache-Control": "public, max-age=86400"}
    )


# An API page's script comes from cdn.jsdelivr.net. Before that script's tag: a note shown
# if it has not loaded within a few seconds (a network that drops the packets keeps the page
# waiting for minutes), taken away if it does; at the page's load, without the script, the
# page says what to read instead (a blank page otherwise).
WAITING = """<script>
window.duetWaiting = setTimeout(function () {
  if (typeof %(script)s !== "undefined" || document.getElementById("docs-waiting")) return;
  var note = document.createElement("p");
  note.id = "docs-waiting";
  note.style = "font: 16px/1.5 system-ui, sans-serif; margin: 1em; padding: 0.5em 1em; " +
    "background: #fff4d6; border: 1px solid #e0c070";
  note.innerHTML = "Still waiting for %(what)s's script from cdn.jsdelivr.net: if this " +
    "network cannot reach it, the whole API is described in " +
    '<a href="%(openapi)s">/openapi.json</a>.';
  document.body.insertBefore(note, document.body.firstChild);
}, 4000);
</script>
<script src="https://cdn.jsdelivr.net"""

UNREACHABLE = """<script>
window.addEventListener("load", function () {
  clearTimeout(window.duetWaiting);
  var waiting = document.getElementById("docs-waiting");
  if (typeof %(script)s !== "undefined") {
    if (waiting) waiting.remove();
    return;
  }
  document.title = "duet API: the page's script did not load";
  document.body.innerHTML = '<main style="font: 16px/1.5 system-ui, sans-serif; ' +
    'max-width: 42em; margin: 3em auto; padding: 0 1em">' +
    '<h1>duet API</h1><p id="docs-offline">This page draws the API with %(what)s, whose ' +
    'script comes from cdn.jsdelivr.net, and this browser could not reach it (an offline ' +
    'or firewalled network). The whole API is described in ' +
    '<a href="%(openapi)s">/openapi.json</a> (OpenAPI 3.1: open it, or load it into ' +
    'any OpenAPI viewer), and the search page is at <a href="%(root)s/">/</a>.</p></main>';
});
</script>
</body>"""


def _with_note(page: HTMLResponse, script: str, what: str, root: str) -> HTMLResponse:
    html = page.body.decode() if isinstance(page.body, bytes) else str(page.body)
    say = {"script": script, "what": what, "openapi": f"{root}/openapi.json", "root": root}
    # the CDN's stylesheet applied once it loads, not awaited before anything is drawn or
    # run (a pending stylesheet holds both back, the notes included)
    html = html.replace(
        'rel="stylesheet" href="https://cdn.jsdelivr.net',
        'rel="stylesheet" media="print" onload="this.media=\'all\'" href="https://cdn.jsdelivr.net',
        1,
    )
    html = html.replace('<script src="https://cdn.jsdelivr.net', WAITING % say, 1)
    return HTMLResponse(html.replace("</body>", UNREACHABLE % say, 1))


def _root(request: Request) -> str:
    """The path the service is mounted at behind a proxy (uvicorn's --root-path), HTML-safe."""
    return html_escape(str(request.scope.get("root_path", "")).rstrip("/"))


@router.api_route("/docs", methods=["GET", "HEAD"], include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    """FastAPI's Swagger UI page for /openapi.json, or a note when its script is out of reach."""
    root = _root(request)
    page = get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title="duet - Swagger UI",
        swagger_favicon_url=f"{root}/favicon.ico",
    )
    return _with_note(page, "SwaggerUIBundle", "Swagger UI", root)


@router.api_route("/redoc", methods=["GET", "HEAD"], include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    """FastAPI's ReDoc page for /openapi.json, or a note when its script is out of reach."""
    root = _root(request)
    page = get_redoc_html(
        openapi_url=f"{root}/openapi.json",
        title="duet - ReDoc",
        redoc_favicon_url=f"{root}/favicon.ico",
        with_google_fonts=False,  # a stylesheet from another host, awaited before drawing
    )
    return _with_note(page, "Redoc", "ReDoc", root)


def allowed(path: Path, roots: list[Path]) -> bool:
    """Whether `path`, where it really is (links followed), lies under one of `roots`."""
    real = path.resolve()
    return any(real.is_relative_to(root.resolve()) for root in roots)


def _served_from(settings: Settings, index: IndexVersion) -> list[Path]:
    return [settings.images_dir or settings.index_dir, index.path]


def _linked_out(path: Path, root: Path) -> str:
    return (
        f"is a link to {path.resolve()}, outside the folder images are served from; set "
        f"DUET_IMAGES_DIR to a folder that holds both {root} and {path.resolve().parent}"
    )


def images_unserved(index: IndexVersion, settings: Settings) -> str | None:
    """Why `GET /images/{id}` cannot serve `index`'s images on this host (every hit's
    `image_url` would be a 404), or None: told at start-up and by /readyz, not first by a
    page of broken thumbnails."""
    root = index.images_root
    if root is None or index.image_index.ntotal == 0:
        return None if root else "the index does not record its corpus folder"
    if not root.is_dir():
        return f"its corpus folder {root} is not on this host (mount it, and set DUET_IMAGES_DIR)"
    first = index.store.images([0])[0]  # as the route finds a hit's file
    if first.path and _leads_out(root, first.path):
        return (  # no setting serves it: told first, not after DUET_IMAGES_DIR was changed
            f"its first image's path, {first.path!r}, leads out of its corpus folder {root} "
            "(images are served only from inside it): build from a corpus file in a folder "
            "that holds every image, the paths written from there"
        )
    if not allowed(root, _served_from(settings, index)):
        served = settings.images_dir or settings.index_dir
        if allowed(served.resolve(), [root]):  # an --append from beside it widened the root
            return (
                f"its corpus folder {root} holds the folder images are served from "
                f"({served}): only the images under that one are served, the rest are 404s; "
                f"set DUET_IMAGES_DIR={root}"
            )
        return (
            f"its corpus folder {root} is outside the folder images are served from; set "
            f"DUET_IMAGES_DIR={root}"
        )
    path = inside(root, first.path) if first.path else None
    if path is None:
        return f"its first image, {first.path!r}, is not in its corpus folder {root}"
    if not allowed(path, _served_from(settings, index)):
        return f"its first image, {first.path!r}, {_linked_out(path, root)}"
    return None


@router.get(
    "/images/{item_id:path}",  # an id with a "/" (sent as %2F) is one id
    response_class=FileResponse,
    responses={
        200: {
            "description": "the image file as indexed, by its extension's type",
            "content": {"image/*": {"schema": {"type": "string", "format": "binary"}}},
        },
        304: {"description": "the file the If-None-Match ETag names: unchanged, no body"},
        206: {"description": "the byte ranges a Range header asks for"},
        **documented(404, 416, 503),
    },
)
async def image(item_id: str, request: Request) -> Response:
    """An indexed image, by its item id: only files the served index names, under its
    corpus's images folder (no path leaves it), and only where they really are (links
    followed) under DUET_IMAGES_DIR or the version's own folder: a manifest's corpus path,
    or a link in the corpus, is not trusted to point anywhere else."""
    pipeline = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        raise NotReady("model and index are loading")
    with pipeline.indexes.lease() as index:
        row = index.store.image_by_id(item_id)
        root = index.images_root
    if row is None or not row.path or root is None:
        raise ImageNotFound(f"no image {item_id!r} in index {index.version}")
    settings = request.app.state.settings
    path = inside(root, row.path)
    if path is None:
        if _leads_out(root, row.path):
            raise ImageNotFound(
                f"image {item_id!r}: its path {row.path!r} leads out of its corpus folder "
                f"{root}, and images are served only from inside it"
            )
        raise ImageNotFound(
            f"image {item_id!r} is not readable here (its corpus folder {root.name}/ is not "
            "mounted on this host, or the file moved)"
        )
    if not allowed(path, _served_from(settings, index)):
        raise ImageNotFound(
            f"image {item_id!r} {_linked_out(path, root)}"
            if path.resolve() != path
            else f"image {item_id!r} is outside the folder images are served from; set "
            "DUET_IMAGES_DIR to the folder that holds the corpus"
        )
    # the file's stat read now, so its ETag is known before answering: a browser that still
    # holds this version of the file (If-None-Match) gets a 304 and no body again
    headers = {"Cache-Control": "public, max-age=3600"}
    answer = FileResponse(path, headers=headers, stat_result=os.stat(path))
    etag = answer.headers["etag"]
    asked = request.headers.get("if-none-match", "")
    if etag in (tag.strip().removeprefix("W/") for tag in asked.split(",")) or asked == "*":
        return Response(status_code=304, headers={**headers, "ETag": etag})
    _judge_range(request, answer)  # last, as RFC 9110 orders the preconditions
    return answer


def _judge_range(request: Request, answer: FileResponse) -> None:
    """The request's Range header as `answer` (which reads it from the scope) is to serve
    it: left out when it is to be ignored, or when an If-Range names another state of the
    file (the whole file, as RFC 9110 says), cut to the ranges in the file, or a JSON 416
    when none is (`app.ranges`)."""
    asked = request.headers.get("range")
    if asked is None:
        return
    size = int(answer.headers["content-length"])
    if_range = request.headers.get("if-range")
    current = (answer.headers["etag"], answer.headers["last-modified"])
    kept = satisfiable(asked, size) if if_range is None or if_range in current else None
    if kept == "":
        shown = asked if len(asked) <= 60 else asked[:60] + "..."
        raise RangeNotSatisfiable(
            f"Range {shown!r} asks for no byte of this {size}-byte file", size
        )
    scope_headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"range"]
    if kept is not None:
        scope_headers.append((b"range", kept.encode("latin-1")))
    request.scope["headers"] = scope_headers


# HEAD as GET (`FileResponse` sends no body for it): a link checker can test an image_url
router.head("/images/{item_id:path}", include_in_schema=False)(image)
