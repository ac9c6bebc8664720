"""A minimal HTTP/1.1 keep-alive client for load: `duet bench`'s and the benchmark scripts'
(`benchmarks/load_client.py`). A load generator shares its machine with the server it
measures, and httpx spends several times the CPU per request of writing the request and
reading Content-Length bytes back by hand."""

from __future__ import annotations

import asyncio
import re
import time
from urllib.parse import urlsplit

import httpx

FLUSH_S = 0.25  # how often a front sends the owner its observations (app.remote.FLUSH_S)
_SUMS = re.compile(r"^duet_(stage|request)_seconds_(sum|count)\{([^}]*)\} (\S+)$", re.M)


async def finish_message(
    reader: asyncio.StreamReader, head: bytes
) -> tuple[str, dict[str, str], bytes]:
    """An HTTP/1.1 message whose head (up to its blank line) was read off `reader`: its start
    line, its headers (names lower-cased) and its Content-Length body, read now."""
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(":") for line in lines[1:] if line)
    }
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ValueError(  # its body unread, the connection is of no further use
            "the server sent a chunked body (a proxy in between?); this client reads bodies "
            "of a stated Content-Length only"
        )
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0], headers, body


class Conn:
    """A minimal HTTP/1.1 keep-alive client over one asyncio connection: the load generator
    shares the machine with the servers, and httpx spends several times the CPU per request
    of writing the request and reading Content-Length bytes back by hand."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)  # http://HOST:PORT, [::1] for an IPv6 host
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"{url!r}: give http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port
        self._io: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(
        self, method: str, path: str, body: bytes = b""
    ) -> tuple[int, dict[str, str], bytes]:
        for attempt in (0, 1):  # once more on a connection the server closed meanwhile
            if self._io is None:
                self._io = await asyncio.open_connection(self.host, self.port)
            reader, writer = self._io
            try:
                writer.write(
                    f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                    "\r\n\r\n".encode()
                    + body
                )
                head = await reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
                continue
            start, headers, data = await finish_message(reader, head)
            status = int(start.split(" ", 2)[1])
            if headers.get("connection", "").lower() == "close":
                self.close()
            return status, headers, data
        raise ConnectionError("unreachable")

    def close(self) -> None:
        if self._io is not None:
            self._io[1].close()
            self._io = None


def stage_totals(url: str) -> dict[str, list[float]]:
    """duet's /metrics now: [seconds, count] of each stage of duet_stage_seconds and of
    "request" (duet_request_seconds, /search/* endpoints). Read once the fronts have sent
    what they observed so far: they send the owner their observations every `FLUSH_S`, so
    a read right after a loaded cell missed its last ones, which the next (lone) cell's
    means then took in (the twenty-sixth session's CPU run: a lone dot-only request's
    server mean 19.5 ms against its client's p50 of 2.9): two intervals and a margin."""
    time.sleep(2 * FLUSH_S + 0.1)
    out: dict[str, list[float]] = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family, kind, labels, value in _SUMS.findall(text):
        if family == "stage":
            key = stage_label(labels) or "?"
        elif 'endpoint="/search/' in labels:
            key = "request"
        else:
            continue
        acc = out.setdefault(key, [0.0, 0.0])
        acc[0 if kind == "sum" else 1] += float(value)
    return out


def stage_label(labels: str) -> str | None:
    """The `stage` label's value in a series' labels, if it has one."""
    found = re.search(r'stage="([^"]+)"', labels)
    return found.group(1) if found else None
