"""The main screen: all panels, the key bindings, the compact (80x24) layout switch.

Layout. Large terminals show everything at once: hosts on top, sessions and the
big handoff counters in the middle, links and the event log at the bottom.
Below 100x32 the screen takes the `-compact` class: hosts stay on top, counters
shrink to one line, and sessions / links / events share the rest, one at a time
(keys 1-3, shown in the view bar). Both layouts are the same widgets restyled by
`themes/kvmesh.tcss`, so state and cursors survive a resize.

Bindings live here rather than on the App so that modals (confirm, picker, help)
do not inherit them: a `d` typed into a confirm dialog must not start another drain.
"""

from __future__ import annotations

from functools import partial
from typing import cast

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Input, Static

from kvmesh.console.actions import MESH_ACTIONS
from kvmesh.console.format import Glyphs, fmt_clock, glyphs_for
from kvmesh.console.host import ConsoleHost
from kvmesh.console.screens.ascii import use_ascii_scrollbars
from kvmesh.console.state import Changes, ConsoleState
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.counters import CountersLine, CountersPanel
from kvmesh.console.widgets.eventlog import EventLog
from kvmesh.console.widgets.hosts import HostsTable
from kvmesh.console.widgets.links import LinksTable
from kvmesh.console.widgets.sessions import SessionsTable
from kvmesh.console.widgets.topbar import TopBar

VIEWS: tuple[str, ...] = ("sessions", "links", "events")

FILTER_DEBOUNCE_S = 0.15
COMPACT_WIDTH = 100
COMPACT_HEIGHT = 32


