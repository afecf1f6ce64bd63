"""The event-loop lag monitor: it reports the lateness a blocking callback causes, over a bounded window."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import serve_in_thread
from kvmesh.node.looplag import LoopLagMonitor
from kvmesh.node.metrics import Metrics


def test_quantiles_over_the_window() -> None:
    """p99 and max are computed over the last `window` samples only."""
    mon = LoopLagMonitor(window=100)
    for _ in range(99):
        mon.record(0.001)
    mon.record(0.5)
    assert mon.max_ms() == pytest.approx(500.0)
    assert mon.quantile_ms(0.99) == pytest.approx(500.0)  # 1 sample in 100 sits at the 99th percentile
    assert mon.quantile_ms(0.5) == pytest.approx(1.0)
    for _ in range(100):  # the stall leaves the window
        mon.record(0.002)
    assert mon.samples == 100
    assert mon.max_ms() == pytest.approx(2.0)
    assert mon.stats() == {"loop_lag_p99_ms": 2.0, "loop_lag_max_ms": 2.0, "loop_lag_cpu_p99_ms": 0.0,
                           "loop_lag_samples": 100}


def test_empty_monitor_reports_zero() -> None:
    """Before the first tick the figures are 0, not an error."""
    mon = LoopLagMonitor()
    assert mon.stats() == {"loop_lag_p99_ms": 0.0, "loop_lag_max_ms": 0.0, "loop_lag_cpu_p99_ms": 0.0,
                           "loop_lag_samples": 0}


def _spin(secs: float) -> None:
    """Block the calling thread on the CPU (unlike time.sleep)."""
    t_end = time.thread_time() + secs
    while time.thread_time() < t_end:
        pass


def _lag_during(blocker: Callable[[float], None]) -> tuple[float, float, float, float]:
    """(idle p50, max, p99, cpu p99) of a monitor while `blocker(0.15)` runs once on the loop."""

    async def main() -> tuple[float, float, float, float]:
        seen: list[float] = []
        mon = LoopLagMonitor(interval_s=0.005, observe=seen.append)
        mon.start()
        await asyncio.sleep(0.2)
        idle_p50 = mon.quantile_ms(0.5)
        asyncio.get_running_loop().call_soon(blocker, 0.15)  # the injected slow callback
        await asyncio.sleep(0.2)
        mon.stop()
        assert not mon.running
        assert len(seen) == mon.samples > 10
        return idle_p50, mon.max_ms(), mon.quantile_ms(0.99), mon.quantile_ms(0.99, cpu=True)

    return asyncio.run(main())


def test_blocking_callback_shows_as_lag() -> None:
    """A callback that blocks the loop for 150 ms (sleeping) is reported as about that much lag, not as loop CPU."""
    idle_p50, worst, p99, cpu_p99 = _lag_during(time.sleep)
    assert worst >= 140.0
    assert p99 >= 100.0  # one sample in ~70: inside the top 1%
    assert idle_p50 < worst / 5
    assert cpu_p99 < 50.0  # the loop thread slept: the lag is waiting, not its own CPU work


def test_cpu_bound_callback_counts_as_loop_cpu() -> None:
    """A callback that spins the loop's CPU for 150 ms shows as lag and as the loop's own CPU part of it."""
    _, worst, p99, cpu_p99 = _lag_during(_spin)
    assert worst >= 140.0
    assert cpu_p99 >= 100.0
    assert cpu_p99 <= p99


def test_metrics_histogram_gets_the_samples() -> None:
    """The node's /metrics exposes the lag histogram fed by the monitor."""
    m = Metrics("n1")
    mon = LoopLagMonitor(observe=m.loop_lag.observe)
    mon.record(0.003)
    mon.record(0.2)
    assert m.registry.get_sample_value("kvmesh_event_loop_lag_seconds_count") == 2.0
    assert m.registry.get_sample_value("kvmesh_event_loop_lag_seconds_bucket", {"le": "0.005"}) == 1.0


def test_rejects_bad_arguments() -> None:
    """Non-positive intervals and windows, and quantiles outside 0..1, are refused."""
    with pytest.raises(ValueError):
        LoopLagMonitor(interval_s=0)
    with pytest.raises(ValueError):
        LoopLagMonitor(window=0)
    with pytest.raises(ValueError):
        LoopLagMonitor().quantile_ms(1.5)


def test_node_exports_loop_lag() -> None:
    """A running node reports loop_lag_p99_ms/loop_lag_max_ms in /v1/stats and the histogram in /metrics."""
    cfg = NodeConfig(name="lag-node", engine=EngineConfig(kind="sim", cache_bytes=16 << 20, slots=1,
                                                           sim=SimConfig(kv_scale=0.01)))
    srv = serve_in_thread(cfg)
    try:
        deadline = time.monotonic() + 10
        while srv.node.loop_lag.samples < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = httpx.get(srv.url + "/v1/stats", timeout=10).json()
        text = httpx.get(srv.url + "/metrics", timeout=10).text
    finally:
        srv.stop()
    assert stats["loop_lag_samples"] >= 5
    assert 0.0 <= stats["loop_lag_p99_ms"] <= stats["loop_lag_max_ms"]
    assert "kvmesh_event_loop_lag_seconds_bucket" in text
    assert not srv.node.loop_lag.running  # stopped with the node
