"""Admission: whether the mesh takes a turn now, or refuses it as overloaded with a place in line.

A refusal is judged by what the client does with it. The OpenAI and Anthropic SDKs (and Claude
Code, built on the latter) retry a 429 or 529 a few times (2 by default), after `Retry-After` when
it is at most 60 s, and give each attempt 600 s; a turn whose retries run out fails in the user's
face. So a refusal must never fail a turn a queue would have served:

- a turn that would start within its client's patience (`wait_s`; a new session's first turn,
  `new_wait_s`) is queued: a refusal would only send it away to wait as long;
- past that, it is refused with a Retry-After the client honours (the time until the queue is
  expected back within the patience, at most 60 s) and a place in line: when it comes back its turn
  is admitted whatever the queue then, and the turns arriving meanwhile count it ahead of them
  (`ahead_with`), so they cannot take its place. The entry keeps the places by session
  (`Reservations`); one its client never claims lapses;
- a turn that could not start within its client's timeout even after its Retry-After is queued, not
  refused: no place could serve it, a refusal could only fail it, and in the queue it may yet start
  (turns ahead of it give up too), or time out there as it would under any router.

The wait is the time before the turn's own prefill could start (`HostLoad.ahead_s`): for a slot,
and for the prefill engine to finish what runs and is queued there. When the chosen host is past the
patience, the turn may still start on a host that needs no queue: for a turn nothing is cached for,
any host with a free slot; for a turn with a cache, only a host running nothing (placement's rule for
a move that is not warm: the capacity idles otherwise, so the recompute deepens no queue). The sim
(node.lab.sim) and the node (node.mesh.mesh) call the same `admit_turn`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvmesh.node.mesh.placement import Decision, Holding, HostLoad, Policy, estimate, spread

# Retry-After goes out in whole seconds (rounded), so a client may come back up to this much before its place is due.
EARLY_S = 1.0


@dataclass(frozen=True)
class Admission:
    # A turn that starts within this is queued, not refused (a running session's; a new session's first). Measured in
    # `kvmesh sim --sweep` with the SDKs' clients: a minute refuses under 0.1% of the turns at 0.6 and fails none
    # (README, "Overload is explicit").
    wait_s: float = 60.0
    new_wait_s: float = 60.0
    max_retry_after_s: float = 60.0  # the longest Retry-After the SDKs honour (a longer one, they ignore)
    timeout_s: float = 600.0  # the SDKs' attempt timeout: a turn queued longer has lost its client
    enabled: bool = True


@dataclass(frozen=True)
class Reservation:
    """A refused turn's place in line: from `due` its turn is admitted whatever the queue."""

    host: str
    since: float  # when the turn was refused
    due: float
    tokens: int = 0  # what it will prefill there (counted in the host's prefill queue meanwhile)


@dataclass(frozen=True)
class Refusal:
    """The turn is refused: no host can start it within `bound_s`; it keeps `reserved`, its place in line."""

    wait_s: float  # the expected wait where it would run
    bound_s: float
    retry_after_s: float
    new_session: bool
    reserved: Reservation

    def message(self) -> str:
        who = "a new session's first turn" if self.new_session else "this session's turn"
        return (f"the mesh is overloaded: {who} would wait about {self.wait_s:.0f} s "
                f"(the limit is {self.bound_s:g} s); retry after {self.retry_after_s:.0f} s: its place in line is kept")


class Reservations:
    """The places in line an entry has promised, by session, and what each host owes them."""

    def __init__(self, cap: int = 10_000, lapse_s: float = 30.0) -> None:
        self.cap, self.lapse_s = cap, lapse_s  # a place not claimed this long after it is due lapses
        self._by_session: collections.OrderedDict[str, Reservation] = collections.OrderedDict()
        self._per_host: dict[str, tuple[int, int]] = {}  # host -> (places, their tokens)

    def __len__(self) -> int:
        return len(self._by_session)

    def _lapse(self, now: float) -> None:
        # Oldest first: places are promised at most max_retry_after_s ahead, so the order is close to due order.
        while self._by_session:
            session, r = next(iter(self._by_session.items()))
            if r.due + self.lapse_s >= now and len(self._by_session) <= self.cap:
                return
            self.release(session)

    def get(self, session: str, now: float) -> Reservation | None:
        self._lapse(now)
        return self._by_session.get(session)

    def per_host(self, now: float) -> Mapping[str, tuple[int, int]]:
        self._lapse(now)
        return self._per_host

    def hold(self, session: str, r: Reservation) -> None:
        self.release(session)
        self._by_session[session] = r
        n, tokens = self._per_host.get(r.host, (0, 0))
        self._per_host[r.host] = (n + 1, tokens + r.tokens)

    def release(self, session: str) -> None:
        r = self._by_session.pop(session, None)
        if r is None:
            return
        n, tokens = self._per_host[r.host]
        if n <= 1:
            del self._per_host[r.host]
        else:
            self._per_host[r.host] = (n - 1, tokens - r.tokens)


