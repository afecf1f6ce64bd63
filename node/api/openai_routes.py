"""OpenAI-compatible routes: chat completions (SSE and not) and models."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.node.api.schema import ChatCompletionRequest
from kvmesh.node.engine.engine import GenerateRequest, TextDelta, TurnStats
from kvmesh.node.engine.sampling import MIN_TEMPERATURE
from kvmesh.node.errors import InvalidRequest, KVMeshError, ModelNotFound
from kvmesh.node.mesh.auth import PEER_HEADER, check_peer_token
from kvmesh.node.mesh.forward import PeerUnavailable, ResumeDiverged, StreamSplice, open_turn, passed_headers, read_whole
from kvmesh.node.mesh.peers import Peer
from kvmesh.node.node import Node, TurnRun, derive_session_id
from kvmesh.node.protocol import session_header

log = logging.getLogger("kvmesh.api")

DEFAULT_MAX_TOKENS = 256


def _usage(stats: TurnStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


FORWARDED, PREV_HOST, PREDICTED, TURN_SEQ, SEED = (
    "X-Kvmesh-Forwarded", "X-Kvmesh-Prev-Host", "X-Kvmesh-Predicted-Reuse", "X-Kvmesh-Turn-Seq", "X-Kvmesh-Seed")


@dataclass
class Placement:
    """Where a turn runs: here (resp is None) or on a peer whose answer is open in resp."""

    host: str
    prev_host: str | None
    predicted: int | None
    resp: httpx.Response | None = None


class _Turn:
    """What the entry node knows of one client turn: enough to place it, and to place it again."""

    def __init__(self, node: Node, session: str, greq: GenerateRequest, messages: list[dict[str, Any]],
                 raw_body: bytes, stream: bool, include_usage: bool):
        self.node, self.session, self.greq, self.messages = node, session, greq, messages
        self.raw_body, self.stream, self.include_usage = raw_body, stream, include_usage
        self.seq = node.mesh.next_seq(session)
        self.unavailable: set[str] = set()

    async def place(self) -> Placement | Response:
        """Place the turn: here, or forwarded to a peer. A peer that fails before answering is
        routed around (nothing the client sent is lost); a non-streamed answer comes back whole."""
        node, mesh, session = self.node, self.node.mesh, self.session
        if not mesh.known(session):
            await mesh.refresh(session)
        while True:
            d = mesh.decide(session, len(self.greq.prompt), unavailable=frozenset(self.unavailable))
            if d is None or d.host == node.name:
                # No peer can take it (or this host is best): run here, even while draining.
                return Placement(node.name, d.prev_host if d else mesh.last_host(session), d.predicted_reused if d else None)
            peer = mesh.peers.peers[d.host]
            headers = {"content-type": "application/json", "X-Session-Id": session_header(session), FORWARDED: "1",
                       PREDICTED: str(d.predicted_reused), TURN_SEQ: str(self.seq)}
            if self.greq.seed is not None:
                headers[SEED] = str(self.greq.seed)
            if d.prev_host:
                headers[PREV_HOST] = d.prev_host
            if mesh.peer_token:
                headers[PEER_HEADER] = mesh.peer_token
            peer.pending += 1
            try:
                resp = await open_turn(mesh.peers.client, d.host, peer.cfg.api, self.raw_body, headers,
                                       timeout_s=node.cfg.mesh.forward_timeout_s)
                if not self.stream or resp.status_code != 200:
                    answer = await read_whole(d.host, resp)
                    mesh.note_routed(session, d.host, self.seq)
                    return answer
            except PeerUnavailable as e:
                log.warning("turn of %s could not go to %s (%s); placing it again", session, d.host, e.reason)
                if not e.overloaded:
                    mesh.peers.mark_down(d.host, e.reason)
                self.unavailable.add(d.host)
                continue
            finally:
                peer.pending -= 1
            mesh.note_routed(session, d.host, self.seq)
            return Placement(d.host, d.prev_host, d.predicted_reused, resp)

    async def run_here(self, prev_host: str | None, predicted: int | None) -> TurnRun:
        run = await self.node.prepare_turn(self.greq, prev_host, predicted, self.messages, self.seq)
        self.node.mesh.note_routed(self.session, self.node.name, self.seq)
        return run

    async def relay(self, first: Placement) -> AsyncIterator[bytes]:
        """The peer's SSE answer, passed on as it comes. If the serving peer dies (or stops being
        heard from) before the answer is whole, the turn is placed again and the new host's answer
        continues where the client's text stopped (StreamSplice checks the repeat is identical)."""
        node, splice, at = self.node, StreamSplice(), first
        try:
            while at.resp is not None:
                reason = "the stream ended before [DONE]"
                try:
                    async for chunk in _watched(at.resp, node.mesh.peers.peers[at.host], node.mesh.peers.stale_after_s):
                        for ev in splice.feed(chunk):
                            yield ev
                        if splice.done:
                            return
                except httpx.HTTPError as e:
                    reason = f"{type(e).__name__}: {e}"
                except _PeerSilent as e:
                    reason = str(e)
                finally:
                    await at.resp.aclose()
                if splice.finished:  # only the trailer was lost: the answer is whole
                    break
                log.warning("turn of %s: %s stopped mid-answer (%s); running it again elsewhere", self.session, at.host, reason)
                node.mesh.peers.mark_down(at.host, reason)
                node.metrics.resumed.inc()
                self.unavailable.add(at.host)
                splice.resume()
                placed = await self.place()
                if isinstance(placed, Response):  # an error status from the new host
                    msg = bytes(placed.body[:300]).decode(errors="replace")
                    yield _error_event(f"the turn could not be run again elsewhere: {msg}", "server_error", "peer_lost")
                    break
                if placed.resp is None:
                    run = await self.run_here(placed.prev_host, placed.predicted)
                    async for chunk in _sse(run, "chatcmpl-resumed", int(time.time()), node.engine.model_name,
                                            self.include_usage):
                        for ev in splice.feed(chunk):
                            yield ev
                    return
                at = placed
        except ResumeDiverged as e:
            log.warning("turn of %s could not be resumed identically: %s", self.session, e)
            yield _error_event(f"the serving host stopped mid-answer and the turn did not repeat identically ({e})",
                               "server_error", "peer_lost")
        except KVMeshError as e:
            yield _error_event(str(e), e.type, e.code)
        yield b"data: [DONE]\n\n"


