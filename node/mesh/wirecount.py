"""Bytes this node's peer HTTP traffic puts on the link, by kind and direction.

The peer client (status polls, forwarded turns, operator relays) runs through
`CountingTransport`, which counts what HTTP/1.1 writes for each exchange: the
request line, headers and body out, the status line, headers, body and chunk
framing back. The node that opened an exchange counts both of its directions,
so a link's traffic one way is this node's `out` plus the peer's `in`. TCP/IP
headers are not here: netlab takes them from `tc`'s own packet count.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator

import httpx

FORWARDED_TURN, PEER_STATUS, PEER_ACTION = "forwarded_turn", "peer_status", "peer_action"


def kind_of(path: str) -> str:
    if path.endswith(("/v1/chat/completions", "/v1/completions")):
        return FORWARDED_TURN
    if path.startswith(("/v1/peer/status", "/v1/peer/state", "/v1/peer/directory/")) or (
            path.startswith("/v1/peer/sessions/") and not path.endswith(("/adopt", "/migrate", "/replicate"))):
        return PEER_STATUS
    return PEER_ACTION


class WireCounts:
    """(peer netloc, direction "out" | "in", kind) -> bytes."""

    def __init__(self) -> None:
        self.bytes: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def add(self, netloc: str, direction: str, kind: str, n: int) -> None:
        self.bytes[(netloc, direction, kind)] += n

    def by_peer(self, names: dict[str, str]) -> dict[str, dict[str, dict[str, int]]]:
        """{peer name: {"out": {kind: bytes}, "in": {kind: bytes}}}; `names` maps netloc -> peer name."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (netloc, direction, kind), n in sorted(self.bytes.items()):
            peer = out.setdefault(names.get(netloc, netloc), {"out": {}, "in": {}})
            peer[direction][kind] = peer[direction].get(kind, 0) + n
        return out


def _head_bytes(first_line: str, headers: httpx.Headers) -> int:
    return len(first_line) + 2 + sum(len(k) + len(v) + 4 for k, v in headers.raw) + 2


class _CountedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, count: WireCounts, netloc: str, kind: str, chunked: bool):
        self.inner, self.count, self.netloc, self.kind, self.chunked = inner, count, netloc, kind, chunked

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            framing = len(f"{len(chunk):x}") + 4 if self.chunked else 0
            self.count.add(self.netloc, "in", self.kind, len(chunk) + framing)
            yield chunk
        if self.chunked:
            self.count.add(self.netloc, "in", self.kind, 5)  # the last chunk: "0\r\n\r\n"

    async def aclose(self) -> None:
        await self.inner.aclose()


class CountingTransport(httpx.AsyncBaseTransport):
    """An httpx transport that counts each exchange's bytes into `count`, then hands it on."""

    def __init__(self, inner: httpx.AsyncBaseTransport, count: WireCounts):
        self.inner, self.count = inner, count

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        netloc, kind = request.url.netloc.decode("ascii"), kind_of(request.url.path)
        body = int(request.headers.get("content-length", "0") or 0)
        line = f"{request.method} {request.url.raw_path.decode('ascii')} HTTP/1.1"
        self.count.add(netloc, "out", kind, _head_bytes(line, request.headers) + body)
        resp = await self.inner.handle_async_request(request)
        self.count.add(netloc, "in", kind, _head_bytes(f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}", resp.headers))
        assert isinstance(resp.stream, httpx.AsyncByteStream)
        chunked = resp.headers.get("transfer-encoding", "").lower() == "chunked"
        return httpx.Response(resp.status_code, headers=resp.headers, extensions=resp.extensions,
                              stream=_CountedStream(resp.stream, self.count, netloc, kind, chunked))

    async def aclose(self) -> None:
        await self.inner.aclose()
