"""The side-by-side benches' arithmetic: decode rate, inter-token gaps, spreads, ratios, the node-path targets, sizing."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.node.lab.bench.nodepath import report
from kvmesh.node.lab.bench.streams import decode_tps, gaps_ms, percentile, prompts, ratios, spread
from kvmesh.node.lab.bench.ttft import sized_tokens
from kvmesh.node.lab.bench.versus import trace_requests
from kvmesh.node.lab.streamclient import StreamedTurn

DATA = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "claude_code"


def _turn(stamps: list[float], tokens: int = 0) -> StreamedTurn:
    return StreamedTurn(first_at=stamps[0], last_at=stamps[-1], stamps=stamps, completion_tokens=tokens)


def test_decode_rate_counts_only_the_window_where_every_stream_decodes() -> None:
    """Two streams overlapping from t=1 to t=2: the chunks in that second; one stream: its own rate."""
    a = _turn([0.2 * i for i in range(0, 11)])        # 0.0 .. 2.0
    b = _turn([1.0 + 0.1 * i for i in range(0, 11)])  # 1.0 .. 2.0
    assert decode_tps([a, b]) == pytest.approx((5 + 10) / 1.0)
    assert decode_tps([a]) == pytest.approx(10 / 2.0)


def test_decode_rate_counts_tokens_not_chunks() -> None:
    """A stream that sent 22 tokens in 11 chunks (a server merging queued outputs) decodes twice its chunk rate."""
    assert decode_tps([_turn([0.1 * i for i in range(0, 11)], tokens=22)]) == pytest.approx(2 * 10 / 1.0)


def test_a_window_too_short_falls_back_to_each_streams_own_rate() -> None:
    """Streams that barely overlap do not make a rate out of a few chunks: each stream's own, summed."""
    a, b = _turn([0.0, 1.0, 2.0]), _turn([1.99, 3.0, 4.0])
    assert decode_tps([a, b]) == pytest.approx(1.0 + 2 / 2.01)


def test_gaps_percentiles_and_spread() -> None:
    """Gaps between a stream's chunks in ms, pooled over streams; percentiles interpolate; spread is min/median/max."""
    assert gaps_ms([_turn([0.0, 0.01, 0.03]), _turn([5.0, 5.002])]) == pytest.approx([10.0, 20.0, 2.0])
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 99) is None
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0} and spread([]) is None


def test_sides_share_prompt_text_but_not_its_first_block() -> None:
    """Two sides given one seed get the same text, opened by their own tag (so a shared server caches neither for the other)."""
    a, b = prompts(5, 2, 100, 4.0, "kvmesh-"), prompts(5, 2, 100, 4.0, "vllm-")
    assert a[0][0]["content"].split(". ", 1)[1] == b[0][0]["content"].split(". ", 1)[1]
    assert a[0][0]["content"] != b[0][0]["content"] and a[0] != a[1]


def _side(cold: float, decode: float, itl99: float) -> dict[str, object]:
    return {"cold_ttft_s": {"median": cold}, "warm_ttft_s": {"median": cold / 4}, "prefill_tps": {"median": 1000 / cold},
            "decode_tps": {"median": decode}, "itl_pooled_p99_ms": itl99}


def test_ratios_are_medians_over_medians() -> None:
    """Cold/warm TTFT and tok/s ratios of medians; the inter-token p99 as a difference in ms."""
    r = ratios(_side(1.05, 95.0, 32.0), _side(1.0, 100.0, 30.0))
    assert r == {"cold_ttft_ratio": 1.05, "warm_ttft_ratio": 1.05, "prefill_ratio": 0.952, "decode_ratio": 0.95,
                 "itl_p99_delta_ms": 2.0}
    assert ratios(None, _side(1.0, 1.0, 1.0))["decode_ratio"] is None


def _rounds(cold: float, decode: float, gap: float) -> list[dict[str, object]]:
    return [{"prompt_tokens": 1000, "cold_ttft_s": cold, "prefill_tps": 1.0, "warm_ttft_s": 0.1, "warm_recomputed": 0,
             "decode_tps": decode, "itl_p50_ms": gap, "itl_p99_ms": gap, "gaps_ms": [gap] * 50}] * 2


def test_nodepath_names_the_targets_at_the_fewest_and_most_streams() -> None:
    """The JSON keys the issue asks for, at 1 and 16 streams (not 4), and whether every target holds."""
    rounds = {"kvmesh": [_rounds(1.0, 100.0, 30.0), _rounds(2.0, 300.0, 40.0), _rounds(4.0, 500.0, 51.0)],
              "vllm": [_rounds(1.0, 100.0, 29.0), _rounds(2.0, 300.0, 40.0), _rounds(4.0, 500.0, 50.0)]}
    out = report([1, 4, 16], 1024, rounds)  # type: ignore[arg-type]
    assert out["cold_ttft_ratio_1"] == 1.0 and out["decode_ratio_16"] == 1.0 and out["itl_p99_delta_ms_16"] == 1.0
    assert "decode_ratio_4" not in out and len(out["points"]) == 3 and out["meets_targets"] is True
    rounds["kvmesh"][2] = _rounds(4.4, 500.0, 51.0)
    assert report([1, 4, 16], 1024, rounds)["meets_targets"] is False  # type: ignore[arg-type]
    assert report([1, 16], 1024, {})["meets_targets"] is False


def test_ttft_sizes_its_default_to_the_context_and_refuses_an_asked_length() -> None:
    """bench ttft's default 16384 tokens becomes 80% of SmolLM2's 8192; an asked 9000 is refused naming --tokens."""
    assert sized_tokens(16384, 8192)[0] == 6553 and sized_tokens(7000, 8192) == (7000, None)
    assert sized_tokens(16384, None) == (16384, None)
    with pytest.raises(SystemExit, match="--tokens 9000 does not fit"):
        sized_tokens(9000, 8192)


@pytest.mark.skipif(not DATA.is_dir(), reason="the Claude Code traces are not beside the checkout")
def test_versus_trace_fits_the_longest_prompt_in_the_context() -> None:
    """The trace's sessions and span are selected, and its longest prompt is scaled to 80% of the context."""
    args = argparse.Namespace(trace=str(DATA), span=300.0, duration=300.0, time_scale=1.0, sessions=4)
    reqs, block_chars, said = trace_requests(args, ctx=8192, per_token=4.0)
    assert said["sessions"] == 4 and len({r.session for r in reqs}) == 4 and max(r.t for r in reqs) < 300
    assert 0.7 * 8192 <= said["prompt_tokens_max"] <= 0.8 * 8192 and block_chars >= 1
