"""Request and response bodies (the HTTP contract in docs/design.md)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal, get_args
from urllib.parse import quote

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from models import rerankers

MAX_QUERY_CHARS = 512

Fusion = Literal["none", "add", "norm_add"]
FUSIONS: tuple[str, ...] = get_args(Fusion)


def _reranker_schema(schema: dict[str, Any]) -> None:
    """The `reranker` field's JSON schema: the registry's names when the schema is made."""
    schema.pop("anyOf", None)
    schema["anyOf"] = [{"type": "string", "enum": list(rerankers.names())}, {"type": "null"}]


def _reranker_doc() -> str:
    entries = [f"{r.name} ({r.summary})" for r in rerankers.REGISTRY.values()]
    return ", ".join([*entries, "none (dot-product order)"])


class SearchOptions(BaseModel):
    """Options shared by both search endpoints.

    `reranker` wins over the older `rerank` flag; the two may only be sent together when they
    agree (`rerank: false` with `reranker: none`, `rerank: true` with any other). `fusion`,
    `lambda` and `theta` are refused where they would change nothing (see `_consistent`).
    """

    model_config = ConfigDict(extra="forbid")

    top_k: int = Field(10, ge=1, le=100, description="hits to return")
    candidates: int = Field(50, ge=1, le=1000, description="top-M by dot product to re-rank")
    rerank: bool = Field(True, description="false = reranker none (the dot-product order)")
    reranker: str | None = Field(
        None,
        description="the re-ranker: " + _reranker_doc(),
        json_schema_extra=_reranker_schema,
    )
    fusion: Fusion | None = Field(
        None,
        description="none (re-ranker score alone), add (lambda*dot + (1-lambda)*score), "
        "norm_add (add after 0-1 normalising both over the candidates); "
        "default: add for ce, none for late and han",
    )
    lambda_: float | None = Field(
        None,
        alias="lambda",
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,  # NaN: "should be a finite number", not "less than or equal to 1"
        description="fusion weight of the dot product; default DUET_RERANK_FUSION_LAMBDA",
    )
    theta: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="late only: S_gl = (1-theta)*dot + theta*S_l; default DUET_RERANK_THETA",
    )

    def reranker_or(self, default: str) -> str:
        """The re-ranker asked for; `default` (the service's, DUET_RERANKER) when the request
        names none and does not send `rerank: false`."""
        if self.reranker is not None:
            return self.reranker
        return default if self.rerank else "none"

    @property
    def effective_reranker(self) -> str:
        return self.reranker_or("ce")

    @property
    def reranks(self) -> bool:
        return self.effective_reranker != "none"

    @property
    def uses_default_reranker(self) -> bool:
        return self.reranker is None and self.rerank

    @field_validator("reranker")
    @classmethod
    def _registered(cls, value: str | None) -> str | None:
        if value is not None and value not in rerankers.names():
            raise ValueError(f"unknown re-ranker {value!r}; one of {', '.join(rerankers.names())}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SearchOptions:
        if (
            self.reranker is not None
            and "rerank" in self.model_fields_set
            and self.rerank != (self.reranker != "none")
        ):
            raise ValueError(
                f"rerank={str(self.rerank).lower()} contradicts "
                f"reranker={self.reranker}; send only reranker"
            )
        if self.lambda_ is not None and self.fusion == "none":
            raise ValueError("lambda applies only to fusion add or norm_add, not none")
        if not self.uses_default_reranker:  # else the service checks against its default
            self.check_for(self.effective_reranker)
        return self

    def check_for(self, r: str) -> None:
        """ValueError for options that re-ranker `r` would ignore."""
        if r == "none":
            for name, value in (
                ("fusion", self.fusion),
                ("lambda", self.lambda_),
                ("theta", self.theta),
            ):
                if value is not None:
                    raise ValueError(
                        f"{name} needs a re-ranker; reranker is none (the dot-product order)"
                    )
        if self.theta is not None and (
            r == rerankers.NONE or "theta" not in rerankers.REGISTRY[r].options
        ):
            takes = [e.name for e in rerankers.REGISTRY.values() if "theta" in e.options]
            raise ValueError(f"theta applies only to reranker={'/'.join(takes)}, not {r}")
        if r != "none" and self.candidates < self.top_k:
            raise ValueError(
                f"candidates ({self.candidates}) must be >= top_k ({self.top_k}) when re-ranking"
            )

    def options(self) -> SearchOptions:
        """Just the options (a request body minus its query or image)."""
        return SearchOptions.model_validate(
            self.model_dump(
                include=set(SearchOptions.model_fields), exclude_unset=True, by_alias=True
            )
        )


class TextSearchRequest(SearchOptions):
    # JSON bodies are typed: `"top_k": "5"` and `"top_k": true` are refused, not coerced
    # (multipart form fields arrive as text and go through SearchOptions, which converts)
    model_config = ConfigDict(extra="forbid", strict=True)

    query: str = Field(
        ..., min_length=1, max_length=MAX_QUERY_CHARS, description="a sentence describing the image"
    )

    @field_validator("query")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("query must contain more than whitespace")
        return value


class ImageSearchJSON(SearchOptions):
    model_config = ConfigDict(extra="forbid", strict=True)

    image_b64: str = Field(..., min_length=1, description="the image file, base64-encoded")


TEXT_EXAMPLE = '{"query": "a red circle"}'
IMAGE_EXAMPLE = '{"image_b64": "<the image file, base64-encoded>"}'
# pydantic's words for a body that is not a JSON object
_NOT_AN_OBJECT = ("model_attributes_type", "model_type", "dict_type")


def field_names(model: type[BaseModel]) -> list[str]:
    """The names a request body sends a model's fields by (`lambda`, not `lambda_`)."""
    return [f.alias or name for name, f in model.model_fields.items()]


def explained(exc: ValidationError, fields: Sequence[str], example: str) -> list[dict[str, Any]]:
    """pydantic's errors for a request body, located under "body" as FastAPI locates them
    (a field named `query` is then named, not taken for where it came from), each message
    saying what to send where pydantic's does not: a missing field, an unknown one (with the
    `fields` the route takes), a body that is not a JSON object (with an `example`)."""
    out = []
    for e in exc.errors(include_url=False):
        kind, msg = e.get("type"), e.get("msg")
        if kind == "missing":
            msg = f"Field required; send a JSON object such as {example}"
        elif kind == "extra_forbidden":
            msg = f"not a field of this route; it takes {', '.join(fields)}"
        elif kind in _NOT_AN_OBJECT:
            msg = f"the body must be a JSON object such as {example}"
        loc = tuple(e["loc"])
        if not loc and kind == "value_error":  # two fields at odds: named by the first one
            named = re.match(r"[a-z_]+", str(msg).removeprefix("Value error, "))
            loc = (named.group(),) if named and named.group() in fields else ()
        out.append({**e, "loc": ("body", *loc), "msg": msg})
    return out


_PLAIN_ID = re.compile(r"[A-Za-z0-9_.~-]+").fullmatch  # what quote(safe="") leaves alone


def image_url(image_id: str | None) -> str | None:
    """Where this service serves an indexed image (GET /images/{id}); None without one.
    An id of letters, digits and `_.~-` (every id the builder makes) is its own quoting:
    half the time of `quote`, ten times a search."""
    if not image_id:
        return None
    s = str(image_id)
    return "/images/" + (s if _PLAIN_ID(s) else quote(s, safe=""))


class Hit(BaseModel):
    # each answer carries every field (null where it has none): required in the OpenAPI
    # document's response schema, so generated clients do not make them optional
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    id: str
    score: float
    retrieval_score: float
    rerank_score: float | None
    rank: int
    meta: dict[str, Any]
    image_url: str | None = Field(
        None,
        description="the hit's image (for a caption: the image it describes), served by "
        "GET /images/{id}; null for a caption that describes no image (a manifest line with "
        "captions only)",
    )
    caption: str | None = Field(
        None,
        description="for a caption hit its text; for an image hit the image's caption that "
        "shares most words with the query; null when the index stores none",
    )
    match: bool | None = Field(
        None,
        description="score >= the documented match threshold: the hit reads as fitting the "
        "words of the query the model read; null when the score is not the one the threshold "
        "was chosen for (duet's own model, reranker ce, fusion add, the default lambda)",
    )


class SearchResponse(BaseModel):
    # each answer carries every field (null where it has none): required in the OpenAPI
    # document's response schema, so generated clients do not make them optional
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    hits: list[Hit]
    timings_ms: dict[str, float]
    index_version: str
    cached: bool
    degraded: bool = Field(
        False,
        description="true when the deadline (DUET_REQUEST_TIMEOUT_MS) could not fit "
        "every candidate: `reranked` says how many were re-ranked",
    )
    reranked: int | None = Field(
        None, description="candidates re-ranked; null when the request does not re-rank"
    )
    unknown_words: list[str] = Field(
        default_factory=list,
        description="query words the model's vocabulary does not know "
        "(it reads them as unknown), then the emoji and other non-ASCII symbols it skips; "
        "empty for image queries",
    )


class Rerankers(BaseModel):
    available: list[str] = Field(description="what `reranker` may name on this deployment")
    default: str | None = Field(description="the re-ranker a request that names none gets")


class Items(BaseModel):
    images: int
    texts: int


class Readiness(BaseModel):
    """GET /readyz's 200 (the OpenAPI document's; the route builds it as a dict)."""

    status: Literal["ready"]
    model: str = Field(description="the served model's fingerprint")
    rerankers: Rerankers
    index_version: str
    items: Items
    cache: str = Field(description="memory or redis")
    cache_answers: bool = Field(
        description="whether the cache answers now (one look-up bounded by "
        "DUET_REDIS_TIMEOUT_MS); ready either way: without it every search is computed"
    )
    images: str = Field(
        description='"served", or why GET /images/{id} cannot serve this version\'s images '
        "here (the setting to change)"
    )
    reload: dict[str, Any] | None = Field(
        description="poll_s, last_swap and last_refused of the index reloader, and "
        "served_damaged: true while the served version's files have changed on disk and fail "
        "their checks (it serves on what it still reads); null without a reloader"
    )
