"""Keeping the garbage collector's full collections off the refresh path of a big console.

A full (generation 2) collection walks every tracked object: with a few thousand
sessions that was a 150 ms stall every few seconds, the p95 of the refresh, and at
20,000 sessions (a 256-host mesh, every node's part kept) 0.3-0.6 s. What the console
holds is long-lived (the state, the widgets, the row caches), and nearly all of its
churn is freed by reference counting, which freezing does not touch. So:

- after cluster views land (256 nodes' parts arrive over seconds), each refresh freezes
  the heap as it is, without collecting (cheap), and once they stop for
  SETTLE_AFTER_S the heap is collected once and frozen: `settle`;
- in the steady state, every YOUNG_EVERY_S the young generations are collected and
  what survives is frozen, so a full collection never has more than that many
  seconds of render caches to walk (it was 60-130k objects, ~0.1-0.2 s);
- what froze as garbage in between (only reference cycles that outlived the young
  generations) is collected by a full settle at most every FULL_EVERY_S: one
  stall that often, instead of one every few seconds.
Below MIN_SESSIONS none of this is worth its one-off cost.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

MIN_SESSIONS = 500
SETTLE_AFTER_S = 1.0
YOUNG_EVERY_S = 2.0
FULL_EVERY_S = 300.0


class HeapSettler:
    """The policy above; `after_refresh` is called once per refresh, with the app's timer factory."""

    def __init__(self, sessions: Callable[[], int], clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions = sessions
        self._clock = clock
        self._frozen_at = float("-inf")  # last full settle
        self._frozen_sessions = 0
        self._young_at = float("-inf")
        self._pending: Callable[[], object] | None = None  # stops the settle timer that is waiting

    def after_refresh(self, cluster_view: bool, set_timer: Callable[[float, Callable[[], None]], Callable[[], object]]) -> None:
        if self._sessions() < MIN_SESSIONS:
            return
        now = self._clock()
        if cluster_view:
            gc.freeze()
            if self._pending is not None:
                self._pending()
            self._pending = set_timer(SETTLE_AFTER_S, self.settle)
        elif now - self._frozen_at >= FULL_EVERY_S and self._pending is None:
            self.settle(force=True)
        elif now - self._young_at >= YOUNG_EVERY_S:
            self._young_at = now
            gc.collect(1)
            gc.freeze()

    def settle(self, force: bool = False) -> None:
        """Collect everything once and freeze what survives (at most once a minute unless the sessions doubled)."""
        self._pending = None
        now, n = self._clock(), self._sessions()
        if n < MIN_SESSIONS or not (force or now - self._frozen_at >= 60 or n >= 2 * self._frozen_sessions):
            return
        self._frozen_at, self._frozen_sessions, self._young_at = now, n, now
        gc.unfreeze()
        gc.collect()
        gc.freeze()
