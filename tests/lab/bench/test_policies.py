"""`kvmesh bench policies`: real sim nodes replay a Claude Code trace under each `mesh.policy`, refusals retried."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TRACE = Path(__file__).resolve().parents[1] / "data" / "claude_code"


def test_both_policies_replay_the_same_trace_on_real_nodes(tmp_path: Path) -> None:
    """Two real nodes per run, kvmesh then session_hash: each serves turns with no error, one JSON line at the end,
    and every turn of each run is a line of its --turns-out file."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "bench", "policies", "--json", "--trace", str(TRACE),
                          "--hosts", "2", "--loads", "0.5", "--duration", "8", "--span", "300",
                          "--turns-out", str(tmp_path / "turns")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    runs = {r["policy"]: r for r in result["runs"]}
    assert set(runs) == {"kvmesh", "session_hash"}, result
    for r in runs.values():
        assert r["turns"] > 0 and r["errors"] == 0 and r["copies"] > 0, r
        assert r["prefill_tokens"] > 0 and r["goodput_per_s"] is not None and 0 < r["cpu_busy_pct"] <= 100, r
    assert runs["session_hash"]["refused_by_mesh"] == {}, runs  # the baselines never refuse
    for policy, r in runs.items():
        lines = [json.loads(x) for x in (tmp_path / "turns" / f"{policy}-0.5.jsonl").read_text().splitlines()]
        served = [x for x in lines if "failed" not in x]
        assert len(served) == r["turns"] and {x["host"] for x in served} <= {"h0", "h1"}, (policy, lines[:3])
        assert len(lines) - len(served) == r["failed_turns"], (policy, r)


def test_an_unknown_policy_is_refused_by_name() -> None:
    """A policy kvmesh has not: exit 2 naming it, before any node starts."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "bench", "policies", "--policies", "kvmesh,sticky"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown policy sticky" in out.stderr and "Traceback" not in out.stderr
