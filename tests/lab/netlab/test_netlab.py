"""netlab: namespaces are made and removed, and a very short run produces its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.node.lab.bench import rawtcp
from kvmesh.node.lab.netlab.netns import TwoHostLab, can_use_netns

USABLE, WHY = can_use_netns()
needs_netns = pytest.mark.skipif(not USABLE, reason=f"netlab needs network namespaces: {WHY}")


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_netns
def test_lab_creates_shaped_link_and_removes_everything() -> None:
    """A TwoHostLab makes two namespaces with a tbf-shaped data link, and leaves nothing on exit."""
    before = _netns()
    with TwoHostLab("1gbit", scale=0.1) as lab:
        made = set(lab.namespaces())
        assert len(made) == 2 and not made & before
        a, b = lab.hosts
        qdisc = subprocess.run(["ip", "netns", "exec", a.ns, "tc", "qdisc", "show"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        # bytes cross the data link from host A to host B, never faster than the line (after idle, too:
        # the token bucket holds 1 ms, not enough to pass a 2 MiB delta early)
        n = 2 << 20
        assert rawtcp.measure(n, b.exec_prefix(), a.exec_prefix(), b.data_ip) >= 0.9 * n * 8 / 100e6
    assert _netns() == before
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert f"km{lab.tag}" not in links


@needs_netns
def test_lab_cleans_up_when_the_body_fails() -> None:
    """An error inside the lab still removes its namespaces."""
    before = _netns()
    with pytest.raises(RuntimeError):
        with TwoHostLab("10gbit", scale=0.05):
            raise RuntimeError("boom")
    assert _netns() == before


@needs_netns
def test_very_short_netlab_run_reports_table_json_and_png(tmp_path: Path) -> None:
    """`kvmesh netlab` end to end on one link for a few seconds: table, JSON last line, files, no leftovers."""
    # K = 4: 12 s carry 48 s of the report's run, long enough for conversations to pass replicate_min_tokens.
    before = _netns()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kvmesh.node.cli", "netlab", "--links", "10gbit", "--duration", "12",
                        "--time-compress", "4", "--sessions", "4", "--target-tokens", "12000", "--cache-mib", "128", "--out", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["kv_scale"] == 0.05 and result["latency_emulation"].startswith("none")
    (row,) = result["links"]
    assert row["link"] == "10gbit" and row["turns"] > 0 and row["errors"] == 0
    for key in ("warm_pct", "partial_pct", "cold_pct", "stale_state_cold", "transfer_p50_s", "ready_lag_p50_s",
                "mbps_per_direction", "useful_util_backlogged", "shortfall", "ttft_p95_s"):
        assert key in row
    # Every byte tc sent on the data link is accounted for by kind, within a few percent, both ways.
    assert set(row["wire_bytes"]) == set(row["tc"]) == {"host-a>host-b", "host-b>host-a"}
    for way, tc in row["tc"].items():
        kinds = row["wire_bytes"][way]
        assert tc["bytes"] > 0 and kinds["peer_status"] > 0 and kinds["tcp_ip_headers"] > 0
        assert 97.0 <= tc["accounted_pct"] <= 103.0, (way, tc, kinds)
    assert sum(row["wire_bytes"]["host-a>host-b"].get(k, 0) + row["wire_bytes"]["host-b>host-a"].get(k, 0)
               for k in ("replica_landed", "replica_cut")) > 0, "no replica crossed the link"
    assert 320 <= result["calibration"]["mbps_per_direction"] <= 450 and result["time_compress"] == 4.0
    assert result["scale"] == result["kv_scale"] * 4
    assert "kvmesh: 10gbit" in r.stdout and "report: 10 GbE" in r.stdout
    assert json.loads((out / "netlab.json").read_text())["links"][0]["link"] == "10gbit"
    assert (out / "netlab.png").stat().st_size > 1000
    assert not list(out.glob(".*.tmp")), "a temporary file was left beside the report"
    assert _netns() == before
