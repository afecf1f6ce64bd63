"""Stored Responses across the mesh: a response is kept with its conversation, wherever that goes.

The mechanism (issue 48). Each conversation's stored responses are one small record (node.responses.record),
named by the conversation's key, which every response id carries (node.responses.ids). The record lives
where the conversation's KV cache lives, each copy with its disk copy (node.responses.store):

- the host that ran the turn (its home) keeps it: the entry node the client called builds the new response's
  entry when the answer is whole, appends it to the record it continued, and files the record with that host
  (`PUT /v1/peer/responses/{session}`; here, if the turn ran here), before the client sees the answer's end;
- that host passes it on to the host it replicates the conversation to (placement's predicted next host,
  and the last host kv_share sent a replica of it), and answers the entry only once they hold it too: the
  client never holds an id whose only copy can die with one host;
- whenever kv_share sends a replica of the conversation from here (a turn's, a drain's, a migration's), the
  record follows it to the same host if that host has not got this version (`on_event`).

So the record rides with the conversation's replica and store copy, at the cost of its text once per turn
on the link (the chat hop already carries the whole conversation), and no host's death loses one: the replica
holder has it, and a restarted host reads its disk copies back.

Finding one (`find`), from any entry: this host's record, else the conversation's holders as the mesh knows
them (its home first; looked up across the mesh first if this entry has not heard of it, as a turn's
placement does), else every other reachable host at once. A response is found only in its scope (the
API key that made it) and alive (not expired, not deleted). A deletion (`delete`) marks it deleted here and
on every reachable host that holds the record; the deletion wins every later merge.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
from pydantic import ValidationError

from kvmesh.node.config import ResponsesConfig
from kvmesh.node.mesh.peers import PeerTable
from kvmesh.node.mesh.placement import Decision, Holding
from kvmesh.node.protocol import Event, ReplicaSent, session_path
from kvmesh.node.responses.ids import session_of
from kvmesh.node.responses.record import Record, StoredEntry, StoredRecord
from kvmesh.node.responses.store import ResponseStore

log = logging.getLogger("kvmesh.responses")
PEER_TIMEOUT_S = 5.0
MAX_REMEMBERED = 100_000
SWEEP_S = 3600.0  # expired entries are not served at once; their bytes are freed at most this much later


class Whereabouts(Protocol):
    """Where the mesh says a conversation is (node.mesh.mesh.Mesh satisfies it)."""

    def needs_lookup(self, session: str) -> bool: ...

    async def refresh(self, session: str) -> None: ...

    def holdings(self, session: str) -> dict[str, Holding]: ...

    def predict_next(self, session: str) -> Decision | None: ...


@dataclass(frozen=True)
class Found:
    """A stored response and the record it was found in (this host's, or a copy a peer sent)."""

    record: Record
    entry: StoredEntry

    @property
    def session(self) -> str:
        return self.record.session


def responses_dir(cfg: ResponsesConfig, store_dir: str) -> Path | None:
    """Where the disk copies go: `responses.dir`, else beside kv_share's store, else None (a temp dir)."""
    if cfg.dir:
        return Path(cfg.dir)
    if store_dir:
        p = Path(store_dir)
        return p.with_name(p.name + "-responses")
    return None


class StoredResponses:
    """This host's part of the mesh's stored responses. It is given its name, its config section, whether disk
    copies are fsynced, where the mesh says conversations are, and the peer table (addresses and the client)."""

    def __init__(self, name: str, cfg: ResponsesConfig, *, store_dir: str, fsync: bool, where: Whereabouts,
                 peers: PeerTable, clock: Callable[[], float] = time.time):
        self.name, self.cfg, self.where, self.peers, self.clock = name, cfg, where, peers, clock
        root = responses_dir(cfg, store_dir)
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        if root is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix=f"kvmesh-responses-{name}-")
            root = Path(self._tmpdir.name)
        self.store = ResponseStore(root, cfg.budget_bytes, fsync=fsync, clock=clock)
        # (session, host) -> the record version that host was sent; session -> the host kv_share last sent a
        # replica to. Both LRU-capped: forgetting one costs at most a record sent twice.
        self._sent: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._replica_to: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def ttl_s(self) -> float:
        return self.cfg.ttl_s

    @property
    def enabled(self) -> bool:
        return self.cfg.budget_bytes > 0

    async def start(self) -> None:
        await self.store.load()
        self._spawn(self._sweeper())

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.to_thread(self.store.close)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    def stats(self) -> dict[str, int]:
        return {"conversations": len(self.store.records), "bytes": self.store.usage_bytes(),
                "budget_bytes": self.store.budget_bytes, "evictions": self.store.evictions}

    # ---- an entry node's calls -------------------------------------------------------

    async def find(self, response_id: str, scope: str) -> Found | None:
        """The response, alive and the scope's, from wherever the mesh keeps it; None looks like an unknown id."""
        session = session_of(response_id)
        if session is None:
            return None
        now = self.clock()
        rec = self.store.get(session)
        if rec is not None and (e := rec.find(response_id, scope, now)) is not None:
            return Found(rec, e)
        asked = {self.name}
        for host in await self._holders(session):
            asked.add(host)
            got = await self._fetch(host, session)
            if got is not None and (e := got.find(response_id, scope, now)) is not None:
                return Found(got, e)
        # A conversation too short to replicate has its record on a host that holds none of its cache (its home's
        # death leaves none that does): every host is asked, as a turn of a session no entry knows asks them all.
        rest = [h for h, p in self.peers.peers.items() if p.reachable and h not in asked]
        for got in await asyncio.gather(*(self._fetch(h, session) for h in rest)):
            if got is not None and (e := got.find(response_id, scope, now)) is not None:
                return Found(got, e)
        return None

    async def keep(self, record: StoredRecord, ran_on: str | None) -> None:
        """File a conversation's record, a new response in it, with the host its turn ran on (here if it ran here,
        or if that host does not take it); it answers once the conversation's replica holder has it too."""
        if ran_on and ran_on != self.name and await self._put(ran_on, record, replicate=True):
            return
        await self.accept(record, replicate=True)

    async def delete(self, response_id: str, scope: str) -> bool:
        """Delete the response everywhere it is kept; False if the scope has no such response."""
        found = await self.find(response_id, scope)
        if found is None:
            return False
        tomb = StoredRecord(session=found.session, entries=[found.entry.model_copy(update={"deleted": True})])
        self.store.merge(tomb, known_only=True)
        hosts = [h for h, p in self.peers.peers.items() if p.reachable]
        await asyncio.gather(*(self._put(h, tomb, replicate=False, known_only=True) for h in hosts))
        return True

    # ---- a peer's calls ----------------------------------------------------------------

    def record(self, session: str) -> StoredRecord | None:
        rec = self.store.get(session)
        return rec.dump() if rec is not None else None

    async def accept(self, incoming: StoredRecord, *, replicate: bool, known_only: bool = False) -> None:
        """Merge a copy in; with `replicate` (this host ran the turn), pass it on to where the conversation's
        replica goes, and return once there."""
        rec = self.store.merge(incoming, known_only=known_only)
        if rec is None or not replicate:
            return
        d = self.where.predict_next(rec.session)
        targets = {t for t in (d.host if d is not None else None, self._replica_to.get(rec.session))
                   if t is not None and t != self.name}
        await asyncio.gather(*(self._send(rec, t) for t in targets))

    def on_event(self, ev: Event) -> None:
        """A replica of a conversation went from here to a host: its record follows, unless that host has it."""
        if not isinstance(ev, ReplicaSent) or ev.src != self.name:
            return
        _remember(self._replica_to, ev.session, ev.dst)
        rec = self.store.records.get(ev.session)
        if rec is not None and self._sent.get((ev.session, ev.dst)) != rec.version:
            self._spawn(self._send(rec, ev.dst))

    # ---- on the wire ----------------------------------------------------------------------

    async def _holders(self, session: str) -> list[str]:
        """The other reachable hosts that hold the conversation or ran it, its home first (as the mesh knows them)."""
        if self.where.needs_lookup(session):
            await self.where.refresh(session)
        held = self.where.holdings(session)
        order = sorted(held, key=lambda h: (-held[h].home_seq, -max(held[h].resident, held[h].stored, held[h].inbound)))
        return [h for h in order if h != self.name and (p := self.peers.peers.get(h)) is not None and p.reachable]

    def _api(self, host: str) -> str | None:
        p = self.peers.peers.get(host)
        return p.cfg.api if p is not None else None

    async def _fetch(self, host: str, session: str) -> Record | None:
        api = self._api(host)
        if api is None:
            return None
        try:
            r = await self.peers.client.get(f"{api}/v1/peer/responses/{session_path(session)}", timeout=PEER_TIMEOUT_S)
            if r.status_code == 404:
                return None
            r.raise_for_status()
            got = await asyncio.to_thread(StoredRecord.model_validate_json, r.content)
        except (httpx.HTTPError, ValidationError) as e:
            log.info("stored responses of %s: %s did not answer (%s)", session, host, type(e).__name__)
            return None
        rec = Record(got.session)
        rec.merge(got.entries)
        return rec if got.session == session else None

    async def _send(self, rec: Record, host: str) -> None:
        version = rec.version
        if await self._put(host, rec.dump(), replicate=False):
            _remember(self._sent, (rec.session, host), version)

    async def _put(self, host: str, record: StoredRecord, *, replicate: bool, known_only: bool = False) -> bool:
        api = self._api(host)
        if api is None:
            return False
        params: Mapping[str, str] = {"replicate": str(replicate).lower(), "known_only": str(known_only).lower()}
        body = await asyncio.to_thread(record.model_dump_json)  # a long conversation's text: off the loop
        try:
            r = await self.peers.client.put(f"{api}/v1/peer/responses/{session_path(record.session)}", params=params,
                                            content=body,
                                            headers={"content-type": "application/json"}, timeout=PEER_TIMEOUT_S)
            r.raise_for_status()
            return True
        except httpx.HTTPError as e:
            log.warning("stored responses of %s: %s did not take them (%s)", record.session, host, type(e).__name__)
            return False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_S, self.cfg.ttl_s))
            self.store.sweep()


K = TypeVar("K")
V = TypeVar("V")


def _remember(d: collections.OrderedDict[K, V], key: K, value: V) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > MAX_REMEMBERED:
        d.popitem(last=False)
