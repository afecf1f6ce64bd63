"""Streamed turns at one point of a side-by-side bench, and the figures read from them.

A point is `streams` conversations at once, each opening with a prompt of about `tokens` tokens. One
round of a point is two turns per stream, every stream together: a cold turn (a prompt no server has
seen: its TTFT is queueing plus prefill; a short reply) and then a warm turn (the same conversation one reply and a
short user message on, its prefix cached: its TTFT is the reuse path, its stream is the decode rate and
the inter-token gaps). Every side of a bench gets the same rounds from the same client, and the same
warm-up round before it is measured. A point is repeated, so each figure comes with its spread
(min, median, max over the rounds); ratios are of medians.

Decode counts tokens, not chunks: a server whose stream falls behind may send several tokens in one
chunk (vLLM merges queued outputs), so each chunk weighs its stream's completion tokens over its chunks.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvmesh.node.lab.streamclient import StreamedTurn, stream_chat
from kvmesh.node.lab.workload import text

COLD_REPLY = 16  # tokens of a cold turn's reply
FOLLOW_UP = "Thanks. Now list the three points above that matter most, one line each."


@dataclass
class Side:
    """One server a bench measures: a name for the JSON, its base URL, the model it serves, headers to send."""

    name: str
    url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)


def prompts(seed: int, n: int, tokens: int, per_token: float, tag: str = "") -> list[list[dict[str, str]]]:
    """`n` conversations' openings of about `tokens` tokens (`per_token` characters each), all different.

    The text depends on `seed` only; `tag` opens it, so two sides given the same seed get the same
    prompts yet never reuse each other's cache where they share a server (a prefix differs from its first block)."""
    rng = random.Random(seed)
    chars = int(tokens * per_token)
    return [[{"role": "system", "content": f"Session {tag}{seed}-{i}. " + text(rng, chars)},
             {"role": "user", "content": "Summarise the notes above."}] for i in range(n)]


def decode_tps(turns: list[StreamedTurn]) -> float:
    """Tokens per second over the window in which every stream was decoding (each chunk weighing its
    stream's tokens per chunk); one stream, or a shared window under half a stream's own: each stream's
    own rate, summed (a window of a few chunks would make any rate)."""
    def weight(t: StreamedTurn) -> float:
        return t.completion_tokens / len(t.stamps) if t.completion_tokens and t.stamps else 1.0

    lo, hi = max(t.first_at for t in turns), min(t.last_at for t in turns)
    own = [t.last_at - t.first_at for t in turns if t.last_at > t.first_at]
    if hi - lo < 0.5 * (sum(own) / len(own) if own else 0.0) or hi <= lo:  # too short a window to count in
        return sum(weight(t) * (len(t.stamps) - 1) / (t.last_at - t.first_at) for t in turns if t.last_at > t.first_at)
    return sum(weight(t) for t in turns for s in t.stamps if lo < s <= hi) / (hi - lo)


def gaps_ms(turns: list[StreamedTurn]) -> list[float]:
    """Every stream's gaps between consecutive content chunks, in milliseconds: the inter-token latency a client sees."""
    return [(b - a) * 1000.0 for t in turns for a, b in zip(t.stamps, t.stamps[1:])]


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    i = int(k)
    return s[i] if i + 1 >= len(s) else s[i] + (s[i + 1] - s[i]) * (k - i)


def spread(xs: list[float]) -> dict[str, float] | None:
    """min, median and max of a figure over a point's rounds (None when it has no value)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": round(min(xs), 4), "median": round(statistics.median(xs), 4), "max": round(max(xs), 4)}


def figures(cold: list[StreamedTurn], warm: list[StreamedTurn], t0: float) -> dict[str, Any]:
    """One round's figures; `gaps_ms` is kept whole so a point's percentiles pool every round."""
    gaps = gaps_ms(warm)
    computed = sum(t.recomputed_tokens for t in cold)
    return {"prompt_tokens": round(sum(t.prompt_tokens for t in cold) / len(cold)),
            "cold_ttft_s": statistics.median(t.ttft_s for t in cold),
            "prefill_tps": computed / max(1e-6, max(t.first_at for t in cold) - t0),
            "warm_ttft_s": statistics.median(t.ttft_s for t in warm),
            "warm_recomputed": sum(t.recomputed_tokens for t in warm),
            "decode_tps": decode_tps(warm),
            "itl_p50_ms": percentile(gaps, 50), "itl_p99_ms": percentile(gaps, 99), "gaps_ms": gaps}


async def one_round(client: httpx.AsyncClient, side: Side, opening: list[list[dict[str, str]]], max_tokens: int,
                    tag: str) -> dict[str, Any]:
    """Every stream's cold turn together, then every stream's warm turn together (see the module docstring)."""
    async def turn(i: int, msgs: list[dict[str, str]], n: int) -> StreamedTurn:
        body = {"model": side.model, "messages": msgs, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        return await stream_chat(client, f"{side.url}/v1/chat/completions", body, {**side.headers, "X-Session-Id": f"{tag}-{i}"})

    t0 = time.monotonic()
    # the cold turn's reply is short: its figures are TTFT and prefill, and decode is the warm turn's to measure
    cold = await asyncio.gather(*(turn(i, m, min(COLD_REPLY, max_tokens)) for i, m in enumerate(opening)))
    follow = [m + [{"role": "assistant", "content": c.text}, {"role": "user", "content": FOLLOW_UP}]
              for m, c in zip(opening, cold)]
    warm = await asyncio.gather(*(turn(i, m, max_tokens) for i, m in enumerate(follow)))
    return figures(list(cold), list(warm), t0)


FIGURES = ("prompt_tokens", "cold_ttft_s", "prefill_tps", "warm_ttft_s", "decode_tps", "itl_p50_ms", "itl_p99_ms")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's point over its rounds: each figure's spread, and the inter-token percentiles of every round's gaps pooled."""
    out: dict[str, Any] = {k: spread([r[k] for r in rounds]) for k in FIGURES if k != "prompt_tokens"}
    pooled = [g for r in rounds for g in r["gaps_ms"]]
    out.update(rounds=len(rounds), prompt_tokens=rounds[0]["prompt_tokens"] if rounds else None,
               warm_recomputed=sum(r["warm_recomputed"] for r in rounds),
               itl_pooled_p50_ms=_r(percentile(pooled, 50)), itl_pooled_p99_ms=_r(percentile(pooled, 99)))
    return out


