"""One turn's path through the mesh, from the node the client called to the node that runs it.

`TurnPath.serve` is the only way a turn runs, and it hands back one `Answer` (node.mesh.answer):
the turn's headers and its answer events, wherever it ran. On the entry node (the one the
client called) an `EntryTurn` places the turn: here, or forwarded to a peer, whose answer is
read into events (node.mesh.forward). A peer that fails before answering is routed around; one
that dies mid-stream is replaced by a survivor whose events are spliced on (StreamSplice), so
the client sees one answer. On the node that runs it, a `HostTurn` brings the engine up to the
best cache the host has, runs the turn, classifies the handoff, records it, and replicates the
session to the host placement predicts next. A turn a peer forwarded here (peer-authenticated
headers) skips placement.

API routes parse requests and render answer events; everything in between is here.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, cast

import httpx
import numpy as np

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.engine.engine import (
    GenerateRequest,
    TextDelta,
    TurnBegin,
    TurnDone,
    TurnStats,
)
from kvmesh.node.engine.sampling import MIN_TEMPERATURE
from kvmesh.node.errors import KVMeshError, Overloaded
from kvmesh.node.kvshare.service import ReuseExplained
from kvmesh.node.mesh.admission import Refusal
from kvmesh.node.mesh.answer import Answer, AnswerEvent, Failed, ParserFactory, listed, local_events, no_parser
from kvmesh.node.mesh.auth import PEER_HEADER, check_peer_token
from kvmesh.node.mesh.forward import (
    HopChunks,
    PeerAnswer,
    PeerSilent,
    PeerUnavailable,
    ResumeDiverged,
    StreamSplice,
    open_turn,
    passed_headers,
    read_whole,
    watched,
    whole_events,
)
from kvmesh.node.mesh.mesh import Mesh
from kvmesh.node.mesh.placement import Decision
from kvmesh.node.mesh.sessions import HandoffRecord
from kvmesh.node.mesh.threads import Opening, Threads
from kvmesh.node.protocol import (
    Event,
    Handoff,
    HandoffClass,
    TurnFinished,
    TurnStarted,
    classify,
    session_from_header,
    session_header,
)

log = logging.getLogger("kvmesh.mesh.turn")

CHAT_PATH = "/v1/chat/completions"
CLIENT_KEY_HEADERS = ("authorization", "x-api-key")  # a client's API key (node.api.clientauth)

# What an entry node tells the peer it forwards a turn to (trusted only with the mesh secret).
FORWARDED, PREV_HOST, PREDICTED, TURN_SEQ, SEED, SOURCE, GROUP = (
    "X-Kvmesh-Forwarded", "X-Kvmesh-Prev-Host", "X-Kvmesh-Predicted-Reuse", "X-Kvmesh-Turn-Seq", "X-Kvmesh-Seed",
    "X-Kvmesh-Session-Source", "X-Kvmesh-Session-Group")
BEST_HELD = "X-Kvmesh-Best-Held"  # the most of the session one host held as placement chose
OPENING = "X-Kvmesh-Thread-Opening"  # node.mesh.threads' signature of the turn's conversation


@dataclass(frozen=True)
class Placed:
    """What placement knew of a turn it put on a host: where the session's last turn ran, how much of
    the prompt it predicted that host reuses, and the most of the session one host held (None: not said)."""

    prev_host: str | None = None
    predicted: int | None = None
    best_held: int | None = None


def _count(header: str) -> int | None:
    return int(header) if header.isdigit() else None


class TurnReplicas(Protocol):
    """What a turn asks of kv_share (KVShare satisfies it)."""

    async def ensure_imported(self, session: str, prompt: np.ndarray) -> int: ...

    def explain(self, session: str, prompt: np.ndarray, reused: int, predicted: int | None,
                best_held: int | None = None) -> ReuseExplained: ...

    def worth_replicating(self, session: str) -> bool: ...

    def after_turn(self, session: str, target: str | None, turn_s: float) -> None: ...


class TurnPath:
    """What a turn's path needs on this node, and the one entry to it (`serve`)."""

    def __init__(self, name: str, engine: EngineAPI, mesh: Mesh, replicas: TurnReplicas, threads: Threads, *,
                 publish: Callable[[Event], object], forward_timeout_s: float, on_resumed: Callable[[], None]):
        """`threads` names each turn's conversation (node.mesh.threads); `on_resumed` counts streams
        continued on another host after theirs stopped."""
        self.name, self.engine, self.mesh, self.replicas = name, engine, mesh, replicas
        self.threads = threads
        self.publish, self.forward_timeout_s, self.on_resumed = publish, forward_timeout_s, on_resumed

    async def serve(self, req: GenerateRequest, headers: Mapping[str, str], hop_body: Callable[[], bytes], *, stream: bool,
                    new_parser: ParserFactory = no_parser, source: str = "digest", path: str = CHAT_PATH,
                    opening: Opening | None = None) -> Answer:
        """Run the client's turn where it belongs and hand back its answer, here or on a peer; errors
        before its first byte are raised (the engine's own, or a peer's as AnswerError).

        hop_body makes what a peer would run, POSTed to its `path` (made only if the turn is forwarded,
        once): chat completions (the mesh's hop format, whatever chat dialect the client spoke) or
        legacy completions (a raw prompt); `new_parser` finds tool calls in a turn run here;
        `source` is what named the session (node.api.sessionid), `opening` which of its conversations
        this is: the entry turns the client's session id into the conversation's key here, and a
        forwarded turn arrives keyed already (its group in a header)."""
        forwarded = self._forwarded(req, headers)
        if forwarded is not None:
            placed, seq = forwarded
            group = session_from_header(headers[GROUP]) if headers.get(GROUP) else req.session
            run = await self.run_here(req, placed, seq, headers.get(SOURCE, "")[:64] or source, group,
                                      headers.get(OPENING, "")[:200])
            return run.answer(new_parser)
        group, looked_up = req.session, False
        if opening is not None and not self.threads.knows(group) and self.mesh.needs_lookup(group):
            # New to this entry: which of its conversations is the main one, if another entry saw it open.
            await self.mesh.refresh(group)
            looked_up = True
        req.session = self.threads.key(group, opening, self.mesh.conversations_of(group))
        # Without a mesh secret peers cannot vouch for the client: its API key goes along.
        keys = {k: headers[k] for k in CLIENT_KEY_HEADERS if k in headers}
        turn = EntryTurn(self, req, hop_body, stream, new_parser, source, keys, path, group,
                         self.threads.signature(group, req.session))
        turn.looked_up = looked_up and req.session == group
        return await turn.start()

    def _forwarded(self, req: GenerateRequest, headers: Mapping[str, str]) -> tuple[Placed, int] | None:
        """(what placement knew, turn sequence) of a turn a peer placed here, or None.
        Only a caller holding the mesh secret is a peer; anyone else's turn is placed anew."""
        if not headers.get(FORWARDED) or not check_peer_token(headers.get(PEER_HEADER), self.mesh.secrets):
            return None
        placed = Placed(headers.get(PREV_HOST) or None, _count(headers.get(PREDICTED, "")),
                        _count(headers.get(BEST_HELD, "")))
        seq = _count(headers.get(TURN_SEQ, ""))
        if seq is None:
            seq = self.mesh.next_seq(req.session)
        if req.seed is None and headers.get(SEED, "").lstrip("-").isdigit():
            req.seed = int(headers[SEED])
        return placed, seq

    async def run_here(self, req: GenerateRequest, placed: Placed, seq: int, source: str = "digest", group: str = "",
                       opening: str = "") -> HostTurn:
        """Start the turn here (HostTurn.start): admitted, brought up to the best cache this host has, run
        to its reused prefix. The engine validates the turn as it admits it: its refusal is raised here,
        before any byte is sent."""
        run = HostTurn(self, req, placed, seq, source, group or req.session, opening)
        await run.start()
        self.mesh.note_routed(req.session, self.name, seq)
        return run


