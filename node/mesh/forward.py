"""Forward a turn to the peer placement chose, and keep a streamed answer whole when that peer dies.

`open_turn` sends the client's body verbatim and returns the peer's open response (or raises
PeerUnavailable before any byte reached the client, so the caller can place the turn elsewhere).
`watched` reads the open answer while checking the peer is still heard from. `StreamSplice` is the
sans-I/O part of a resumed stream: it relays SSE events as they come, remembers what the client
has been sent (text, and tool calls: each call's name and argument text), and when the turn is run
again elsewhere it drops the new stream's repeat of that (checking it is the same) so the client
sees one answer, with each tool call once, under the id it was first sent with.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import Response

from kvmesh.node.mesh.peers import Peer

PASS_HEADERS = ("content-type", "cache-control", "retry-after", "x-session-id", "x-accel-buffering")


class PeerUnavailable(Exception):
    """The peer could not take the turn (unreachable, or overloaded before answering)."""

    def __init__(self, peer: str, reason: str, *, overloaded: bool = False):
        super().__init__(f"{peer}: {reason}")
        self.peer, self.reason, self.overloaded = peer, reason, overloaded


class ResumeDiverged(Exception):
    """The turn run again elsewhere did not repeat the text the client already has."""


class PeerSilent(Exception):
    """The peer serving a stream has not been heard from for longer than `stale_after_s`."""


async def open_turn(client: httpx.AsyncClient, peer: str, url: str, body: bytes, headers: dict[str, str],
                    *, timeout_s: float) -> httpx.Response:
    """POST the body to the peer's turn route `url`; the answer's status is known, its body not yet read.

    Header values go out as latin-1 bytes, as they came in (httpx would send a str as ASCII
    only; a UTF-8 session id arrives as latin-1 text, see `protocol.session_header`)."""
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    req = client.build_request("POST", url, content=body, headers=raw,
                               timeout=httpx.Timeout(timeout_s, connect=1.0))
    try:
        resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise PeerUnavailable(peer, f"{type(e).__name__}: {e}") from None
    if resp.status_code == 429 or resp.status_code >= 500:
        await resp.aclose()
        raise PeerUnavailable(peer, f"answered {resp.status_code}", overloaded=resp.status_code == 429)
    return resp


def passed_headers(resp: httpx.Response) -> dict[str, str]:
    """The peer's headers the client should see, byte for byte (latin-1 both ways: a UTF-8 session id stays UTF-8)."""
    out = {}
    for k, v in resp.headers.raw:
        name = k.decode("latin-1").lower()
        if name in PASS_HEADERS or name.startswith("x-kvmesh-"):
            out[name] = v.decode("latin-1")
    return out


async def read_whole(peer: str, resp: httpx.Response) -> Response:
    """A non-streamed answer, passed through once it is whole (a peer dying before then is
    PeerUnavailable: nothing reached the client)."""
    try:
        content = await resp.aread()
    except httpx.HTTPError as e:
        raise PeerUnavailable(peer, f"{type(e).__name__} while reading the answer") from None
    finally:
        await resp.aclose()
    return Response(content, status_code=resp.status_code, headers=passed_headers(resp))


