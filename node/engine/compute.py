"""A runner's one compute thread, which can say whether anything waits for it or runs on it.

Every llama.cpp call of a runner runs on one thread (its OpenMP team belongs to the thread that first computes), so
prefills, loads, stores, decode batches and settles queue behind each other there. Idle-time work (a settle,
node.engine.deferred) asks `idle()` before it queues: it counts each job from its submission until its future ends,
by the future's own done-callback, so a job whose awaiting turn was cancelled still counts while it runs, and one
dropped from the queue (cancelled, or the executor shut down) stops counting at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ComputeThread(concurrent.futures.ThreadPoolExecutor):
    """A one-thread executor that counts its jobs not yet ended (submitted from any thread, read from any)."""

    def __init__(self, name: str):
        super().__init__(1, thread_name_prefix=name)
        self._count_lock = threading.Lock()
        self._unended = 0

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> concurrent.futures.Future[T]:
        with self._count_lock:
            self._unended += 1
        try:
            fut = super().submit(fn, *args, **kwargs)
        except BaseException:  # shut down: nothing was queued
            self._ended(None)
            raise
        fut.add_done_callback(self._ended)
        return fut

    def _ended(self, _: Any) -> None:
        with self._count_lock:
            self._unended -= 1

    def idle(self) -> bool:
        """No job waits for the thread or runs on it."""
        with self._count_lock:
            return self._unended == 0
