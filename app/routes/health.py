"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.errors import NotReady, documented
from app.routes.ui import images_unserved
from app.schemas import Readiness

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and answering."""
    return {"status": "ok"}


@router.get("/readyz", responses={200: {"model": Readiness}, **documented(503)})
async def readyz(request: Request) -> JSONResponse:
    """Model and index are loaded and search can be served."""
    pipeline = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        raise NotReady("model and index are loading")
    index = pipeline.index
    reloader = getattr(request.app.state, "reloader", None)
    return JSONResponse(
        {
            "status": "ready",
            "model": pipeline.model.fingerprint,
            "rerankers": {
                "available": list(pipeline.rerankers),
                "default": pipeline.default_reranker,
            },
            "index_version": index.version,
            "items": {"images": index.image_index.ntotal, "texts": index.text_index.ntotal},
            "cache": pipeline.cache.backend.name,
            # ready either way: without an answering cache every search is computed
            "cache_answers": await pipeline.cache.answers(),
            # whether GET /images/{id} serves this version's images here, or why not
            "images": images_unserved(index, request.app.state.settings) or "served",
            "reload": reloader.status() if reloader is not None else None,
        }
    )


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition format",
        }
    },
)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


# HEAD as GET without the body (the server leaves it out), not a 405: what a probe or a
# monitor that sends HEAD needs (RFC 9110: HEAD wherever GET is served)
router.head("/healthz", include_in_schema=False)(healthz)
router.head("/readyz", include_in_schema=False)(readyz)
router.head("/metrics", include_in_schema=False)(metrics)
