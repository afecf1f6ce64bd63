"""Pilot tests of the sessions view's lifecycle (running / idle / ended) and replica freshness
(fresh / behind / in flight / stale), each driven by real protocol events through the app's ingest path."""

from __future__ import annotations

import pytest
from kvm_helpers import T0, Clock, FakeSource, make_app, make_view

from kvmesh.console.state import IDLE_AFTER_S, REPLICA_PUSH_GRACE_S
from kvmesh.console.widgets.sessions import SessionsTable
from kvmesh.node.protocol import (
    ClusterViewEvent,
    ReplicaReady,
    ReplicaRefused,
    ReplicaSent,
    ReplicaStarted,
    TurnFinished,
    TurnStarted,
)

pytestmark = pytest.mark.anyio

BLOCK = 256
# s-000 lives on node-1 with 10,000 tokens (39 whole blocks and 16 tokens); its replica is on node-2.
WHOLE = 10_000 // BLOCK * BLOCK


async def settle(pilot) -> None:  # type: ignore[no-untyped-def]
    """Let the fake source's frames land, then refresh the view now."""
    await pilot.pause()
    pilot.app.refresh_view()
    await pilot.pause()


def fresh_cell(app, sid: str = "s-000") -> str:  # type: ignore[no-untyped-def]
    return app.main.query_one(SessionsTable).get_cell(sid, "fresh").plain


def lifecycle_snapshot() -> ClusterViewEvent:
    """s-001 ... s-003 idle; s-004 held nowhere (ended); s-005 last turn an hour ago (ended);
    s-002's cache is in no engine, only in node-1's replica store."""
    snap = make_view(block_size=BLOCK)
    sessions = snap.cluster.sessions
    sessions[2].resident_tokens = 0
    sessions[4].resident_tokens, sessions[4].replica_host = 0, None
    sessions[5].last_turn_at = T0 - 3600
    return snap


async def test_lifecycle_running_idle_ended_and_the_all_toggle(clock: Clock) -> None:
    """Live sessions only by default, running first; the title counts each state; a shows ended ones; time ends idle ones."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=lifecycle_snapshot())
    async with app.run_test(size=(120, 40)) as pilot:
        source.push(TurnStarted(ts=T0 + 9, node="node-3", seq=1, session="s-003", host="node-1",
                                prompt_tokens=13_000, cached_tokens=12_900, turn_seq=1))
        await source.drained()
        await settle(pilot)
        table = app.main.query_one(SessionsTable)
        assert table.row_count == 4, "s-004 (held nowhere) and s-005 (no turn for an hour) are hidden"
        assert table.get_row_index("s-003") == 0, "a running session leads"
        assert table.get_cell("s-003", "session").plain.startswith(" ▶")
        assert "1 running · 3 idle · 2 ended" in str(table.border_title)
        assert table.get_cell("s-002", "tokens").plain == "store:node-1"
        await pilot.press("a")
        await settle(pilot)
        assert table.row_count == 6
        assert table.get_cell("s-005", "session").plain.startswith(" ×")
        clock.advance(IDLE_AFTER_S + 1)  # no event: time alone ends every idle session
        await settle(pilot)
        assert "1 running · 0 idle · 5 ended" in str(table.border_title)
        await pilot.press("a")
        await settle(pilot)
        assert [table.get_row_index("s-003"), table.row_count] == [0, 1]


async def test_replica_missing_only_the_partial_block_is_fresh(clock: Clock) -> None:
    """A replica holding every whole block (the partial last block is never sent) shows fresh, not behind."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view(block_size=BLOCK))
    async with app.run_test(size=(120, 40)) as pilot:
        source.push(ReplicaReady(ts=T0 + 9, node="node-2", seq=1, session="s-000", src="node-1", dst="node-2",
                                 tokens=WHOLE, bytes=WHOLE * 4096, lag_s=0.01, imported=False))
        await source.drained()
        await settle(pilot)
        assert state.sessions["s-000"].replica_behind_tokens == 10_000 - WHOLE > 0
        assert fresh_cell(app) == "● fresh  1s"


