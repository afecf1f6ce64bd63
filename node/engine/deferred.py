"""A compute-thread job that starts only after a grace period, and that whoever needs its thread first can drop.

A turn's end settles its slot's last partial block (node.engine.live.OwnTail): work that only pays where the slot
sits idle before its next turn. A client that answers at once (a tool that took no time, a subagent's next step,
a benchmark) would otherwise find that work running and wait it out in its time to first token, where its own
prefill would have recomputed those cells for less (unpadded, inside its first ubatch). So the job waits a grace
period on a timer thread, not on an event loop (a settle outlives the loop of the turn that started it: benches
and tests run each turn in a loop of their own), then waits for its thread to be idle (`when`: a settle run while
other slots decode is a stall in each of their streams), and `cancel` drops it while it has not started.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


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
        self._timer = self._arm()

    def _arm(self) -> threading.Timer:
        t = threading.Timer(self._after_s, self._fire)
        t.daemon = True  # a grace period never keeps a process alive
        t.start()
        return t

    def _fire(self) -> None:
        with self._lock:
            if self.done.cancelled():
                return
            if not self._when():
                self._timer = self._arm()
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
            self._timer.cancel()
            job = self._job
            if job is None:
                self._drop()
                return True
        return job.cancel()  # its callback cancels `done`

    def _drop(self) -> None:
        """`done` ends cancelled, and `concurrent.futures.wait` on it hears so (as an executor's own futures do)."""
        if self.done.cancel():
            self.done.set_running_or_notify_cancel()