class HostTurn:
    """A turn running on this host: the engine's event stream plus the bookkeeping around it."""

    def __init__(self, path: TurnPath, req: GenerateRequest, placed: Placed, seq: int, source: str = "digest",
                 group: str = "", opening: str = ""):
        self.path, self.req, self.placed, self.seq = path, req, placed, seq
        self.source, self.group, self.opening = source, group or req.session, opening
        self.events: AsyncGenerator[TurnBegin | TextDelta | TurnDone, None]  # the engine's run, from `start`
        self.begin: TurnStats | None = None
        self.handoff_class: HandoffClass | None = None

    def answer(self, new_parser: ParserFactory) -> Answer:
        """The turn's answer: what it tells the client about itself (peers pass these headers back
        through the entry), and its events."""
        b = self.begin
        prompt, cached = (b.prompt_tokens, b.cached_tokens) if b else (0, 0)
        headers = {"X-Kvmesh-Host": self.path.name, "X-Session-Id": session_header(self.req.session),
                   "X-Kvmesh-Handoff": self.handoff_class or "none", "X-Kvmesh-Prompt-Tokens": str(prompt),
                   "X-Kvmesh-Cached-Tokens": str(cached)}
        return Answer(headers, prompt, cached, local_events(self.stream(), new_parser))

    async def start(self) -> None:
        """Admit the turn (its session's lock, then a slot), bring the engine up to the best cache this host
        holds (kv_share imports a stored replica: holding the slot, nothing can evict it in between), then run
        it to its reused prefix, so errors surface before any byte is sent."""
        p, req = self.path, self.req
        admitted = await p.engine.admit(req)
        try:
            await p.replicas.ensure_imported(req.session, np.asarray(req.prompt, dtype=np.int32))
        except Exception:  # an optimisation failed: the turn runs with what the engine holds
            log.exception("import before the turn of %s failed; running without it", req.session)
        except BaseException:
            admitted.release()
            raise
        self.events = cast(AsyncGenerator[TurnBegin | TextDelta | TurnDone, None], p.engine.run(admitted))
        ev = await anext(self.events)
        assert isinstance(ev, TurnBegin)
        self.begin = ev.stats
        p.publish(TurnStarted(session=self.req.session, host=p.name, prompt_tokens=ev.stats.prompt_tokens,
                              cached_tokens=ev.stats.cached_tokens, turn_seq=self.seq))
        if self.placed.prev_host and self.placed.prev_host != p.name:
            self.handoff_class = classify(ev.stats.cached_tokens / max(1, ev.stats.prompt_tokens))

    async def stream(self) -> AsyncGenerator[TextDelta | TurnDone, None]:
        """The turn's text and its end; a turn that does not reach its end is published as failed."""
        ok = False
        try:
            async for ev in self.events:
                if isinstance(ev, TurnDone):
                    ok = True
                    try:
                        self._finished(ev.stats)
                    except Exception:  # bookkeeping must never fail a user's turn
                        log.exception("after-turn bookkeeping of %s failed", self.req.session)
                if not isinstance(ev, TurnBegin):
                    yield ev
        finally:
            if not ok:
                await self.events.aclose()
                s = self.begin
                if s is not None:
                    self.path.publish(TurnFinished(session=s.session, host=self.path.name, prompt_tokens=s.prompt_tokens,
                                                   cached_tokens=s.cached_tokens, completion_tokens=s.completion_tokens,
                                                   ttft_s=s.ttft_s, total_s=s.total_s, ok=False, turn_seq=self.seq))

    def _finished(self, stats: TurnStats) -> None:
        p, req = self.path, self.req
        p.publish(TurnFinished(session=req.session, host=p.name, prompt_tokens=stats.prompt_tokens,
                               cached_tokens=stats.cached_tokens, completion_tokens=stats.completion_tokens,
                               ttft_s=round(stats.ttft_s, 4), total_s=round(stats.total_s, 4), turn_seq=self.seq))
        handoff = self._handoff(stats)
        p.mesh.book.turn_served(req.session, stats.prompt_tokens, handoff, self.seq, self.source, self.group, self.opening)
        p.mesh.known_threads.heard(self.group or req.session, req.session, self.opening)
        self._replicate(stats.total_s)

    def _handoff(self, stats: TurnStats) -> HandoffRecord | None:
        """Publish the handoff this turn was, if it moved here, with why it reused less than predicted."""
        p, req, src = self.path, self.req, self.placed.prev_host
        if self.handoff_class is None or src is None:
            return None
        cls = classify(stats.cached_tokens / max(1, stats.prompt_tokens))
        prompt = np.asarray(req.prompt, dtype=np.int32)
        why = p.replicas.explain(req.session, prompt, stats.cached_tokens, self.placed.predicted, self.placed.best_held)
        # Where the prompt stopped matching: for a handoff that was not warm, or one that diverged.
        mismatch_tok = why.mismatch_token if cls != "warm" or why.shortfall == "prompt_diverged" else None
        msg_idx = None
        if mismatch_tok is not None:
            starts = p.engine.tokenizer.message_starts(np.asarray(req.prompt))
            msg_idx = int(np.searchsorted(starts, mismatch_tok, side="right")) - 1
        if why.shortfall != "none":
            log.info("handoff of %s %s->%s reused %d of %d predicted: %s", req.session, src, p.name,
                     stats.cached_tokens, self.placed.predicted or 0, why.shortfall)
        stale = why.stale_state and cls == "cold"
        p.publish(Handoff(session=req.session, src=src, dst=p.name, cls=cls,
                          prompt_tokens=stats.prompt_tokens, reused_tokens=stats.cached_tokens,
                          predicted_reused_tokens=self.placed.predicted, replica_age_s=why.replica_age_s,
                          mismatch_token=mismatch_tok, mismatch_message=msg_idx, stale_state=stale,
                          shortfall=why.shortfall, inflight_landed_tokens=why.inflight_landed,
                          inflight_offered_tokens=why.inflight_offered, refused_reason=why.refused_reason,
                          evicted_from=why.evicted_from, turn_seq=self.seq))
        return HandoffRecord(src, cls, stale, why.shortfall)

    def _replicate(self, turn_s: float) -> None:
        """Push the session to the host it would move to next: placement decides, here where the turn ended
        (under a baseline mesh.policy, nowhere)."""
        p, session = self.path, self.req.session
        target = None
        if p.mesh.replicates and p.replicas.worth_replicating(session):
            target = p.mesh.push_target(session)
        p.replicas.after_turn(session, target, turn_s)


