"""Forward a turn to the peer placement chose, read its answer into answer events, and keep a
streamed answer whole when that peer dies.

`open_turn` sends the hop's body and returns the peer's open response (or raises PeerUnavailable
before any byte reached the client, so the caller can place the turn elsewhere). `watched` reads
the open answer while checking the peer is still heard from. The hop's answer (chat completions,
or legacy completions for a raw prompt) is read once, here, into answer events (node.mesh.answer):
`HopChunks` a stream, `whole_events` a whole answer. `StreamSplice` is the sans-I/O part of a
resumed stream: it passes events on as they come, remembers what the client has been sent (text,
and tool calls: each call's name and argument text), and when the turn is run again elsewhere it
drops the new stream's repeat of that (checking it is the same) so the client sees one answer,
with each tool call once, under the id it was first sent with.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvmesh.node.engine.boundary import TokenLogprob
from kvmesh.node.mesh.answer import (
    AnswerError,
    AnswerEvent,
    ContentDelta,
    Failed,
    Finish,
    Logprobs,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from kvmesh.node.mesh.peers import Peer


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
    """What the peer told the client about the turn (X-Kvmesh-*, X-Session-Id), byte for byte (latin-1 both
    ways: a UTF-8 session id stays UTF-8)."""
    out = {}
    for k, v in resp.headers.raw:
        name = k.decode("latin-1").lower()
        if name == "x-session-id" or name.startswith("x-kvmesh-"):
            out[name] = v.decode("latin-1")
    return out


@dataclass
class PeerAnswer:
    """A peer's whole answer (or its error status), read to its end."""

    status: int
    body: bytes
    headers: dict[str, str]


async def read_whole(peer: str, resp: httpx.Response) -> PeerAnswer:
    """A non-streamed answer, once it is whole (a peer dying before then is PeerUnavailable:
    nothing reached the client)."""
    try:
        content = await resp.aread()
    except httpx.HTTPError as e:
        raise PeerUnavailable(peer, f"{type(e).__name__} while reading the answer") from None
    finally:
        await resp.aclose()
    return PeerAnswer(resp.status_code, content, passed_headers(resp))


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


