"""The receiver's decisions, made on the event loop (the engine's bookkeeping has one writer): where an
offered replica lands (`on_offer`: into the engine's pool through an `ImportTxn`, or into the store when
the pool has no room), its commit once every byte is in place (`on_complete`), and the undoing of one
that failed (`abort`, `refused`). The receiving thread (`receiver.py`) moves the bytes in between.

`_Inbound` is a replica landing now, as a turn that waits for it sees it: this part owns the map of
them (`Landing.inbound`), the receiving thread fills in each one's progress."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvmesh.node.engine.boundary import EngineAPI, ImportAPI
from kvmesh.node.errors import ImportRefused
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.links import LinkStats
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.protocol import Event, ReplicaReady, ReplicaRefused

log = logging.getLogger("kvmesh.kvshare")


@dataclass
class _Inbound:
    """A replica being received. The loop makes it; the receiving thread writes `landed` and
    `t_first` (plain int/float stores), the loop reads them: no lock, nothing ever blocks on it."""

    src: str
    tokens: int  # tokens the replica carries (whole blocks offered)
    started: float
    eta_s: float  # expected transfer time, estimated when it was offered (from the link's past rate)
    held: int = 0  # tokens of it this host held already (not sent)
    landed: int = 0  # tokens in place so far: `held`, then each verified block as it lands
    t_first: float = 0.0  # monotonic time the first block began to arrive (0: none yet)
    offered: np.ndarray | None = None  # the replica's token ids (to tell a divergent prompt)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # landed whole, or ended

    def rest_s(self, now: float) -> float:
        """Expected seconds until the rest lands: at the rate observed on this transfer once blocks
        have landed, else what is left of the estimate made when it was offered; once that has
        passed with nothing landed, as long again as it has taken so far (a stalled link is not
        waited for beyond what recomputing would cost)."""
        got, t_first = self.landed - self.held, self.t_first
        if got > 0 and 0 < t_first < now:
            return (self.tokens - self.landed) * (now - t_first) / got
        left = self.started + self.eta_s - now
        return left if left > 0 else now - self.started


@dataclass
class _Plan:
    """The receiver's decision on an offer, made on the event loop."""

    refuse: tuple[str, str] | None = None
    first_missing: int = 0
    txn: ImportAPI | None = None  # payloads land in the engine's pool...
    store_only: bool = False  # ...or, when the engine has no room, in the store
    engine_held: int = 0
    store_held: int = 0
    tokens: np.ndarray | None = None
    hashes: list[bytes] = field(default_factory=list)
    inbound: _Inbound | None = None  # its progress, for turns that wait on it


