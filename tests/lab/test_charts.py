"""Charts (node.lab.charts): a bench's rows drawn against load, one SVG per trace and size, a line per policy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.node.lab.charts import POLICIES_METRICS, SWEEP_METRICS, file_name, policies_rows, write_charts


def _row(trace: str, hosts: int, load: float, policy: str, p50: float, **kw: Any) -> dict[str, Any]:
    return {"trace": trace, "hosts": hosts, "load": load, "policy": policy, "warm_pct": 99.0, "ttft_p50_s": p50,
            "ttft_p99_s": 10 * p50, "failed_pct": 0.0, **kw}


def _points(svg: str, policies: int = 2) -> int:
    """Line markers drawn, less the legend's one per policy: matplotlib writes markers and axis ticks alike as <use>
    elements, ticks stroked black and unfilled."""
    return sum("fill:" in u for u in re.findall(r"<use [^>]*>", svg)) - policies


def test_one_svg_per_trace_and_size_with_a_line_per_policy_named_in_text(tmp_path: Path) -> None:
    """Two traces x two sizes: four files; each names every policy of its cell and the panels' titles as SVG text,
    and draws a marker per (policy, load, panel); a row missing a metric leaves its point out."""
    rows = [_row(t, n, u, p, 0.1 * u * (2 if p != "kvmesh" else 1)) for t in ("mooncake", "../shared/data/claude_code")
            for n in (2, 8) for u in (0.3, 0.6, 0.9) for p in ("kvmesh", "session_hash")]
    rows[0]["warm_pct"] = None
    written = write_charts(rows, tmp_path / "out", SWEEP_METRICS, title="sweep")
    assert sorted(p.name for p in written) == ["claude_code-2hosts.svg", "claude_code-8hosts.svg",
                                               "mooncake-2hosts.svg", "mooncake-8hosts.svg"], written
    svg = (tmp_path / "out" / "mooncake-2hosts.svg").read_text()
    for text in ("kvmesh", "session_hash", "TTFT p99", "warm handoffs", "offered load per host", "mooncake, 2 hosts"):
        assert text in svg, text
    assert _points(svg) == 2 * 3 * len(SWEEP_METRICS) - 1, _points(svg)
    assert _points((tmp_path / "out" / "mooncake-8hosts.svg").read_text()) == 2 * 3 * len(SWEEP_METRICS)
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_the_same_rows_draw_the_same_bytes(tmp_path: Path) -> None:
    """No date or random ids in the file: a chart in the manual changes only when its figures do."""
    rows = [_row("mooncake", 2, u, p, u) for u in (0.3, 0.6) for p in ("kvmesh", "kv_overlap")]
    a = write_charts(rows, tmp_path / "a", SWEEP_METRICS, title="sweep")[0].read_bytes()
    b = write_charts(rows, tmp_path / "b", SWEEP_METRICS, title="sweep")[0].read_bytes()
    assert a == b


def test_bench_policies_runs_become_rows_with_the_share_of_prompt_reused() -> None:
    """Each run keeps its figures, gains the result's trace and hosts, and reused % = 1 - recomputed / prompt."""
    result = {"trace": "mooncake", "hosts": 4, "runs": [
        {"policy": "kvmesh", "load": 0.5, "prompt_tokens": 1000, "prompt_tokens_recomputed": 250, "ttft_p50_s": 0.1},
        {"policy": "session_hash", "load": 0.5, "prompt_tokens": 0, "prompt_tokens_recomputed": 0, "ttft_p50_s": 0.2}]}
    rows = policies_rows(result)
    assert rows[0]["reused_pct"] == 75.0 and rows[1]["reused_pct"] is None
    assert all(r["trace"] == "mooncake" and r["hosts"] == 4 for r in rows)
    assert [k for k, _, _ in POLICIES_METRICS][0] == "reused_pct"


def test_a_file_name_is_the_traces_last_part_in_safe_characters() -> None:
    """A directory trace is named by its folder; characters a file name should not hold become underscores."""
    assert file_name("../shared/data/claude_code/", 8) == "claude_code-8hosts.svg"
    assert file_name("my trace?.jsonl", 2) == "my_trace_.jsonl-2hosts.svg"


def test_the_sweep_writes_its_charts_beside_its_json(tmp_path: Path) -> None:
    """`kvmesh sim --sweep --chart DIR` on the built-in Mooncake trace, one seed, two loads: the JSON line last, and
    one SVG for the one size with every policy swept in it."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--sweep", "--sweep-hosts", "2", "--sweep-loads",
                          "0.3,0.6", "--sweep-policies", "kvmesh,session_hash", "--seeds", "1", "--span", "120",
                          "--jobs", "1", "--chart", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["cells"] == 2, doc
    svg = (tmp_path / "mooncake-2hosts.svg").read_text()
    assert "kvmesh" in svg and "session_hash" in svg


@pytest.mark.parametrize("argv", [["sim", "--sweep"], ["bench", "policies"]])
def test_without_matplotlib_a_chart_is_refused_before_any_run(tmp_path: Path, argv: list[str]) -> None:
    """matplotlib hidden: exit 2 at once, naming the report extra, with nothing run."""
    hide = tmp_path / "hide"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    env = {"PYTHONPATH": str(hide), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "kvmesh", *argv, "--chart", str(tmp_path / "c")], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 2 and "kvmesh[report]" in out.stderr, (out.returncode, out.stderr[-1000:])
    assert not (tmp_path / "c").exists()
