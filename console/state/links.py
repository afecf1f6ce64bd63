"""Links between hosts, one per direction: bytes and transfers, a per-second throughput
history (the sparkline), the last transfer's rate, and the handoff classes seen on it.

A cluster view is each link's new baseline; `replica_sent` adds a transfer, spreading
its bytes over the seconds it took; `handoff` counts its class on the link.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvmesh.console.state.changes import Changes, LinkKey, advance
from kvmesh.node.protocol import Handoff, LinkInfo, ReplicaSent

# Per-second throughput buckets kept per link (the sparkline's history).
LINK_HISTORY_S = 120


@dataclass(slots=True)
class LinkRow:
    src: str
    dst: str
    bytes_sent: int = 0
    transfers: int = 0
    last_transfer_s: float | None = None
    last_transfer_bytes: int | None = None
    last_transfer_at: float | None = None
    last: tuple[str, int] = ("", 0)  # (node, seq) of the last transfer applied
    goodput_gbps: float | None = None
    blocks_per_s: float | None = None  # the last transfer's rate in blocks (estimates in-flight progress)
    view_bps: float = 0.0  # throughput the node reported in the last cluster view
    view_ts: float = 0.0
    warm: int = 0
    partial: int = 0
    cold: int = 0
    # bytes per whole wall-clock second, spread over each transfer's duration
    buckets: dict[int, float] = field(default_factory=dict)

    @property
    def key(self) -> LinkKey:
        return (self.src, self.dst)

    def add_transfer(self, end_ts: float, seconds: float, nbytes: int) -> None:
        """Spread a transfer's bytes over the seconds it took, so the sparkline shows a rate."""
        seconds = max(seconds, 1e-3)
        start = end_ts - seconds
        t = start
        while t < end_ts:
            sec = math.floor(t)
            nxt = min(end_ts, sec + 1.0)
            self.buckets[sec] = self.buckets.get(sec, 0.0) + nbytes * (nxt - t) / seconds
            t = nxt

    def history_bps(self, now: float, n: int) -> list[float]:
        """Bits per second for each of the last `n` complete seconds, oldest first."""
        last = math.floor(now) - 1
        return [self.buckets.get(s, 0.0) * 8 for s in range(last - n + 1, last + 1)]

    def now_bps(self, now: float, window: int = 3) -> float:
        """Recent throughput: the mean of the last few seconds, else the cluster view's figure."""
        if self.buckets:
            return sum(self.history_bps(now, window)) / window
        if self.view_ts and now - self.view_ts < 10:
            return self.view_bps
        return 0.0

    def trim(self, now: float) -> None:
        cutoff = math.floor(now) - LINK_HISTORY_S
        for sec in [s for s in self.buckets if s < cutoff]:
            del self.buckets[sec]


def _link_from_info(row: LinkRow, info: LinkInfo, ts: float) -> None:
    row.last = ("", 0)  # the cluster view is the new baseline
    row.bytes_sent = info.bytes_sent
    row.transfers = info.transfers
    row.last_transfer_s = info.last_transfer_s
    row.last_transfer_bytes = info.last_transfer_bytes
    row.goodput_gbps = info.goodput_gbps
    row.view_bps = info.throughput_bps
    row.view_ts = ts
    row.warm, row.partial, row.cold = info.warm, info.partial, info.cold


class Links:
    """Every link any cluster view or event named, by (src, dst)."""

    def __init__(self, changes: Changes, clock: Callable[[], float]) -> None:
        self.rows: dict[LinkKey, LinkRow] = {}
        self._changes = changes
        self._clock = clock

    def apply_view(self, infos: Iterable[LinkInfo], ts: float) -> None:
        for li in infos:
            link = self.rows.get((li.src, li.dst))
            if link is None:
                link = self.rows[(li.src, li.dst)] = LinkRow(src=li.src, dst=li.dst)
            _link_from_info(link, li, ts)

    def _link(self, src: str, dst: str) -> LinkRow:
        row = self.rows.get((src, dst))
        if row is None:
            row = self.rows[(src, dst)] = LinkRow(src=src, dst=dst)
        self._changes.links.add((src, dst))
        return row

    def blocks_per_s(self, src: str, dst: str) -> float | None:
        """The link's last measured rate in blocks (None: no transfer measured, or no such link)."""
        row = self.rows.get((src, dst))
        return row.blocks_per_s if row is not None else None

    def on_handoff(self, ev: Handoff) -> None:
        link = self._link(ev.src, ev.dst)
        setattr(link, ev.cls, getattr(link, ev.cls) + 1)

    def on_replica_sent(self, ev: ReplicaSent) -> None:
        link = self._link(ev.src, ev.dst)
        link.bytes_sent += ev.bytes
        link.transfers += 1
        if advance(link, ev):
            link.last_transfer_at = ev.ts
            link.last_transfer_s = ev.seconds
            link.last_transfer_bytes = ev.bytes
            link.goodput_gbps = ev.bytes * 8 / ev.seconds / 1e9 if ev.seconds > 0 else None
            if ev.seconds > 0 and ev.blocks > 0:
                link.blocks_per_s = ev.blocks / ev.seconds
        link.add_transfer(ev.ts or self._clock(), ev.seconds, ev.bytes)

    def tick(self, now: float) -> None:
        """Age out link history."""
        for link in self.rows.values():
            if link.buckets:
                link.trim(now)
                self._changes.links.add(link.key)  # the sparkline moves with time