def ahead_with(h: HostLoad, reserved: tuple[int, int] = (0, 0)) -> float:
    """How long a new turn would wait on `h` before its own prefill starts (`HostLoad.ahead_s`), counting the turns
    promised a place there (`reserved`: how many, and their prompt tokens) ahead of it."""
    n, tokens = reserved
    if n <= 0:
        return h.ahead_s()
    ahead = h.queued + n - (h.free if h.queued == 0 else 0)
    slot = 0.0 if ahead < 0 else (ahead + 1) * h.mean_turn_s / max(1, h.slots)
    return max(slot, h.prefill_wait_s() + tokens / h.prefill_tps)


def admit(d: Decision, hosts: dict[str, HostLoad], holdings: dict[str, Holding], prompt_tokens: int, policy: Policy,
          rule: Admission, *, unavailable: frozenset[str] = frozenset(), session: str = "",
          new_session: bool | None = None, now: float = 0.0, reservation: Reservation | None = None,
          reserved: Mapping[str, tuple[int, int]] | None = None) -> Decision | Refusal:
    """`d` if its host starts the turn within the patience, or its place in line (`reservation`) is due, or no place
    could serve it; else a host with a free slot that does; else a Refusal with its place.
    `new_session`: whether this is a session's first turn (default: no host holds anything of it);
    `reserved`: the places promised on each host."""
    cached = any(h.resident or h.stored or h.inbound for h in holdings.values())
    if new_session is None:
        new_session = d.home is None and not cached
    bound = rule.new_wait_s if new_session else rule.wait_s
    if not rule.enabled:
        return d
    if reservation is not None:
        if now >= reservation.due - EARLY_S:
            return d
        early = reservation.due - now  # back before its place is due (a client that did not wait): it is kept
        return Refusal(early, bound, math.ceil(early), new_session, reservation)
    owed = reserved or {}
    chosen = hosts.get(d.host)
    if chosen is None or ahead_with(chosen, owed.get(d.host, (0, 0))) <= bound:
        return d
    cands = [h for h in hosts.values() if h.available and h.name not in unavailable]
    waits = {h.name: ahead_with(h, owed.get(h.name, (0, 0))) for h in cands}
    spare = [h for h in cands if waits[h.name] <= bound and h.free and (not cached or h.idle(policy))]
    if spare:
        est = {h.name: estimate(h, holdings.get(h.name), prompt_tokens, policy) for h in spare}
        best = min(spare, key=lambda h: (round(est[h.name][0], 4), spread(session, h.name), h.name))
        ttft, reuse, _ = est[best.name]
        return Decision(best.name, d.home, d.prev_host, reuse, ttft, "overflow")
    # The place is where the turn goes when it comes back: placement's host (one its cache is not on would not take
    # it then either).
    wait = waits.get(d.host, ahead_with(chosen))
    # Back when the queue is expected within the patience again (later, the admitted queue would drain while
    # refused turns sit out their wait); whole seconds, as the header says it.
    retry = float(min(rule.max_retry_after_s, max(1, math.ceil(wait - bound))))
    if wait - retry > rule.timeout_s:
        # Even back after its Retry-After it would not start within its client's timeout: a refusal could only fail
        # it. Queued, it may yet start (the turns ahead of it give up too), or time out as under any router. Measured
        # (Mooncake, 2 hosts, 1.2): refusing such turns failed 3.9% of them against session hashing's 2.9%; queued, 2.9%.
        return d
    todo = max(0, prompt_tokens - d.predicted_reused)
    return Refusal(wait, bound, retry, new_session, Reservation(d.host, now, now + retry, todo))


def admit_turn(book: Reservations, session: str, now: float, d: Decision, hosts: dict[str, HostLoad],
               holdings: dict[str, Holding], prompt_tokens: int, policy: Policy, rule: Admission, *,
               unavailable: frozenset[str] = frozenset(), new_session: bool | None = None) -> Decision | Refusal:
    """`admit` with the entry's places in line: a refusal's place is kept, an admitted turn's given up."""
    held = book.get(session, now)
    a = admit(d, hosts, holdings, prompt_tokens, policy, rule, unavailable=unavailable, session=session,
              new_session=new_session, now=now, reservation=held, reserved=book.per_host(now))
    if isinstance(a, Refusal):
        if held is None:
            book.hold(session, a.reserved)
    else:
        book.release(session)
    return a
