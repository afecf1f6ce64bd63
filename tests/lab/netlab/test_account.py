"""netlab's link accounting: each direction's bytes by kind, tc's headers and what is left, and useful utilisation."""

from __future__ import annotations

from typing import Any

from kvmesh.node.lab.netlab.account import HEADER_BYTES, account, useful_util_backlogged


def _stats(peer: str, landed: int, cut: int, replies: int, backlog_bytes: int, backlog_s: float,
           http_out: dict[str, int], http_in: dict[str, int]) -> dict[str, Any]:
    return {"kvshare": {"out": {peer: {"wire": {"replica_landed": landed, "replica_cut": cut, "replica_replies": replies},
                                       "landed_backlogged_bytes": backlog_bytes, "backlogged_s": backlog_s}}},
            "peer_wire": {peer: {"out": http_out, "in": http_in}}}


def test_directions_sum_both_nodes_views() -> None:
    """A>B is A's pushes and requests plus B's push replies and the answers to B's requests; tc's rest is shown."""
    a = _stats("b", 1000, 200, 30, 0, 0.0, {"peer_status": 50, "forwarded_turn": 400}, {"peer_status": 700})
    b = _stats("a", 5000, 0, 40, 0, 0.0, {"peer_status": 60}, {"peer_status": 900, "forwarded_turn": 80})
    tc = {"a": (1000 + 200 + 40 + 50 + 400 + 900 + 80 + 10 * HEADER_BYTES + 7, 10), "b": (9999, 3)}
    out = account({"a": a, "b": b}, tc)
    ab = out["wire_bytes"]["a>b"]
    assert ab == {"replica_landed": 1000, "replica_cut": 200, "replica_replies": 40, "peer_status": 50 + 900,
                  "forwarded_turn": 400 + 80, "tcp_ip_headers": 10 * HEADER_BYTES, "unaccounted": 7}
    assert out["tc"]["a>b"]["packets"] == 10 and out["tc"]["a>b"]["accounted_pct"] < 100
    ba = out["wire_bytes"]["b>a"]
    assert ba["replica_landed"] == 5000 and ba["replica_replies"] == 30 and ba["peer_status"] == 60 + 700
    assert ba["unaccounted"] == 9999 - sum(v for k, v in ba.items() if k != "unaccounted")


def test_useful_util_backlogged_counts_landed_bytes_over_capacity_while_queued() -> None:
    """Landed bytes sent while queued / (rate x queued time), over both directions; None with no backlog."""
    a = _stats("b", 0, 0, 0, 900_000, 1.0, {}, {})
    b = _stats("a", 0, 0, 0, 300_000, 1.0, {}, {})
    assert useful_util_backlogged({"a": a, "b": b}, 8e6) == 0.6  # 1.2 MB in 2 s of a 1 MB/s link
    assert useful_util_backlogged({"a": _stats("b", 0, 0, 0, 0, 0.0, {}, {})}, 8e6) is None