async def test_replica_missing_whole_blocks_is_behind_since_the_turn(clock: Clock) -> None:
    """A turn that grows the session by whole blocks leaves its replica behind: tokens short and since when."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view(block_size=BLOCK))
    async with app.run_test(size=(120, 40)) as pilot:
        source.push(TurnFinished(ts=T0 + 4, node="node-1", seq=1, session="s-000", host="node-1",
                                 prompt_tokens=10_300, cached_tokens=10_000, completion_tokens=300, ttft_s=0.1,
                                 total_s=1.0))
        await source.drained()
        await settle(pilot)
        # 10,600 tokens = 41 whole blocks; the replica holds 39: 2 blocks (512 tokens) short since T0+4
        assert fresh_cell(app) == "◐  512   6s"


async def test_replica_push_moving_is_in_flight_with_progress(clock: Clock) -> None:
    """replica_started shows the push in flight, its progress estimated from the link's last rate; ready ends it."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view(block_size=BLOCK))
    async with app.run_test(size=(120, 40)) as pilot:
        # The link's last transfer: 10 blocks in 1 s.
        source.push(ReplicaSent(ts=T0 + 1, node="node-1", seq=1, session="s-004", src="node-1", dst="node-2",
                                blocks=10, bytes=10 << 20, seconds=1.0, tokens=2560),
                    TurnFinished(ts=T0 + 2, node="node-1", seq=2, session="s-000", host="node-1",
                                 prompt_tokens=14_700, cached_tokens=10_000, completion_tokens=300, ttft_s=0.1,
                                 total_s=1.0),
                    ReplicaStarted(ts=T0 + 8, node="node-1", seq=3, session="s-000", src="node-1", dst="node-2",
                                   blocks=58, tokens=58 * BLOCK))
        await source.drained()
        await settle(pilot)
        # 58 blocks offered, 39 held there: 19 to send at 10 blocks/s = 1.9 s; 2 s in, capped at 99%
        assert fresh_cell(app) == "⇄  99%  2s"
        clock.now = T0 + 8.95
        await settle(pilot)
        assert fresh_cell(app) == "⇄  50%  1s"
        source.push(ReplicaReady(ts=T0 + 9.5, node="node-2", seq=1, session="s-000", src="node-1", dst="node-2",
                                 tokens=58 * BLOCK, bytes=19 << 20, lag_s=0.01, imported=False))
        await source.drained()
        clock.now = T0 + 10
        await settle(pilot)
        assert fresh_cell(app) == "● fresh  0s"


async def test_replica_behind_with_no_push_coming_is_stale(clock: Clock) -> None:
    """Behind and the push refused (or none for the grace period) is stale: no transfer is coming."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view(block_size=BLOCK))
    async with app.run_test(size=(120, 40)) as pilot:
        source.push(TurnFinished(ts=T0 + 4, node="node-1", seq=1, session="s-000", host="node-1",
                                 prompt_tokens=10_300, cached_tokens=10_000, completion_tokens=300, ttft_s=0.1,
                                 total_s=1.0),
                    TurnFinished(ts=T0 + 5, node="node-1", seq=2, session="s-004", host="node-2",
                                 prompt_tokens=14_300, cached_tokens=14_000, completion_tokens=300, ttft_s=0.1,
                                 total_s=1.0),
                    ReplicaRefused(ts=T0 + 6, node="node-2", seq=1, session="s-000", src="node-1", dst="node-2",
                                   reason="budget", message="store full"))
        await source.drained()
        await settle(pilot)
        assert fresh_cell(app) == "○  512   6s"
        assert fresh_cell(app, "s-004").startswith("◐")  # behind, a push may still come...
        clock.advance(REPLICA_PUSH_GRACE_S)
        await settle(pilot)
        assert fresh_cell(app, "s-004").startswith("○")  # ...but none came within the grace period


def test_block_size_reaches_the_console_from_the_snapshot(clock: Clock) -> None:
    """The block size the freshness rule uses is the one the hosts put on the wire."""
    app, state = make_app(clock, snapshot=make_view(block_size=BLOCK))
    assert state.block_size(state.sessions["s-000"]) == BLOCK
    assert state.hosts["node-1"].info.block_size == BLOCK
