"""`kvmesh soak`'s verdict: file descriptors and latency are judged too, and a failure names its rule."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvmesh.node.lab.launcher import NodeProcess
from kvmesh.node.lab.soak import Soak

MIB = 1 << 20


def _soak(tmp: Path, fds: tuple[float, float], minutes: float = 0.5) -> Soak:
    """A Soak whose samples are given: 500 MiB RSS throughout, `fds` open at steady state and at the end."""
    args = argparse.Namespace(minutes=minutes, sessions=64, slots=8, max_rss_growth_pct=5.0, max_p99_s=30.0,
                              max_fd_growth=32)
    s = Soak(args, tmp)
    s.nodes = [NodeProcess("node-a", tmp / "a.toml", tmp)]
    mem = {"rss": 500.0 * MIB, "shared": 100.0 * MIB, "threads": 20.0}
    s.samples = {"node-a": {"ready": {**mem, "fds": 40.0}, "start": {**mem, "fds": fds[0]},
                            "steady": {**mem, "fds": fds[0]}, "end": {**mem, "fds": fds[1]}}}
    s.rss_max = {"node-a": 500.0 * MIB}
    s.steady_at = 5.0
    return s


def _report(s: Soak, p99: float) -> dict[str, Any]:
    load = {"turns": 500, "errors": 0, "status": {"200": 500}, "error_samples": [], "conversations": 64,
            "latency_p50_s": 1.0, "latency_p99_s": p99, "ttft_p50_s": 0.1, "ttft_p99_s": 0.5}
    stats = {"node-a": {"kvshare": {"store_bytes": 1}, "engine": {"turns": 500}}}
    cluster = {"counters": {"warm": 1, "partial": 0, "cold": 0, "stale_state_cold": 0}}
    return s.report(load, 30.0, stats, cluster)


def test_a_clean_run_passes(tmp_path: Path) -> None:
    """No errors, p99 under the bound and fds back to the steady level: passed, no rule failed."""
    r = _report(_soak(tmp_path, (120, 90)), p99=3.0)
    assert r["passed"] and r["failed_rules"] == []


def test_fd_growth_fails_the_run_and_names_the_rule(tmp_path: Path) -> None:
    """A node ending with 200 more fds than at steady state fails the soak as `fds`, with the figures."""
    r = _report(_soak(tmp_path, (100, 300)), p99=3.0)
    assert not r["passed"]
    assert r["failed_rules"] == ["fds: node-a 100 -> 300 (+200, bound +32)"]


def test_p99_over_the_bound_fails_the_run_and_names_the_rule(tmp_path: Path) -> None:
    """A p99 turn latency over --max-p99-s fails the soak as `latency`."""
    r = _report(_soak(tmp_path, (100, 100)), p99=45.0)
    assert not r["passed"]
    assert r["failed_rules"] == ["latency: p99 45.0s over the 30s bound"]
