"""Link accounting: what each direction of each link carried (`LinkStats`, kept in `Links`), one push's
bytes as its sender thread counts them (`_Progress`), and what the kernel itself counted on a TCP
socket (TCP_INFO), which sees resends and replies the transfer's own counts cannot."""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.node.protocol import LinkInfo


@dataclass
class LinkStats:
    """One direction of one link, as seen from this node."""

    bytes: int = 0
    transfers: int = 0
    seconds: float = 0.0
    last_s: float | None = None
    last_bytes: int | None = None
    superseded: int = 0  # replicas replaced by a newer one: queued, or in flight (counted in both)
    superseded_in_flight: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    ready_lag_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=256))
    import_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=256))
    window: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=512))
    # Bytes on the link by kind, as the kernel counted them on the push's socket (TCP_INFO):
    # replica_landed / replica_cut went to the target, replica_replies came back from it.
    wire: collections.Counter[str] = field(default_factory=collections.Counter)
    backlogged_s: float = 0.0  # time with at least one push to this target waiting for a send permit
    landed_backlogged_bytes: int = 0  # bytes of replicas that landed, acknowledged while a push was queued
    # State snapshots (window cells, recurrent state) that landed, carried in those replicas: in `bytes` too.
    snapshots: int = 0
    snapshot_bytes: int = 0
    snapshots_failed: int = 0  # pushes carrying one that did not land (superseded ones aside)
    _queued: int = 0
    _backlog_since: float = 0.0

    def queue_changed(self, delta: int) -> None:
        """A push to this target was queued (+1) or left the queue (-1)."""
        now = time.monotonic()
        if self._queued == 0 and delta > 0:
            self._backlog_since = now
        self._queued += delta
        if self._queued == 0:
            self.backlogged_s += now - self._backlog_since

    def backlog_s_now(self) -> float:
        return self.backlogged_s + (time.monotonic() - self._backlog_since if self._queued else 0.0)

    def goodput_bps(self) -> float:
        """Bits/s of recent whole transfers (a 1 Gb/s guess before the first)."""
        return 8 * self.bytes / self.seconds if self.seconds > 0 and self.bytes else 1e9

    def add(self, nbytes: int, secs: float) -> None:
        self.bytes += nbytes
        self.transfers += 1
        self.seconds += secs
        self.last_s, self.last_bytes = secs, nbytes
        self.window.append((time.monotonic(), nbytes))

    def rate_bps(self, horizon: float = 5.0) -> float:
        now = time.monotonic()
        return 8 * sum(b for t, b in self.window if now - t <= horizon) / horizon


class Links:
    """Every link of this node in both directions; a link's stats start at its first use. The sender
    writes `out`, the receiver `inn` (both on the event loop); the node's views read them here."""

    def __init__(self) -> None:
        self.out: dict[str, LinkStats] = collections.defaultdict(LinkStats)  # by target
        self.inn: dict[str, LinkStats] = collections.defaultdict(LinkStats)  # by source

    def rates(self) -> tuple[float, float]:
        return sum(s.rate_bps() for s in self.inn.values()), sum(s.rate_bps() for s in self.out.values())

    def snapshot_totals(self) -> dict[str, int]:
        """Snapshots this node's replicas carried, over every link: sent (landed) and received."""
        out, inn = self.out.values(), self.inn.values()
        return {"sent": sum(s.snapshots for s in out), "sent_bytes": sum(s.snapshot_bytes for s in out),
                "send_failed": sum(s.snapshots_failed for s in out), "received_over_links": sum(s.snapshots for s in inn),
                "received_bytes": sum(s.snapshot_bytes for s in inn)}

    def links_out(self, me: str) -> list[LinkInfo]:
        return [
            LinkInfo(src=me, dst=dst, bytes_sent=s.bytes, transfers=s.transfers, last_transfer_s=s.last_s,
                     # 3 significant digits: a decaying rate would otherwise change (and be pushed) every tick
                     last_transfer_bytes=s.last_bytes, throughput_bps=float(f"{s.rate_bps():.3g}"),
                     goodput_gbps=(8 * s.last_bytes / s.last_s / 1e9) if s.last_s and s.last_bytes else None)
            for dst, s in sorted(self.out.items())
        ]

    def stats(self) -> dict[str, object]:
        """The "out" and "in" sections of kv_share's stats."""
        def pct(xs: collections.deque[float], q: float) -> float | None:
            v = sorted(xs)
            return round(v[min(len(v) - 1, int(q * len(v)))], 4) if v else None

        return {
            "out": {d: {"bytes": s.bytes, "transfers": s.transfers, "seconds": round(s.seconds, 3),
                        "superseded": s.superseded, "superseded_in_flight": s.superseded_in_flight,
                        "refused": dict(s.refused), "wire": dict(s.wire), "backlogged_s": round(s.backlog_s_now(), 3),
                        "landed_backlogged_bytes": s.landed_backlogged_bytes, "snapshots": s.snapshots,
                        "snapshot_bytes": s.snapshot_bytes, "snapshots_failed": s.snapshots_failed}
                    for d, s in self.out.items()},
            "in": {src: {"bytes": s.bytes, "transfers": s.transfers, "seconds": round(s.seconds, 3),
                         "ready_lag_p50_s": pct(s.ready_lag_s, 0.5), "ready_lag_max_s": pct(s.ready_lag_s, 1.0),
                         "refused": dict(s.refused), "snapshots": s.snapshots, "snapshot_bytes": s.snapshot_bytes}
                    for src, s in self.inn.items()},
        }


