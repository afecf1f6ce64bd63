"""`kvmesh sim`'s clients (node.lab.clientmodel): retries within a budget, Retry-After honoured up to 60 s, a timeout
that fails a queued turn, and the figures the JSON reports of them; on small synthetic traces."""

from __future__ import annotations

from typing import Any

from kvmesh.node.lab.sim.policies import Route, SessionHashRouter
from kvmesh.node.lab.sim.run import SimParams, Simulation
from kvmesh.node.lab.workload import TraceRequest
from kvmesh.node.mesh.admission import Refusal, Reservation


def _req(t: float, session: str, turn: int = 0, *, tokens: int = 1024, out: int = 10, think_s: float = 0.0) -> TraceRequest:
    base = sum(map(ord, session)) * 1000 + turn * 100
    return TraceRequest(t=t, session=session, turn=turn, input_length=tokens, output_length=out,
                        blocks=tuple(range(base, base + max(1, tokens // 512))), think_s=think_s)


class Refuser(SessionHashRouter):
    """Session hashing that refuses, with Retry-After `retry_after_s`: every attempt of a session named x*, and each
    other turn's first attempt; it records when each attempt came."""

    retry_after_s = 2.0

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.attempts: list[tuple[str, int, float]] = []

    def route(self, req: TraceRequest, entry: str, now: float) -> Route:
        first = not any(a[:2] == (req.session, req.turn) for a in self.attempts)
        self.attempts.append((req.session, req.turn, now))
        if req.session.startswith("x") or first:
            ra = self.retry_after_s
            return Route("h000", refused=Refusal(ra, 1.0, ra, req.turn == 0, Reservation("h000", now, now + ra)))
        return super().route(req, entry, now)


def _run(reqs: list[TraceRequest], *, retry_after_s: float = 2.0, hosts: int = 1, refuse: bool = True,
         **kw: Any) -> tuple[dict[str, Any], Simulation]:
    p = SimParams(hosts=hosts, policy="session_hash", **kw)
    sim = Simulation(p, reqs)
    if refuse:
        sim.router = Refuser(sim.cluster, sim.rng, kv_bytes_per_token=p.kv_bytes_per_token,
                             directory_after_hosts=p.directory_after_hosts)
        sim.router.retry_after_s = retry_after_s  # type: ignore[attr-defined]
    sim.run()
    return sim.summary(max(1.0, sim.fig.end)), sim


def _times(sim: Simulation, session: str) -> list[float]:
    return [t for s, _, t in sim.router.attempts if s == session]  # type: ignore[attr-defined]


def test_the_client_gives_up_after_its_retries_and_the_turn_fails() -> None:
    """Always refused: the SDKs' 2 retries make three attempts, then one failed turn; with no retries, one attempt.
    The conversation goes on: its next turn is sent (and refused, and fails, the same way)."""
    out, sim = _run([_req(0.0, "x1"), _req(0.0, "x1", 1, think_s=5.0)])
    assert len(_times(sim, "x1")) == 6 and out["refused"] == 6 and out["failed_turns"] == 2, out
    assert out["failed_refused"] == 2 and out["requests"] == 0, out
    out, sim = _run([_req(0.0, "x1")], client_retries=0)
    assert out["refused"] == 1 and out["failed_turns"] == 1, out


def test_retry_after_is_honoured_up_to_60_s_and_a_longer_one_is_backed_off() -> None:
    """Retry-After 60 s: attempts a minute apart. 61 s, which the SDKs ignore: their backoff, 0.5 s then 1 s (each
    shortened by up to a quarter)."""
    _, sim = _run([_req(0.0, "x1")], retry_after_s=60.0)
    t = _times(sim, "x1")
    assert len(t) == 3 and all(abs(b - a - 60.0) < 0.01 for a, b in zip(t, t[1:], strict=False)), t
    _, sim = _run([_req(0.0, "x1")], retry_after_s=61.0)
    t = _times(sim, "x1")
    assert len(t) == 3 and 0.375 <= t[1] - t[0] <= 0.51 and 0.75 <= t[2] - t[1] <= 1.01, t


def test_a_turn_queued_past_the_clients_timeout_fails_under_a_policy_that_never_refuses() -> None:
    """One slot held 200 s by a long reply; a second session's turn queued behind it fails at its client's 100 s
    timeout and leaves the queue, and that conversation's next turn is then served. On two slots, a turn that would
    wait 200 s for the prefill engine (a 2M-token prompt ahead) fails the same way, and never takes the slot."""
    reqs = [_req(0.0, "a", out=10_000), _req(1.0, "b"), _req(1.0, "b", 1, think_s=1.0)]
    out, _ = _run(reqs, refuse=False, slots=1, client_timeout_s=100.0)
    assert out["failed_turns"] == out["failed_timeout"] == 1 and out["requests"] == 2, out
    assert out["ttft_with_retries_p99_s"] is not None and out["ttft_with_retries_p99_s"] < 100, out
    reqs = [_req(0.0, "a", tokens=2_000_000), _req(1.0, "b")]
    out, sim = _run(reqs, refuse=False, slots=2, client_timeout_s=100.0)
    assert out["failed_timeout"] == 1 and out["requests"] == 1, out
    assert sim.cluster.hosts["h000"].busy == 0


def test_the_client_figures_in_the_json() -> None:
    """Four turns, each refused once (Retry-After 2 s) and served: every turn refused once, one refusal per turn, none
    failed, and from the first attempt each took 2 s (and a round trip) more than its served attempt. Two of them
    always refused instead: those two failed (50%), after three refusals each: two refusals per turn."""
    reqs = [_req(100.0 * i, f"s{i}") for i in range(4)]
    out, _ = _run(reqs)
    assert (out["requests"], out["failed_turns"], out["failed_pct"]) == (4, 0, 0.0), out
    assert out["turns_refused_once_pct"] == 100.0 and out["refusals_per_turn"] == 1.0, out
    gap = out["ttft_with_retries_p50_s"] - out["ttft_p50_s"]
    assert 2.0 < gap < 2.01 and out["ttft_with_retries_p99_s"] - out["ttft_p99_s"] == gap, out
    reqs = [_req(100.0 * i, f"s{i}" if i % 2 else f"x{i}") for i in range(4)]
    out, _ = _run(reqs)
    assert (out["requests"], out["failed_turns"], out["failed_pct"]) == (2, 2, 50.0), out
    assert out["turns_refused_once_pct"] == 100.0 and out["refusals_per_turn"] == 2.0, out
    assert out["client_retries"] == 2 and out["client_timeout_s"] == 600.0, out
