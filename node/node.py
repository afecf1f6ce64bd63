"""The node agent: one host's engine, store, kv_share, mesh view and event hub.

`Node.chat` is the one path every turn takes: place it (here or on a peer),
make sure the engine holds what the store holds (asked of the engine, never
remembered), run it, classify the handoff, then replicate to the host the
session would move to next.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

import numpy as np
import psutil
import torch

from kvmesh.node.config import NodeConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest, TextDelta, TurnBegin, TurnDone, TurnStats
from kvmesh.node.errors import InvalidRequest
from kvmesh.node.events import EventHub
from kvmesh.node.kvshare.service import KVShare
from kvmesh.node.mesh.auth import PEER_HEADER
from kvmesh.node.mesh.mesh import Mesh
from kvmesh.node.metrics import Metrics
from kvmesh.node.protocol import (
    ActionResult,
    DrainCompleted,
    DrainProgress,
    DrainStarted,
    Handoff,
    HostInfo,
    HostStatus,
    LinkInfo,
    MigrateCompleted,
    MigrateStarted,
    ReplicaEvicted,
    TurnFinished,
    TurnStarted,
    Undrained,
    classify,
    is_valid_session_id,
)

log = logging.getLogger("kvmesh.node")


def derive_session_id(header: str | None, user: str | None, messages: list[dict[str, Any]]) -> str:
    """X-Session-Id header, else the request's `user`, else a hash of the first system+user message."""
    if header is not None:
        if not is_valid_session_id(header):
            raise InvalidRequest(
                "X-Session-Id must be 1-128 characters of A-Z a-z 0-9 . _ : @ - (and not '.' or '..')",
                param="X-Session-Id",
            )
        return header
    if user:
        # `user` is free text in the OpenAI API: used as is when it is a safe id, hashed otherwise.
        return user if is_valid_session_id(user) else "user-" + hashlib.sha256(user.encode()).hexdigest()[:20]
    first = [m for m in messages if m.get("role") in ("system", "developer")][:1]
    first += [m for m in messages if m.get("role") == "user"][:1]
    blob = repr([(m.get("role"), m.get("content")) for m in first]).encode()
    return "conv-" + hashlib.sha256(blob).hexdigest()[:20]


class TurnRun:
    """A turn running on this host: the engine's event stream plus the bookkeeping around it."""

    def __init__(self, node: Node, req: GenerateRequest, prev_host: str | None, predicted: int | None,
                 messages: list[dict[str, Any]], seq: int):
        self.node, self.req, self.prev_host, self.predicted, self.messages = node, req, prev_host, predicted, messages
        self.seq = seq
        self.events = cast(AsyncGenerator[TurnBegin | TextDelta | TurnDone, None], node.engine.generate(req))
        self.begin: TurnStats | None = None
        self.handoff_class: str | None = None

    async def start(self) -> None:
        """Wait for a slot and learn the reused prefix (so errors surface before any byte is sent)."""
        ev = await anext(self.events)
        assert isinstance(ev, TurnBegin)
        self.begin = ev.stats
        n = self.node
        n.hub.publish(TurnStarted(session=self.req.session, host=n.name, prompt_tokens=ev.stats.prompt_tokens,
                                  cached_tokens=ev.stats.cached_tokens, turn_seq=self.seq))
        if self.prev_host and self.prev_host != n.name:
            self.handoff_class = classify(ev.stats.cached_tokens / max(1, ev.stats.prompt_tokens))

    async def stream(self) -> AsyncGenerator[TextDelta | TurnDone, None]:
        ok = False
        try:
            async for ev in self.events:
                if isinstance(ev, TurnDone):
                    ok = True
                    try:
                        self.node._turn_done(self, ev.stats)
                    except Exception:  # noqa: BLE001 - bookkeeping must never fail a user's turn
                        log.exception("after-turn bookkeeping of %s failed", self.req.session)
                if not isinstance(ev, TurnBegin):
                    yield ev
        finally:
            if not ok:
                await self.events.aclose()
                s = self.begin
                if s is not None:
                    self.node.hub.publish(TurnFinished(session=s.session, host=self.node.name, prompt_tokens=s.prompt_tokens,
                                                       cached_tokens=s.cached_tokens, completion_tokens=s.completion_tokens,
                                                       ttft_s=s.ttft_s, total_s=s.total_s, ok=False,
                                                       turn_seq=self.seq))


