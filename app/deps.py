"""Dependency aliases for route handlers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.config import Settings
from app.errors import NotReady
from app.pipeline import SearchPipeline


# async, though they never await: FastAPI runs a plain `def` dependency in its thread pool,
# a thread hop per request for a dictionary look-up (measured: most of a dot-only request's
# time on the event loop)
async def get_pipeline(request: Request) -> SearchPipeline:
    pipeline: SearchPipeline | None = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        raise NotReady("the model and index are still loading; retry in a moment")
    return pipeline


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


PipelineDep = Annotated[SearchPipeline, Depends(get_pipeline)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
