"""Request and response bodies (the HTTP contract in docs/design.md)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_QUERY_CHARS = 512


class SearchOptions(BaseModel):
    """Options shared by both search endpoints."""

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(10, ge=1, le=100, description="hits to return")
    candidates: int = Field(50, ge=1, le=1000, description="top-M by dot product to re-rank")
    rerank: bool = Field(True, description="false returns the dot-product order")

    @model_validator(mode="after")
    def _enough_candidates(self) -> SearchOptions:
        if self.rerank and self.candidates < self.top_k:
            raise ValueError(f"candidates ({self.candidates}) must be >= top_k ({self.top_k}) "
                             "when rerank is true")
        return self


class TextSearchRequest(SearchOptions):
    query: str = Field(..., min_length=1, max_length=MAX_QUERY_CHARS,
                       description="a sentence describing the image")

    @model_validator(mode="after")
    def _not_blank(self) -> TextSearchRequest:
        if not self.query.strip():
            raise ValueError("query must contain more than whitespace")
        return self


class ImageSearchJSON(SearchOptions):
    image_b64: str = Field(..., min_length=1, description="the image file, base64-encoded")


class Hit(BaseModel):
    id: str
    score: float
    retrieval_score: float
    rerank_score: float | None
    rank: int
    meta: dict[str, Any]


class SearchResponse(BaseModel):
    hits: list[Hit]
    timings_ms: dict[str, float]
    index_version: str
    cached: bool
