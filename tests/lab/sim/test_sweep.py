"""`kvmesh sim --sweep`: one row per policy, size and load, and each check kvmesh fails in a cell named."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from kvmesh.node.lab.sim.sweep import every_turn_percentile, failures, pool


def _row(policy: str, **kw: Any) -> dict[str, Any]:
    base = {"policy": policy, "warm_pct": 99.0, "ttft_p50_s": 1.0, "ttft_p99_s": 5.0, "goodput_per_s": 2.0,
            "prefill_tokens": 100, "prefill_mtok": 0.0, "failed_turns": 0, "ttft_with_retries_p99_s": 5.0,
            "ttft_every_turn_p99_s": 5.0}
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


def test_a_cell_where_kvmesh_fails_more_turns_or_keeps_them_longer_in_all_is_not_held() -> None:
    """As the clients lived it: one failed turn more than session hashing, or a TTFT from the first attempt 0.1 s
    longer at p99 than kv_overlap's, is a failed check, each named, whatever the other figures."""
    why = failures([_row("kvmesh", failed_turns=3), _row("session_hash", failed_turns=2), _row("kv_overlap", failed_turns=9)])
    assert why == ["failed turns 3 > session_hash's 2"], why
    why = failures([_row("kvmesh", ttft_every_turn_p99_s=5.1), _row("session_hash", ttft_every_turn_p99_s=6.0),
                    _row("kv_overlap")])
    assert why == ["ttft_every_turn_p99_s 5.1 > kv_overlap's 5.0"], why


def test_a_turn_that_failed_counts_later_than_any_served_at_p99() -> None:
    """A p99 turn that failed (None) loses to any served one, and ties another policy's failed p99 turn; the p99
    of the served turns alone is not judged (it drops the turns that timed out)."""
    why = failures([_row("kvmesh", ttft_every_turn_p99_s=None), _row("session_hash", ttft_every_turn_p99_s=599.0)])
    assert why == ["ttft_every_turn_p99_s failed > session_hash's 599.0"], why
    assert failures([_row("kvmesh", ttft_every_turn_p99_s=650.0, ttft_with_retries_p99_s=650.0),
                     _row("session_hash", ttft_every_turn_p99_s=None, ttft_with_retries_p99_s=599.0)]) == []
    assert failures([_row("kvmesh", ttft_every_turn_p99_s=None), _row("session_hash", ttft_every_turn_p99_s=None)]) == []
    served = [float(i) for i in range(100)]
    assert every_turn_percentile(served, 0, 0.99) == 99.0 and every_turn_percentile(served, 2, 0.99) is None


def _run(seed: int, ttft: list[float], warm: int, follow: int, prefill: int) -> tuple[dict[str, Any], list[float], list[float]]:
    row = {"trace": "t", "hosts": 2, "load": 0.3, "policy": "kvmesh", "seed": seed, "requests": len(ttft), "refused": 1,
           "failed_turns": seed, "failed_timeout": 1, "turns_refused": 1, "client_retries": 2,
           "follow_ups": follow, "follow_ups_by_class": {"warm": warm, "cold": follow - warm}, "slo_s": 2.0,
           "duration_s": 10.0, "prefill_tokens": prefill, "utilisation": 0.5, "moves": 1, "wall_s": 0.1}
    return row, sorted(ttft), sorted(x + 1 for x in ttft)


def test_a_cells_row_pools_its_seeds_runs() -> None:
    """Percentiles over both runs' turns (not the mean of each run's), warm % over all follow-ups, goodput over
    the summed time, refusals over all attempts, failed turns and turns refused over all turns, prefill the mean."""
    row = pool([_run(1, [0.1] * 60, warm=9, follow=10, prefill=100), _run(2, [3.0] * 40, warm=1, follow=10, prefill=300)])
    assert row["seeds"] == 2 and row["requests"] == 100
    assert row["ttft_p50_s"] == 0.1 and row["ttft_p99_s"] == 3.0 and row["ttft_with_retries_p99_s"] == 4.0, row
    assert row["ttft_with_retries_p50_s"] == 1.1, row
    # 100 served and 3 failed: the p99 turn (index 101 of 103) is one of the failed
    assert row["ttft_every_turn_p99_s"] is None, row
    assert row["warm_pct"] == 50.0 and row["goodput_per_s"] == 3.0 and row["refused_pct"] == round(200 / 104, 2)
    # 3 of 103 turns failed (one run's 1, the other's 2); one turn each refused: 2 of 103; 2 refusals
    assert row["failed_turns"] == 3 and row["failed_pct"] == round(300 / 103, 2), row
    assert row["turns_refused_once_pct"] == round(200 / 103, 2) and row["refusals_per_turn"] == round(2 / 103, 4), row
    assert row["prefill_tokens"] == 200 and row["moves"] == 2, row


def test_the_sweep_runs_every_policy_of_a_cell_and_ends_with_one_json_line() -> None:
    """Two hosts at 0.3 on the shipped Mooncake trace, kvmesh and session_hash: the table, then the verdict."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--sweep", "--sweep-traces", "mooncake",
                          "--sweep-hosts", "2", "--sweep-loads", "0.3", "--sweep-policies", "kvmesh,session_hash",
                          "--seeds", "2", "--jobs", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["cells"] == 1 and [r["policy"] for r in result["rows"]] == ["kvmesh", "session_hash"], result
    assert [r["seeds"] for r in result["rows"]] == [2, 2], result
    assert result["held"] + len(result["failed"]) == 1
    assert lines[0].startswith("| trace | hosts | load | policy |") and any("**kvmesh**" in ln for ln in lines)


def test_no_seeds_is_refused_by_name() -> None:
    """--seeds 0 would pool nothing: exit 2 naming it, no traceback."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--sweep", "--seeds", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--seeds must be at least 1" in out.stderr and "Traceback" not in out.stderr


def test_an_unknown_sweep_policy_is_refused_by_name() -> None:
    """A policy the sim has not: exit 2 naming it, no traceback."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--sweep", "--sweep-policies", "kvmesh,sticky"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown sticky" in out.stderr and "Traceback" not in out.stderr
