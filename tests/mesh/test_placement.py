"""Placement's arithmetic (node.mesh.placement, pure functions): what a host's holding predicts a turn there reuses."""

from __future__ import annotations

from kvmesh.node.mesh.placement import Holding, HostLoad, Policy, choose

PREFILL = 10_000.0  # tokens/s on every host here
PROMPT = 20_000


def _predict(held: Holding) -> tuple[int, float]:
    """(predicted reuse, expected TTFT) of a turn placed on b, the session's home a draining."""
    hosts = {"a": HostLoad("a", 2, 0, 0, 1.0, PREFILL, 1e9, available=False),
             "b": HostLoad("b", 2, 0, 0, 1.0, PREFILL, 1e9)}
    holdings = {"a": Holding(resident=PROMPT, home_seq=3, turn_seq=3), "b": held}
    d = choose(hosts, holdings, PROMPT, Policy(kv_bytes_per_token=1))
    assert d is not None and d.host == "b", d
    return d.predicted_reused, d.expected_ttft_s


def test_an_inbound_replica_that_lands_before_the_recompute_counts_whole() -> None:
    """A replica landing in 0.5 s, against 1.6 s to recompute what it brings, counts in full (the turn waits)."""
    reuse, ttft = _predict(Holding(stored=4_000, inbound=20_000, inbound_eta_s=0.5))
    assert reuse == PROMPT - 1  # all but the last token (which the turn computes)
    assert abs(ttft - (0.5 + 1 / PREFILL)) < 1e-3, ttft


def test_a_slow_inbound_replica_counts_for_nothing_until_it_lands_whole() -> None:
    """A replica landing in 5 s, against 1.6 s to recompute, adds nothing: its landed blocks are not usable before
    its end (the receiver commits, and authenticates its bytes, only then)."""
    reuse, ttft = _predict(Holding(stored=4_000, inbound=20_000, inbound_eta_s=5.0))
    assert reuse == 4_000
    assert abs(ttft - (4_000 / 1e9 + (PROMPT - 4_000) / PREFILL)) < 1e-3, ttft


def test_a_slow_inbound_replica_never_predicts_less_than_what_is_stored() -> None:
    """Landed tokens below what the store holds add nothing: the stored replica is the prediction."""
    reuse, _ = _predict(Holding(stored=8_000, inbound=20_000, inbound_eta_s=5.0))
    assert reuse == 8_000
    reuse, _ = _predict(Holding(resident=9_000, inbound=20_000, inbound_eta_s=5.0))
    assert reuse == 9_000
