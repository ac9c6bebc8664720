"""A Python client for a running duet service: text and image search, typed hits, errors as
exceptions.

    from duet.client import DuetClient

    with DuetClient("http://127.0.0.1:8000") as duet:
        result = duet.search_text("a small red diamond left of a small yellow triangle", top_k=5)
        for hit in result.hits:
            print(hit.rank, hit.id, round(hit.score, 3), hit.caption)
        same = duet.search_image("data/demo/images/0007.png")  # captions for an image
        png = duet.image(result.hits[0])  # the hit's image file, as bytes

Every option of `POST /search/text` and `POST /search/image` is a keyword argument; options
left as None take the service's defaults. A 4xx/5xx answer raises `DuetError` (its `code`,
`status` and `message` are the service's); a 429 raises `Overloaded` with the service's
`retry_after` seconds, and `retries=N` makes the client wait that long and try again up to
N times. Only httpx is needed (no torch, no duet service code).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["DuetClient", "DuetError", "Hit", "Overloaded", "SearchResult"]


class DuetError(Exception):
    """The service answered with an error (`code`, `status`, `message` from its JSON body), or
    could not be reached (`code` "unreachable", `status` 0: refused, no route, or not
    listening yet, as while it loads), or did not answer within the client's `timeout`
    (`code` "timeout", `status` 0: the service may still be working on the request)."""

    def __init__(
        self, status: int, code: str, message: str, body: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {message}" if status else f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body or {}


class Overloaded(DuetError):
    """429: the service is at capacity or the request's deadline passed; retry after
    `retry_after` seconds."""

    def __init__(
        self, status: int, code: str, message: str, body: dict[str, Any], retry_after: float
    ):
        super().__init__(status, code, message, body)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Hit:
    """One result: an image for a text query, a caption for an image query."""

    id: str
    rank: int
    score: float  # what the hits are ordered by (the fused score when re-ranked)
    retrieval_score: float  # the dot product
    rerank_score: float | None  # the re-ranker's own score; None when not re-ranked
    image_url: str | None  # path of the hit's image on the service (see DuetClient.image)
    meta: dict[str, Any] = field(default_factory=dict)
    # the hit's text for an image query, else the image's caption closest to the query
    caption: str | None = None
    # the score reads as a fit (>= the service's match threshold); None when not judged
    match: bool | None = None


def _text(meta: dict[str, Any]) -> str | None:
    """A caption from the hit's meta (a service older than its `caption` field): the hit's
    text, else the image's first caption when the index stores captions with it."""
    text = meta.get("text")
    if isinstance(text, str):
        return text
    captions = meta.get("captions")
    return str(captions[0]) if isinstance(captions, list) and captions else None


@dataclass(frozen=True)
class SearchResult:
    hits: list[Hit]
    index_version: str
    cached: bool
    degraded: bool  # fewer candidates re-ranked than asked, to meet the deadline
    reranked: int | None  # how many candidates were re-ranked; None when not re-ranked
    unknown_words: list[str]  # query words the model does not know (read as unknown)
    timings_ms: dict[str, float]

    @classmethod
    def of(cls, body: dict[str, Any]) -> SearchResult:
        return cls(
            hits=[
                Hit(
                    id=h["id"],
                    rank=h["rank"],
                    score=h["score"],
                    retrieval_score=h["retrieval_score"],
                    rerank_score=h.get("rerank_score"),
                    image_url=h.get("image_url"),
                    meta=h.get("meta") or {},
                    caption=h.get("caption") or _text(h.get("meta") or {}),
                    match=h.get("match"),
                )
                for h in body["hits"]
            ],
            index_version=body["index_version"],
            cached=body["cached"],
            degraded=body.get("degraded", False),
            reranked=body.get("reranked"),
            unknown_words=list(body.get("unknown_words") or []),
            timings_ms=dict(body.get("timings_ms") or {}),
        )


