"""`kvmesh soak`, short: 64 agent sessions for 30 s on a three-node sim mesh, 0 errors, sane figures."""

from __future__ import annotations

from .conftest import run_cli


def test_soak_half_a_minute() -> None:
    """30 s of 64 sessions: no error, sane latencies, and no node leaks threads or fds or miscounts its store."""
    r, proc = run_cli("soak", "--minutes", "0.5", "--json", timeout=200)
    assert proc.returncode == 0, (r, proc.stderr[-2000:])
    assert r["passed"] and r["errors"] == 0, r["error_samples"]
    assert r["sessions"] == 64 and r["turns"] >= 64, r
    assert set(r["status"]) == {"200"}, r["status"]
    assert 0 < r["latency_p50_s"] <= r["latency_p99_s"] < 60, r
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] < 60, r
    assert set(r["nodes"]) == {"node-a", "node-b", "node-c"}
    for name, n in r["nodes"].items():
        # Every node served turns; its process figures were read (the KV pool alone is > 100 MiB).
        assert n["engine_turns"] > 0, (name, n)
        assert 100 < n["rss_start_mib"] and 100 < n["rss_end_mib"] <= n["rss_max_mib"] + 0.1, (name, n)
        assert 0 < n["fds_start"] and 0 < n["fds_end"] < 1000, (name, n)
        # No thread leaks: each node ran ~100 turns and as many transfers; one thread each would show.
        assert 0 < n["threads_start"] and n["threads_end"] <= n["threads_start"] + 8, (name, n)
        assert n["fds_end"] <= n["fds_start"] + 96, (name, n)  # ~100 turns each: an fd left per turn or transfer shows
        # Every node stored replicas, and the store's own byte count is what its files hold on disk
        # (within 10%: a write-behind may land between the two readings).
        assert n["store_bytes"] > 0, (name, n)
        assert abs(n["store_disk_bytes"] - n["store_bytes"]) <= 0.1 * n["store_bytes"], (name, n)
    assert r["store_bytes_total"] > 0, "no replica reached any store"
    assert r["rss_growth_judged"] is False  # a 30 s run is warm-up; growth is judged on 10+ minutes
    for name, n in r["nodes"].items():
        # One row a minute (the first at the start): minute, anonymous RSS, store MiB.
        assert n["per_minute"] and all(len(row) == 3 and row[1] > 100 for row in n["per_minute"]), (name, n)
    assert r["steady_reason"] in ("stores full", "stores not full by half the run", "run too short"), r
