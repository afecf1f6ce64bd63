"""The wire contract: every event, cluster view and command that crosses a process boundary.

The console and any third-party consumer import this module and nothing else
from `node`; it depends on pydantic only (and `node.sessionids`, the session-id rules, whose
names it re-exports). Every event carries `type`, `v`
(the protocol version), `ts` (wall-clock seconds), `node` (who emitted it) and
`seq` (that node's event counter: with `node` it identifies an event, so a
consumer dedupes replays by `(node, seq)`). Events delivered from the replay
ring on (re)connect have `replay=True`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from kvmesh.node.sessionids import MAX_SESSION_ID_BYTES as MAX_SESSION_ID_BYTES
from kvmesh.node.sessionids import SessionId as SessionId
from kvmesh.node.sessionids import is_valid_session_id as is_valid_session_id
from kvmesh.node.sessionids import session_from_header as session_from_header
from kvmesh.node.sessionids import session_header as session_header
from kvmesh.node.sessionids import session_id_problem as session_id_problem
from kvmesh.node.sessionids import session_key as session_key
from kvmesh.node.sessionids import session_path as session_path

PROTOCOL_VERSION = 1

HandoffClass = Literal["warm", "partial", "cold"]
# Why a handoff reused less than placement predicted, or, when it met the prediction and still was not
# warm, why the prediction was short (one reason per handoff; "none" when it was warm as predicted).
# prompt_diverged: the prompt stopped matching the best cache or replica the host held, before the
# predicted point; replica_in_flight: a replica of the session was still landing when the turn ran;
# replica_refused: this host refused the session's latest replica; evicted: this host held more of
# the session (engine or store) and evicted it; unexplained: a gap nobody could explain (counted, not hidden).
# no_replicas: the model keeps no blocks (recurrent or hybrid: node.engine.live), so a move recomputes.
# new_input: reused as predicted, but the turn brought more than a tenth of its prompt new (tool output,
# a pasted file): no host held it, so no replica could have made the move warm; replica_behind: reused as
# predicted, but another host held enough for a warm move and this host's replica was of an older turn.
ShortfallReason = Literal["none", "prompt_diverged", "replica_in_flight", "replica_refused", "evicted", "no_replicas",
                          "new_input", "replica_behind", "unexplained"]
SHORTFALL_REASONS: tuple[ShortfallReason, ...] = get_args(ShortfallReason)


def classify(reused_fraction: float) -> HandoffClass:
    """warm >= 90% of the prompt reused, partial 30-90%, cold < 30%."""
    if reused_fraction >= 0.9:
        return "warm"
    if reused_fraction >= 0.3:
        return "partial"
    return "cold"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- cluster views ------------------------------------------------------------


class HostInfo(_Model):
    name: str
    api: str = ""
    reachable: bool = True
    draining: bool = False
    slots: int = 0
    busy: int = 0
    queued: int = 0
    mem_used_bytes: int = 0
    mem_total_bytes: int = 0
    gpu_mem_used_bytes: int | None = None
    gpu_mem_total_bytes: int | None = None
    kv_cache_bytes: int = 0
    kv_cache_used_bytes: int = 0
    store_bytes: int = 0
    kvshare_in_bps: float = 0.0
    kvshare_out_bps: float = 0.0
    prefill_tps: float = 0.0
    prefill_backlog_tokens: int = 0  # prompt tokens its running turns have still to prefill
    queued_tokens: int = 0  # prompt tokens its turns queued for a slot will prefill
    last_seen: float = 0.0  # wall time this host was last heard from
    # Tokens per KV block in this host's engine; replicas move whole blocks only, so a replica
    # missing just the partial last block is as fresh as it can be. 0: not reported (older node).
    block_size: int = 0
    no_replicas: str = ""  # why its model keeps no blocks, so no replicas (recurrent or hybrid: node.engine.live)
    zone: str = ""  # a rack or zone label from the node's config; the console groups hosts by it


class SessionInfo(_Model):
    session: str
    home: str | None = None
    resident_tokens: int = 0
    replica_host: str | None = None
    replica_tokens: int = 0
    replica_behind_tokens: int = 0  # tokens the replica lags the home cache
    replica_age_s: float | None = None
    last_handoff: HandoffClass | None = None
    turns: int = 0
    moves: int = 0
    last_turn_at: float = 0.0
    home_seq: int = 0  # turn sequence that made `home` the home (the mesh's order, not a clock)
    id_source: str = ""  # what named the session: a header, a body field or "digest" (node.api.sessionid)
    # The client's session id this conversation belongs to (node.mesh.threads): a session is an
    # affinity group, and each conversation in it (the main one, each subagent's) is a session here,
    # keyed `session`. The main conversation's key is the group itself; "" from an older node.
    group: str = ""


class LinkInfo(_Model):
    src: str
    dst: str
    bytes_sent: int = 0
    transfers: int = 0
    last_transfer_s: float | None = None
    last_transfer_bytes: int | None = None
    goodput_gbps: float | None = None
    throughput_bps: float = 0.0  # now (recent window)
    warm: int = 0
    partial: int = 0
    cold: int = 0


class HandoffCounters(_Model):
    warm: int = 0
    partial: int = 0
    cold: int = 0
    stale_state_cold: int = 0
    # Handoffs by why they reused less than predicted (ShortfallReason -> count; "none" included, so
    # the counts add up to the handoffs of nodes that report it).
    shortfall: dict[str, int] = Field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.warm + self.partial + self.cold

    def warm_pct(self) -> float:
        return 100.0 * self.warm / self.total if self.total else 100.0


class ClusterView(_Model):
    node: str  # who answered
    ts: float
    hosts: list[HostInfo] = []
    sessions: list[SessionInfo] = []
    links: list[LinkInfo] = []
    counters: HandoffCounters = HandoffCounters()
    # "mesh": every session some host holds is listed. "partial": past `mesh.directory_after_hosts` a node
    # lists only the sessions it holds and those it is directory for (hosts, links and counters are whole);
    # `note` then says how to get the whole: `GET /v1/cluster?scope=mesh`, or a console following every node.
    scope: Literal["mesh", "partial"] = "mesh"
    note: str = ""
    parts: list[str] = []  # a fan-in's: the hosts whose views were merged into it


def merge_session_parts(parts: Iterable[tuple[SessionInfo, float]], now: float) -> SessionInfo:
    """One session as the mesh holds it, from what several nodes' views (each with its `ts`) said of it.

    Each part is one node's view: what it holds itself, and what every host holds if it is the session's
    directory. The home is the one with the highest `home_seq` any part names (the mesh's turn order, never a
    clock), so a host that says it is home outranks an older home's claim; every other host named as holding
    tokens (an older home's cache, a replica) is a replica candidate and the largest wins, as a node's own
    `/v1/cluster` picks it. Turn and move counts are the largest any part saw (the directory's covers every
    host), so nothing is counted twice. Replica ages are re-based from each part's `ts` to `now`."""
    parts = list(parts)
    best = max(parts, key=lambda p: (p[0].home_seq, p[0].home is not None, p[0].resident_tokens))[0]
    home = best.home
    replica: tuple[int, float | None, str] | None = None  # (tokens, write time, host)
    for info, ts in parts:
        cands = [(info.resident_tokens, None, info.home), (info.replica_tokens, info.replica_age_s, info.replica_host)]
        for tokens, age, host in cands:
            if host and host != home and tokens > 0:
                at = ts - age if age is not None else None
                if replica is None or (tokens, at or 0.0) > (replica[0], replica[1] or 0.0):
                    replica = (tokens, at, host)
    tokens, at, rhost = replica if replica is not None else (0, None, None)
    return best.model_copy(update={
        "replica_host": rhost, "replica_tokens": tokens,
        "replica_behind_tokens": max(0, best.resident_tokens - tokens) if rhost else 0,
        "replica_age_s": round(now - at, 2) if at is not None else None,
        "turns": max(p.turns for p, _ in parts), "moves": max(p.moves for p, _ in parts),
        "last_turn_at": max(p.last_turn_at for p, _ in parts),
        "id_source": best.id_source or next((p.id_source for p, _ in parts if p.id_source), ""),
        "group": best.group or next((p.group for p, _ in parts if p.group), ""),
    })


def merge_clusters(own: ClusterView, others: Iterable[ClusterView]) -> ClusterView:
    """A mesh-wide view from nodes' partial ones: `own`'s hosts, links and counters (every node's are
    whole), and the sessions of all of them, each merged by `merge_session_parts`."""
    snaps = [own, *others]
    by_session: dict[str, list[tuple[SessionInfo, float]]] = {}
    for snap in snaps:
        for info in snap.sessions:
            by_session.setdefault(info.session, []).append((info, snap.ts))
    sessions = [merge_session_parts(p, own.ts) for _, p in sorted(by_session.items())]
    return own.model_copy(update={"sessions": sessions, "scope": "mesh", "note": "",
                                  "parts": sorted(s.node for s in snaps)})


class SessionHolding(_Model):
    """What one host holds of one session, as that host reports it (peer status)."""

    session: str
    resident_tokens: int = 0  # in this host's engine now (asked of the engine)
    store_tokens: int = 0  # in this host's replica store
    store_updated: float | None = None  # wall time the stored replica was last written
    # Order across hosts comes from the session's turn sequence, never from hosts' clocks:
    # the entry that places a turn numbers it one past the highest it has heard of.
    home_seq: int = 0  # sequence of the last turn here, or of a migration here
    turn_seq: int = 0  # sequence of the last turn here
    last_turn_at: float = 0.0  # wall time of the last turn here (for display only)
    turns: int = 0
    moves: int = 0
    last_handoff: HandoffClass | None = None
    id_source: str = ""  # what named the session in its last turn here
    group: str = ""  # the client's session id it is a conversation of (SessionInfo.group)
    opening: str = ""  # what tells this conversation apart within its group (node.mesh.threads signature)
    inflight_to: str | None = None  # a replica of it being sent from here
    inbound_tokens: int = 0  # a replica of it being received here...
    inbound_eta_s: float | None = None  # ...expected to land in this many seconds
    inbound_landed: int = 0  # ...of which this many tokens are in place here already


class PeerStatus(_Model):
    """A host's answer to GET /v1/peer/status: everything placement needs from it."""

    v: int = PROTOCOL_VERSION
    host: HostInfo
    sessions: list[SessionHolding] = []
    counters: HandoffCounters = HandoffCounters()
    links: list[LinkInfo] = []  # links whose src is this host
    mean_turn_s: float = 1.0
    import_bps: float = 0.0
    kv_bytes_per_token: int = 0
    wasted_replica_bytes: int = 0


class DirectoryEntry(_Model):
    """A directory host's answer to GET /v1/peer/directory/{session}: what each host holds of it."""

    session: str
    held: dict[str, SessionHolding] = {}


class StateBaseline(_Model):
    """The first message of a peer state stream (`/v1/peer/state`), and the answer to a resync: the
    sender's whole status at `seq`. `epoch` (the sender's start, wall time) changes on restart."""

    type: Literal["state_snapshot"] = "state_snapshot"  # the wire tag keeps its older name: nodes of both ages interoperate
    epoch: float
    seq: int
    status: PeerStatus


class StateDelta(_Model):
    """What changed in the sender's status since `seq - 1`, field by field (node.mesh.statefeed).

    `host` and `fields` hold changed HostInfo and PeerStatus fields; `sessions` maps a session to its
    changed SessionHolding fields (a new session: all its fields); `removed` lists sessions the
    sender no longer holds; `links` and `links_removed` do the same for its links. A heartbeat
    repeats the last `seq` and carries nothing."""

    type: Literal["state_delta"] = "state_delta"
    epoch: float
    seq: int
    host: dict[str, object] = {}
    fields: dict[str, object] = {}
    sessions: dict[str, dict[str, object]] = {}
    removed: list[str] = []
    links: dict[str, dict[str, object]] = {}  # "src>dst" -> changed LinkInfo fields, like sessions
    links_removed: list[str] = []


StateMessage = Annotated[StateBaseline | StateDelta, Field(discriminator="type")]
STATE_ADAPTER: TypeAdapter[StateMessage] = TypeAdapter(StateMessage)


# ---- events ------------------------------------------------------------------


class _Event(_Model):
    v: int = PROTOCOL_VERSION
    ts: float = 0.0
    node: str = ""
    epoch: float = 0.0  # the emitting process's start (wall time): (node, epoch, seq) survives restarts
    seq: int = 0  # for a cluster view: the last event the view already reflects
    replay: bool = False


class ClusterViewEvent(_Event):
    """A node's cluster view, the first message of `/v1/events` (the wire tag keeps its older name, 'snapshot')."""

    type: Literal["snapshot"] = "snapshot"
    cluster: ClusterView


class TurnStarted(_Event):
    type: Literal["turn_started"] = "turn_started"
    session: str
    host: str
    prompt_tokens: int
    cached_tokens: int
    turn_seq: int = 0  # the session's turn sequence across the mesh (0: not known)


class TurnFinished(_Event):
    type: Literal["turn_finished"] = "turn_finished"
    session: str
    host: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float
    ok: bool = True
    turn_seq: int = 0


class Handoff(_Event):
    type: Literal["handoff"] = "handoff"
    session: str
    src: str
    dst: str
    cls: HandoffClass
    turn_seq: int = 0
    prompt_tokens: int
    reused_tokens: int
    predicted_reused_tokens: int | None = None
    replica_age_s: float | None = None
    mismatch_token: int | None = None  # where the prompt stopped matching the best cache held
    mismatch_message: int | None = None  # ...as an index into the request's messages
    stale_state: bool = False  # cold although a usable replica was in the target's store
    shortfall: ShortfallReason = "none"  # why it reused less than predicted
    inflight_landed_tokens: int | None = None  # replica_in_flight: tokens of the replica in place when the turn ran...
    inflight_offered_tokens: int | None = None  # ...of the tokens the replica carries
    refused_reason: str | None = None  # replica_refused: the reason this host refused the latest replica
    evicted_from: Literal["engine", "store"] | None = None  # evicted: where this host dropped it from


class ReplicaStarted(_Event):
    """A replica push began moving: its end is a replica_sent, replica_refused or replica_superseded."""

    type: Literal["replica_started"] = "replica_started"
    session: str
    src: str
    dst: str
    blocks: int  # whole blocks offered (the receiver takes only those it lacks)
    tokens: int  # tokens those blocks cover


class ReplicaSent(_Event):
    type: Literal["replica_sent"] = "replica_sent"
    session: str
    src: str
    dst: str
    blocks: int
    bytes: int
    seconds: float
    tokens: int
    snapshot_bytes: int = 0  # of `bytes`: the state snapshot that went with the blocks (node.engine.snapshots)


class ReplicaReady(_Event):
    type: Literal["replica_ready"] = "replica_ready"
    session: str
    src: str
    dst: str
    tokens: int
    bytes: int
    lag_s: float  # replica usable this long after its last byte arrived
    imported: bool  # landed in the engine (else: store only)
    recv_s: float = 0.0  # from the answer to the last byte: the transfer as the receiver saw it
    blocks: int = 0  # blocks that crossed the wire (the delta)
    snapshot_bytes: int = 0  # of `bytes`: the state snapshot that came with the blocks


class ReplicaImported(_Event):
    type: Literal["replica_imported"] = "replica_imported"
    session: str
    host: str
    tokens: int
    seconds: float


class ReplicaEvicted(_Event):
    type: Literal["replica_evicted"] = "replica_evicted"
    session: str
    host: str
    where: Literal["engine", "store"]


class ReplicaRefused(_Event):
    type: Literal["replica_refused"] = "replica_refused"
    session: str
    src: str
    dst: str
    reason: str
    message: str = ""


class ReplicaSuperseded(_Event):
    type: Literal["replica_superseded"] = "replica_superseded"
    session: str
    src: str
    dst: str


class HostStatus(_Event):
    type: Literal["host_status"] = "host_status"
    host: HostInfo


class PeerUp(_Event):
    type: Literal["peer_up"] = "peer_up"
    peer: str


class PeerDown(_Event):
    type: Literal["peer_down"] = "peer_down"
    peer: str
    reason: str = ""


class DrainStarted(_Event):
    type: Literal["drain_started"] = "drain_started"
    host: str
    sessions: int


class DrainProgress(_Event):
    type: Literal["drain_progress"] = "drain_progress"
    host: str
    done: int
    total: int


class DrainCompleted(_Event):
    type: Literal["drain_completed"] = "drain_completed"
    host: str
    moved: int
    failed: int = 0


class Undrained(_Event):
    type: Literal["undrained"] = "undrained"
    host: str


class MigrateStarted(_Event):
    type: Literal["migrate_started"] = "migrate_started"
    session: str
    src: str
    dst: str


class MigrateCompleted(_Event):
    type: Literal["migrate_completed"] = "migrate_completed"
    session: str
    src: str
    dst: str
    ok: bool
    message: str = ""


Event = Annotated[
    ClusterViewEvent | TurnStarted | TurnFinished | Handoff | ReplicaStarted | ReplicaSent | ReplicaReady | ReplicaImported | ReplicaEvicted | ReplicaRefused | ReplicaSuperseded | HostStatus | PeerUp | PeerDown | DrainStarted | DrainProgress | DrainCompleted | Undrained | MigrateStarted | MigrateCompleted,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(data: str | bytes) -> Event:
    """One JSON event from the wire; raises pydantic.ValidationError on anything else."""
    return EVENT_ADAPTER.validate_json(data)


# ---- admin commands (POST bodies) --------------------------------------------


class MigrateCommand(_Model):
    target: str = Field(min_length=1, max_length=64)


class ActionResult(_Model):
    ok: bool
    message: str


class PeerHello(_Model):
    """A host's answer to POST /v1/peer/hello: who it is, and a MAC over the caller's nonce and these
    fields with the mesh secret (node.mesh.discovery), so a host found by DNS is admitted only if it
    holds the secret. The caller reaches it at the address it resolved; the ports come from here."""

    name: str
    api_port: int
    kvshare_port: int
    scheme: str = "http"
    mac: str
