"""The console's model of the mesh: plain Python, fed cluster views and events, no Textual.

Everything the screen shows is read from one `ConsoleState`. The ingest side
calls `feed_frame` / `feed` with what arrives on each node's websocket and
`node_connected` / `node_disconnected` as sockets come and go; the UI side reads
the tables here and calls `take_changes()` on its refresh timer to learn which
rows to patch. Keeping it free of Textual means the tricky parts (rebuild on
reconnect, dedupe, replay vs live, out-of-order, pause) are unit-tested directly.

Rules this model keeps:
- A cluster view replaces the mesh-wide picture (hosts are upserted and never dropped,
  sessions absent from it are removed, counters are replaced).
- Events are identified by `(node, seq)` and applied at most once.
- Replayed events (`replay=True`) are already reflected in the cluster view that
  preceded them, so they go to the event log only, unless they are newer than the
  cluster view's watermark (`ClusterViewEvent.seq` from the same node, when the node
  sets it). Applying them again would double-count handoffs and roll hosts back
  to older values.
- "Latest value" fields (a host's status, a session's home) never go backwards
  within one node's stream: an event with a lower seq than the last one applied
  from the same node is late and does not overwrite newer state. Across nodes, a
  session's turns are ordered by their turn sequence (`turn_seq`, the mesh's own
  order): a late event of an older turn does not move the home back. Otherwise
  the order is arrival order, never the hosts' clocks (they can be skewed by
  seconds). Counts (handoffs, turns) are commutative and always applied.
- While paused, events queue in arrival order and are applied in that order on
  resume; nothing is dropped. Connection status is not queued: it is about the
  console's own sockets, and an operator must see a node go away even when paused.
- A node whose socket is lost stays, marked DISCONNECTED with the time it went stale.

The package, one concern a file: `model.py` the `ConsoleState` that composes the
rest; `stream.py` frames, dedupe, the pause queue and ingest counts; `router.py`
which part each event changes (and replay vs live); `nodes.py` the console's own
connections; `hosts.py`, `sessions.py` (lifecycle, freshness) with `replicas.py`
(replica events) and `threads.py` (a client session's conversations, one group), `links.py`, `counters.py` and `eventlog.py` the tables; and
`changes.py` the dirty marks they share and the "never backwards" rule. This file
names what widgets and tests import.
"""

from __future__ import annotations

from kvmesh.console.state.changes import Changes, LinkKey
from kvmesh.console.state.eventlog import CONSOLE_NODE, NOISY_TYPES, Level, LogEntry, describe
from kvmesh.console.state.hosts import HostLevel, HostRow
from kvmesh.console.state.links import LINK_HISTORY_S, LinkRow
from kvmesh.console.state.model import ConsoleState
from kvmesh.console.state.nodes import NodeConn, normalize_url
from kvmesh.console.state.sessions import (
    IDLE_AFTER_S,
    LIFECYCLES,
    REPLICA_PUSH_GRACE_S,
    FreshKind,
    Lifecycle,
    ReplicaFreshness,
    SessionRow,
)
from kvmesh.console.state.stream import DEDUPE_WINDOW
from kvmesh.console.state.threads import group_of_key

__all__ = [
    "CONSOLE_NODE",
    "DEDUPE_WINDOW",
    "IDLE_AFTER_S",
    "LIFECYCLES",
    "LINK_HISTORY_S",
    "NOISY_TYPES",
    "REPLICA_PUSH_GRACE_S",
    "Changes",
    "ConsoleState",
    "FreshKind",
    "HostLevel",
    "HostRow",
    "Level",
    "Lifecycle",
    "LinkKey",
    "LinkRow",
    "LogEntry",
    "NodeConn",
    "ReplicaFreshness",
    "SessionRow",
    "describe",
    "group_of_key",
    "normalize_url",
]
