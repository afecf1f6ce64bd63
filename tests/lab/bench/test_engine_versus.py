"""`kvmesh bench engine` and `bench versus`: their figures from measured rounds, and real runs of the kvmesh side.

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
from kvmesh.node.lab.bench.enginebench import _table, default_prompts, fits
from kvmesh.node.lab.bench.versus import summarize


def test_prompts_are_sized_to_the_context() -> None:
    """Default prompts are 1/32 and 1/8 of a slot's context; a size past it is refused naming --prompts and what fits."""
    assert default_prompts(8192) == [256, 1024] and default_prompts(16384) == [512, 2048]
    assert fits([256, 1024], 64, 8192) is None
    why = fits([1000, 8000], 64, 8192)
    assert why is not None and "--prompts 8000" in why and f"{8192 - 128 - 256} tokens or less" in why


def _round(cold: float, decode: float, gaps: list[float]) -> dict[str, object]:
    return {"prompt_tokens": 1000, "cold_ttft_s": cold, "prefill_tps": 1000 / cold, "warm_ttft_s": cold / 10,
            "warm_recomputed": 30, "decode_tps": decode, "itl_p50_ms": 10.0, "itl_p99_ms": max(gaps), "gaps_ms": gaps}


def test_table_sets_kvmesh_against_the_other_side() -> None:
    """Each point's ratios are kvmesh's medians over the other side's; a side that did not run leaves them unset."""
    km = [[_round(2.0, 90.0, [10.0] * 90 + [20.0] * 10), _round(2.2, 80.0, [10.0]), _round(1.8, 100.0, [10.0])]]
    sv = [[_round(2.0, 100.0, [10.0] * 100), _round(2.0, 100.0, [10.0]), _round(2.0, 100.0, [10.0])]]
    (row,) = _table([(4, 1000)], {"kvmesh": km, "llama-server": sv}, ["kvmesh", "llama-server"])
    assert row["streams"] == 4 and row["cold_ttft_ratio"] == 1.0 and row["decode_ratio"] == 0.9
    assert row["kvmesh"]["decode_tps"] == {"min": 80.0, "median": 90.0, "max": 100.0} and row["kvmesh"]["rounds"] == 3
    assert row["itl_p99_delta_ms"] is not None and row["itl_p99_delta_ms"] > 0
    (alone,) = _table([(4, 1000)], {"kvmesh": km}, ["kvmesh"])
    assert alone["prefill_ratio"] is None and alone["decode_ratio"] is None


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
    """A real node on a generated GGUF: every point measured over its repeats, prompts near the asked size, progress on stderr."""
    rc, res, err = _bench("engine", "--against", "none", "--model", str(tiny), "--prompts", "200",
                          "--streams", "1,2", "--max-tokens", "8", "--repeats", "2")
    assert rc == 0, err
    points = res["comparisons"]["none"]  # type: ignore[index]
    assert isinstance(points, list) and [p["streams"] for p in points] == [1, 2]
    for p in points:
        assert p["kvmesh"]["decode_tps"]["median"] > 0 and p["kvmesh"]["rounds"] == 2 and p["decode_ratio"] is None
        assert p["kvmesh"]["cold_ttft_s"]["min"] <= p["kvmesh"]["cold_ttft_s"]["max"]
        assert 150 <= p["prompt_tokens"] <= 300
    assert res["errors"] == 0 and res["ratio_min"] is None
    assert "warm-up on kvmesh" in err and "repeat 2/2" in err


def test_bench_engine_refuses_what_it_cannot_run(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No llama-server built: exit 2 naming `make llama-server`; a prompt past the context: exit 2 naming --prompts."""
    monkeypatch.setenv("KVMESH_LLAMA_SERVER_DIR", str(tmp_path))
    monkeypatch.delenv("KVMESH_LLAMA_SERVER", raising=False)
    p = subprocess.run([sys.executable, "-m", "kvmesh.node.cli", "bench", "engine", "--model", str(tiny), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "make llama-server" in p.stderr
    p = subprocess.run([sys.executable, "-m", "kvmesh.node.cli", "bench", "engine", "--against", "none", "--model",
                        str(tiny), "--prompts", "999999", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--prompts 999999 does not fit" in p.stderr


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
