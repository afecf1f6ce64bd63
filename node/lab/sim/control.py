"""Control-plane bytes in `kvmesh sim`, from the sizes of the real messages.

Sizes are measured once by encoding the node's own wire messages (node.mesh.statefeed's deltas and
heartbeats, a directory answer, a polled `PeerStatus`) with values like the sim's, each as a
websocket frame (or an HTTP exchange) on the wire; the sim then counts how many of each it sends.
Pushed load goes to every other host, one delta per burst of changes (node.mesh.statestream sends
a change's delta `MIN_GAP_S` after it, with whatever else changed meanwhile), else a heartbeat per
`heartbeat_s`; a session's changes go to its directory host only (to every
host in a mesh at or under `directory_after_hosts`); a turn whose entry is not its session's
directory costs one lookup. TCP/IP headers are not counted (as in node.mesh.wirecount).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.node.mesh.statefeed import encode
from kvmesh.node.mesh.statestream import frame_bytes
from kvmesh.node.protocol import (
    DirectoryEntry,
    HandoffCounters,
    HostInfo,
    LinkInfo,
    PeerStatus,
    SessionHolding,
    StateDelta,
)

_EPOCH = 1_764_600_000.123456
_SESSION = "claude-code-2f9c1d7e-5b1a-4e0f-9d3c-8a7b6c5d4e3f"  # an agent's session id, as long as they come
_HTTP_HEAD = 260  # a peer GET's request line and headers (the mesh auth header included), and its reply's


def _holding(i: int) -> SessionHolding:
    return SessionHolding(session=f"{_SESSION[:-4]}{i:04d}", resident_tokens=31_744 + i, store_tokens=30_720,
                          store_updated=_EPOCH + i, home_seq=17, turn_seq=17, last_turn_at=_EPOCH + i, turns=17,
                          moves=1, last_handoff="warm", id_source="header")


@dataclass(frozen=True)
class Sizes:
    load_delta: int  # a host's changed load fields
    heartbeat: int
    session_delta: int  # one session's changed fields
    kv_event: int  # one block stored or evicted, batched (Dynamo-style KV events)
    lookup: int  # one directory lookup, both ways
    poll_base: int  # one polled PeerStatus without sessions, both ways
    poll_per_session: int

    @classmethod
    def measured(cls) -> Sizes:
        ws = lambda s: frame_bytes(len(s), masked=False)  # noqa: E731
        load = encode(StateDelta(epoch=_EPOCH, seq=123_456, host={"busy": 7, "queued": 2, "kv_cache_used_bytes": 51_234_567_890,
                                                                "prefill_tps": 9876.5, "mem_used_bytes": 123_456_789_012},
                                 fields={"mean_turn_s": 3.217}))
        beat = encode(StateDelta(epoch=_EPOCH, seq=123_456))
        sess = encode(StateDelta(epoch=_EPOCH, seq=123_457, sessions={_SESSION: {
            "resident_tokens": 31_744, "turn_seq": 18, "home_seq": 18, "last_turn_at": _EPOCH, "turns": 18}}))
        entry = DirectoryEntry(session=_SESSION, held={"gpu-017": _holding(1), "gpu-203": _holding(2)}).model_dump_json()
        host = HostInfo(name="gpu-017", api="http://10.1.17.4:8000", slots=8, busy=7, queued=2, mem_used_bytes=1 << 37,
                        mem_total_bytes=1 << 39, kv_cache_bytes=1 << 36, kv_cache_used_bytes=1 << 35, store_bytes=1 << 38,
                        prefill_tps=9876.5, last_seen=_EPOCH, block_size=256)
        base = PeerStatus(host=host, counters=HandoffCounters(warm=1234, partial=5, cold=2, shortfall={"none": 1241}),
                          links=[LinkInfo(src="gpu-017", dst="gpu-203", bytes_sent=1 << 34, transfers=345)],
                          mean_turn_s=3.217, import_bps=1.6e10, kv_bytes_per_token=131_072)
        one = base.model_copy(update={"sessions": [_holding(1)]})
        poll_base = len(base.model_dump_json()) + 2 * _HTTP_HEAD
        return cls(load_delta=ws(load), heartbeat=ws(beat), session_delta=ws(sess), kv_event=12,
                   lookup=2 * _HTTP_HEAD + len(entry), poll_base=poll_base,
                   poll_per_session=len(one.model_dump_json()) + 2 * _HTTP_HEAD - poll_base)


def load_stream_bytes(changes: list[float], duration_s: float, recipients: int, sizes: Sizes,
                      *, interval_s: float, heartbeat_s: float) -> int:
    """What one host's pushed load costs: a delta per `interval_s` window in which it changed, a
    heartbeat per `heartbeat_s` of silence between them, to each of `recipients`."""
    ticks = sorted({math.floor(t / interval_s) for t in changes})
    beats, last = 0, 0.0
    for k in ticks:
        t = k * interval_s
        beats += int((t - last) // heartbeat_s)
        last = t
    beats += int((duration_s - last) // heartbeat_s)
    return recipients * (len(ticks) * sizes.load_delta + beats * sizes.heartbeat)
