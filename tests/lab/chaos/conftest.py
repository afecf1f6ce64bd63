"""Fixtures for the fault drills: one `kvmesh chaos` run shared by the scenario tests.

The drills run as the operator runs them (`python -m kvmesh.node.cli chaos --json --only ...`, a
subprocess that starts and stops its own nodes); each test reads its scenario's entry of the
JSON line the command prints last.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
# The scenarios the suite runs: both proxy faults, a killed node, an engine that drops every
# cache at once, a wall clock that jumps (~140 s on 2 cores).
SUITE = ("connection-cut", "bit-flip", "receiver-killed", "evict-all", "clock-jump")


def run_cli(*args: str, timeout: float) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run `kvmesh ARGS`; returns the JSON object of its last stdout line and the process."""
    proc = subprocess.run([sys.executable, "-m", "kvmesh.node.cli", *args], cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"kvmesh {' '.join(args)} printed nothing; stderr:\n{proc.stderr[-3000:]}"
    try:
        return json.loads(lines[-1]), proc
    except json.JSONDecodeError:
        pytest.fail(f"the last stdout line of kvmesh {' '.join(args)} is not JSON:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def chaos() -> dict[str, dict[str, Any]]:
    """The suite's scenarios, run once: name -> that scenario's details."""
    result, proc = run_cli("chaos", "--json", "--only", *SUITE, timeout=400)
    assert result["scenarios"] == len(SUITE), proc.stdout[-3000:]
    assert result["passed"] + result["failed"] + result["not_run"] == result["scenarios"], result
    # Exit status 0 only when every scenario passed; 3 when none failed but some were not run.
    want = 0 if result["passed"] == result["scenarios"] else 1 if result["failed"] else 3
    assert proc.returncode == want, proc.stdout[-2000:]
    return {d["name"]: d for d in result["details"]}
