"""Why a handoff reused what it did: what this host held of a session as its turn began, the latest
refusal of its replica here, and its evictions here (`HandoffNotes`, each LRU-capped at MAX_EXPLAINED),
read back by `explain` once the turn has replaced the engine's cache. It also counts the replica bytes
received that no turn used before the store dropped them (`wasted_bytes`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.kvshare.common import MAX_UNUSED_TRACKED, _remember
from kvmesh.node.kvshare.landing import _Inbound
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.protocol import ShortfallReason


@dataclass(frozen=True)
class _Before:
    """What this host held of a session when a turn of it started (after any wait and import)."""

    mismatch: int | None  # where the prompt stopped matching the best cache/replica held (its end if it matched)
    diverged: bool  # ...because a token differed (not because what was held ended there)
    inflight: tuple[int, int] | None  # (tokens landed, tokens offered) of a replica still landing
    store_usable: int = 0  # tokens of the prompt the store's replica matched (whole blocks) as the turn began


@dataclass(frozen=True)
class ReuseExplained:
    """Why a handoff reused what it did (kv_share's answer to `explain`)."""

    shortfall: ShortfallReason = "none"
    mismatch_token: int | None = None  # where the prompt stopped matching the best cache held before the turn
    stale_state: bool = False  # the store held >= 90% of the prompt, yet < 90% was reused
    replica_age_s: float | None = None
    inflight_landed: int | None = None
    inflight_offered: int | None = None
    refused_reason: str | None = None
    evicted_from: Literal["engine", "store"] | None = None


def store_match_blocks(store: ReplicaStore, engine: EngineAPI, session: str, prompt: np.ndarray) -> int:
    """Whole blocks of the stored replica that match the prompt's prefix."""
    m = store.manifest(session)
    e = engine
    if m is None or m.fingerprint != e.fingerprint:
        return 0
    n = min(len(m.tokens), len(prompt))
    diff = np.flatnonzero(m.tokens[:n] != prompt[:n])
    same = int(diff[0]) if len(diff) else n
    return same // e.block_size


class HandoffNotes:
    """What explains a handoff here, noted as it happens. It is given the engine and the store it
    compares a prompt with; the receiver tells it what landed or was refused, the node what was
    evicted, the import path what a turn found and used."""

    def __init__(self, engine: EngineAPI, store: ReplicaStore):
        self.engine = engine
        self.store = store
        self.wasted_bytes = 0
        self._unused: dict[str, int] = {}  # replica bytes received per session, not yet used by a turn
        # To explain a handoff that reused less than predicted (each LRU-capped at MAX_EXPLAINED):
        self._before: dict[str, _Before] = {}  # what was held when the session's last turn here started
        self._refusals: dict[str, str] = {}  # the reason this host refused the session's latest replica
        self._evictions: dict[str, Literal["engine", "store"]] = {}  # evicted here since it last landed or ran

    # ---- told as it happens ------------------------------------------------------

    def landed(self, session: str, received: int) -> None:
        """A replica of the session landed whole here, after `received` bytes on the wire."""
        # A replica of it landed whole: an earlier refusal or eviction no longer explains anything.
        self._refusals.pop(session, None)
        self._evictions.pop(session, None)
        # A delta builds on the replica before it: those bytes stay useful. Replica bytes
        # are wasted only if the store drops them before any turn here used them.
        self._unused[session] = self._unused.get(session, 0) + received
        while len(self._unused) > MAX_UNUSED_TRACKED:  # sessions that ended and never came back
            self.wasted_bytes += self._unused.pop(next(iter(self._unused)))

    def refused(self, session: str, reason: str) -> None:
        _remember(self._refusals, session, reason)

    def store_evicted(self, session: str) -> None:
        self.wasted_bytes += self._unused.pop(session, 0)
        _remember(self._evictions, session, "store")

    def engine_evicted(self, session: str) -> None:
        """The engine dropped the session's resident cache (its LRU, to make room)."""
        _remember(self._evictions, session, "engine")

    def ran_here(self, session: str) -> None:
        """A turn of the session ended here."""
        self._evictions.pop(session, None)  # it ran here: the engine holds it afresh

    def used(self, session: str) -> None:
        """A turn of the session starts here."""
        self._unused.pop(session, None)  # whatever replica is here is now being used

    def note_before(self, session: str, prompt: np.ndarray, ib: _Inbound | None, store_usable: int) -> None:
        """Remember what this host holds of the session as its turn starts (to explain the handoff
        later, once the turn has replaced the engine's cache): where the prompt stops matching the
        largest cache or replica held (the engine's, the store's, or one still landing), and how
        much of a replica still landing is here."""
        m = self.store.manifest(session)
        held = [t for t in (self.engine.session_tokens(session), m.tokens if m is not None else None,
                            ib.offered if ib is not None else None) if t is not None and len(t)]
        mismatch, diverged = None, False
        if held:
            best = max(held, key=len)
            n = min(len(best), len(prompt))
            diff = np.flatnonzero(best[:n] != prompt[:n])
            mismatch, diverged = (int(diff[0]), True) if len(diff) else (n, False)
        inflight = (ib.landed, ib.tokens) if ib is not None and not ib.arrived.is_set() else None
        _remember(self._before, session, _Before(mismatch, diverged, inflight, store_usable))

    # ---- read back ----------------------------------------------------------------

    def explain(self, session: str, prompt: np.ndarray, reused: int, predicted: int | None,
                best_held: int | None = None) -> ReuseExplained:
        """Why a turn of `session` that moved here reused `reused` tokens when placement predicted
        `predicted`: one reason, checked in order. The prompt diverged from what was held before
        the predicted point; else a replica was still landing when the turn ran; else this host
        refused the session's latest replica; else it evicted the session; else unexplained. A model
        that keeps no replicas (node.engine.live) says so first. A turn that met the prediction and was
        still not warm says why the prediction was short, from `best_held`, the most of the session
        any host held when it was placed: new_input if even that was not a warm share of the prompt,
        else replica_behind (None: placement did not say, and the reason stays none)."""
        e = self.engine
        before = self._before.pop(session, None)
        m = self.store.manifest(session)
        age = round(time.time() - m.updated, 3) if m is not None else None
        # Stale state: the store held a usable replica when the turn began, and the turn did not use it
        # (what landed during the turn does not count: that is a replica in flight).
        usable = (before.store_usable if before is not None
                  else store_match_blocks(self.store, e, session, prompt) * e.block_size)
        stale = usable >= 0.9 * len(prompt) and reused < 0.9 * len(prompt)
        mismatch = before.mismatch if before is not None else None
        base = ReuseExplained(mismatch_token=mismatch, stale_state=stale, replica_age_s=age)
        if e.inexact_reason is not None and reused < 0.9 * len(prompt):
            return dataclasses.replace(base, shortfall="no_replicas")  # nothing could have come with it
        # Reuse comes in whole blocks: a prediction inside the last block is met by the block before it.
        expected = (predicted or 0) // e.block_size * e.block_size
        if reused >= expected:
            return dataclasses.replace(base, shortfall=_prediction_short(len(prompt), reused, best_held))
        if before is not None and before.diverged and mismatch is not None and mismatch < expected:
            return dataclasses.replace(base, shortfall="prompt_diverged")
        if before is not None and before.inflight is not None:
            landed, offered = before.inflight
            return dataclasses.replace(base, shortfall="replica_in_flight", inflight_landed=landed,
                                       inflight_offered=offered)
        if session in self._refusals:
            return dataclasses.replace(base, shortfall="replica_refused", refused_reason=self._refusals[session])
        if session in self._evictions:
            return dataclasses.replace(base, shortfall="evicted", evicted_from=self._evictions[session])
        return dataclasses.replace(base, shortfall="unexplained")


def _prediction_short(prompt: int, reused: int, best_held: int | None) -> ShortfallReason:
    """Why a handoff that reused what placement predicted was not warm ("none" when it was, or when
    placement did not say what the other hosts held)."""
    if best_held is None or reused >= 0.9 * prompt:
        return "none"
    return "new_input" if min(best_held, prompt) < 0.9 * prompt else "replica_behind"
