"""Event-loop lateness: how long ready callbacks wait before the loop runs them.

A periodic timer asks to run every `interval_s`; how late it actually runs is
the time everything else on the loop (turns, events, placement decisions)
waited too. Anything that blocks the loop (a copy, a digest, an fsync, a long
synchronous computation) shows up here as lag, whichever code caused it.

Samples are kept in a bounded window (p99 and max are over its last `window`
samples) and, when given, fed to an observer such as a Prometheus histogram.

Beside each lateness the monitor keeps the part of it that the loop thread's
own CPU time explains (its CPU time over the period, less the period, within
0..lateness): high lateness with a low CPU part means the loop waited for a
core or the GIL (a contended host), not that its own callbacks blocked it.
A blocking call that does not use CPU (an fsync) counts as waiting.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

INTERVAL_S = 0.01  # short enough to see a stall of a few ms, cheap enough to leave on (100 wakeups/s)
WINDOW = 6000  # samples kept: the last minute at INTERVAL_S
# Prometheus buckets (seconds) for the lag histogram: the goal is <= 5 ms at p99.
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLagMonitor:
    """Measures the running loop's lateness with a self-rescheduling timer."""

    def __init__(
        self,
        *,
        interval_s: float = INTERVAL_S,
        window: int = WINDOW,
        observe: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if window < 1:
            raise ValueError("window must be >= 1")
        self.interval_s = interval_s
        self._observe = observe
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._samples: collections.deque[float] = collections.deque(maxlen=window)
        self._cpu_samples: collections.deque[float] = collections.deque(maxlen=window)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._cpu_at = 0.0  # the loop thread's CPU time when the current period began

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        """Start measuring the running loop (call from a coroutine or callback on it)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        assert self._loop is not None
        # The loop's own clock decides when the timer is due; ours measures when it ran.
        self._due = self._clock() + self.interval_s
        self._cpu_at = self._cpu_clock()  # runs on the loop thread: its CPU clock
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        # The loop may run a timer up to its clock resolution early: that is not negative lag.
        lag = max(0.0, self._clock() - self._due)
        busy = self._cpu_clock() - self._cpu_at
        self.record(lag, min(lag, max(0.0, busy - self.interval_s)))
        self._schedule()

    def record(self, lag_s: float, cpu_s: float = 0.0) -> None:
        """Add one lateness sample (seconds), and the part of it the loop's own CPU time explains."""
        self._samples.append(lag_s)
        self._cpu_samples.append(cpu_s)
        if self._observe is not None:
            self._observe(lag_s)

    @property
    def samples(self) -> int:
        return len(self._samples)

    def quantile_ms(self, q: float, *, cpu: bool = False) -> float:
        """The q-quantile of the window's lateness (cpu=True: of its CPU part), in ms; 0.0 before the first sample."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be within 0..1")
        xs = sorted(self._cpu_samples if cpu else self._samples)
        if not xs:
            return 0.0
        return 1000.0 * xs[min(len(xs) - 1, int(q * len(xs)))]

    def max_ms(self) -> float:
        return 1000.0 * max(self._samples, default=0.0)

    def stats(self) -> dict[str, float | int]:
        """The figures /v1/stats reports."""
        return {
            "loop_lag_p99_ms": round(self.quantile_ms(0.99), 3),
            "loop_lag_max_ms": round(self.max_ms(), 3),
            "loop_lag_cpu_p99_ms": round(self.quantile_ms(0.99, cpu=True), 3),
            "loop_lag_samples": self.samples,
        }
