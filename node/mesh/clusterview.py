"""`/v1/cluster` at any size: a node's own view says whether it is the whole mesh, and a fan-in makes it so.

Past `mesh.directory_after_hosts` a node mirrors only the sessions it is directory for (node.mesh.directory),
so its `cluster()` lists those and its own; hosts, links and counters are still whole, since every peer's
load reaches everyone. Rather than answer with that as if it were the mesh, the view is marked
`scope = "partial"` with a note saying how to get the whole.

The whole is `GET /v1/cluster?scope=mesh`: this node asks every member for its own `/v1/cluster` at once
(at most `FAN_IN_CONCURRENCY` in flight, each bounded by `FAN_IN_TIMEOUT_S`) and merges the parts by owner
(`node.protocol.merge_clusters`, the rule the console applies to the nodes' streams). It is asked for, not
the default: a tool that polls every node's `/v1/cluster` would otherwise make N x N requests a round, and
a mesh-wide answer costs one request per host. A member that does not answer leaves the answer partial,
named in the note: never a silently short list.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable

import httpx
from pydantic import ValidationError

from kvmesh.node.protocol import (
    ClusterView,
    HandoffCounters,
    HostInfo,
    LinkInfo,
    PeerStatus,
    SessionHolding,
    SessionInfo,
    merge_clusters,
)

FAN_IN_TIMEOUT_S = 3.0
FAN_IN_CONCURRENCY = 32


def partial_note(members: int, threshold: int) -> str:
    return (f"this node lists the sessions it holds and those it is directory for: the mesh has {members} hosts,"
            f" past mesh.directory_after_hosts = {threshold}. Hosts, links and counters are whole. For every"
            f" session: GET /v1/cluster?scope=mesh (a fan-in over every host), or kvmesh-console, which follows"
            f" every node's stream")


def scoped(view: ClusterView, members: int, threshold: int) -> ClusterView:
    """`view`, marked partial (with the note) when the mesh is past the directory threshold."""
    if members > threshold:
        view.scope = "partial"
        view.note = partial_note(members, threshold)
    return view


async def mesh_wide(own: ClusterView, peers: Iterable[tuple[str, str]], client: httpx.AsyncClient, *,
                    headers: dict[str, str] | None = None) -> ClusterView:
    """The whole mesh: `own` merged with every peer's (name, API URL) own view; partial if any did not answer.
    `headers` go with each ask beside the client's own (the caller's API key: a peer's view wants one when keys
    are set, and without a mesh secret the peer client has no token to present instead)."""
    gate = asyncio.Semaphore(FAN_IN_CONCURRENCY)

    async def ask(name: str, api: str) -> ClusterView | str:
        async with gate:
            try:
                r = await client.get(f"{api}/v1/cluster", headers=headers, timeout=FAN_IN_TIMEOUT_S)
                r.raise_for_status()
                return ClusterView.model_validate_json(r.content)
            except httpx.HTTPStatusError as e:  # e.g. 401: the host wants a key this node had none to pass on
                return f"{name} (HTTP {e.response.status_code})"
            except (httpx.HTTPError, ValidationError) as e:
                return f"{name} ({type(e).__name__})"

    answers = await asyncio.gather(*(ask(n, a) for n, a in peers))
    whole = merge_clusters(own, [a for a in answers if isinstance(a, ClusterView)])
    missing = sorted(a for a in answers if isinstance(a, str))
    if missing:
        whole.scope = "partial"
        whole.note = f"no answer from {len(missing)} hosts, so their own sessions may be missing: {', '.join(missing)}"
    return whole


def assemble(node: str, now: float, statuses: dict[str, PeerStatus], hosts: list[HostInfo]) -> ClusterView:
    """One node's cluster view from the statuses it holds (its own and its peers'): a session per row with its
    home and best replica, counters summed, each link's transfer figures from its sender and handoffs from its
    receiver."""
    by_session: dict[str, dict[str, SessionHolding]] = collections.defaultdict(dict)
    for host, st in statuses.items():
        for sh in st.sessions:
            by_session[sh.session][host] = sh
    sessions = [_session_info(s, held, now) for s, held in sorted(by_session.items())]
    counters = HandoffCounters()
    links: dict[tuple[str, str], LinkInfo] = {}
    for host, st in statuses.items():
        for f in ("warm", "partial", "cold", "stale_state_cold"):
            setattr(counters, f, getattr(counters, f) + getattr(st.counters, f))
        for reason, n in st.counters.shortfall.items():
            counters.shortfall[reason] = counters.shortfall.get(reason, 0) + n
        for li in st.links:
            # Transfer figures come from the sender's report, handoff counts from the receiver's.
            cur = links.setdefault((li.src, li.dst), LinkInfo(src=li.src, dst=li.dst))
            if li.src == host:
                cur.bytes_sent, cur.transfers, cur.throughput_bps = li.bytes_sent, li.transfers, li.throughput_bps
                cur.last_transfer_s, cur.last_transfer_bytes = li.last_transfer_s, li.last_transfer_bytes
                cur.goodput_gbps = li.goodput_gbps
            if li.dst == host:
                cur.warm, cur.partial, cur.cold = li.warm, li.partial, li.cold
    return ClusterView(node=node, ts=now, hosts=sorted(hosts, key=lambda h: h.name),
                       sessions=sessions, links=sorted(links.values(), key=lambda li: (li.src, li.dst)),
                       counters=counters)


def _session_info(session: str, held: dict[str, SessionHolding], now: float) -> SessionInfo:
    home = max(held, key=lambda h: (held[h].home_seq, h))
    if held[home].home_seq == 0:
        home = None  # type: ignore[assignment]
    home_tokens = held[home].resident_tokens if home else 0
    others = [(max(sh.store_tokens, sh.resident_tokens), h) for h, sh in held.items() if h != home]
    replica_tokens, replica_host = max(others, default=(0, None))
    rep = held.get(replica_host) if replica_host else None
    age = now - rep.store_updated if rep is not None and rep.store_updated else None
    last = held[home] if home else None
    return SessionInfo(
        session=session, home=home, resident_tokens=home_tokens,
        replica_host=replica_host if replica_tokens else None, replica_tokens=replica_tokens,
        replica_behind_tokens=max(0, home_tokens - replica_tokens) if replica_tokens else 0,
        replica_age_s=round(age, 2) if age is not None else None,
        last_handoff=last.last_handoff if last else None,
        turns=sum(sh.turns for sh in held.values()), moves=sum(sh.moves for sh in held.values()),
        last_turn_at=max((sh.last_turn_at for sh in held.values()), default=0.0),
        home_seq=held[home].home_seq if home else 0,
        id_source=last.id_source if last and last.id_source else next((sh.id_source for sh in held.values() if sh.id_source), ""),
        group=last.group if last and last.group else next((sh.group for sh in held.values() if sh.group), ""),
    )