async def watched(resp: httpx.Response, peer: Peer, stale_after_s: float, every_s: float = 1.0) -> AsyncIterator[bytes]:
    """The response's raw bytes; gives up (PeerSilent) once the peer's status has not been heard
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
                    raise PeerSilent(f"{peer.name} not heard from for {silent_s:.1f}s: {peer.error or 'no answer'}")
        finally:
            if not nxt.done():
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return


def sse_error(message: str, type_: str, code: str | None) -> bytes:
    """An OpenAI-style in-band error event: how a stream that already began reports a failure."""
    return b"data: " + json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode() + b"\n\n"


Piece = tuple[str, str]  # ("c", content text) | ("n<i>", tool call i's name) | ("a<i>", its argument text)


def _pieces(delta: dict[str, Any]) -> list[Piece]:
    """What a delta tells the client, in order."""
    out: list[Piece] = []
    if isinstance(delta.get("content"), str) and delta["content"]:
        out.append(("c", delta["content"]))
    if isinstance(delta.get("text"), str) and delta["text"]:  # a legacy completions choice
        out.append(("c", delta["text"]))
    for tc in delta.get("tool_calls") or []:
        i, fn = tc.get("index", 0), tc.get("function") or {}
        if fn.get("name"):
            out.append((f"n{i}", fn["name"]))
        if fn.get("arguments"):
            out.append((f"a{i}", fn["arguments"]))
    return out


def _add(record: list[Piece], piece: Piece) -> None:
    if record and record[-1][0] == piece[0] and piece[0][0] != "n":
        record[-1] = (piece[0], record[-1][1] + piece[1])
    else:
        record.append(piece)


def _rebuilt(delta: dict[str, Any], kept: list[Piece]) -> dict[str, Any]:
    """The delta with only the pieces the client has not been sent (a call's id goes with its name)."""
    out = {k: v for k, v in delta.items() if k not in ("content", "tool_calls", "role")}
    text = "".join(t for c, t in kept if c == "c")
    if text:
        out["content"] = text
    names = {c[1:]: t for c, t in kept if c[0] == "n"}
    args = {c[1:]: t for c, t in kept if c[0] == "a"}
    calls = []
    for tc in delta.get("tool_calls") or []:
        i = str(tc.get("index", 0))
        if i not in names and i not in args:
            continue
        fn = {"name": names[i]} if i in names else {}
        fn["arguments"] = args.get(i, "")
        entry = {k: v for k, v in tc.items() if k in ("index", "id", "type")} if i in names else {"index": tc.get("index", 0)}
        calls.append(entry | {"function": fn})
    if calls:
        out["tool_calls"] = calls
    return out


class StreamSplice:
    """One client's SSE answer, assembled from the streams of the hosts that ran the turn.

    feed(bytes) -> SSE events for the client. resume() says the stream so far broke off and the
    turn is running again from its start: the next stream's role chunk and its repeat of what was
    already sent (text, tool calls' names and arguments) are dropped, its chunks take the first
    stream's id, and a repeat that differs raises ResumeDiverged (a sampled turn is only
    repeatable with its seed).
    """

    def __init__(self) -> None:
        self._buf = b""
        self.sent: list[Piece] = []  # what the client has been sent, adjacent pieces of one kind joined
        self._skip: list[Piece] = []  # what the current stream must repeat before it says anything new
        self._resumed = False
        self._ident: dict[str, Any] = {}  # id, created, model of the first stream
        self.finished = False  # a finish_reason was relayed: the answer is whole
        self.done = False  # [DONE] or an in-band error was relayed: the stream is over
        self.resumes = 0

    @property
    def sent_text(self) -> str:
        """The content text the client has been sent."""
        return "".join(t for c, t in self.sent if c == "c")

    def resume(self) -> None:
        self._buf = b""  # a torn event of the dead stream is dropped
        self._skip = list(self.sent)
        self._resumed = True
        self.resumes += 1

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while not self.done:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            event, self._buf = self._buf[: end + 2], self._buf[end + 2:]
            out.extend(self._event(event))
        return out

    def _event(self, event: bytes) -> list[bytes]:
        payload = event.strip()
        if not payload.startswith(b"data:"):
            return [event]  # a comment or keep-alive
        data = payload[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return [event]
        try:
            obj = json.loads(data)
        except ValueError:
            return [event]
        if not isinstance(obj, dict):
            return [event]
        if "error" in obj:
            self.done = True
            return [event]
        if not self._ident:
            self._ident = {k: obj.get(k) for k in ("id", "created", "model")}
        choices = obj.get("choices") or []
        # A legacy completions choice carries its text itself, not in a delta.
        legacy = bool(choices) and "delta" not in choices[0]
        delta = (choices[0] if legacy else choices[0].get("delta", {})) if choices else {}
        pieces = _pieces(delta)
        finish = bool(choices and choices[0].get("finish_reason"))
        self.finished = self.finished or finish
        if not self._resumed:
            for p in pieces:
                _add(self.sent, p)
            return [event]
        if "role" in delta and not pieces and not self.finished:
            return []  # the client has its role chunk
        kept = self._unrepeated(pieces)
        if finish and self._skip:
            raise ResumeDiverged("the repeat finished before reaching what the client was sent")
        if not kept and not finish and pieces:
            return []
        for p in kept:
            _add(self.sent, p)
        if legacy:
            choices[0]["text"] = "".join(t for _, t in kept)
        elif choices:
            choices[0]["delta"] = _rebuilt(delta, kept)
        obj.update(self._ident)
        return [b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"]

    def _unrepeated(self, pieces: list[Piece]) -> list[Piece]:
        """The pieces past the repeat of what was sent; raises ResumeDiverged where the repeat differs."""
        kept: list[Piece] = []
        for kind, text in pieces:
            if self._skip:
                want_kind, want = self._skip[0]
                n = len(want) if kind[0] == "n" else min(len(want), len(text))
                if kind != want_kind or text[:n] != want[:n] or (kind[0] == "n" and text != want):
                    raise ResumeDiverged(f"the repeat says {kind}:{text[:n]!r} where the client was sent {want_kind}:{want[:n]!r}")
                text = text[n:]
                if want[n:]:
                    self._skip[0] = (want_kind, want[n:])
                else:
                    self._skip.pop(0)
                if text and self._skip:
                    raise ResumeDiverged(f"the repeat says {kind}:{text!r} where the client was sent {self._skip[0][0]} next")
                if not text:
                    continue
            kept.append((kind, text))
        return kept
