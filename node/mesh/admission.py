"""Admission: whether the mesh takes a turn now, or refuses it early as overloaded.

Past what the mesh can serve within a bound, a queue only grows: every turn waits minutes, and
the agent behind it (which retries a 429 or Anthropic's 529 on its own, after `Retry-After`) is
better told at once. The check sits beside placement's action: `choose` picks the host, `admit`
says whether the turn may wait there. A turn of a running session (a host holds its cache) may
wait up to `wait_s`; a new session's first turn only `new_wait_s`, so under overload the mesh
keeps serving the conversations it has (warm, and cheap to serve) and refuses new ones first.
Either bound grows by the time the turn has already been refused (`waited_s`, which the entry keeps
by session id), up to `max_wait_s`: retries come back ahead of fresh arrivals, and an agent (which
retries a bounded number of times) is admitted within a few retries rather than starved.

The wait is the slot queue's (`HostLoad.wait_s`): overload is turns queueing for slots. A host
busy prefilling with a slot free is working, not overloaded (a coding agent's first prompt of 100k
tokens takes seconds of prefill on its own), so prefill backlog is placement's business, not a
reason to refuse. When the chosen host is over the bound, the turn may still start on a host that
needs no queue: for a turn nothing is cached for (a new session, or one evicted everywhere), any
host with a free slot, as it is cold anyway; for a turn with a cache, only a host running nothing
(placement's rule for a move that is not warm, without its wait: the capacity idles otherwise, so
the recompute deepens no queue). Only when no host can start it within the bound is it refused.
The sim (node.lab.sim) and the node (node.mesh.turn) call the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.node.mesh.placement import Decision, Holding, HostLoad, Policy, estimate, spread


@dataclass(frozen=True)
class Admission:
    wait_s: float = 3.0  # a running session's turn waits at most this long before it is refused
    new_wait_s: float = 1.0  # ...a new session's first turn
    max_wait_s: float = 5.0  # the bound of a turn refused before grows with its wait up to this
    max_retry_after_s: float = 60.0
    enabled: bool = True


@dataclass(frozen=True)
class Refusal:
    """The turn is refused: no host can start it within `bound_s`."""

    wait_s: float  # the shortest expected wait of any host that could take it
    bound_s: float
    retry_after_s: float
    new_session: bool

    def message(self) -> str:
        who = "a new session's first turn" if self.new_session else "this session's turn"
        return (f"the mesh is overloaded: {who} would wait about {self.wait_s:.0f} s for a slot "
                f"(the limit is {self.bound_s:g} s); retry after {self.retry_after_s:.0f} s")


def admit(d: Decision, hosts: dict[str, HostLoad], holdings: dict[str, Holding], prompt_tokens: int, policy: Policy,
          rule: Admission, *, unavailable: frozenset[str] = frozenset(), session: str = "",
          new_session: bool | None = None, waited_s: float = 0.0) -> Decision | Refusal:
    """`d` if its host starts the turn within the bound; else a host with a free slot that does; else a Refusal.
    `new_session`: whether this is a session's first turn (default: no host holds anything of it);
    `waited_s`: how long ago the turn was first refused."""
    cached = any(h.resident or h.stored or h.inbound for h in holdings.values())
    if new_session is None:
        new_session = d.home is None and not cached
    cap = max(rule.wait_s, rule.max_wait_s)
    bound = min(cap, (rule.new_wait_s if new_session else rule.wait_s) + waited_s)
    chosen = hosts.get(d.host)
    if not rule.enabled or chosen is None or chosen.wait_s() <= bound:
        return d
    cands = [h for h in hosts.values() if h.available and h.name not in unavailable]
    spare = [h for h in cands if h.free and (not cached or h.idle(policy))]
    if spare:
        est = {h.name: estimate(h, holdings.get(h.name), prompt_tokens, policy) for h in spare}
        best = min(spare, key=lambda h: (round(est[h.name][0], 4), spread(session, h.name), h.name))
        ttft, reuse, _ = est[best.name]
        return Decision(best.name, d.home, d.prev_host, reuse, ttft, "overflow")
    wait = min(h.wait_s() for h in cands) if cands else chosen.wait_s()
    # When the queue is expected to be back within the bound: later, the admitted queue would drain and
    # slots idle while refused turns sit out their wait.
    retry = min(rule.max_retry_after_s, max(1.0, wait - bound))
    return Refusal(wait, bound, retry, new_session)
