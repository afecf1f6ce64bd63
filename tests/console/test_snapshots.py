"""Snapshot (SVG) tests of the whole screen: every theme at 80x24 and 120x40, plus ASCII and the confirm modal.

Data and time are frozen (clock, UTC, fixed event times), so the screens are byte-for-byte stable.
Update with `pytest tests/console/test_snapshots.py --snapshot-update` after an intended change.
"""

from __future__ import annotations

import pytest
from kvm_helpers import NODE1, NODE2, T0, Clock, add_group, make_app, make_view

from kvmesh.console.app import KvmeshConsole
from kvmesh.console.theme import THEME_NAMES
from kvmesh.node.protocol import DrainStarted, Handoff, ReplicaSent, TurnStarted


def scenario(theme: str = "kvmesh-dark", ascii_only: bool = False, readonly: bool = False) -> KvmeshConsole:
    """Three hosts (node-2's stream lost, node-3 draining), six sessions, two links with traffic."""
    clock = Clock(T0 + 10)
    app, state = make_app(clock, theme=theme, ascii_only=ascii_only, readonly=readonly, snapshot=make_view())
    state.feed(NODE1, ReplicaSent(ts=T0 + 9, node="node-1", seq=1, session="s-000", src="node-1", dst="node-2",
                                  blocks=40, bytes=300 << 20, seconds=2.5, tokens=40_000))
    state.feed(NODE1, Handoff(ts=T0 + 8, node="node-2", seq=1, session="s-003", src="node-1", dst="node-2",
                              cls="warm", prompt_tokens=13_000, reused_tokens=12_900))
    state.feed(NODE1, DrainStarted(ts=T0 + 9, node="node-3", seq=1, host="node-3", sessions=2))
    # node-2's own stream was followed and lost at T0+5: it must stay, dimmed, DISCONNECTED
    clock.now = T0 + 5
    state.node_connected(NODE2)
    state.nodes[NODE2].name = "node-2"
    state.node_disconnected(NODE2, "connection reset")
    clock.now = T0 + 10
    return app


async def _settle(pilot) -> None:  # type: ignore[no-untyped-def]
    pilot.app.refresh_view()
    await pilot.pause()
    await pilot.pause()


@pytest.mark.parametrize("theme", THEME_NAMES)
@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_screen_snapshot(snap_compare, theme: str, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """The full screen in each theme at 80x24 (compact layout) and 120x40 (every panel)."""
    assert snap_compare(scenario(theme), terminal_size=size, run_before=_settle)


def test_ascii_readonly_snapshot(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """--ascii --readonly at 80x24: no Unicode glyphs or box drawing, RO in the header, no action keys."""
    assert snap_compare(scenario(ascii_only=True, readonly=True), terminal_size=(80, 24), run_before=_settle)


def test_confirm_modal_snapshot(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """The drain confirm modal at 80x24: names the host, says what happens, Cancel focused."""

    async def open_confirm(pilot) -> None:  # type: ignore[no-untyped-def]
        await _settle(pilot)
        await pilot.press("h", "d")
        await pilot.pause()

    assert snap_compare(scenario(), terminal_size=(80, 24), run_before=open_confirm)


def threads_scenario() -> KvmeshConsole:
    """The six sessions and a client session cc-1 (issue 31): its main conversation and three threads, one of
    them running a turn."""
    app, state = make_app(Clock(T0 + 10), snapshot=add_group(make_view()))
    state.feed(NODE1, TurnStarted(ts=T0 + 9, node="node-3", seq=1, session="cc-1#12345678", host="node-3",
                                  prompt_tokens=6400, cached_tokens=6300))
    return app


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_threads_snapshot(snap_compare, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """A client session's rows read as one: "cc-1 +3" then its threads as "› #<hex>", the group first since one
    thread is running; at 120x40 the line under the table names the group's threads (cursor on the main)."""
    assert snap_compare(threads_scenario(), terminal_size=size, run_before=_settle)