class Landing:
    """The loop's side of receiving. It is given what it uses: the host's name, the engine, the store,
    the stats of its incoming links (by source), a publish function, what to tell when a replica of a
    session landed whole (`on_landed(session, bytes received)`) or was refused (`on_refused(session,
    reason)`), and the store's write-behind for a replica that landed in the pool."""

    def __init__(self, name: str, engine: EngineAPI, store: ReplicaStore, *, inn: dict[str, LinkStats],
                 publish: Callable[[Event], object], on_landed: Callable[[str, int], None],
                 on_refused: Callable[[str, str], None],
                 write_behind: Callable[[str, np.ndarray, list[bytes], int], None]):
        self.name = name
        self.engine = engine
        self.store = store
        self.inn = inn
        self._publish = publish
        self._on_landed = on_landed
        self._on_refused = on_refused
        self._write_behind = write_behind
        self.inbound: dict[str, _Inbound] = {}

    def on_offer(self, ev: wire.OfferReceived) -> _Plan:
        """Decide on the loop: refuse, or the first block to send and where payloads land."""
        e, offer = self.engine, ev.offer
        if offer.fingerprint != e.fingerprint:
            return _Plan(refuse=("fingerprint", "model fingerprint differs from this engine's"))
        if offer.block_size != e.block_size or offer.block_bytes != e.block_bytes:
            return _Plan(refuse=("shape", f"blocks of {offer.block_size} tokens/{offer.block_bytes} bytes; "
                                          f"this engine uses {e.block_size}/{e.block_bytes}"))
        store_held = self.store.held_prefix_blocks(offer.session, offer.fingerprint, ev.hashes)
        try:
            txn = e.begin_import(offer.session, offer.fingerprint, ev.tokens, ev.hashes)
        except ImportRefused as err:
            if err.reason != "no_room":
                return _Plan(refuse=(err.reason, str(err)))
            # Every KV block is held by a running turn: the replica goes to the store only
            # (the slow path: disk on the critical path), to be imported before its next turn.
            # The receiving thread opens the store write (it copies and verifies held blocks).
            ib = self._track_inbound(offer, store_held, ev.tokens)
            return _Plan(store_only=True, first_missing=store_held, store_held=store_held, inbound=ib)
        engine_held = txn.missing[0] if txn.missing else offer.n_blocks
        first = max(engine_held, store_held)
        ib = self._track_inbound(offer, first, ev.tokens)
        return _Plan(txn=txn, first_missing=first, engine_held=engine_held, store_held=store_held, tokens=ev.tokens,
                     hashes=ev.hashes, inbound=ib)

    def _track_inbound(self, offer: wire.Offer, first: int, tokens: np.ndarray) -> _Inbound:
        st = self.inn.get(offer.sender)
        rate = st.bytes / st.seconds if st is not None and st.seconds > 0 else 1e9  # measured on this link
        held = first * offer.block_size
        ib = self.inbound[offer.session] = _Inbound(
            offer.sender, offer.num_tokens, time.monotonic(), eta_s=(offer.n_blocks - first) * offer.block_bytes / rate,
            held=held, landed=held, offered=tokens)
        return ib

    def on_complete(self, offer: wire.Offer, plan: _Plan, received: int, last_byte: float, t_first: float,
                    committed: int | None, snapshot_bytes: int = 0) -> int:
        """END verified and every byte in place (`_land`): commit the import, the replica is ready.
        `committed`: the tokens the store committed when the replica went to the store only; `snapshot_bytes`:
        the state snapshot's that came with the blocks (kept already: the engine's snapshots, or the store)."""
        txn = plan.txn
        if txn is not None:
            tokens = txn.commit()
        else:
            assert committed is not None
            tokens = committed
        ready = time.monotonic()
        lag = ready - last_byte
        st = self.inn[offer.sender]
        st.add(received, max(1e-9, last_byte - t_first))
        st.ready_lag_s.append(lag)
        if snapshot_bytes:
            st.snapshots += 1
            st.snapshot_bytes += snapshot_bytes
        ib = self.inbound.pop(offer.session, None)
        if ib is not None:
            ib.landed = ib.tokens
            ib.arrived.set()
        self._on_landed(offer.session, received)
        self._publish(ReplicaReady(session=offer.session, src=offer.sender, dst=self.name, tokens=tokens,
                                   bytes=received, lag_s=round(lag, 5), imported=txn is not None,
                                   recv_s=round(last_byte - t_first, 5),
                                   blocks=offer.n_blocks - plan.first_missing, snapshot_bytes=snapshot_bytes))
        if txn is not None and plan.tokens is not None:
            self._write_behind(offer.session, plan.tokens, plan.hashes, plan.store_held)
        return tokens

    def abort(self, offer: wire.Offer | None, txn: ImportAPI) -> None:
        txn.abort()
        if offer is not None:
            ib = self.inbound.pop(offer.session, None)
            if ib is not None:
                ib.arrived.set()

    def refused(self, offer: wire.Offer | None, src: str, reason: str, message: str) -> None:
        self.inn[src].refused[reason] += 1
        session = offer.session if offer is not None else "?"
        if offer is not None:
            self._on_refused(offer.session, reason)
            ib = self.inbound.pop(offer.session, None)
            if ib is not None:
                ib.arrived.set()
        log.info("refused a replica of %s from %s: %s (%s)", session, src, reason, message)
        self._publish(ReplicaRefused(session=session, src=src, dst=self.name, reason=reason,
                                     message=message[:200]))
