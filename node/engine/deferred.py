"""A compute-thread job that starts only after a grace period, and that whoever needs its thread first can drop.

A turn's end settles its slot's last partial block (node.engine.live.OwnTail): work that only pays where the slot
sits idle before its next turn. A client that answers at once (a tool that took no time, a subagent's next step,
a benchmark) would otherwise find that work running and wait it out in its time to first token, where its own
prefill would have recomputed those cells for less (unpadded, inside its first ubatch). So the job waits a grace
period on a clock thread, not on an event loop (a settle outlives the loop of the turn that started it: benches
and tests run each turn in a loop of their own), then waits for its thread to be idle (`when`: a settle run while
other slots decode is a stall in each of their streams), and `cancel` drops it while it has not started. Every
deferred job of the process shares that one clock thread: a host that stays busy keeps each slot's settle asking
again every grace period, and a thread per ask would start five a second for each.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class _Clock:
    """One daemon thread that calls each callback once its time has come, earliest first."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties keep their order; callables never compare
        self._thread: threading.Thread | None = None

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._due, (time.monotonic() + delay_s, next(self._order), fn))
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(target=self._loop, name="kvmesh-deferred", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cv.wait(self._due[0][0] - time.monotonic() if self._due else None)
                fn = heapq.heappop(self._due)[2]
            try:
                fn()
            except Exception:  # one job's failure never stops the others' clock
                log.exception("a deferred job's timer callback failed")


_clock = _Clock()


class Deferred(Generic[T]):
    """`start()` (which submits the job, returning its future) called `after_s` from now, and then at each
    `after_s` until `when()` says so, unless cancelled first. `done` ends as the job ends: its result, its error, or
    cancelled (dropped, or its executor was shut down)."""

    def __init__(self, after_s: float, start: Callable[[], concurrent.futures.Future[T]],
                 when: Callable[[], bool] = lambda: True):
        self.done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._after_s, self._start, self._when = after_s, start, when
        self._lock = threading.Lock()
        self._job: concurrent.futures.Future[T] | None = None
        _clock.call_later(after_s, self._fire)

    def _fire(self) -> None:
        with self._lock:
            if self.done.cancelled():
                return
            if not self._when():
                _clock.call_later(self._after_s, self._fire)
                return
            try:
                self._job = job = self._start()
            except RuntimeError:  # its executor is shut down (the engine closed meanwhile): it never runs
                self._drop()
                return
        job.add_done_callback(self._copy)

    def _copy(self, job: concurrent.futures.Future[T]) -> None:
        if job.cancelled():
            self._drop()
        elif not self.done.done():
            if (e := job.exception()) is not None:
                self.done.set_exception(e)
            else:
                self.done.set_result(job.result())

    def cancel(self) -> bool:
        """Drop the job if it has not started; False where it runs or ran (then `done` ends with it)."""
        with self._lock:
            job = self._job  # a pending clock callback finds `done` cancelled and does nothing
            if job is None:
                self._drop()
                return True
        return job.cancel()  # its callback cancels `done`

    def _drop(self) -> None:
        """`done` ends cancelled, and `concurrent.futures.wait` on it hears so (as an executor's own futures do)."""
        if self.done.cancel():
            self.done.set_running_or_notify_cancel()
