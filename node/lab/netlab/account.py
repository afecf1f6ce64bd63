"""Where a lab link's bytes went, per direction, beside `tc -s qdisc`'s own count.

Each node reports what it put on the data link to its peer (GET /v1/stats):
kv_share pushes as the kernel counted them on each push's socket (landed or cut
part-way, and the receiver's replies coming back), and the peer HTTP exchanges
it opened (status polls, forwarded turns, operator relays: request out, answer
in). One direction of the link (A>B) is A's pushes and requests, plus B's
push replies and the answers to B's requests. The tbf on A's end of the veth
counts every frame A sends with its 66 bytes of Ethernet, IPv4 and TCP headers
(with timestamps); its packet count x 66 gives those headers, and what is left
unaccounted is shown, never spread over the kinds.

`useful_util_backlogged`: bytes of replicas that landed, acknowledged while at
least one more push to the same target waited for a send permit, over the link's
capacity for the time a push waited. Bytes of a transfer later cut do not count.
The sender samples acknowledged bytes per block; each sample's bytes count in the
share of its interval that the link was backlogged.
"""

from __future__ import annotations

from typing import Any

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12


def direction_bytes(src: dict[str, Any], dst: dict[str, Any], src_name: str, dst_name: str) -> dict[str, int]:
    """Payload bytes by kind on the src>dst direction, from both nodes' /v1/stats."""
    kinds: dict[str, int] = {}

    def add(kind: str, n: int) -> None:
        if n:
            kinds[kind] = kinds.get(kind, 0) + int(n)

    push = src["kvshare"]["out"].get(dst_name, {}).get("wire", {})
    add("replica_landed", push.get("replica_landed", 0))
    add("replica_cut", push.get("replica_cut", 0))
    add("replica_replies", dst["kvshare"]["out"].get(src_name, {}).get("wire", {}).get("replica_replies", 0))
    for kind, n in src.get("peer_wire", {}).get(dst_name, {}).get("out", {}).items():
        add(kind, n)
    for kind, n in dst.get("peer_wire", {}).get(src_name, {}).get("in", {}).items():
        add(kind, n)
    return kinds


def account(stats: dict[str, dict[str, Any]], tc: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """{"A>B": {kind: bytes, ..., "tcp_ip_headers", "unaccounted"}, ...} and tc's counts, for two hosts.
    `stats` maps host name -> its /v1/stats; `tc` maps host name -> (bytes, packets) of its data-link tbf."""
    a, b = sorted(stats)
    wire: dict[str, dict[str, int]] = {}
    qdisc: dict[str, dict[str, Any]] = {}
    for src, dst in ((a, b), (b, a)):
        key = f"{src}>{dst}"
        kinds = direction_bytes(stats[src], stats[dst], src, dst)
        tc_bytes, tc_pkts = tc.get(src, (0, 0))
        kinds["tcp_ip_headers"] = tc_pkts * HEADER_BYTES
        kinds["unaccounted"] = tc_bytes - sum(kinds.values())
        wire[key] = kinds
        counted = tc_bytes - kinds["unaccounted"]
        qdisc[key] = {"bytes": tc_bytes, "packets": tc_pkts,
                      "accounted_pct": round(100 * counted / tc_bytes, 2) if tc_bytes else None}
    return {"wire_bytes": wire, "tc": qdisc}


def useful_util_backlogged(stats: dict[str, dict[str, Any]], rate_bps: float) -> float | None:
    """Landed replica bytes sent while pushes were queued / (capacity x queued time), both directions."""
    landed, seconds = 0, 0.0
    for st in stats.values():
        for out in st["kvshare"]["out"].values():
            landed += out.get("landed_backlogged_bytes", 0)
            seconds += out.get("backlogged_s", 0.0)
    if seconds <= 0 or rate_bps <= 0:
        return None
    return round(8 * landed / (rate_bps * seconds), 3)
