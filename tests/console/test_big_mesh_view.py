"""The console at 256 hosts and thousands of sessions: the sessions order and filter run over every session
while the table holds a page; find-by-id jumps to a session off the page; hosts group by state (or zone) and
the title counts them, readable at 80x24 (issue 32)."""

from __future__ import annotations

import random

import pytest
from kvm_helpers import T0, Clock, FakeAdmin, screen_text

from kvmesh.console.app import KvmeshConsole
from kvmesh.console.config import ConsoleConfig
from kvmesh.console.screens.confirm import ConfirmScreen
from kvmesh.console.state import ConsoleState
from kvmesh.console.synthetic import SyntheticMesh
from kvmesh.console.widgets.hosts import HostsTable
from kvmesh.console.widgets.sessions import SessionsTable
from kvmesh.console.widgets.window import Window

pytestmark = pytest.mark.anyio


def test_window_keeps_the_full_order_through_changes_and_pages_it() -> None:
    """After random puts and discards the window's order equals a full sort, either direction, and its page is
    the slice of that order at `start`; index finds any key's position."""
    rng = random.Random(5)
    win = Window(page=50)
    truth: dict[str, tuple[int, str]] = {}
    for step in range(40):
        for _ in range(rng.choice([3, 30, 400])):
            k = f"s{rng.randrange(2000):04d}"
            if rng.random() < 0.2:
                win.discard(k)
                truth.pop(k, None)
            else:
                truth[k] = (rng.randrange(50), k)
                win.put(k, truth[k])
        reverse = step % 7 == 0
        win.set_reverse(reverse)
        win.settle()
        want = sorted(truth, key=truth.__getitem__, reverse=reverse)
        win.start = rng.randrange(len(want))
        assert win.rows() == want[win.start : win.start + 50]
        k = rng.choice(want)
        assert win.index(k) == want.index(k) and win.at(want.index(k)) == k
    assert win.label() == f"rows {win.start + 1}-{min(len(truth), win.start + 50)} of {len(truth)}"


def _big_state(clock: Clock, hosts: int, sessions: int) -> ConsoleState:
    """A mesh past the directory threshold, fed as it arrives: one partial snapshot per host."""
    mesh = SyntheticMesh(hosts=hosts, sessions=sessions, t0=T0)
    state = ConsoleState(clock=clock)
    for view in mesh.views(T0):
        url = f"synthetic://mesh/{view.node}"
        state.node_connected(url)
        state.feed(url, view)
    return state


def _app(state: ConsoleState) -> KvmeshConsole:
    """The app over a pre-filled state, as `kvm_helpers.make_app` makes it (frozen clock, UTC, no discovery)."""
    return KvmeshConsole(ConsoleConfig(utc=True, discover=False, refresh_interval=0.1), state=state, sources=[])


async def test_find_jumps_to_a_session_off_the_page_and_past_the_filter(clock: Clock) -> None:
    """f, an id fragment, Enter: the cursor lands on that session although it was beyond the table's page and
    the filter hid it (the filter is cleared and the operator told)."""
    app = _app(_big_state(clock, hosts=32, sessions=3000))
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.main.query_one(SessionsTable)
        app.refresh_view()
        await pilot.pause()
        assert table.row_count == table.window.page < 3000 and not table.has_row("sess-02917")
        await pilot.press("slash", *"node-1 ", "enter")
        await pilot.pause(0.3)
        app.refresh_view()
        assert table.window.total < 3000
        await pilot.press("f", *"2917", "enter")
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        assert table.cursor_key == "sess-02917" and table.filter_text == ""
        assert "rows" in str(table.border_title) and "of 3000" in str(table.border_title)


async def test_the_cursor_pages_past_the_edge_of_the_table(clock: Clock) -> None:
    """Down at the last row of the page moves the page on: the next session in the full order is selected."""
    app = _app(_big_state(clock, hosts=32, sessions=1200))
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.main.query_one(SessionsTable)
        app.refresh_view()
        await pilot.pause()
        last = table.window.page - 1
        table.move_cursor(row=last, animate=False)
        await pilot.pause()
        before = table.window.at(last)
        assert table.cursor_key == before
        await pilot.press("down")
        await pilot.pause()
        assert table.cursor_key == table.window.at(last + 1) and table.window.start > 0


async def test_256_hosts_group_by_state_and_read_at_80x24(clock: Clock) -> None:
    """256 hosts: a disconnected and a draining host are the first rows (problems first), the title counts every
    state, and at 80x24 (no panel titles) the top bar counts the hosts that need a look, shown first."""
    state = _big_state(clock, hosts=256, sessions=2000)
    app = _app(state)
    state.node_disconnected("synthetic://mesh/node-200", "reset")
    state.hosts["node-77"].info.draining = True
    async with app.run_test(size=(80, 24)) as pilot:
        app.refresh_view()
        await pilot.pause()
        hosts = app.main.query_one(HostsTable)
        assert hosts.ordered_keys()[:2] == ["node-200", "node-77"]
        title = str(hosts.border_title)
        assert title.startswith("Hosts 256") and "254 UP" in title and "1 DRAINING" in title
        assert "1 DISCONNECTED" in title and "by state" in title
        await pilot.press("g", "g")  # auto -> name -> state
        app.refresh_view()
        assert hosts.grouping == "state"
        text = screen_text(app)
        assert "hosts 256 (1 DRAINING, 1 DISCONNECTED)" in text  # the compact layout has no panel titles
        assert text.index("node-200") < text.index("node-77") < text.index("Sessions")


async def test_hosts_group_by_zone_when_hosts_report_one(clock: Clock) -> None:
    """Hosts that report a zone label are grouped by it (the title says so), in name order within a zone."""
    state = _big_state(clock, hosts=20, sessions=100)
    app = _app(state)
    for i, row in enumerate(state.hosts.values()):
        row.info.zone = "rack-b" if i % 2 else "rack-a"
    async with app.run_test(size=(120, 40)) as pilot:
        app.refresh_view()
        await pilot.pause()
        hosts = app.main.query_one(HostsTable)
        order = hosts.ordered_keys()
        zones = [state.hosts[n].info.zone for n in order]
        assert zones == sorted(zones) and "by zone" in str(hosts.border_title)


async def test_the_palette_finds_one_session_among_thousands(clock: Clock) -> None:
    """ctrl+p, "replicate sess-02917", Enter at 3,000 sessions (6,000 session commands): the confirm names it."""
    app = KvmeshConsole(ConsoleConfig(utc=True, discover=False, refresh_interval=0.1),
                        state=_big_state(clock, hosts=32, sessions=3000), sources=[], admin=FakeAdmin())  # type: ignore[arg-type]
    async with app.run_test(size=(120, 40)) as pilot:
        app.refresh_view()
        await pilot.press("ctrl+p")
        await pilot.pause(0.2)
        await pilot.press(*"replicate sess-02917")
        await pilot.pause(0.8)
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.action_spec.targets == ("sess-02917",)
