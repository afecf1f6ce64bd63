"""`kvmesh demo --headless`: a two-node mesh with the workload, counters printed, everything stopped after."""

from __future__ import annotations

import subprocess
import sys

import psutil


def test_headless_demo_prints_counters_and_leaves_nothing_running() -> None:
    """The headless demo serves turns, shows handoff counters each second, and stops its nodes at the end."""
    r = subprocess.run([sys.executable, "-m", "kvmesh.node.cli", "demo", "--headless", "--seconds", "12", "--sessions", "8"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    header = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["time", "turns", "handoffs"])
    rows = [ln.split() for ln in lines[header + 1 :] if ln.split() and ln.split()[0].isdigit()]
    assert len(rows) >= 8
    assert int(rows[-1][1]) > 0  # turns were served
    assert "gpu-1:" in lines[-1] and "gpu-2:" in lines[-1]
    up = next(ln for ln in lines if ln.startswith("mesh up:"))
    pids = [int(w.strip(",")) for w, prev in zip(up.split()[1:], up.split()) if prev == "pid"]
    assert len(pids) == 2
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
