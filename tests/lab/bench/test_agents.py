"""`kvmesh bench agents`: every dialect's scripted agent session on two real node processes, moved warm by drains."""

from __future__ import annotations

import json
import subprocess
import sys

DIALECTS = ("messages", "responses", "chat", "completions")


def test_bench_agents_reports_each_dialect_warm_with_its_usage_reuse() -> None:
    """Four turns per dialect with a drain before the third: one warm move each, reuse p5 >= 0.9, no error, exit 0."""
    r = subprocess.run([sys.executable, "-m", "kvmesh", "bench", "agents", "--json", "--turns", "4", "--move-every", "2",
                        "--system-chars", "3000", "--tool-chars", "100"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(result["dialects"]) == set(DIALECTS) and result["errors"] == 0
    for name, d in result["dialects"].items():
        assert d["turns"] == 4 and d["warm"] == 1 and d["cold"] == 0 and d["partial"] == 0, (name, d)
        assert d["reuse_p5"] is not None and d["reuse_p5"] >= 0.9, (name, d)