@dataclass
class _Progress:
    """One push's bytes so far, on its sender thread."""

    backlog_s: Callable[[], float]  # the link's time backlogged so far (LinkStats.backlog_s_now)
    sent: int = 0  # handed to the socket
    acked: int = 0  # acknowledged by the receiver (TCP_INFO), as last sampled
    backlogged: int = 0  # ...of which while another push waited for a send permit
    clock: Callable[[], float] = time.monotonic
    _at: float = 0.0
    _backlog_at: float = 0.0

    def __post_init__(self) -> None:
        self._at, self._backlog_at = self.clock(), self.backlog_s()

    def acked_to(self, acked: int) -> None:
        """Sampled per block and at the verdict. Bytes acknowledged since the last sample count as
        backlogged in the share of that interval the link was backlogged: judged by the state at the
        sample alone, the bytes acknowledged while the receiver lands a push (seconds) were all
        counted whenever a push happened to be queued at the verdict, which put useful utilisation
        above 1."""
        now, backlog = self.clock(), self.backlog_s()
        span = now - self._at
        share = min(1.0, max(0.0, backlog - self._backlog_at) / span) if span > 0 else 0.0
        self.backlogged += round((acked - self.acked) * share)
        self.acked, self._at, self._backlog_at = acked, now, backlog


def _tcp_info_u64(sock: socket.socket, *offsets: int) -> tuple[int, ...]:
    """Counters of struct tcp_info at these byte offsets, as the kernel keeps them for this TCP
    socket; all 0 where the kernel does not say (no TCP_INFO, or a struct too short)."""
    end = max(offsets) + 8
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, end)
    except (OSError, AttributeError):
        return (0,) * len(offsets)
    if len(info) < end:
        return (0,) * len(offsets)
    return tuple(struct.unpack_from("Q", info, off)[0] for off in offsets)


def tcp_bytes(sock: socket.socket) -> tuple[int, int]:
    """(payload bytes sent, including resends; payload bytes received) on this TCP socket
    (tcpi_bytes_sent at 200, tcpi_bytes_received at 128; Linux 4.19+)."""
    sent, received = _tcp_info_u64(sock, 200, 128)
    return sent, received


def tcp_acked(sock: socket.socket) -> int:
    """Payload bytes the peer has acknowledged on this TCP socket (tcpi_bytes_acked at 120)."""
    return _tcp_info_u64(sock, 120)[0]


def _linger_close(conn: socket.socket, limit_s: float = 1.0) -> None:
    """Half-close after a refusal and drain briefly, so the sender reads the refusal
    instead of a connection reset caused by its own unread bytes."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(0.2)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and conn.recv(1 << 20):
            pass