class DuetClient:
    """A connection to one duet service (keep-alive; use it as a context manager or call
    `close`)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        timeout: float = 30.0,
        retries: int = 0,
        max_wait: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`retries`: how many times a 429 is retried after its Retry-After (each wait at
        most `max_wait` seconds)."""
        self.url = url.rstrip("/")
        self.retries = retries
        self.max_wait = max_wait
        self._http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport)

    def __enter__(self) -> DuetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- search ------------------------------------------------------------------------
    def search_text(self, query: str, **options: Any) -> SearchResult:
        """Images for a sentence. Options: top_k, candidates, reranker (ce, late, han, none,
        or another the service registers), fusion, lambda_ (sent as `lambda`), theta."""
        body = {"query": query, **_options(options)}
        return SearchResult.of(self._call("POST", "/search/text", json=body).json())

    def search_image(
        self, image: bytes | bytearray | memoryview | str | Path, **options: Any
    ) -> SearchResult:
        """Captions for an image: its file's bytes or a path to it (uploaded as multipart).
        Options as for `search_text`."""
        if isinstance(image, (bytes, bytearray, memoryview)):
            data = bytes(image)
        elif isinstance(image, (str, Path)):
            data = Path(image).read_bytes()
        else:
            raise TypeError(
                f"search_image takes the image file's bytes or a path to it, not "
                f"{type(image).__name__} (a PIL image: save it to io.BytesIO and pass .getvalue())"
            )
        form = {
            k: str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in _options(options).items()
        }
        resp = self._call("POST", "/search/image", files={"image": ("image", data)}, data=form)
        return SearchResult.of(resp.json())

    def image(self, hit: Hit | str) -> bytes:
        """The image file of a hit (or of an image id) as the service serves it."""
        path = hit.image_url if isinstance(hit, Hit) else f"/images/{hit}"
        if path is None:
            raise DuetError(
                0, "no_image", f"hit {hit.id if isinstance(hit, Hit) else hit} has no image"
            )
        return self._call("GET", path).content

    # -- status ------------------------------------------------------------------------
    def ready(self) -> dict[str, Any]:
        """GET /readyz: the index version served, the re-rankers offered and their default.
        While the service loads: DuetError 0 `unreachable` (its port is not open yet), or 503
        `not_ready` (in the process layout, from a front that answers before the model is
        loaded)."""
        body: dict[str, Any] = self._call("GET", "/readyz").json()
        return body

    # -- transport -----------------------------------------------------------------------
    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.request(method, path, **kw)
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ConnectTimeout):  # not reached at all
                    raise DuetError(0, "unreachable", f"{self.url}: {exc}") from exc
                raise DuetError(
                    0, "timeout", f"{self.url}{path}: no answer within the client's timeout ({exc})"
                ) from exc
            except httpx.TransportError as exc:
                raise DuetError(0, "unreachable", f"{self.url}: {exc}") from exc
            if resp.status_code < 400:
                return resp
            err = _error(resp)
            if isinstance(err, Overloaded) and attempt < self.retries:
                time.sleep(min(self.max_wait, err.retry_after))
                continue
            raise err
        raise AssertionError("unreachable")


def _options(options: dict[str, Any]) -> dict[str, Any]:
    """Keyword options -> the request's fields (lambda_ -> lambda; None left out)."""
    out = {("lambda" if k == "lambda_" else k): v for k, v in options.items() if v is not None}
    return out


def _error(resp: httpx.Response) -> DuetError:
    try:
        body = resp.json()
        err = body.get("error", {}) if isinstance(body, dict) else {}
    except ValueError:
        body, err = {}, {}
    code = str(err.get("code") or f"http_{resp.status_code}")
    message = str(err.get("message") or resp.text[:200] or resp.reason_phrase)
    if resp.status_code == 429:
        try:
            retry = float(resp.headers.get("retry-after", "1"))
        except ValueError:
            retry = 1.0
        return Overloaded(resp.status_code, code, message, body, retry)
    return DuetError(resp.status_code, code, message, body)