class MainScreen(Screen[None]):
    # description: the footer's short label; tooltip: the help screen's explanation.
    BINDINGS = [
        Binding("q", "quit", "Quit", tooltip="quit the console (the mesh is not touched)"),
        Binding("question_mark", "help", "Help", tooltip="this list of keys"),
        Binding("slash", "filter", "Filter", tooltip="filter sessions and the event log by text (id, host, WARM/PART/COLD, event type)"),
        Binding("escape", "clear_filter", "Clear filter", show=False, tooltip="clear the filter"),
        Binding("f", "find", "Find", show=False,
                tooltip="find a session by the id its user reads out (Claude Code session id, prompt_cache_key...) and jump to it"),
        Binding("p", "pause", "Pause", tooltip="freeze the view; updates queue (N pending) and apply in order on resume"),
        Binding("d", "drain", "Drain", tooltip="drain the selected host, or every marked host (confirm first)"),
        Binding("u", "undrain", "Undrain", tooltip="undrain the selected host, or every marked host (confirm first)"),
        Binding("m", "migrate", "Migrate", tooltip="move the selected (or marked) sessions: pick a target host, then confirm"),
        Binding("r", "replicate", "Replicate", tooltip="ship a replica of the selected (or marked) sessions now (confirm first)"),
        Binding("space", "mark", "Mark", show=False, tooltip="mark the row under the cursor for a batch action"),
        Binding("t", "cycle_theme", "Theme", tooltip="cycle themes: dark, light, colour-blind safe"),
        Binding("a", "show_all", "All", show=False, tooltip="sessions: live only (running, idle) or all, ended too"),
        Binding("s", "sort", "Sort", show=False, tooltip="sort sessions by the next column (or click a header)"),
        Binding("e", "log_scope", "Log scope", show=False, tooltip="event log: mesh events / all incl. turns / actions only"),
        Binding("o", "log_order", "Log order", show=False, tooltip="event log: newest first or tail"),
        Binding("1", "view('sessions')", "Sessions", show=False, tooltip="sessions panel (the compact layout shows one panel)"),
        Binding("2", "view('links')", "Links", show=False, tooltip="links panel"),
        Binding("3", "view('events')", "Events", show=False, tooltip="event log panel"),
        Binding("h", "focus_hosts", "Hosts", show=False, tooltip="move to the hosts table to select a host"),
        Binding("g", "group_hosts", "Group hosts", show=False,
                tooltip="hosts: group by state (problems first), by zone, or list by name"),
        Binding("v", "demo_view", "Demo view", show=False,
                tooltip="big counters, link sparklines, handoffs as they happen (v or Esc comes back)"),
    ]

    def __init__(self, *, readonly: bool, ascii_only: bool) -> None:
        super().__init__()
        self.readonly = readonly
        self.ascii_only = ascii_only
        self.view = "sessions"
        self.compact = False
        self.ready = False  # set once the panels are mounted; the refresh timer waits for it
        self._filter_timer: Timer | None = None
        self._viewbar_last: Text | None = None

    @property
    def console_app(self) -> ConsoleHost:
        return cast(ConsoleHost, self.app)

    def compose(self) -> ComposeResult:
        yield TopBar(readonly=self.readonly, id="topbar")
        hosts = HostsTable(id="hosts")
        hosts.border_title = "Hosts"
        yield hosts
        yield CountersLine(id="counters-line")
        yield Static("", id="viewbar")
        with Horizontal(id="middle"):
            yield SessionsTable(id="sessions", classes="view")
            counters = CountersPanel(ascii_only=self.ascii_only, id="counters")
            counters.border_title = "Handoffs"
            yield counters
        with Horizontal(id="bottom"):
            yield LinksTable(id="links", classes="view")
            yield EventLog(id="events", classes="view")
        yield Input(placeholder="filter sessions and events (Enter keeps it, Esc clears)", id="filter")
        yield Input(placeholder="find a session by id: Enter jumps to its row (Esc closes)", id="find")
        yield Footer()

    def on_mount(self) -> None:
        self.add_class(f"-view-{self.view}")
        if self.ascii_only:
            self.add_class("-ascii")
            use_ascii_scrollbars(*self.query(".view, #hosts"))
        self.query_one(SessionsTable).focus()
        self._apply_size(self.size.width, self.size.height)
        self.ready = True

    def on_resize(self, event: events.Resize) -> None:
        self._apply_size(event.size.width, event.size.height)

    def _apply_size(self, width: int, height: int) -> None:
        forced = self.console_app.config.layout
        compact = forced == "compact" or (forced == "auto" and (width < COMPACT_WIDTH or height < COMPACT_HEIGHT))
        if compact != self.compact or not (self.has_class("-compact") or self.has_class("-large")):
            self.compact = compact
            self.set_class(compact, "-compact")
            self.set_class(not compact, "-large")
            self.query_one(Footer).compact = compact
            self.console_app.state.mark_all_dirty()  # the counters widget in use changed

    # ---- patching from the state (called inside App.batch_update) -----------------------------

    def patch(self, state: ConsoleState, changes: Changes, palette: Palette, glyphs: Glyphs) -> None:
        app = self.console_app
        cfg = app.config
        full = changes.full
        self.query_one(TopBar).patch(state, palette, glyphs, theme=app.theme, utc=cfg.utc, show_clock=cfg.show_clock)
        self.query_one(HostsTable).patch(state, palette, glyphs, utc=cfg.utc, full=full)
        links = self.query_one(LinksTable)
        if not state.paused or changes.full:  # sparklines move with the clock; paused is frozen
            links.patch(state, palette, glyphs)
        if self.compact:
            self.query_one(CountersLine).patch(state, palette, glyphs, links.selected_link)
        else:
            self.query_one(CountersPanel).patch(state, palette, glyphs, links.selected_link)
        self.query_one(SessionsTable).patch(state, changes, palette, glyphs, full=full)
        self.query_one(EventLog).patch(state, palette, glyphs, utc=cfg.utc, force=full)
        self._patch_viewbar(state, palette, glyphs)

    def _patch_viewbar(self, state: ConsoleState, palette: Palette, glyphs: Glyphs) -> None:
        t = Text(no_wrap=True, overflow=glyphs.overflow)  # type: ignore[arg-type]
        for i, view in enumerate(VIEWS, 1):
            current = view == self.view
            t.append(f"{glyphs.cursor if current else ' '}{i} {view.capitalize()} ", style=palette.bold if current else palette.muted)
            if view == "sessions":  # the compact layout has no panel titles: the counts go here
                live = state.lifecycle_counts["running"] + state.lifecycle_counts["idle"]
                t.append(f"({live} live {glyphs.dot} {state.lifecycle_counts['ended']} ended) ", style=palette.muted)
        notes = []
        for name in state.host_names():
            word, level, since = state.host_state(name)
            if level == "stale" and since:
                notes.append(f"{name} {word}, stale since {fmt_clock(since, self.console_app.config.utc)}")
        if notes:
            t.append(" " + "; ".join(notes), style=palette.stale)
        if t != self._viewbar_last:
            self._viewbar_last = t
            self.query_one("#viewbar", Static).update(t, layout=False)

    # ---- readonly: mesh actions are hidden from the footer and not bound ------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in MESH_ACTIONS and self.readonly:
            return False
        return True

    # ---- actions ------------------------------------------------------------------------------

    async def action_quit(self) -> None:
        await self.app.action_quit()

    def action_help(self) -> None:
        from kvmesh.console.screens.help import HelpScreen

        glyphs = glyphs_for(self.ascii_only)
        self.console_app.push_modal(HelpScreen(list(self.BINDINGS), self.readonly, glyphs))  # type: ignore[arg-type]

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("-shown")
        box.focus()

    def action_find(self) -> None:
        box = self.query_one("#find", Input)
        box.add_class("-shown")
        box.focus()

    def action_clear_filter(self) -> None:
        find = self.query_one("#find", Input)
        if find.has_class("-shown"):
            find.value = ""
            find.remove_class("-shown")
            self.query_one(SessionsTable).focus()
            return
        box = self.query_one("#filter", Input)
        if box.value or box.has_class("-shown"):
            box.value = ""
            box.remove_class("-shown")
            self._apply_filter("")
            self.query_one(SessionsTable).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self._apply_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "find":
            table = self.query_one(SessionsTable)
            sid, message = table.find(self.console_app.state, event.value)
            if message:
                self.notify(message, timeout=4, severity="information" if sid else "warning")
            event.input.value = ""
            event.input.remove_class("-shown")
            box = self.query_one("#filter", Input)
            if box.value and not table.filter_text:  # the find cleared a filter that hid the session
                box.value = ""
                box.remove_class("-shown")
            if self.view != "sessions":
                self.action_view("sessions")
            table.focus()
            self.console_app.schedule_refresh()
            return
        if event.input.id == "filter":
            if not event.value:
                event.input.remove_class("-shown")
            self.query_one(SessionsTable).focus()

    def _apply_filter(self, text: str) -> None:
        # Debounced: typing "node-2" re-filters once, not six times over thousands of rows.
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_timer = self.set_timer(FILTER_DEBOUNCE_S, partial(self._filter_now, text))

    def _filter_now(self, text: str) -> None:
        self._filter_timer = None
        self.query_one(SessionsTable).set_filter(text)
        self.query_one(EventLog).set_filter(text)
        self.console_app.schedule_refresh()

    def action_pause(self) -> None:
        self.console_app.toggle_pause()

    def action_drain(self) -> None:
        self.console_app.request_action("drain")

    def action_undrain(self) -> None:
        self.console_app.request_action("undrain")

    def action_migrate(self) -> None:
        self.console_app.request_action("migrate")

    def action_replicate(self) -> None:
        self.console_app.request_action("replicate")

    def action_mark(self) -> None:
        focused = self.focused
        table: HostsTable | SessionsTable | None = None
        if isinstance(focused, (HostsTable, SessionsTable)):
            table = focused
        if table is None:
            return
        key = table.toggle_mark()
        if key is None:
            return
        state = self.console_app.state
        if isinstance(table, SessionsTable):
            state.touch_session(key)  # re-render the row with its mark
        else:
            state.touch_host(key)
        table.action_cursor_down()
        self.console_app.schedule_refresh()

    def action_cycle_theme(self) -> None:
        self.console_app.cycle_theme()

    def action_sort(self) -> None:
        by = self.query_one(SessionsTable).cycle_sort()
        self.notify(f"sessions sorted by {by}", timeout=2)
        self.console_app.schedule_refresh()

    def action_show_all(self) -> None:
        shown = "all sessions, ended too" if self.query_one(SessionsTable).toggle_all() else "live sessions only"
        self.notify(shown, timeout=2)
        self.console_app.schedule_refresh()

    def action_log_scope(self) -> None:
        scope = self.query_one(EventLog).cycle_scope()
        self.notify(f"event log: {scope}", timeout=2)
        self.console_app.schedule_refresh()

    def action_log_order(self) -> None:
        self.query_one(EventLog).toggle_order()
        self.console_app.schedule_refresh()

    def action_view(self, view: str) -> None:
        if view not in VIEWS:
            return
        self.remove_class(f"-view-{self.view}")
        self.view = view
        self.add_class(f"-view-{view}")
        widget = {"sessions": SessionsTable, "links": LinksTable, "events": EventLog}[view]
        self.call_after_refresh(self.query_one(widget).focus)
        self._viewbar_last = None
        self.console_app.schedule_refresh()

    def action_demo_view(self) -> None:
        self.console_app.show_demo_view()

    def action_group_hosts(self) -> None:
        table = self.query_one(HostsTable)
        grouping = table.cycle_grouping()
        shown = table.effective_grouping(self.console_app.state)
        self.notify(f"hosts by {shown}" + (" (auto)" if grouping == "auto" else ""), timeout=2)
        self.console_app.schedule_refresh()

    def action_focus_hosts(self) -> None:
        self.query_one(HostsTable).focus()
