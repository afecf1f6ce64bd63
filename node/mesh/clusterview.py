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
from collections.abc import Iterable

import httpx
from pydantic import ValidationError

from kvmesh.node.protocol import ClusterView, merge_clusters

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


async def mesh_wide(own: ClusterView, peers: Iterable[tuple[str, str]], client: httpx.AsyncClient) -> ClusterView:
    """The whole mesh: `own` merged with every peer's (name, API URL) own view; partial if any did not answer."""
    gate = asyncio.Semaphore(FAN_IN_CONCURRENCY)

    async def ask(name: str, api: str) -> ClusterView | str:
        async with gate:
            try:
                r = await client.get(f"{api}/v1/cluster", timeout=FAN_IN_TIMEOUT_S)
                r.raise_for_status()
                return ClusterView.model_validate_json(r.content)
            except (httpx.HTTPError, ValidationError) as e:
                return f"{name} ({type(e).__name__})"

    answers = await asyncio.gather(*(ask(n, a) for n, a in peers))
    whole = merge_clusters(own, [a for a in answers if isinstance(a, ClusterView)])
    missing = sorted(a for a in answers if isinstance(a, str))
    if missing:
        whole.scope = "partial"
        whole.note = f"no answer from {len(missing)} hosts, so their own sessions may be missing: {', '.join(missing)}"
    return whole
