"""A load sent through the official Anthropic SDK: its own retries of a real node's refusals counted, usage read."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvmesh.node.lab.clientmodel import ClientModel
from kvmesh.node.lab.launcher import write_mesh
from kvmesh.node.lab.load import LoadRunner, LoadShape, LoadStats
from kvmesh.node.lab.sdkclient import AnthropicSender, anthropic_messages


def test_chat_messages_become_anthropic_ones() -> None:
    """System messages become `system`; a tool's output is a user turn; the rest keep their roles and order."""
    system, msgs = anthropic_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                                       {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}])
    assert system == "S"
    assert msgs == [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "t"}]


def _replay(tmp_path: Path, retries: int, turns: io.StringIO | None = None) -> LoadStats:
    """One slot decoding slowly; a second session's first turn arrives while the first runs, so the node's admission
    (a new session may wait 0.05 s) refuses it with a Retry-After and a place in line."""
    trace = tmp_path / "trace.jsonl"
    lines = [{"session": "s1", "t": 0.0, "messages": [{"role": "system", "content": "You are terse. " * 20},
                                                      {"role": "user", "content": "Write the plan. " * 30}]},
             {"session": "s2", "t": 0.3, "messages": [{"role": "user", "content": "Other work. " * 30}]},
             {"session": "s1", "t": 0.4, "messages": [{"role": "assistant", "content": "ok"},
                                                      {"role": "tool", "content": "result " * 40}]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    mesh = write_mesh(tmp_path / "mesh", ["a"], engine={"kind": "sim", "slots": 1, "sim": {"decode_tps": 20.0}},
                      extra={"kvshare": {"fsync": "never"}, "mesh": {"admit_new_wait_s": 0.05}})
    mesh.start(peers_timeout=None)
    try:
        runner = LoadRunner([mesh.nodes["a"].api], LoadShape(max_tokens=40), client=ClientModel(retries=retries),
                            sdk="anthropic", turns=turns)
        return asyncio.run(runner.replay(trace))
    finally:
        mesh.stop()


def test_the_sdk_retries_a_refusal_after_its_retry_after_and_each_attempt_is_counted(tmp_path: Path) -> None:
    """With the SDK's default 2 retries the refused turn comes back after its Retry-After and is served; its refusal
    is counted, and its TTFT from the first attempt includes the wait."""
    stats = _replay(tmp_path, retries=2)
    s = stats.summary()
    assert s["errors"] == 0 and s["turns"] == 3 and s["failed_turns"] == 0, s
    assert s["refused"] >= 1 and s["turns_refused_once_pct"] == pytest.approx(100 / 3, abs=0.01), s
    # The refused turn, and it alone, waited its Retry-After (>= 1 s) before its served attempt; the served attempt's
    # own TTFT may include a queue (its place is due up to a second early), so the wait is read per turn.
    waited = [w - t for w, t in zip(stats.ttft_with_retries_s, stats.ttft_s, strict=True)]
    assert sorted(x >= 1.0 for x in waited) == [False, False, True] and min(waited) == 0.0, waited
    # The follow-up of s1 reused its conversation's prefix, as read from the SDK's usage (cache_read_input_tokens).
    assert s["prompt_tokens_recomputed"] < s["prompt_tokens"], s


def test_a_turn_whose_sdk_has_no_retries_left_fails_as_refused(tmp_path: Path) -> None:
    """max_retries 0: the refusal ends the turn, counted as failed (refused), not as an error."""
    s = _replay(tmp_path, retries=0).summary()
    assert s["errors"] == 0 and s["turns"] == 2, s
    assert s["refused"] == 1 and s["failed_refused"] == 1 and s["failed_timeout"] == 0, s


def _lines(turns: io.StringIO) -> dict[str, list[dict[str, Any]]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for line in turns.getvalue().splitlines():
        row = json.loads(line)
        by.setdefault(row["session"], []).append(row)
    return by


def test_every_turn_is_one_line_saying_where_it_ran_and_what_it_waited(tmp_path: Path) -> None:
    """`turns`: a line per turn, the refused one's with its refusal and its wait, each with host, handoff and tokens."""
    turns = io.StringIO()
    _replay(tmp_path, retries=2, turns=turns)
    by = _lines(turns)
    assert sorted((k, len(v)) for k, v in by.items()) == [("s1", 2), ("s2", 1)], by
    (s2,) = by["s2"]
    assert s2["refused"] == 1 and s2["host"] == "a" and s2["ttft_with_retries_s"] >= s2["ttft_s"] + 1.0, s2
    first, follow = by["s1"]
    assert first["refused"] == follow["refused"] == 0 and first["t"] < follow["t"], by
    assert first["cached_tokens"] == 0 < follow["cached_tokens"] < follow["prompt_tokens"], by
    assert {r["handoff"] for r in by["s1"]} == {"none"} and "failed" not in first, by


def test_a_failed_turn_is_a_line_that_says_why(tmp_path: Path) -> None:
    """With no retries the refused turn's line says it failed as refused, with no host (it never ran)."""
    turns = io.StringIO()
    _replay(tmp_path, retries=0, turns=turns)
    (s2,) = _lines(turns)["s2"]
    assert s2["failed"] == "refused" and s2["refused"] == 1 and "host" not in s2, s2


def test_the_schedule_starts_once_the_clients_are_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that takes a second to set up (the SDK's import on a busy box) still sends the trace's first request
    at its time: timed from before the setup, the trace's first seconds went out as one burst."""
    slow_init = AnthropicSender.__init__

    def slow(self: AnthropicSender, *a: Any, **kw: Any) -> None:
        time.sleep(1.5)
        slow_init(self, *a, **kw)

    monkeypatch.setattr(AnthropicSender, "__init__", slow)
    turns = io.StringIO()
    _replay(tmp_path, retries=2, turns=turns)
    first = _lines(turns)["s1"][0]
    assert first["t"] < 0.5, first  # the trace sends it at 0.0
