"""`kvmesh bench subagents`: Claude Code's subagents under the main's session id, on real sim node processes."""

from __future__ import annotations

import json
import subprocess
import sys

VARIANTS = {"same_id/concurrent", "own_ids/concurrent", "same_id/serial", "own_ids/serial"}


def test_bench_subagents_runs_them_in_parallel_under_one_id_and_keeps_the_main_warm() -> None:
    """Subagents at once under the main's id take as long as under their own, and the main's next turn reuses >= 90%."""
    r = subprocess.run([sys.executable, "-m", "kvmesh", "bench", "subagents", "--json", "--main-tokens", "8000",
                        "--subagent-tokens", "6000"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["engine"] == "sim" and result["errors"] == 0 and result["turns"] == 2 * 4 * 5, result
    for mesh in ("one_node", "two_nodes"):
        run = result[mesh]
        assert set(run["variants"]) == VARIANTS, run
        for name, v in run["variants"].items():
            assert len(v["subagents"]) == 3 and v["main_first"]["cached"] == 0, (mesh, name, v)
            assert all(s["host"] for s in v["subagents"]) and v["main_next"]["host"], (mesh, name, v)
        # Sim prefill is timed sleep, so the ratio is about 1.0 when the subagents run at once, 3 when queued; the
        # margin over the 1.2 goal is for a shared box's noise on a small run.
        assert run["parallel_ratio"] is not None and run["parallel_ratio"] <= 1.5, (mesh, run)
        assert run["main_reuse"] is not None and run["main_reuse"] >= 0.9, (mesh, run)
    assert result["parallel_ratio"] == max(result[m]["parallel_ratio"] for m in ("one_node", "two_nodes"))
    assert result["main_reuse"] == min(result[m]["main_reuse"] for m in ("one_node", "two_nodes"))
