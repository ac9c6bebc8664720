"""A minimal HTTP/1.1 keep-alive client for load: `duet bench`'s and the benchmark scripts'
(`benchmarks/load_client.py`). A load generator shares its machine with the server it
measures, and httpx spends several times the CPU per request of writing the request and
reading Content-Length bytes back by hand."""

from __future__ import annotations

import asyncio


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
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0], headers, body


class Conn:
    """A minimal HTTP/1.1 keep-alive client over one asyncio connection: the load generator
    shares the machine with the servers, and httpx spends several times the CPU per request
    of writing the request and reading Content-Length bytes back by hand."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
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