def _peer_answer(headers: dict[str, str], events: AsyncIterator[AnswerEvent]) -> Answer:
    """A peer's answer, with the prompt's token counts it told the client in its headers."""
    def count(name: str) -> int:
        value = headers.get(name, "")
        return int(value) if value.isdigit() else 0
    return Answer(headers, count("x-kvmesh-prompt-tokens"), count("x-kvmesh-cached-tokens"), events)


@dataclass
class _There:
    """Placement chose a peer, whose streamed answer is open in resp."""

    host: str
    resp: httpx.Response


class EntryTurn:
    """What the entry node knows of one client turn: enough to place it, and to place it again."""

    def __init__(self, path: TurnPath, req: GenerateRequest, hop_body: Callable[[], bytes], stream: bool,
                 new_parser: ParserFactory, source: str, client_keys: dict[str, str], hop_path: str, group: str = "", opening: str = ""):
        if req.seed is None and req.temperature >= MIN_TEMPERATURE:
            # The entry picks the seed, so a turn run again elsewhere samples the same answer.
            req.seed = secrets.randbits(63)
        self.path, self.req, self.session, self.group = path, req, req.session, group or req.session
        self.opening = opening  # the conversation's signature within its group (node.mesh.threads)
        self.looked_up = False  # the session was just looked up across the mesh: placing it need not again
        self.stream, self.new_parser, self.source = stream, new_parser, source
        self._hop_body, self._body = hop_body, b""
        self.client_keys, self.hop_path = client_keys, hop_path
        self.seq = path.mesh.next_seq(req.session)
        self.unavailable: set[str] = set()
        self.admitted = False  # once a stream has started, placing it again never refuses it

    async def start(self) -> Answer:
        placed = await self.place()
        if isinstance(placed, Placed):
            run = await self.path.run_here(self.req, placed, self.seq, self.source,
                                           self.group, self.opening)
            return run.answer(self.new_parser)
        if isinstance(placed, _There):
            return _peer_answer(passed_headers(placed.resp), self.relay(placed))
        return _peer_answer(placed.headers, listed(whole_events(placed.status, placed.body)))

    async def place(self) -> Placed | _There | PeerAnswer:
        """Place the turn: here, or forwarded to a peer. A peer that fails before answering is
        routed around (nothing the client sent is lost); a non-streamed answer comes back whole."""
        mesh, session = self.path.mesh, self.session
        if not self.looked_up and mesh.needs_lookup(session):
            await mesh.refresh(session)
            self.seq = mesh.next_seq(session)  # numbered from what the lookup found
        while True:
            d = mesh.decide(session, len(self.req.prompt), unavailable=frozenset(self.unavailable),
                            admit_turn=not self.admitted, group=self.group)
            if isinstance(d, Refusal):
                raise Overloaded(d.message(), retry_after_s=d.retry_after_s)
            if d is None or d.host == self.path.name:
                # No peer can take it (or this host is best): run here, even while draining.
                if d is None:
                    return Placed(mesh.last_host(session))
                return Placed(d.prev_host, d.predicted_reused, d.best_held)
            try:
                return await self._forward(d)
            except PeerUnavailable as e:
                log.warning("turn of %s could not go to %s (%s); placing it again", session, d.host, e.reason)
                if not e.overloaded:
                    mesh.peers.mark_down(d.host, e.reason)
                self.unavailable.add(d.host)

    async def _forward(self, d: Decision) -> _There | PeerAnswer:
        """Send the turn to the peer placement chose (PeerUnavailable if it cannot take it)."""
        mesh = self.path.mesh
        peer = mesh.peers.peers[d.host]
        headers = {"content-type": "application/json", "X-Session-Id": session_header(self.session), FORWARDED: "1",
                   PREDICTED: str(d.predicted_reused), BEST_HELD: str(d.best_held), TURN_SEQ: str(self.seq), SOURCE: self.source,
                   GROUP: session_header(self.group), OPENING: self.opening}
        headers |= self.client_keys
        if self.req.seed is not None:
            headers[SEED] = str(self.req.seed)
        if d.prev_host:
            headers[PREV_HOST] = d.prev_host
        if mesh.peer_token:
            headers[PEER_HEADER] = mesh.peer_token
        todo = max(0, len(self.req.prompt) - d.predicted_reused)  # what it will prefill there
        peer.pending += 1
        peer.pending_tokens += todo
        try:
            self._body = self._body or self._hop_body()
            resp = await open_turn(mesh.peers.client, d.host, peer.cfg.api + self.hop_path, self._body, headers,
                                   timeout_s=self.path.forward_timeout_s)
            whole = None
            if not self.stream or resp.status_code != 200:
                whole = await read_whole(d.host, resp)
        finally:
            peer.pending -= 1
            peer.pending_tokens -= todo
        mesh.note_routed(self.session, d.host, self.seq)
        return whole if whole is not None else _There(d.host, resp)

    async def relay(self, first: _There) -> AsyncIterator[AnswerEvent]:
        """The peer's answer events, passed on as they come. If the serving peer dies (or stops being
        heard from) before the answer is whole, the turn is placed again and the new host's answer
        continues where the client's stopped (StreamSplice checks the repeat is identical)."""
        splice, at = StreamSplice(), first
        peers = self.path.mesh.peers
        try:
            while True:
                reason, hop = "the stream ended before [DONE]", HopChunks()
                try:
                    async for chunk in watched(at.resp, peers.peers[at.host], peers.stale_after_s):
                        for ev in hop.feed(chunk):
                            for out in splice.feed(ev):
                                yield out
                        if hop.done:
                            return
                except httpx.HTTPError as e:
                    reason = f"{type(e).__name__}: {e}"
                except PeerSilent as e:
                    reason = str(e)
                finally:
                    await at.resp.aclose()
                if hop.finished:  # only the trailer was lost: the answer is whole
                    for ev in hop.end():
                        for out in splice.feed(ev):
                            yield out
                    return
                placed = await self._place_again(at.host, reason, splice)
                if isinstance(placed, PeerAnswer):  # an error status from the new host
                    msg = placed.body[:300].decode(errors="replace")
                    yield Failed(f"the turn could not be run again elsewhere: {msg}", "server_error", "peer_lost")
                    return
                if isinstance(placed, Placed):
                    run = await self.path.run_here(self.req, placed, self.seq, self.source,
                                                   self.group, self.opening)
                    async for ev in run.answer(self.new_parser).events:
                        for out in splice.feed(ev):
                            yield out
                    return
                at = placed
        except ResumeDiverged as e:
            log.warning("turn of %s could not be resumed identically: %s", self.session, e)
            yield Failed(f"the serving host stopped mid-answer and the turn did not repeat identically ({e})",
                         "server_error", "peer_lost")
        except KVMeshError as e:
            yield Failed(str(e), e.type, e.code)

    async def _place_again(self, lost: str, reason: str, splice: StreamSplice) -> Placed | _There | PeerAnswer:
        """The host serving the stream stopped mid-answer: route around it and run the turn again."""
        log.warning("turn of %s: %s stopped mid-answer (%s); running it again elsewhere", self.session, lost, reason)
        self.path.mesh.peers.mark_down(lost, reason)
        self.path.on_resumed()
        self.unavailable.add(lost)
        splice.resume()
        self.admitted = True
        return await self.place()
