"""netlab's workload: the report's figures fix the load's distributions, and time compression keeps its bytes."""

from __future__ import annotations

import argparse
import random

import pytest

from kvmesh.node.cli import build_parser
from kvmesh.node.lab.netlab import calibrate as cal
from kvmesh.node.lab.netlab.run import node_config, plan_of
from kvmesh.node.lab.workload import text


def test_calibrated_demand_is_the_reports() -> None:
    """The calibrated shape gives 320-450 Mb/s of kv_share per direction at full scale, with turns small enough to move warm."""
    c = cal.calibrate()
    assert cal.MBPS_PER_DIRECTION[0] <= c.mbps_per_direction <= cal.MBPS_PER_DIRECTION[1]
    assert c.turns_per_conversation == 21
    assert c.replicated_tokens_per_conversation == pytest.approx(47_894)
    # A turn adds under a tenth of a 25k-token prompt: a move there can reuse >= 90% (warm).
    assert c.turn_tokens < 0.1 * 25_000
    assert c.delta_mib == pytest.approx(c.turn_tokens * cal.KV_BYTES_PER_TOKEN / 2**20)
    assert 0.3 < c.slot_utilization < 0.6  # homes fill often enough to move turns, not always


def test_think_scale_for_demand_doubles_the_traffic() -> None:
    """--demand 2 picks think times that give twice the report's Mb/s, turns unchanged."""
    s = cal.think_scale_for(2.0)
    assert s < 0.5  # turn time does not shrink, so think time shrinks by more than half
    assert cal.calibrate(s).mbps_per_direction == pytest.approx(2 * cal.calibrate().mbps_per_direction, rel=1e-6)
    with pytest.raises(ValueError, match="closer than their own length"):
        cal.think_scale_for(10.0)


def test_time_compression_divides_times_and_multiplies_rates() -> None:
    """K = 12: think / 12, sim prefill and decode x 12, the link x 12 on top of the byte scale, 90 min in 7.5."""
    k = cal.Compression(12.0)
    assert k.think_multiplier() == pytest.approx(1 / 12)
    assert k.think_multiplier(0.5) == pytest.approx(0.5 / 12)
    assert k.engine_rates() == (cal.PREFILL_TPS * 12, cal.DECODE_TPS * 12)
    assert k.link_scale(0.05) == pytest.approx(0.6)
    assert k.duration_s() == pytest.approx(450.0)
    assert k.full_scale_s(10.0) == pytest.approx(120.0)
    # Demand per compressed second is K times the full-scale demand, and so is the link: utilisation is kept.
    full = cal.calibrate()
    compressed_mbps = full.mbps_per_direction * 0.05 * 12
    assert compressed_mbps / (1000 * k.link_scale(0.05)) == pytest.approx(full.mbps_per_direction / 1000)


def test_load_shape_draws_match_the_calibration() -> None:
    """The load generator's tool outputs (1 char ~ 1 token) average the calibrated turn growth."""
    shape = cal.load_shape(seed=3)
    rng = random.Random(3)
    sizes = [len(text(rng, rng.randint(*shape.tool_tokens))) for _ in range(400)]
    mean = sum(sizes) / len(sizes) + shape.max_tokens
    assert abs(mean - cal.calibrate().turn_tokens) / cal.calibrate().turn_tokens < 0.05
    assert shape.sessions == 16 and shape.target_tokens == 50_000 and shape.think_s == cal.THINK_S


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"kv_scale": 0.05, "time_compress": 4.0, "time_scale": 1.0, "demand": None, "kvshare": "on"}
    return argparse.Namespace(**{**base, **kw})


def test_netlab_plan_applies_compression_to_nodes_link_and_load() -> None:
    """--time-compress 4 reaches the lab: sim rates x4, the link at rate x 0.05 x 4, think / 4, mesh timers / 4."""
    plan = plan_of(_args())
    assert plan.link_scale == pytest.approx(0.2) and plan.think == pytest.approx(0.25) and plan.demand == 1.0
    engine, extra = node_config(plan, 1024)
    assert engine["sim"] == {"kv_scale": 0.05, "prefill_tps": cal.PREFILL_TPS * 4, "decode_tps": cal.DECODE_TPS * 4}
    assert engine["slots"] == cal.SLOTS and extra["mesh"]["cold_move_after_s"] == pytest.approx(7.5)
    assert extra["kvshare"].get("replicate_min_tokens") is None
    off = node_config(plan_of(_args(kvshare="off")), 1024)[1]["kvshare"]
    assert off["enabled"] is False and off["persist_own"] is False and "replicate_min_tokens" not in off  # the real switch
    twice = plan_of(_args(demand=2.0))
    assert twice.demand == pytest.approx(2.0) and twice.think == pytest.approx(cal.think_scale_for(2.0) / 4)
    with pytest.raises(SystemExit, match="not both"):
        plan_of(_args(demand=2.0, time_scale=0.5))


def test_bad_netlab_arguments_are_refused_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """Zero, negative or non-numeric rates and a demand turns cannot meet are refused before anything starts."""
    for bad, said in ((["--demand", "0"], "must be above 0"), (["--time-compress", "-2"], "must be above 0"),
                      (["--duration", "x"], "is not a number")):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["netlab", *bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit, match="turns closer than their own length"):
        plan_of(_args(demand=10.0))