class _PeerSilent(Exception):
    pass


async def _watched(resp: httpx.Response, peer: Peer, stale_after_s: float, every_s: float = 1.0) -> AsyncIterator[bytes]:
    """The response's raw bytes; gives up (_PeerSilent) once the peer's status has not been heard
    for stale_after_s, rather than wait out the read timeout on a host that stopped answering
    (one failed call elsewhere is not enough: a slow answer is still an answer)."""
    chunks = resp.aiter_raw()
    while True:
        nxt = asyncio.ensure_future(anext(chunks))
        try:
            while not nxt.done():
                await asyncio.wait({nxt}, timeout=every_s)
                silent_s = time.monotonic() - peer.heard_at
                if not nxt.done() and not peer.reachable and silent_s > stale_after_s:
                    raise _PeerSilent(f"{peer.name} not heard from for {silent_s:.1f}s: {peer.error or 'no answer'}")
        finally:
            if not nxt.done():
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return


def _error_event(message: str, type_: str, code: str | None) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode() + b"\n\n"


def _chunk(ident: tuple[str, int, str], delta: dict[str, Any], finish: str | None = None,
           usage: dict[str, Any] | None = None) -> bytes:
    cid, created, model = ident
    obj: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if usage is None else [],
    }
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(run: TurnRun, cid: str, created: int, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    """A turn running here, as OpenAI stream chunks."""
    ident = (cid, created, model)
    events = run.stream()
    yield _chunk(ident, {"role": "assistant", "content": ""})
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield _chunk(ident, {"content": ev.text})
            else:
                yield _chunk(ident, {}, ev.stats.finish_reason)
                if include_usage:
                    yield _chunk(ident, {}, usage=_usage(ev.stats))
    except KVMeshError as e:
        yield _error_event(str(e), e.type, e.code)
    finally:
        await events.aclose()
    yield b"data: [DONE]\n\n"


def router(node: Node) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": node.engine.model_name, "object": "model", "created": int(node.started), "owned_by": "kvmesh"}],
        }

    @r.get("/health")
    async def health() -> dict[str, object]:
        return node.health()

    @r.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        x_session_id: str | None = Header(None),
    ) -> Response:
        if body.model != node.engine.model_name:
            raise ModelNotFound(f"model {body.model!r} is not served here; GET /v1/models lists {node.engine.model_name!r}")
        messages = body.messages_as_dicts()
        session = derive_session_id(x_session_id, body.user, messages)
        try:
            prompt = node.engine.tokenizer.apply_chat_template(messages)
        except UnicodeEncodeError:
            raise InvalidRequest("message content is not valid Unicode (an unpaired surrogate?)", param="messages") from None
        greq = GenerateRequest(
            session=session,
            prompt=prompt,
            max_tokens=body.token_budget(DEFAULT_MAX_TOKENS),
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop_list(),
        )
        node.engine.validate(greq)
        hdrs = request.headers
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if hdrs.get(FORWARDED) and check_peer_token(hdrs.get(PEER_HEADER), node.mesh.secrets):
            prev_host = hdrs.get(PREV_HOST) or None
            predicted = int(hdrs[PREDICTED]) if hdrs.get(PREDICTED, "").isdigit() else None
            seq = int(hdrs[TURN_SEQ]) if hdrs.get(TURN_SEQ, "").isdigit() else node.mesh.next_seq(session)
            if greq.seed is None and hdrs.get(SEED, "").lstrip("-").isdigit():
                greq.seed = int(hdrs[SEED])
            run = await node.prepare_turn(greq, prev_host, predicted, messages, seq)
            node.mesh.note_routed(session, node.name, seq)
        else:
            if greq.seed is None and greq.temperature >= MIN_TEMPERATURE:
                # The entry picks the seed, so a turn run again elsewhere samples the same answer.
                greq.seed = secrets.randbits(63)
            turn = _Turn(node, session, greq, messages, await request.body(), body.stream, include_usage)
            placed = await turn.place()
            if isinstance(placed, Response):
                return placed
            if placed.resp is not None:
                return StreamingResponse(turn.relay(placed), status_code=200, headers=passed_headers(placed.resp))
            run = await turn.run_here(placed.prev_host, placed.predicted)
        turn_headers = {"X-Kvmesh-Host": node.name, "X-Session-Id": session_header(session),
                        "X-Kvmesh-Handoff": run.handoff_class or "none",
                        "X-Kvmesh-Cached-Tokens": str(run.begin.cached_tokens if run.begin else 0)}
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = node.engine.model_name
        if body.stream:
            headers = dict(turn_headers)
            headers["Cache-Control"] = "no-cache"
            headers["X-Accel-Buffering"] = "no"
            return StreamingResponse(_sse(run, cid, created, model, include_usage), media_type="text/event-stream",
                                     headers=headers)
        text, stats = [], None
        async for ev in run.stream():
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            else:
                stats = ev.stats
        assert stats is not None
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(text)},
                        "finish_reason": stats.finish_reason,
                        "logprobs": None,
                    }
                ],
                "usage": _usage(stats),
            },
            headers=turn_headers,
        )

    return r
