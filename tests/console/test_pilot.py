"""Pilot tests: the running app, driven by keys, fed by a fake event source, with a fake admin client."""

from __future__ import annotations

import asyncio

import pytest
from kvm_helpers import NODE1, T0, Clock, FakeAdmin, FakeSource, make_app, make_view, screen_text
from textual.widgets import Button, Input

from kvmesh.console.screens.confirm import ConfirmScreen
from kvmesh.console.screens.help import HelpScreen
from kvmesh.console.screens.main import MainScreen
from kvmesh.console.screens.picker import TargetPicker
from kvmesh.console.widgets.eventlog import EventLog
from kvmesh.console.widgets.hosts import HostsTable
from kvmesh.console.widgets.sessions import SessionsTable
from kvmesh.console.widgets.topbar import TopBar
from kvmesh.node.protocol import ActionResult, DrainStarted, Handoff, MigrateCompleted, MigrateStarted, TurnFinished

pytestmark = pytest.mark.anyio


def cell(table: HostsTable | SessionsTable, row: str, col: str) -> str:
    return table.get_cell(row, col).plain


def log_texts(app) -> list[str]:  # type: ignore[no-untyped-def]
    return [e.text for e in app.state.log]


async def settle(pilot, seconds: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    """Let queued messages run, finish any admin call in flight, then refresh the view now (not on the timer)."""
    app = pilot.app
    await pilot.pause()
    admin = [w for w in app.workers if w.group == "admin"]
    if admin:
        await app.workers.wait_for_complete(admin)
    if seconds:
        await pilot.pause(seconds)
    app.refresh_view()
    await pilot.pause()


async def test_drain_confirm_cancel_makes_no_call(clock: Clock) -> None:
    """d opens the confirm modal naming the host with Cancel focused; Enter cancels and nothing is sent."""
    admin = FakeAdmin()
    app, state = make_app(clock, admin=admin, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("h", "down", "d")
        await settle(pilot)
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.action_spec.targets == ("node-2",)
        assert "Drain node-2?" in str(app.screen.query_one("#confirm-title").render())
        assert isinstance(app.focused, Button) and app.focused.id == "cancel"
        await pilot.press("enter")
        await settle(pilot)
        assert isinstance(app.screen, MainScreen)
        assert admin.calls == []
        assert any("cancelled drain node-2" in t for t in log_texts(app))


async def test_drain_confirm_sends_and_progress_lands_in_log(clock: Clock) -> None:
    """Confirming calls the admin API once; the node's drain events then show in hosts and the event log."""
    admin = FakeAdmin()
    source = FakeSource()
    app, state = make_app(clock, admin=admin, source=source, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("h", "down", "d")
        await settle(pilot)
        await pilot.press("right", "enter")
        await settle(pilot)
        assert admin.calls == [("drain", "node-2")]
        texts = log_texts(app)
        assert any("requested drain node-2" in t for t in texts)
        assert any("drain node-2: accepted" in t for t in texts)
        source.push(DrainStarted(ts=T0 + 20, node="node-2", seq=1, host="node-2", sessions=3))
        await source.drained()
        await settle(pilot)
        hosts = app.main.query_one(HostsTable)
        assert cell(hosts, "node-2", "state") == "DRAIN 0/3"
        log = app.main.query_one(EventLog)
        assert any(e.kind == "drain_started" for e in log.entries)


async def test_failed_action_result_is_logged_as_failed(clock: Clock) -> None:
    """A refused admin call (401/409...) is logged as FAILED with the node's message."""
    admin = FakeAdmin(result=ActionResult(ok=False, message="unauthorized (admin token missing or wrong)"))
    app, state = make_app(clock, admin=admin, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("h", "d", "right", "enter")
        await settle(pilot)
        assert admin.calls == [("drain", "node-1")]
        assert any("drain node-1: FAILED: unauthorized" in t for t in log_texts(app))


async def test_migrate_picker_then_confirm(clock: Clock) -> None:
    """m opens the target picker (home disabled), the pick goes to the confirm modal, then one migrate call."""
    admin = FakeAdmin()
    source = FakeSource()
    app, state = make_app(clock, admin=admin, source=source, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        # s-001 is homed on node-2
        await pilot.press("down", "m")
        await settle(pilot)
        picker = app.screen
        assert isinstance(picker, TargetPicker)
        assert picker.sessions == ["s-001"]
        options = {name: ok for name, _, ok in picker.hosts}
        assert options == {"node-1": True, "node-2": False, "node-3": True}
        await pilot.press("down", "enter")  # node-1 highlighted first; down skips disabled node-2
        await settle(pilot)
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.action_spec.target_host == "node-3"
        assert app.focused is not None and app.focused.id == "cancel"
        await pilot.press("tab", "enter")
        await settle(pilot)
        assert admin.calls == [("migrate", "s-001", "node-3")]
        source.push(
            MigrateStarted(ts=T0 + 20, node="node-2", seq=5, session="s-001", src="node-2", dst="node-3"),
            MigrateCompleted(ts=T0 + 21, node="node-2", seq=6, session="s-001", src="node-2", dst="node-3", ok=True),
        )
        await source.drained()
        await settle(pilot)
        sessions = app.main.query_one(SessionsTable)
        assert cell(sessions, "s-001", "home") == "node-3"
        assert any("migrate s-001 node-2→node-3 completed" in t for t in log_texts(app))


async def test_migrate_picker_escape_cancels(clock: Clock) -> None:
    """Esc in the picker cancels: no confirm, no call."""
    admin = FakeAdmin()
    app, state = make_app(clock, admin=admin, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("m")
        await settle(pilot)
        await pilot.press("escape")
        await settle(pilot)
        assert isinstance(app.screen, MainScreen)
        assert admin.calls == []


async def test_readonly_hides_and_refuses_actions(clock: Clock) -> None:
    """--readonly: RO in the header, no action keys or palette commands, and invoking one anyway is refused."""
    app, state = make_app(clock, readonly=True, admin=FakeAdmin(), snapshot=make_view())
    assert app.admin is None, "a read-only console holds no admin client"
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert " RO " in str(app.main.query_one(TopBar).render())
        for key in ("d", "u", "m", "r"):
            await pilot.press("h" if key in "du" else "1", key)
            await settle(pilot)
            assert isinstance(app.screen, MainScreen), f"{key} must not open anything in read-only mode"
        shown = {ab.binding.action for ab in app.screen.active_bindings.values() if ab.binding.show}
        assert not shown & {"drain", "undrain", "migrate", "replicate"}
        names = [name for name, _, _ in app.palette_commands(include_sessions=True)]
        assert not any(n.split()[0] in ("drain", "undrain", "migrate", "replicate") for n in names)
        app.request_action("drain", ["node-1"])
        await settle(pilot)
        assert isinstance(app.screen, MainScreen)
        assert any("refused drain" in t for t in log_texts(app))


async def test_filter_narrows_sessions_and_escape_clears(clock: Clock) -> None:
    """/ then text keeps only matching sessions (id, hosts, class word); Esc restores all rows."""
    app, state = make_app(clock, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        sessions = app.main.query_one(SessionsTable)
        assert sessions.row_count == 6
        await pilot.press("slash")
        assert isinstance(app.focused, Input)
        await pilot.press(*"cold")
        await settle(pilot, 0.2)  # the filter is debounced
        assert set(sessions.shown_keys()) == {"s-003"}
        await pilot.press("escape")
        await settle(pilot, 0.2)
        assert sessions.row_count == 6
        assert isinstance(app.focused, SessionsTable)


async def test_pause_queues_updates_and_resume_applies_them(clock: Clock) -> None:
    """p freezes the view and shows "N updates pending"; p again applies them in order."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("p")
        for i in range(3):
            source.push(Handoff(ts=T0 + 20 + i, node="node-3", seq=10 + i, session="s-000", src="node-1",
                                dst="node-3", cls="cold", prompt_tokens=100, reused_tokens=0))
        await source.drained()
        await settle(pilot)
        top = str(app.main.query_one(TopBar).render())
        assert "PAUSED" in top and "3 updates pending" in top
        assert state.counters.cold == 1
        await pilot.press("p")
        await settle(pilot)
        assert state.counters.cold == 4
        assert "PAUSED" not in str(app.main.query_one(TopBar).render())
        assert any("applied 3 queued updates" in t for t in log_texts(app))


async def test_cursor_stays_on_session_across_updates(clock: Clock) -> None:
    """The cursor follows its session id when rows are added above it and when the sort order changes."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        sessions = app.main.query_one(SessionsTable)
        await pilot.press("down", "down", "down")
        assert sessions.cursor_key == "s-003"
        source.push(TurnFinished(ts=T0 + 20, node="node-1", seq=1, session="a-new", host="node-1",
                                 prompt_tokens=10, cached_tokens=0, completion_tokens=5, ttft_s=0.1, total_s=1))
        await source.drained()
        await settle(pilot)
        assert sessions.row_count == 7 and sessions.get_row_index("a-new") == 0
        assert sessions.cursor_key == "s-003"
        await pilot.press("s", "s", "s")  # state -> session -> home -> tokens, largest first
        await settle(pilot)
        assert sessions.sort_by == "tokens"
        assert sessions.cursor_key == "s-003"


async def test_space_marks_rows_for_a_batch_action(clock: Clock) -> None:
    """space marks sessions; r then confirms all marked ones in one modal and replicates each."""
    admin = FakeAdmin()
    app, state = make_app(clock, admin=admin, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("space", "down", "space", "r")
        await settle(pilot)
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.action_spec.targets == ("s-000", "s-002")
        await pilot.press("right", "enter")
        await settle(pilot)
        assert admin.calls == [("replicate", "s-000"), ("replicate", "s-002")]
        assert not app.main.query_one(SessionsTable).marked, "marks are cleared after the action"


async def test_help_lists_every_key(clock: Clock) -> None:
    """? opens help listing every binding of the main screen plus ctrl+p; Esc closes it."""
    app, state = make_app(clock, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        await settle(pilot)
        assert isinstance(app.screen, HelpScreen)
        text = "\n".join(app.screen.lines)
        for binding in MainScreen.BINDINGS:
            assert binding.description in text  # type: ignore[union-attr]
        for key in ("q", "?", "/", "p", "d", "u", "m", "r", "t", "space", "ctrl+p"):
            assert f"  {key} " in text, key
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)


async def test_theme_cycles_through_console_themes(clock: Clock) -> None:
    """t cycles dark -> light -> colour-blind-safe -> dark."""
    app, state = make_app(clock, snapshot=make_view())
    async with app.run_test(size=(80, 24)) as pilot:
        seen = [app.theme]
        for _ in range(3):
            await pilot.press("t")
            await settle(pilot)
            seen.append(app.theme)
        assert seen == ["kvmesh-dark", "kvmesh-light", "kvmesh-cb", "kvmesh-dark"]


async def test_command_palette_drain_by_name_goes_through_confirm(clock: Clock) -> None:
    """ctrl+p, "drain node-3", Enter: the same confirm modal as the d key."""
    admin = FakeAdmin()
    app, state = make_app(clock, admin=admin, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+p")
        await settle(pilot)
        await pilot.press(*"drain node-3")
        await settle(pilot, 0.5)
        await pilot.press("enter")
        await settle(pilot, 0.2)
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.action_spec.kind == "drain" and app.screen.action_spec.targets == ("node-3",)
        await pilot.press("escape")
        await settle(pilot)
        assert admin.calls == []


async def test_disconnected_node_dimmed_with_stale_since(clock: Clock) -> None:
    """A lost node stays in the hosts table as DISCONNECTED with its stale-since time; the app keeps running."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        source.queue.put_nowait(None)  # the fake socket closes
        await source.drained()
        await settle(pilot)
        hosts = app.main.query_one(HostsTable)
        assert cell(hosts, "node-1", "state") == "DISCONNECTED"
        assert cell(hosts, "node-1", "since") == "22:13:30"
        viewbar = str(app.main.query_one("#viewbar").render())
        assert "node-1 DISCONNECTED, stale since 22:13:30" in viewbar
        assert app.is_running


async def test_compact_and_large_layouts(clock: Clock) -> None:
    """80x24 gets the compact layout with view keys 1-3; 120x40 shows every panel at once."""
    app, state = make_app(clock, snapshot=make_view())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        main = app.main
        assert main.has_class("-compact")
        assert main.query_one("#sessions").display and not main.query_one("#counters").display
        await pilot.press("2")
        await settle(pilot)
        assert main.query_one("#links").region.height > 0 and main.query_one("#sessions").region.height == 0
        await pilot.press("3")
        await settle(pilot)
        assert main.query_one("#events").region.height > 0
        await pilot.resize_terminal(120, 40)  # type: ignore[attr-defined]
        await settle(pilot)
        assert main.has_class("-large")
        for wid in ("#hosts", "#sessions", "#counters", "#links", "#events"):
            assert main.query_one(wid).region.height > 0, wid


async def test_ingest_worker_survives_bad_frames(clock: Clock) -> None:
    """Garbage on the stream is counted and skipped; the worker keeps feeding the state."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        state.feed_frame(NODE1, "garbage")
        source.push(Handoff(ts=T0 + 30, node="node-2", seq=99, session="s-004", src="node-1", dst="node-2",
                            cls="warm", prompt_tokens=10, reused_tokens=10))
        await source.drained()
        await asyncio.sleep(0.1)
        await settle(pilot)
        assert state.bad_frames == 1 and state.counters.warm == 51


async def test_ascii_mode_draws_only_ascii(clock: Clock) -> None:
    """--ascii: the main screen (both layouts), the confirm modal, the picker and help contain no non-ASCII character."""
    app, state = make_app(clock, ascii_only=True, admin=FakeAdmin(), snapshot=make_view(n_sessions=40))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        shots = {"compact": screen_text(app)}
        await pilot.press("h", "d")
        await settle(pilot)
        shots["confirm"] = screen_text(app)
        await pilot.press("escape", "1", "m")
        await settle(pilot)
        shots["picker"] = screen_text(app)
        await pilot.press("escape", "question_mark")
        await settle(pilot)
        shots["help"] = screen_text(app)
        await pilot.press("escape")
        await pilot.resize_terminal(120, 40)  # type: ignore[attr-defined]
        await settle(pilot)
        shots["large"] = screen_text(app)
    for name, text in shots.items():
        bad = sorted({ch for ch in text if ord(ch) > 126})
        assert not bad, f"{name}: non-ASCII {bad}"
    assert "WARM" in shots["compact"] and "Drain node-1?" in shots["confirm"]


async def test_event_log_scope_order_and_type_filter(clock: Clock) -> None:
    """e cycles mesh/all/actions (turns only under all), o flips newest-first/tail, / filters by event type."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        source.push(
            TurnFinished(ts=T0 + 1, node="node-1", seq=1, session="s-000", host="node-1", prompt_tokens=10,
                         cached_tokens=0, completion_tokens=5, ttft_s=0.1, total_s=1),
            DrainStarted(ts=T0 + 2, node="node-2", seq=1, host="node-2", sessions=3),
            Handoff(ts=T0 + 3, node="node-3", seq=1, session="s-001", src="node-2", dst="node-3", cls="warm",
                    prompt_tokens=10, reused_tokens=10),
        )
        await source.drained()
        await settle(pilot)
        log = app.main.query_one(EventLog)
        kinds = [e.kind for e in log.entries]
        assert "turn_finished" not in kinds and kinds.index("handoff") < kinds.index("drain_started")
        await pilot.press("e")  # all
        await settle(pilot)
        assert "turn_finished" in [e.kind for e in log.entries]
        await pilot.press("e")  # actions
        await settle(pilot)
        assert {e.kind for e in log.entries} <= {"drain_started", "action"} and log.entries
        await pilot.press("e", "o")  # back to mesh, tail order
        await settle(pilot)
        kinds = [e.kind for e in log.entries]
        assert kinds.index("handoff") > kinds.index("drain_started")
        await pilot.press("slash", *"drain_")
        await settle(pilot, 0.2)
        assert [e.kind for e in log.entries] == ["drain_started"]


async def test_clicking_a_header_sorts_sessions(clock: Clock) -> None:
    """Clicking the Tokens header sorts by tokens (largest first); clicking again reverses."""
    app, state = make_app(clock, snapshot=make_view())
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        sessions = app.main.query_one(SessionsTable)
        x = 1 + sum(c.width + 2 for c in SessionsTable.COLUMNS[:2]) + 2  # past the border, inside "Tokens"
        await pilot.click(SessionsTable, offset=(x, 1))  # row 1: the header, under the border
        await settle(pilot)
        assert sessions.sort_by == "tokens" and sessions.sort_reverse
        assert list(sessions.shown_keys()) and sessions.get_row_index("s-005") == 0
        await pilot.click(SessionsTable, offset=(x, 1))  # row 1: the header, under the border
        await settle(pilot)
        assert not sessions.sort_reverse and sessions.get_row_index("s-000") == 0


async def test_names_from_the_mesh_are_not_markup(clock: Clock) -> None:
    """Host names with [brackets] show literally in the tables, the picker and the confirm modal."""
    snap = make_view()
    snap.cluster.hosts[2].name = "gpu[bold]3"
    app, state = make_app(clock, admin=FakeAdmin(), snapshot=snap)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert "gpu[bold]3" in screen_text(app)
        await pilot.press("m")
        await settle(pilot)
        assert "gpu[bold]3" in screen_text(app)
        await pilot.press("enter")  # hosts are in name order: "gpu[bold]3" first
        await settle(pilot)
        assert isinstance(app.screen, ConfirmScreen)
        text = screen_text(app)
        assert "Migrate s-000 to gpu[bold]3?" in text and "Migrate s-000 to gpu[bold]3 " in text  # title, button


async def test_a_host_without_replicas_says_so_in_the_hosts_table(clock: Clock) -> None:
    """A host whose model keeps no replicas (hybrid, recurrent) shows KV in/out 'none' and the reason in the subtitle."""
    snap = make_view()
    snap.cluster.hosts[1].no_replicas = "it has recurrent layers only"
    app, state = make_app(clock, snapshot=snap)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        hosts = app.main.query_one(HostsTable)
        assert (cell(hosts, "node-2", "kv_in"), cell(hosts, "node-2", "kv_out")) == ("none", "none")
        assert cell(hosts, "node-1", "kv_in") != "none"
        assert "node-2: no replicas (it has recurrent layers only)" in str(hosts.border_subtitle)
