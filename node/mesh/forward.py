"""Forward a turn to the peer placement chose, streaming its answer back unchanged."""

from __future__ import annotations

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

PASS_HEADERS = ("content-type", "cache-control", "retry-after", "x-session-id", "x-accel-buffering")


class PeerUnavailable(Exception):
    """The peer could not take the turn (unreachable, or overloaded before answering)."""

    def __init__(self, peer: str, reason: str, *, overloaded: bool = False):
        super().__init__(f"{peer}: {reason}")
        self.peer, self.reason, self.overloaded = peer, reason, overloaded


async def forward_turn(client: httpx.AsyncClient, peer: str, api: str, body: bytes, headers: dict[str, str],
                       *, stream: bool, timeout_s: float) -> Response:
    """POST the client's body verbatim to the peer; pass status, kvmesh headers and bytes through.

    Raises PeerUnavailable before any byte reached the client, so the caller can place the turn elsewhere.
    """
    req = client.build_request("POST", f"{api}/v1/chat/completions", content=body, headers=headers,
                               timeout=httpx.Timeout(timeout_s, connect=1.0))
    try:
        resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise PeerUnavailable(peer, f"{type(e).__name__}: {e}") from None
    if resp.status_code == 429 or resp.status_code >= 500:
        await resp.aclose()
        raise PeerUnavailable(peer, f"answered {resp.status_code}", overloaded=resp.status_code == 429)
    out_headers = {k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS or k.lower().startswith("x-kvmesh-")}
    if not stream or resp.status_code != 200:
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            raise PeerUnavailable(peer, f"{type(e).__name__} while reading the answer") from None
        finally:
            await resp.aclose()
        return Response(content, status_code=resp.status_code, headers=out_headers)

    async def relay():  # type: ignore[no-untyped-def]
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            # The serving peer died mid-stream: tell the client in-band (the status is already sent).
            yield b'data: {"error":{"message":"the serving host stopped mid-answer","type":"server_error","code":"peer_lost"}}\n\n'
            yield b"data: [DONE]\n\n"

    return StreamingResponse(relay(), status_code=200, headers=out_headers, background=BackgroundTask(resp.aclose))