def ratios(mine: dict[str, Any] | None, other: dict[str, Any] | None) -> dict[str, float | None]:
    """One side's point against another's, medians over medians: cold and warm TTFT (lower is better for the
    first side), prefill and decode tok/s (higher), and the pooled inter-token p99's difference in ms."""
    def med(s: dict[str, Any] | None, k: str) -> float | None:
        v = (s or {}).get(k)
        return v["median"] if isinstance(v, dict) else None

    out: dict[str, float | None] = {}
    for k, key in (("cold_ttft_ratio", "cold_ttft_s"), ("warm_ttft_ratio", "warm_ttft_s"),
                   ("prefill_ratio", "prefill_tps"), ("decode_ratio", "decode_tps")):
        a, b = med(mine, key), med(other, key)
        out[k] = round(a / b, 3) if a is not None and b else None
    a2, b2 = (mine or {}).get("itl_pooled_p99_ms"), (other or {}).get("itl_pooled_p99_ms")
    out["itl_p99_delta_ms"] = round(a2 - b2, 2) if a2 is not None and b2 is not None else None
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


@dataclass
class Plan:
    """What a side-by-side bench runs: its points (streams, prompt tokens), rounds of each, tokens per reply,
    the model's characters per token, and a time budget after which no new repeat starts (never under
    `min_repeats`: a spread needs more than one round)."""

    points: list[tuple[int, int]]
    repeats: int
    max_tokens: int
    per_token: float
    budget_s: float | None = None
    min_repeats: int = 2
    warmup_tokens: int = 8


def say(bench: str, msg: str) -> None:
    """Progress on stderr, so a long bench shows it is alive and stdout keeps its one JSON line."""
    print(f"{bench}: {msg}", file=sys.stderr, flush=True)


async def measure(sides: list[Side], plan: Plan, bench: str, t_start: float) -> dict[str, list[list[dict[str, Any]]]]:
    """Every side's rounds at every point: `out[side][point]` a list of rounds.

    First one warm-up round per side, the same for each (the most streams, the smallest prompt): a first
    turn's one-time costs (graph allocation, first-touch memory, kernels built on first use) belong to no
    point. Then repeat by repeat, point by point, the sides one after the other, the order turned round
    each repeat, so a box whose load drifts weighs on every side alike."""
    out: dict[str, list[list[dict[str, Any]]]] = {s.name: [[] for _ in plan.points] for s in sides}
    most, least = max(s for s, _ in plan.points), min(t for _, t in plan.points)
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800, connect=30), limits=limits) as client:
        for s in sides:
            say(bench, f"warm-up on {s.name}: {most} stream(s) x {least} tokens")
            await one_round(client, s, prompts(7, most, least, plan.per_token, f"{s.name}-warmup-"), plan.warmup_tokens,
                            f"{s.name}-warmup")
        per_repeat = 0.0
        for r in range(plan.repeats):
            elapsed = time.monotonic() - t_start
            if r >= plan.min_repeats and plan.budget_s is not None and elapsed + per_repeat > plan.budget_s:
                say(bench, f"stopping after {r} repeats: another would pass the {plan.budget_s:.0f} s budget")
                break
            t_rep = time.monotonic()
            order = sides[r % len(sides):] + sides[: r % len(sides)]
            for k, (streams, tokens) in enumerate(plan.points):
                for s in order:
                    fig = await one_round(client, s, prompts(1000 * r + 10 * k + 1, streams, tokens, plan.per_token,
                                                             f"{s.name}-"), plan.max_tokens, f"{s.name}-{r}-{k}")
                    out[s.name][k].append(fig)
                    say(bench, f"repeat {r + 1}/{plan.repeats} {s.name} {streams}x{tokens}: cold TTFT "
                        f"{fig['cold_ttft_s']:.2f} s, warm TTFT {fig['warm_ttft_s']:.2f} s, decode "
                        f"{fig['decode_tps']:.1f} tok/s ({time.monotonic() - t_start:.0f} s in)")
            per_repeat = time.monotonic() - t_rep
    return out
