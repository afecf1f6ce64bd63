"""`kvmesh sim --sweep`: one row per policy, size and load, and each check kvmesh fails in a cell named."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from kvmesh.node.lab.sim.sweep import failures


def _row(policy: str, **kw: Any) -> dict[str, Any]:
    base = {"policy": policy, "warm_pct": 99.0, "ttft_p50_s": 1.0, "ttft_p99_s": 5.0, "goodput_per_s": 2.0,
            "prefill_tokens": 100, "prefill_mtok": 0.0}
    return {**base, **kw}


def test_a_cell_where_kvmesh_matches_the_others_holds() -> None:
    """Equal figures everywhere: no failed check."""
    assert failures([_row("kvmesh"), _row("session_hash"), _row("kv_overlap")]) == []


def test_each_check_kvmesh_fails_is_named() -> None:
    """Less warm by more than 0.2, a slower p50 and p99, less goodput, 6% more prefill: five reasons."""
    cell = [_row("kvmesh", warm_pct=98.7, ttft_p50_s=1.1, ttft_p99_s=6.0, goodput_per_s=1.9, prefill_tokens=106),
            _row("session_hash"), _row("kv_overlap", warm_pct=90.0)]
    why = failures(cell)
    assert len(why) == 5, why
    assert any(w.startswith("warm 98.7") for w in why) and any("session_hash's 1.0" in w for w in why), why
    assert any(w.startswith("goodput") for w in why) and any(w.startswith("prefill") for w in why), why
    assert failures([_row("kvmesh", warm_pct=98.85), _row("session_hash")]) == []  # within 0.2 points


def test_the_sweep_runs_every_policy_of_a_cell_and_ends_with_one_json_line() -> None:
    """Two hosts at 0.3 on the shipped Mooncake trace, kvmesh and session_hash: the table, then the verdict."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--sweep", "--sweep-traces", "mooncake",
                          "--sweep-hosts", "2", "--sweep-loads", "0.3", "--sweep-policies", "kvmesh,session_hash",
                          "--jobs", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["cells"] == 1 and [r["policy"] for r in result["rows"]] == ["kvmesh", "session_hash"], result
    assert result["held"] + len(result["failed"]) == 1
    assert lines[0].startswith("| trace | hosts | load | policy |") and any("**kvmesh**" in ln for ln in lines)


def test_an_unknown_sweep_policy_is_refused_by_name() -> None:
    """A policy the sim has not: exit 2 naming it, no traceback."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--sweep", "--sweep-policies", "kvmesh,sticky"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown sticky" in out.stderr and "Traceback" not in out.stderr
