"""`kvmesh bench ...` results: the exit status follows the run's errors, and the reported round is the median."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from kvmesh.node.cli import build_parser
from kvmesh.node.lab.bench.common import emit, failures
from kvmesh.node.lab.bench.handoff import run_handoff
from kvmesh.node.lab.bench.transfer import median_index, summarize


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(json=True, **kw)


def test_a_result_with_errors_exits_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """emit() returns 1 when the result counts errors (or completed nothing) and 0 for a clean run."""
    assert emit({"turns": 10, "errors": 0}, _args()) == 0
    assert emit({"turns": 10, "errors": 2, "error_samples": ["s1: HTTP 503"]}, _args()) == 1
    assert emit({"turns": 0, "errors": 0}, _args()) == 1
    assert emit({"rounds": [], "errors": 0}, _args()) == 1
    err = capsys.readouterr().err
    assert "2 error(s): s1: HTTP 503" in err and "no turn completed" in err and "no round completed" in err
    assert failures({"turns": 3, "errors": 0, "rounds": [{}]}) == []


def test_median_index_is_the_median_by_value_not_the_chronological_middle() -> None:
    """With an even count the reported round is the lower middle value, not the middle round in time."""
    ratios = [1.0, 0.5, 0.9, 0.1]  # chronological middle (index 2) is 0.9; sorted: 0.1 0.5 | 0.9 1.0
    assert ratios[median_index(ratios)] == 0.5
    assert median_index([0.7, 0.2, 0.4]) == 2  # odd count: the middle value (0.4)
    assert median_index([3.0]) == 0 and median_index([2.0, 1.0]) == 1


def _round(gbps_kv: float, gbps_raw: float) -> dict[str, Any]:
    nbytes = 1_000_000_000
    return {"bytes": nbytes, "blocks": 50, "recv_s": 8 * nbytes / gbps_kv / 1e9, "lag_s": 0.01,
            "raw_s": 8 * nbytes / gbps_raw / 1e9, "base_blocks": 8}


def test_transfer_summary_reports_the_median_round_and_counts_failed_rounds() -> None:
    """summarize() reports the median-ratio round of an even --repeat, and a failed round as an error."""
    rounds = [_round(10, 10), _round(5, 10), _round(9, 10), _round(1, 10)]  # ratios 1.0 0.5 0.9 0.1
    res = summarize({"rounds": rounds, "errors": []}, link="loopback", delta_blocks=50, block_bytes=20_000_000)
    assert res["ratio"] == 0.5 and res["kvshare_gbps"] == 5.0 and res["errors"] == 0
    assert [r["kvshare_gbps"] for r in res["rounds"]] == [10.0, 5.0, 9.0, 1.0]
    bad = summarize({"rounds": rounds[:1], "errors": ["round 1: TimeoutError: no replica_ready"]}, link="loopback",
                    delta_blocks=50, block_bytes=20_000_000)
    assert bad["errors"] == 1 and failures(bad)
    none = summarize({"rounds": [], "errors": ["round 0: RuntimeError: replica refused"]}, link="loopback",
                     delta_blocks=50, block_bytes=20_000_000)
    assert none["rounds"] == [] and len(failures(none)) == 2


def test_bench_handoff_exits_non_zero_when_turns_failed(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh bench handoff` whose every turn is refused (max_tokens 0 -> 400) exits 1 and counts the errors."""
    args = build_parser().parse_args(["bench", "handoff", "--json", "--duration", "2", "--sessions", "2",
                                      "--max-tokens", "0", "--cache-bytes", str(64 << 20)])
    rc = run_handoff(args)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["errors"] >= 1 and out["turns"] == 0, out
    assert out["status"].get("400", 0) >= 1 and out["error_samples"], out
    assert rc == 1


@pytest.mark.parametrize("alias", ["hybrid-tiny", "mamba-tiny"])
def test_bench_ttft_moves_a_recurrent_model_with_its_snapshot(alias: str, capsys: pytest.CaptureFixture[str]) -> None:
    """bench ttft on a generated model with recurrent state: the warm engine reuses the blocks up to the snapshot that
    travelled with them, the JSON names its bytes, and the replica's bytes include it."""
    from kvmesh.node.cli import main

    assert main(["bench", "ttft", "--json", "--model", alias, "--tokens", "3000"]) == 0  # the alias implies llamacpp
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["errors"] == 0 and out["snapshot_pos"] == out["warm_cached_tokens"] > 0.8 * out["warm_prompt_tokens"]
    assert out["snapshot_bytes"] > 0 and out["replica_bytes"] > out["snapshot_bytes"]


def test_bench_exactness_passes_the_gate_on_the_generated_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    """bench exactness on MoE, hybrid and recurrent-only models: each row 64 identical greedy tokens within 0.05,
    B reusing what A's replica (and, with recurrent state, its snapshot) carried; an unknown kind is refused."""
    from kvmesh.node.cli import main

    assert main(["bench", "exactness", "--json", "--kinds", "moe,hybrid,recurrent"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["kind"]: r for r in out["table"]}
    assert out["errors"] == 0 and set(rows) == {"moe", "hybrid", "recurrent"}
    for r in rows.values():
        assert r["passed"] and r["tokens_identical"] == r["steps"] == 64 and r["max_logit_diff"] <= 0.05
        assert r["reused_on_b"] > 0.8 * r["prompt_tokens"]
    assert rows["moe"]["snapshot_pos"] == 0 and rows["hybrid"]["snapshot_pos"] == rows["hybrid"]["reused_on_b"]
    with pytest.raises(SystemExit, match="unknown kinds"):
        main(["bench", "exactness", "--kinds", "dense,nope"])