class Node:
    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.name = cfg.name
        self.started = time.time()  # wall time, reported as such
        self._started_mono = time.monotonic()
        self.hub = EventHub(cfg.name)
        self.engine = Engine(cfg.engine)
        self.metrics = Metrics(cfg.name)
        self.hub.on_publish(self.metrics.on_event)
        self.kvshare = KVShare(self)
        self.mesh = Mesh(self)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.engine.on_evict = self._engine_evicted
        log.info(
            "node %s: engine %s, %d slots, %d KV blocks of %d tokens (%.2f MiB each), fingerprint %s",
            self.name, cfg.engine.kind, cfg.engine.slots, self.engine.pool.num_blocks, self.engine.block_size,
            self.engine.block_bytes / 2**20, self.engine.fingerprint[:12],
        )

    async def start(self) -> None:
        await self.kvshare.start()
        loop = asyncio.get_running_loop()

        def store_evicted(session: str) -> None:  # called on the store's thread
            loop.call_soon_threadsafe(self.kvshare.store_evicted, session)
            loop.call_soon_threadsafe(self.hub.publish, ReplicaEvicted(session=session, host=self.name, where="store"))

        self.kvshare.store.on_evict = store_evicted
        await self.mesh.start()
        self._spawn(self._status_loop())

    def _engine_evicted(self, session: str) -> None:
        self.hub.publish(ReplicaEvicted(session=session, host=self.name, where="engine"))

    async def _status_loop(self, every_s: float = 1.0) -> None:
        """Periodic host status: one coalesced event a second (not kept in the replay ring)."""
        while True:
            await asyncio.sleep(every_s)
            self.hub.publish(HostStatus(host=self.host_info()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.mesh.stop()
        await self.kvshare.stop()
        self.engine.close()

    # ---- turns ---------------------------------------------------------------

    async def prepare_turn(self, req: GenerateRequest, prev_host: str | None, predicted: int | None,
                           messages: list[dict[str, Any]], seq: int) -> TurnRun:
        """Start the turn; once it holds its slot, the engine is brought up to the best cache
        this host has (a stored replica imported), so no eviction can slip in between."""
        self.engine.validate(req)
        prompt = np.asarray(req.prompt, dtype=np.int32)
        req.prepare = lambda: self.kvshare.ensure_imported(req.session, prompt)
        run = TurnRun(self, req, prev_host, predicted, messages, seq)
        await run.start()
        return run

    def _turn_done(self, run: TurnRun, stats: TurnStats) -> None:
        req = run.req
        self.hub.publish(TurnFinished(session=req.session, host=self.name, prompt_tokens=stats.prompt_tokens,
                                      cached_tokens=stats.cached_tokens, completion_tokens=stats.completion_tokens,
                                      ttft_s=round(stats.ttft_s, 4), total_s=round(stats.total_s, 4), turn_seq=run.seq))
        handoff = None
        if run.handoff_class is not None and run.prev_host is not None:
            cls = classify(stats.cached_tokens / max(1, stats.prompt_tokens))
            mismatch_tok, stale, age = self.kvshare.explain_reuse(req.session, np.asarray(req.prompt, dtype=np.int32), stats.cached_tokens)
            msg_idx = None
            if mismatch_tok is not None:
                starts = self.engine.tokenizer.message_starts(np.asarray(req.prompt))
                msg_idx = int(np.searchsorted(starts, mismatch_tok, side="right")) - 1
            self.hub.publish(Handoff(session=req.session, src=run.prev_host, dst=self.name, cls=cls,
                                     prompt_tokens=stats.prompt_tokens, reused_tokens=stats.cached_tokens,
                                     predicted_reused_tokens=run.predicted, replica_age_s=age,
                                     mismatch_token=mismatch_tok if cls != "warm" else None,
                                     mismatch_message=msg_idx if cls != "warm" else None,
                                     stale_state=stale and cls == "cold", turn_seq=run.seq))
            handoff = (run.prev_host, cls, stale)
        self.mesh.book.turn_served(req.session, stats.prompt_tokens, handoff, run.seq)  # type: ignore[arg-type]
        self.kvshare.after_turn(req.session)

    # ---- facts for the mesh view --------------------------------------------

    def store_tokens(self, session: str) -> tuple[int, float | None]:
        return self.kvshare.store_tokens(session)

    def store_sessions(self) -> list[str]:
        return self.kvshare.store_sessions()

    def inbound(self, session: str) -> tuple[int, float | None]:
        return self.kvshare.inbound(session)

    def inflight_to(self, session: str) -> str | None:
        return self.kvshare.inflight_to(session)

    def import_bps(self) -> float:
        return self.kvshare.import_bps()

    def wasted_replica_bytes(self) -> int:
        return self.kvshare.wasted_bytes

    def links(self) -> list[LinkInfo]:
        out = {li.dst: li for li in self.kvshare.links_out()}
        for src, lc in self.mesh.book.links_in.items():
            out[f"<-{src}"] = LinkInfo(src=src, dst=self.name, warm=lc.warm, partial=lc.partial, cold=lc.cold)
        return list(out.values())

    def host_info(self) -> HostInfo:
        e = self.engine
        vm = psutil.virtual_memory()
        gpu_used = gpu_total = None
        if e.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(e.device)
            gpu_used, gpu_total = total - free, total
        in_bps, out_bps = self.kvshare.rates()
        return HostInfo(
            name=self.name, api=self.api_url, reachable=True, draining=self.mesh.draining, slots=e.slots.slots,
            busy=e.slots.busy, queued=e.slots.queued, mem_used_bytes=vm.total - vm.available, mem_total_bytes=vm.total,
            gpu_mem_used_bytes=gpu_used, gpu_mem_total_bytes=gpu_total, kv_cache_bytes=e.pool.num_blocks * e.block_bytes,
            kv_cache_used_bytes=(e.pool.num_blocks - e.blocks.num_free) * e.block_bytes,
            store_bytes=self.kvshare.store_bytes(), kvshare_in_bps=in_bps, kvshare_out_bps=out_bps,
            prefill_tps=e.prefill_rate(), last_seen=time.time(), block_size=e.block_size,
        )

    api_url: str = ""

    def stats(self) -> dict[str, object]:
        m = self.mesh
        return {
            "node": self.name,
            "handoffs": m.book.counters.model_dump(),
            "decision_p50_ms": round(m.decision_ms(0.5), 4),
            "decision_p99_ms": round(m.decision_ms(0.99), 4),
            "decision_cpu_p99_ms": round(m.decision_ms(0.99, cpu=True), 4),
            "decisions": len(m.decision_s),
            "engine": {"turns": self.engine.counters.turns, "prefill_tokens": self.engine.counters.prefill_tokens,
                       "cached_tokens": self.engine.counters.cached_tokens,
                       "evicted_sessions": self.engine.counters.evicted_sessions,
                       "imported_blocks": self.engine.counters.imported_blocks,
                       "prefill_tps": round(self.engine.prefill_rate(), 1)},
            "kvshare": self.kvshare.stats(),
        }

    # ---- operator actions ------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def host_action(self, action: str) -> ActionResult:
        if action == "undrain":
            self.mesh.draining = False
            self.hub.publish(Undrained(host=self.name))
            return ActionResult(ok=True, message=f"{self.name} takes new turns again")
        if action != "drain":
            return ActionResult(ok=False, message=f"unknown action {action!r}")
        if self.mesh.draining:
            return ActionResult(ok=True, message=f"{self.name} is already draining")
        self.mesh.draining = True
        sessions = [s for s in list(self.engine.sessions) if self.mesh.home(s) in (self.name, None)]
        self.hub.publish(DrainStarted(host=self.name, sessions=len(sessions)))
        self._spawn(self._drain(sessions))
        return ActionResult(ok=True, message=f"draining {self.name}: pushing {len(sessions)} sessions to their next hosts")

    async def _drain(self, sessions: list[str]) -> None:
        """Push each resident session to the host it would go to next, so the drain is warm."""
        moved = failed = 0
        for i, s in enumerate(sessions):
            d = self.mesh.predict_next(s)
            ok = False
            if d is not None and d.host != self.name:
                ok = (await self.kvshare.push(s, d.host)).ok
            moved += ok
            failed += not ok
            self.hub.publish(DrainProgress(host=self.name, done=i + 1, total=len(sessions)))
        self.hub.publish(DrainCompleted(host=self.name, moved=moved, failed=failed))

    async def _relay(self, home: str, path: str) -> ActionResult:
        peer = self.mesh.peers.peers[home]
        headers = {PEER_HEADER: self.mesh.peer_token} if self.mesh.peer_token else {}
        try:
            r = await self.mesh.peers.client.post(f"{peer.cfg.api}{path}", headers=headers, timeout=120.0)
            return ActionResult.model_validate_json(r.content)
        except Exception as e:  # noqa: BLE001 - any transport failure reads the same to the operator
            return ActionResult(ok=False, message=f"home host {home} did not answer: {type(e).__name__}")

    async def migrate(self, session: str, target: str, *, relay: bool = True) -> ActionResult:
        """Push the session's replica to target, then make target its home."""
        home = self.mesh.home(session)
        if relay and home is not None and home != self.name:
            return await self._relay(home, f"/v1/peer/sessions/{session}/migrate?target={target}")
        seq = self.mesh.next_seq(session)
        if target == self.name:
            self.mesh.book.adopt(session, seq)
            return ActionResult(ok=True, message=f"{session} is already homed on {target}")
        if self.engine.resident_tokens(session) == 0:
            return ActionResult(ok=False, message=f"{self.name} holds no cache of {session}")
        self.hub.publish(MigrateStarted(session=session, src=self.name, dst=target))
        res = await self.kvshare.push(session, target)
        ok = res.ok
        msg = f"{res.tokens} tokens now on {target}" if ok else f"replica push failed: {res.reason} {res.message}"
        if ok:
            adopt = await self._relay(target, f"/v1/peer/sessions/{session}/adopt?seq={seq}")
            ok = adopt.ok
            if not ok:
                msg = adopt.message
        self.hub.publish(MigrateCompleted(session=session, src=self.name, dst=target, ok=ok, message=msg))
        return ActionResult(ok=ok, message=msg)

    async def replicate_now(self, session: str, *, relay: bool = True) -> ActionResult:
        home = self.mesh.home(session)
        if relay and home is not None and home != self.name:
            return await self._relay(home, f"/v1/peer/sessions/{session}/replicate")
        d = self.mesh.predict_next(session)
        if d is None or d.host == self.name:
            return ActionResult(ok=False, message=f"no other host could take {session} now")
        res = await self.kvshare.push(session, d.host)
        if res.ok:
            return ActionResult(ok=True, message=f"{session}: {res.tokens} tokens on {d.host} ({res.bytes_sent} bytes sent)")
        return ActionResult(ok=False, message=f"{session}: push to {d.host} failed: {res.reason} {res.message}")

    def health(self) -> dict[str, object]:
        s = self.engine.slots
        return {"status": "draining" if self.mesh.draining else "ok", "node": self.name, "model": self.engine.model_name,
                "slots": s.slots, "busy": s.busy, "queued": s.queued, "uptime_s": round(time.monotonic() - self._started_mono, 1)}