def peer_answer_error(status: int, body: bytes) -> AnswerError:
    """A peer's error status (its OpenAI-shaped error body) as the error to say in the client's dialect."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = {}
    got = obj.get("error") if isinstance(obj, dict) else None
    err: dict[str, Any] = got if isinstance(got, dict) else {}
    return AnswerError(status if status != 200 else 502, str(err.get("message") or f"the peer answered {status}"),
                       str(err.get("type") or "server_error"), err.get("code"), err.get("param"))


def _chat_scores(choice: dict[str, Any]) -> Logprobs | None:
    """A chat choice.logprobs (OpenAI's shape) back as the tokens' log probabilities, if it has any."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or not content:
        return None

    def tok(e: dict[str, Any]) -> bytes:
        b = e.get("bytes")
        return bytes(b) if isinstance(b, list) else str(e.get("token", "")).encode()

    try:
        return Logprobs(tuple(TokenLogprob(tok(e), float(e["logprob"]),
                                           tuple((tok(t), float(t["logprob"])) for t in e.get("top_logprobs") or []))
                              for e in content))
    except (KeyError, TypeError, ValueError):
        return None  # a malformed peer answer loses its log probabilities, never the turn


def _legacy_scores(choice: dict[str, Any]) -> Logprobs | None:
    """A legacy choice.logprobs (tokens, token_logprobs, top_logprobs) back as the tokens' log probabilities."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not lp.get("tokens"):
        return None
    try:
        tops = lp.get("top_logprobs") or [{}] * len(lp["tokens"])
        return Logprobs(tuple(TokenLogprob(str(t).encode(), float(v), tuple((str(k).encode(), float(x))
                                                                             for k, x in (top or {}).items()))
                              for t, v, top in zip(lp["tokens"], lp["token_logprobs"], tops, strict=True)))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _usage_of(obj: dict[str, Any]) -> tuple[int, int, int]:
    u = obj.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(u.get("prompt_tokens") or 0), int(cached), int(u.get("completion_tokens") or 0)


def whole_events(status: int, body: bytes) -> list[AnswerEvent]:
    """A peer's whole answer (a chat.completion or a legacy text_completion) as answer events; an error
    status, or a body that is not an answer, raised as AnswerError."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = {}
    if status != 200 or not isinstance(obj, dict) or "choices" not in obj:
        raise peer_answer_error(status, body)
    choice = (obj.get("choices") or [{}])[0]
    out: list[AnswerEvent] = []
    if "message" in choice:
        msg = choice.get("message") or {}
        out += [ContentDelta(msg["content"])] if msg.get("content") else []
        scored = _chat_scores(choice)
        for i, tc in enumerate(msg.get("tool_calls") or []):
            fn = tc.get("function") or {}
            out += [ToolCallStart(i, str(tc.get("id") or ""), str(fn.get("name") or "")),
                    ToolCallArgs(i, str(fn.get("arguments") or "")), ToolCallEnd(i)]
    else:  # a legacy completions choice carries its text itself
        out += [ContentDelta(choice["text"])] if isinstance(choice.get("text"), str) and choice["text"] else []
        scored = _legacy_scores(choice)
    if scored is not None:
        out.append(scored)
    out.append(Finish(str(choice.get("finish_reason") or "stop"), *_usage_of(obj), stop_sequence=choice.get("stop_reason")))
    return out


class HopChunks:
    """The hop's streamed answer (chat chunks, or legacy text_completion chunks) as answer events,
    sans-I/O: feed(bytes) -> events. Read once, here; every dialect renders the events."""

    def __init__(self) -> None:
        self._buf = b""
        self._open: list[int] = []  # tool calls started and not yet ended, by index
        self._finish: tuple[str, str | None] | None = None
        self.done = False  # [DONE] or an in-band error was read: the stream is over

    @property
    def finished(self) -> bool:
        """A finish_reason was read: the answer is whole, even if its trailer is lost."""
        return self._finish is not None

    def feed(self, data: bytes) -> list[AnswerEvent]:
        self._buf += data
        out: list[AnswerEvent] = []
        while not self.done and (end := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[:end].strip(), self._buf[end + 2:]
            if event.startswith(b"data:"):
                out.extend(self._data(event[5:].strip()))
        return out

    def end(self) -> list[AnswerEvent]:
        """The stream closed: what is owed if it closed without its [DONE]."""
        if self.done:
            return []
        self.done = True
        if self._finish is None:
            return [Failed("the serving host's answer ended before it was whole", "server_error", "peer_lost")]
        return [*self._close_calls(), Finish(self._finish[0], stop_sequence=self._finish[1])]

    def _data(self, data: bytes) -> list[AnswerEvent]:
        if data == b"[DONE]":
            return self.end()
        try:
            obj = json.loads(data)
        except ValueError:
            return []
        if not isinstance(obj, dict):
            return []
        if "error" in obj:
            self.done = True
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            return [Failed(str(err.get("message", "the serving host failed")), str(err.get("type", "server_error")),
                           err.get("code"))]
        choices = obj.get("choices") or []
        if not choices:
            if obj.get("usage") and self._finish is not None:  # the usage chunk, after the finish
                self.done = True
                return [*self._close_calls(), Finish(self._finish[0], *_usage_of(obj), stop_sequence=self._finish[1])]
            return []
        choice = choices[0]
        finish = choice.get("finish_reason")
        if "delta" in choice:
            out, scored = self._delta(choice.get("delta") or {}), _chat_scores(choice)
        else:  # legacy: the text itself; an empty one only said to carry its log probabilities
            text, scored = choice.get("text"), _legacy_scores(choice)
            out = [ContentDelta(text)] if isinstance(text, str) and not finish and (text or scored is None) else []
        if scored is not None:
            out.append(scored)
        if finish:
            self._finish = (str(finish), choice.get("stop_reason"))
        return out

    def _delta(self, delta: dict[str, Any]) -> list[AnswerEvent]:
        out: list[AnswerEvent] = []
        if isinstance(delta.get("content"), str) and "role" not in delta:  # the role chunk says nothing
            out.append(ContentDelta(delta["content"]))
        for tc in delta.get("tool_calls") or []:
            i, fn = int(tc.get("index", 0)), tc.get("function") or {}
            if fn.get("name"):
                out += self._close_calls()  # calls come one after another
                self._open.append(i)
                out.append(ToolCallStart(i, str(tc.get("id") or ""), str(fn["name"])))
            if fn.get("arguments"):
                out.append(ToolCallArgs(i, str(fn["arguments"])))
        return out

    def _close_calls(self) -> list[AnswerEvent]:
        out: list[AnswerEvent] = [ToolCallEnd(i) for i in self._open]
        self._open.clear()
        return out


Piece = tuple[str, str]  # ("c", content text) | ("n<i>", tool call i's name) | ("a<i>", its argument text)


def _piece(ev: AnswerEvent) -> Piece | None:
    if isinstance(ev, ContentDelta):
        return "c", ev.text
    if isinstance(ev, ToolCallStart):
        return f"n{ev.index}", ev.name
    if isinstance(ev, ToolCallArgs):
        return f"a{ev.index}", ev.text
    return None


def _add(record: list[Piece], piece: Piece) -> None:
    if record and record[-1][0] == piece[0] and piece[0][0] != "n":
        record[-1] = (piece[0], record[-1][1] + piece[1])
    else:
        record.append(piece)


class StreamSplice:
    """One client's answer, assembled from the event streams of the hosts that ran the turn.

    feed(event) -> the events the client is sent. resume() says the stream so far broke off and
    the turn is running again from its start: the next stream's repeat of what was already sent
    (text, tool calls' names and arguments, the ends of calls, the log probabilities of repeated
    text) is dropped, a call keeps the id it was first sent with, and a repeat that differs raises
    ResumeDiverged (a sampled turn is only repeatable with its seed).
    """

    def __init__(self) -> None:
        self.sent: list[Piece] = []  # what the client has been sent, adjacent pieces of one kind joined
        self._skip: list[Piece] = []  # what the current stream must repeat before it says anything new
        self._ended: set[int] = set()  # tool calls whose end the client has been sent
        self._dropped = False  # the last event was repeated text: its log probabilities are the client's already
        self.resumes = 0

    def resume(self) -> None:
        self._skip = list(self.sent)
        self.resumes += 1

    def feed(self, ev: AnswerEvent) -> list[AnswerEvent]:
        dropped, self._dropped = self._dropped, False
        if isinstance(ev, Logprobs):
            return [] if dropped else [ev]
        if isinstance(ev, ToolCallEnd):
            if self._skip and self._skip[0][0][1:] == str(ev.index):
                raise ResumeDiverged(f"the repeat ended tool call {ev.index} before what the client was sent of it")
            if ev.index in self._ended:
                return []
            self._ended.add(ev.index)
            return [ev]
        if isinstance(ev, Finish) and self._skip:
            raise ResumeDiverged("the repeat finished before reaching what the client was sent")
        piece = _piece(ev)
        if piece is None:  # Finish, Failed
            return [ev]
        kept = self._unrepeated(piece)
        if kept is None:
            self._dropped = isinstance(ev, ContentDelta)
            return []
        if kept[1] or kept[0][0] == "n":
            _add(self.sent, kept)
        if kept == piece:
            return [ev]
        return [ContentDelta(kept[1]) if isinstance(ev, ContentDelta) else ToolCallArgs(int(kept[0][1:]), kept[1])]

    def _unrepeated(self, piece: Piece) -> Piece | None:
        """The piece past the repeat of what was sent (None: all repeat); raises ResumeDiverged where the repeat differs."""
        kind, text = piece
        if not self._skip:
            return piece
        if not text and kind[0] != "n":
            return None  # says nothing, so repeats nothing
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
        return (kind, text) if text else None
