"""Fault drills (`kvmesh chaos`): kv_share faults never fail or corrupt a user's turn.

Each scenario ran on a fresh three-node sim mesh under the coding-agent workload; these
tests assert the invariants the drill measured (see node/chaos/ for how each is measured):
0 failed turns and 0 5xx, 0 corrupt or partial replicas (every stored block re-hashed), every
reply identical to a never-failing reference node's, no leaked temp files, every node serving
afterwards; and that the fault really happened.
"""

from __future__ import annotations

from typing import Any

import pytest


def _kv_share_invariants(d: dict[str, Any]) -> None:
    assert d["status"] != "not_run", f"the drill could not inject its fault: {d['not_run']}"
    assert d["fault"].get("hit"), f"the fault was not injected: {d['fault']}"
    assert d["corrupt_imports"] == 0, d["corrupt"]
    assert d["blocks_rehashed"] > 0 and d["replicas_checked"] > 0, "nothing was re-hashed"
    assert d["leaked_temp_files"] == 0, d["leaked"]
    assert d["outputs_compared"] > 20 and not d["output_mismatches"], d["output_mismatches"]
    assert d["serving_after"], d["serving"]
    assert d["turns"]["load"] > 10, d["turns"]


def _no_turn_lost(d: dict[str, Any]) -> None:
    assert d["failed_turns"] == 0, d["error_samples"]
    assert d["http_5xx"] == 0, d["turns"]


@pytest.mark.parametrize("name", ["connection-cut", "bit-flip"])
def test_proxy_fault_never_reaches_a_turn(chaos: dict[str, dict[str, Any]], name: str) -> None:
    """Half a replica, or a flipped bit: the receiver refuses the transfer, imports nothing of it,
    the retry lands whole and the session's next turn is warm; no turn failed."""
    d = chaos[name]
    _kv_share_invariants(d)
    _no_turn_lost(d)
    f = d["fault"]
    assert f["injected"]["blocks_sent"] > 2 and 0 < f["injected"]["sent_index"] < f["injected"]["blocks_sent"], f
    assert not f["migrate"]["ok"], f"the faulted transfer was reported delivered: {f['migrate']}"
    assert f["receiver_held_after"] == f["receiver_held_before"], "a torn or corrupt transfer was imported"
    if name == "bit-flip":
        assert "digest" in f["receiver_refused"], f["receiver_refused"]
    assert f["migrate_retry"]["ok"] and f["receiver_holds"] >= f["sender_holds"] // 256 * 256, f
    assert f["next_turn"]["ok"] and f["next_turn"]["cached_tokens"] >= 0.9 * f["next_turn"]["prompt_tokens"], f
    assert d["passed"], d["failures"]


def test_receiver_killed_mid_transfer_kv_share_invariants(chaos: dict[str, dict[str, Any]]) -> None:
    """The receiver dies mid-transfer and restarts: no partial replica anywhere, no temp file
    left, the replica is delivered whole afterwards, and every answered turn is the reference's."""
    d = chaos["receiver-killed"]
    _kv_share_invariants(d)
    f = d["fault"]
    assert f["turn_in_flight_on_victim"] and f["hog_running_at_kill"], f
    assert not f["migrate"]["ok"], f["migrate"]
    assert f["migrate_retry"]["ok"], f["migrate_retry"]
    assert d["checks"] == {k: True for k in d["checks"]}, d["checks"]


def test_receiver_killed_no_turn_lost(chaos: dict[str, dict[str, Any]]) -> None:
    """The streamed turn in flight on the killed host goes on from a survivor: no turn failed, and its
    answer is the reference's (compared with every other turn)."""
    d = chaos["receiver-killed"]
    _no_turn_lost(d)
    assert d["fault"]["hog_turn"]["ok"] and "hog_retry" not in d["fault"], d["fault"]
    assert d["passed"], d["failures"]


def test_evict_all_restores_from_the_store(chaos: dict[str, dict[str, Any]]) -> None:
    """Every idle cache on a host dropped at once: no turn fails, and a dropped session comes back
    from the host's own store (not recomputed) once kv_share is idle."""
    d = chaos["evict-all"]
    _kv_share_invariants(d)
    _no_turn_lost(d)
    f = d["fault"]
    assert f["evicted"] >= 1 and len(f["still_resident"]) <= 2, f  # running turns (one per slot) keep theirs
    assert d["checks"]["restored_from_store_when_idle"], f["restore_when_idle"]


def test_evict_all_restores_while_a_push_is_in_flight(chaos: dict[str, dict[str, Any]]) -> None:
    """A restore that needs the pool blocks a slow replica push pins stops that push: the turn is warm."""
    d = chaos["evict-all"]
    assert d["fault"]["restore_while_pushing"]["push_in_flight"], d["fault"]
    assert d["checks"]["restored_from_store_while_a_push_is_in_flight"], d["fault"]["restore_while_pushing"]
    assert d["passed"], d["failures"]


def test_clock_jump_really_jumps_the_victims_clock(chaos: dict[str, dict[str, Any]]) -> None:
    """The victim's own answers show its wall clock +1 h, then -1 h off; migrations still move the
    home everywhere, peers stay reachable, no turn fails, and the node uses monotonic clocks for durations."""
    d = chaos["clock-jump"]
    assert d["status"] != "not_run", f"the clock jump was not injected: {d['not_run']}"
    f = d["fault"]
    assert f["hit"] and len(f["jumps"]) == 2, f
    seen = [j["victim_clock_offset_s"] for j in f["jumps"]]
    assert abs(seen[0] - 3600) < 60 and abs(seen[1] + 3600) < 60, seen
    assert d["checks"] == {k: True for k in d["checks"]} and len(d["checks"]) == 5, d["checks"]
    assert not f["static_check"]["violations"], f["static_check"]
    _no_turn_lost(d)
    assert d["corrupt_imports"] == 0 and d["leaked_temp_files"] == 0 and d["serving_after"], d["failures"]
    assert d["status"] == "passed" and d["passed"], d["failures"]
