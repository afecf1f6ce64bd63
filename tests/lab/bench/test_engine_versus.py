"""`kvmesh bench engine` and `bench versus`: their figures from measured streams, and real runs of the kvmesh side.

The llama-server side needs `make llama-server` (a 10-30 minute build, not part of `make test`), so
the end-to-end runs here measure kvmesh's own arms on a generated GGUF; the arithmetic that sets
kvmesh against llama-server is tested on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.node.lab import testmodels
from kvmesh.node.lab.bench.enginebench import _decode_tps, _points
from kvmesh.node.lab.bench.versus import summarize
from kvmesh.node.lab.streamclient import StreamedTurn


def _turn(first: float, stamps: list[float]) -> StreamedTurn:
    return StreamedTurn(first_at=first, last_at=stamps[-1], stamps=[first, *stamps])


def test_decode_rate_counts_only_the_window_where_every_stream_decodes() -> None:
    """Two streams, 10 chunks each, overlapping from t=1 to t=2: 2 x 5 chunks in that second."""
    a = _turn(0.0, [0.2 * i for i in range(1, 11)])        # 0.2 .. 2.0
    b = _turn(1.0, [1.0 + 0.1 * i for i in range(1, 11)])  # 1.1 .. 2.0
    assert _decode_tps([a, b]) == pytest.approx((5 + 10) / 1.0)
    assert _decode_tps([a]) == pytest.approx(10 / 2.0)  # one stream: its own rate


def test_points_set_kvmesh_against_the_server() -> None:
    """Each point's ratios are kvmesh over llama-server; a side that did not run leaves them unset."""
    km = [{"prompt_tokens": 1000, "prefill_tps": 300.0, "decode_tps": 90.0}]
    sv = [{"prompt_tokens": 1000, "prefill_tps": 400.0, "decode_tps": 100.0}]
    (row,) = _points([(4, 1000)], {"kvmesh": km, "server": sv})
    assert row["streams"] == 4 and row["prefill_ratio"] == 0.75 and row["decode_ratio"] == 0.9
    (alone,) = _points([(4, 1000)], {"kvmesh": km})
    assert alone["server_prefill_tps"] is None and alone["prefill_ratio"] is None


def _arm(p95: float, tps: float, errors: int = 0, turns: int = 10) -> dict[str, object]:
    return {"ttft_p95_s": p95, "turns_per_s": tps, "errors": errors, "error_samples": ["x"] * errors, "turns": turns}


def test_versus_ratios_and_errors() -> None:
    """kvmesh over sticky and round robin; any arm's errors, or an arm with no turn, fail the bench."""
    out = summarize({"kvmesh": _arm(2.0, 1.0), "sticky": _arm(4.0, 0.8), "round_robin": _arm(10.0, 0.5)})
    assert out["ttft_p95_ratio_vs_sticky"] == 0.5 and out["turns_per_s_ratio_vs_sticky"] == 1.25
    assert out["ttft_p95_ratio_vs_round_robin"] == 0.2 and out["errors"] == 0
    assert summarize({"kvmesh": _arm(2.0, 1.0), "sticky": _arm(4.0, 0.8, errors=2)})["errors"] == 2
    assert summarize({"kvmesh": _arm(2.0, 1.0, turns=0)})["errors"] == 1


def _bench(*args: str, timeout: float = 600) -> tuple[int, dict[str, object], str]:
    p = subprocess.run([sys.executable, "-m", "kvmesh.node.cli", "bench", *args, "--json"],
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testmodels.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", testmodels.spec_for("tiny"))


def test_bench_engine_kvmesh_side_end_to_end(tiny: Path) -> None:
    """A real node on a generated GGUF: every point measured, prompts near the asked size, no error."""
    rc, res, err = _bench("engine", "--against", "none", "--model", str(tiny), "--prompts", "200",
                          "--streams", "1,2", "--max-tokens", "8")
    assert rc == 0, err
    points = res["points"]
    assert isinstance(points, list) and [p["streams"] for p in points] == [1, 2]
    for p in points:
        assert p["kvmesh_prefill_tps"] > 0 and p["kvmesh_decode_tps"] > 0 and p["server_prefill_tps"] is None
        assert 150 <= p["prompt_tokens"] <= 300
    assert res["errors"] == 0 and res["ratio_min"] is None


def test_bench_versus_kvmesh_arms_end_to_end(tiny: Path) -> None:
    """Two pinned real nodes per arm, agents through the mesh: both kvmesh arms complete turns without error."""
    rc, res, err = _bench("versus", "--model", str(tiny), "--arms", "kvmesh", "kvmesh_no_share", "--duration", "15",
                          "--sessions", "2", "--max-tokens", "8", "--cache-mib", "256")
    assert rc == 0, err
    arms = res["arms"]
    assert isinstance(arms, dict) and set(arms) == {"kvmesh", "kvmesh_no_share"}
    for a in arms.values():
        assert a["turns"] > 0 and a["errors"] == 0 and a["ttft_p95_s"] is not None
        assert 0 <= a["prompt_tokens_recomputed"] <= a["prompt_tokens"]


def test_bench_versus_on_a_shaped_link(tiny: Path) -> None:
    """--link 1gbit: the two pinned nodes live in network namespaces joined by a shaped veth and still serve every turn."""
    from kvmesh.node.lab.netlab.netns import can_use_netns

    ok, why = can_use_netns()
    if not ok:
        pytest.skip(why)
    rc, res, err = _bench("versus", "--model", str(tiny), "--arms", "kvmesh", "--duration", "12", "--sessions", "2",
                          "--max-tokens", "8", "--cache-mib", "256", "--link", "1gbit")
    assert rc == 0, err
    assert res["link"] == "1gbit" and "network namespaces" in str(res["hosts"])
    assert res["arms"]["kvmesh"]["turns"] > 0 and res["errors"] == 0  # type: ignore[index]
