"""The field report's workload, as numbers: what netlab drives and why.

The report (shared/reference/field-report.md) fixes the demand, and this module
derives the load generator's distributions from its figures, so the arithmetic
is written down, tested (tests/netlab/test_calibrate.py), and printed with
every run:

- 16 coding-agent sessions on 2 hosts x 4 slots; conversations grow to ~50k tokens.
- ~1 GB of KV per 50k tokens: 20,480 bytes per token at full scale.
- Warm means >= 90% of the prompt reused, and the report saw 93.8-96.8% warm. A
  turn's new tokens (the tool output it appends) can never come from any cache,
  so most turns must add under a tenth of their prompt: tool output is drawn
  uniformly from 300-4,000 tokens (mean 2,150) and the reply is 64 tokens. A
  conversation opens with a ~3.3k-token system prompt and task, runs ~21 turns,
  and replicates from 8,192 tokens on: the whole session once, then one delta
  per turn (~43 MiB at full scale).
- The report's "~247 MiB delta" (12.6k tokens, a quarter of a 50k prompt) cannot
  be one turn's growth at that warm rate (a turn adding 12.6k tokens to a 50k
  prompt reuses at most 75% anywhere, even at home), so it must span several
  turns. We keep the report's traffic instead: kv_share averaged 320-450 Mb/s
  per direction. With the sessions split over two hosts, each direction carries
  half the sessions' replicas, which fixes the period between a session's
  turns: `period = replicated bits per conversation x sessions/2 / (turns per
  conversation x Mb/s)` = ~7.7 s for 388 Mb/s.
- A turn is a 0.1 s prefill of its new tokens (20k tokens/s) plus the reply at
  40 tokens/s per slot: ~1.7 s. Think time (tool runs, the agent's own work) is
  the rest of the period: uniform 4-8 s. Slots are then ~44% busy on average,
  and a session's home is full often enough to move turns.

Time compression (`--time-compress K`) divides think, prefill and decode times by
K and multiplies the link rate by K: the same bytes, the same handoff decisions,
K times sooner. `--time-scale` still multiplies think times; `--demand D` sets
them for D x the report's kv_share traffic. KV bytes and link rates are scaled
by `kv_scale` together, so transfer times match the full-size experiment.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.node.config import KVShareConfig
from kvmesh.node.lab.load import LoadShape

# The report's figures (field-report.md).
SESSIONS = 16
HOSTS = 2
SLOTS = 4
CONVERSATION_TOKENS = 50_000
KV_BYTES_PER_TOKEN = 20_480  # ~1 GB per 50k tokens
DELTA_MIB = 247
MBPS_PER_DIRECTION = (320.0, 450.0)
RUN_MINUTES = 90
REPLICATE_MIN_TOKENS = KVShareConfig().replicate_min_tokens  # netlab's nodes run with the default

# The load generator's distributions, derived below and checked by tests/netlab/test_calibrate.py.
SYSTEM_TOKENS = (2500, 4000)  # system prompt; the task message adds ~300
TASK_TOKENS = 300
REPLY_TOKENS = 64
TOOL_TOKENS = (300, 4000)  # mean 2,150: a turn adds <10% of a 25k+ prompt, so a move can be warm
THINK_S = (4.0, 8.0)
PREFILL_TPS = 20_000.0
DECODE_TPS = 40.0


@dataclass(frozen=True)
class Calibration:
    """The workload the report's figures fix, at full scale and K = 1."""

    turn_tokens: float  # mean growth per turn (tool output + reply)
    turns_per_conversation: int
    replicated_tokens_per_conversation: float
    turn_s: float  # mean turn time (prefill of the new tokens + the reply)
    period_s: float  # mean time between a session's turns (think + turn)
    mbps_per_direction: float  # kv_share traffic this demand gives, full scale
    delta_mib: float
    slot_utilization: float

    def summary(self) -> dict[str, float | int]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def _mean(r: tuple[float, float]) -> float:
    return (r[0] + r[1]) / 2


def calibrate(think_scale: float = 1.0) -> Calibration:
    """The demand of `load_shape(think_scale)`, computed from the means of its distributions."""
    turn_tokens = _mean(TOOL_TOKENS) + REPLY_TOKENS
    size = _mean(SYSTEM_TOKENS) + TASK_TOKENS
    turns, replicated, last_sent = 0, 0.0, 0.0
    while size < CONVERSATION_TOKENS:
        turns += 1
        after = size + REPLY_TOKENS  # the cache after the turn: its prompt and its reply
        if after >= REPLICATE_MIN_TOKENS:
            replicated += after - last_sent  # only what the target does not hold crosses the wire
            last_sent = after
        size += turn_tokens
    turn_s = turn_tokens / PREFILL_TPS + REPLY_TOKENS / DECODE_TPS
    period = _mean(THINK_S) * think_scale + turn_s
    bits = replicated * KV_BYTES_PER_TOKEN * 8
    mbps = bits * (SESSIONS / HOSTS) / (turns * period) / 1e6
    return Calibration(turn_tokens=turn_tokens, turns_per_conversation=turns,
                       replicated_tokens_per_conversation=replicated, turn_s=turn_s, period_s=period,
                       mbps_per_direction=mbps, delta_mib=turn_tokens * KV_BYTES_PER_TOKEN / 2**20,
                       slot_utilization=SESSIONS * turn_s / period / (HOSTS * SLOTS))


def think_scale_for(demand: float) -> float:
    """The think-time multiplier that gives `demand` x the report's kv_share traffic (turns keep their length)."""
    base = calibrate()
    period = base.period_s / demand
    if period <= base.turn_s:
        raise ValueError(f"demand {demand:g}x the report's would need turns closer than their own length")
    return (period - base.turn_s) / _mean(THINK_S)


def load_shape(seed: int = 1, sessions: int = SESSIONS, target_tokens: int = CONVERSATION_TOKENS) -> LoadShape:
    """The load generator's shape for the report's workload (think times at K = 1)."""
    return LoadShape(sessions=sessions, target_tokens=target_tokens, tool_tokens=TOOL_TOKENS,
                     system_tokens=SYSTEM_TOKENS, max_tokens=REPLY_TOKENS, think_s=THINK_S, seed=seed)


@dataclass(frozen=True)
class Compression:
    """`--time-compress K`: the report's run in 1/K of the time, same bytes."""

    k: float = 1.0

    def think_multiplier(self, time_scale: float = 1.0) -> float:
        return time_scale / self.k

    def engine_rates(self) -> tuple[float, float]:
        """(prefill tokens/s, decode tokens/s per slot) of the sim."""
        return PREFILL_TPS * self.k, DECODE_TPS * self.k

    def link_scale(self, kv_scale: float) -> float:
        """The shaped link runs at (rate x kv_scale x K): bytes are kv_scale smaller, time K faster."""
        return kv_scale * self.k

    def duration_s(self, minutes: float = RUN_MINUTES) -> float:
        return minutes * 60 / self.k

    def full_scale_s(self, seconds: float) -> float:
        """A time measured in the compressed run, as it would be at full scale."""
        return seconds * self.k
