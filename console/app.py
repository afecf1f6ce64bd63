"""The Textual app: wires the state, the ingest workers, the refresh timer and the action path.

- One ingest worker per node (`run_worker(..., group="ingest:<url>", exclusive=True)`),
  each following that node's websocket forever and feeding `ConsoleState`, presenting the
  client API key when there is one (`console.apikey`).
- A timer (~0.5 s) patches the main screen from the state inside `batch_update()`;
  widgets are patched, never rebuilt. Each refresh's time to paint is recorded
  (the bench reports its p95).
- Every mesh-changing action (keys, palette, batch marks) goes through
  `request_action` (`action_path.py`, mixed in): refused in read-only mode, a target
  picker for migrate, the one confirm modal, then the admin API; requests and results
  land in the event log.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any

from textual.app import App
from textual.css.query import NoMatches
from textual.screen import ModalScreen

from kvmesh.console.action_path import ActionPath
from kvmesh.console.admin import AdminClient, TokenSource
from kvmesh.console.apikey import ApiKey
from kvmesh.console.config import ConsoleConfig
from kvmesh.console.format import glyphs_for
from kvmesh.console.heap import HeapSettler
from kvmesh.console.host import PaletteCommand
from kvmesh.console.ingest import stream_node
from kvmesh.console.palette import MeshCommands
from kvmesh.console.screens.demo import DemoScreen
from kvmesh.console.screens.main import VIEWS, MainScreen
from kvmesh.console.state import ConsoleState
from kvmesh.console.theme import DEFAULT_THEME, THEME_NAMES, Palette, css_path, fill_kvm_variables, load_themes

Source = Callable[[ConsoleState], Awaitable[None]]


class KvmeshConsole(ActionPath, App[None]):
    CSS_PATH = str(css_path())
    TITLE = "kvmesh-console"
    COMMANDS = App.COMMANDS | {MeshCommands}

    def __init__(
        self,
        config: ConsoleConfig,
        *,
        state: ConsoleState | None = None,
        sources: Iterable[tuple[str, Source]] | None = None,
        admin: AdminClient | None = None,
        token: TokenSource | None = None,
        api_key: ApiKey | None = None,
    ) -> None:
        self.config = config
        self.glyphs = glyphs_for(config.ascii)
        self.state = state or ConsoleState(glyphs=self.glyphs)
        self.state.glyphs = self.glyphs
        self.state.idle_after_s = config.idle_minutes * 60
        super().__init__()
        for theme in load_themes():
            self.register_theme(theme)
        self.theme = config.theme if config.theme in self.available_themes else DEFAULT_THEME
        self._sources = list(sources) if sources is not None else None
        # Read-only consoles hold no admin client at all: nothing to misuse.
        self.admin = None if config.readonly else admin
        self.token = token
        self.api_key = api_key or ApiKey()
        self._palette: Palette | None = None
        self._main: MainScreen | None = None
        self._demo: DemoScreen | None = None  # the demo view, while it is open
        self._refresh_pending = False
        self.patch_ms: deque[float] = deque(maxlen=100_000)
        self.refresh_ms: deque[float] = deque(maxlen=100_000)
        self.refresh_cpu_ms: deque[float] = deque(maxlen=100_000)
        self._heap = HeapSettler(lambda: len(self.state.sessions))

    # ---- theme ---------------------------------------------------------------------------

    def get_css_variables(self) -> dict[str, str]:
        variables = fill_kvm_variables(super().get_css_variables())
        self.theme_variables = variables
        return variables

    @property
    def palette(self) -> Palette:
        if self._palette is None:
            self._palette = Palette.from_variables(self.theme_variables or self.get_css_variables())
        return self._palette

    def _on_theme_changed(self, _theme: object) -> None:
        self._palette = None
        self.state.mark_all_dirty()
        self.schedule_refresh()

    def cycle_theme(self) -> None:
        names = [n for n in THEME_NAMES if n in self.available_themes]
        i = names.index(self.theme) if self.theme in names else -1
        self.theme = names[(i + 1) % len(names)]

    # ---- lifecycle -------------------------------------------------------------------------

    def get_default_screen(self) -> MainScreen:
        self._main = MainScreen(readonly=self.config.readonly, ascii_only=self.config.ascii)
        return self._main

    @property
    def main(self) -> MainScreen:
        assert self._main is not None
        return self._main

    def on_mount(self) -> None:
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        self.set_interval(self.config.refresh_interval, self.refresh_view, name="refresh")
        if self.config.readonly:
            self.state.log_console("read-only console: drain, undrain, migrate and replicate are off")
        elif self.token is not None:
            if self.token.warning:
                self.state.log_console(self.token.warning, level="warn")
            if self.token.token is None:
                self.state.log_console(
                    "no admin token (KVMESH_ADMIN_TOKEN or --admin-token-file): nodes will refuse actions",
                    level="warn",
                )
        if self.api_key.warning:
            self.state.log_console(self.api_key.warning, level="warn")
        self._start_sources()
        if self.config.view == "demo":
            self.show_demo_view()
        self.call_after_refresh(self.refresh_view)

    def show_demo_view(self) -> None:
        """Open the demo view over the main screen; closing it comes back to the main screen as it was."""
        if self._demo is not None:
            return
        self._demo = DemoScreen(readonly=self.config.readonly, ascii_only=self.config.ascii)

        def closed(_: None) -> None:
            self._demo = None
            self.state.mark_all_dirty()  # the main screen was not patched while the demo view was up
            self.schedule_refresh()

        self.push_screen(self._demo, callback=closed)
        self.schedule_refresh()

    async def on_unmount(self) -> None:
        if self.admin is not None:
            await self.admin.aclose()

    def _start_sources(self) -> None:
        if self._sources is None:
            self._sources = []
            for url in self.config.nodes:
                conn = self.state.add_node(url)
                self._sources.append((conn.url, self._node_source(conn.url)))
        for name, source in self._sources:
            self._run_source(name, source)

    def _node_source(self, url: str) -> Source:
        async def run(state: ConsoleState) -> None:
            await stream_node(url, state, headers=self.api_key.headers())

        return run

    def _run_source(self, name: str, source: Source) -> None:
        # exclusive per node: restarting a node's stream replaces, never doubles, it.
        self.run_worker(
            source(self.state), name=f"ingest {name}", group=f"ingest:{name}", exclusive=True, exit_on_error=False,
        )

    def _discover(self) -> None:
        found = self.state.take_discovered()
        if not found or not self.config.discover:
            return
        for name, url in found.items():
            if url in self.state.nodes:
                continue
            conn = self.state.add_node(url, discovered=True)
            self.state.log_console(f"discovered {name} at {url}; following its events")
            self._run_source(conn.url, self._node_source(conn.url))

    # ---- refresh -------------------------------------------------------------------------

    def schedule_refresh(self) -> None:
        """Refresh soon (after an operator action) without waiting for the timer."""
        if not self._refresh_pending:
            self._refresh_pending = True
            self.call_later(self.refresh_view)

    def refresh_view(self) -> None:
        self._refresh_pending = False
        if self._main is None or not self._main.ready:
            return
        t0 = time.perf_counter()
        c0 = time.thread_time()
        self.state.tick()
        self._discover()
        changes = self.state.take_changes()
        try:
            with self.batch_update():
                if self._demo is not None and self.screen is self._demo:
                    if self._demo.is_mounted:
                        self._demo.patch(self.state, self.palette, self.glyphs)
                    self.state.merge_changes(changes)  # kept for the main screen, patched when it is back
                else:
                    self._main.patch(self.state, changes, self.palette, self.glyphs)
        except NoMatches:
            return  # the screen is being torn down (quitting): nothing left to patch
        self.patch_ms.append((time.perf_counter() - t0) * 1000)
        self.call_after_refresh(self._painted, t0, c0)
        self._heap.after_refresh(changes.full or changes.cluster_view, self._timer)

    def _timer(self, delay: float, callback: Callable[[], None]) -> Callable[[], object]:
        return self.set_timer(delay, callback).stop

    def _painted(self, t0: float, c0: float) -> None:
        # Wall time is what the operator sees; CPU time is the console's own cost,
        # which stays meaningful on a box where other processes compete for cores.
        self.refresh_ms.append((time.perf_counter() - t0) * 1000)
        self.refresh_cpu_ms.append((time.thread_time() - c0) * 1000)

    # ---- pause -----------------------------------------------------------------------------

    def toggle_pause(self) -> None:
        if self.state.paused:
            n = self.state.resume()
            self.state.log_console(f"resumed: applied {n} queued update{'s' if n != 1 else ''} in order")
        else:
            self.state.pause()
            self.state.log_console("paused: updates are queued, none dropped (p resumes)")
        self.schedule_refresh()

    # ---- modals ----------------------------------------------------------------------------

    def push_modal(self, screen: ModalScreen[Any], callback: Callable[[Any], object] | None = None) -> None:
        """Push a modal, carrying the ASCII class so its borders and buttons stay ASCII too."""
        if self.config.ascii:
            screen.add_class("-ascii")
        self.push_screen(screen, callback=callback)  # type: ignore[arg-type]

    # ---- command palette -----------------------------------------------------------------------

    def palette_commands(self, include_sessions: bool) -> list[PaletteCommand]:
        cmds: list[PaletteCommand] = [
            ("resume updates" if self.state.paused else "pause updates", "freeze the view; updates queue", self.toggle_pause),
            ("help: keys", "list every key", self.main.action_help),
            ("filter sessions and events", "same as /", self.main.action_filter),
        ]
        for name in THEME_NAMES:
            cmds.append((f"theme {name}", "switch theme", partial(setattr, self, "theme", name)))
        for view in VIEWS:
            cmds.append((f"view {view}", "show that panel (compact layout)", partial(self.main.action_view, view)))
        if self.config.readonly:
            return cmds  # no mesh-changing command exists in a read-only console
        act = self.request_action
        for host in self.state.host_names():
            cmds.append((f"drain {host}", "confirm, then drain this host", partial(act, "drain", [host])))
            cmds.append((f"undrain {host}", "confirm, then undrain this host", partial(act, "undrain", [host])))
        if include_sessions:
            for sid in self.state.sessions:
                cmds.append((f"migrate {sid}", "pick a target host, then confirm", partial(act, "migrate", [sid])))
                cmds.append((f"replicate {sid}", "confirm, then replicate now", partial(act, "replicate", [sid])))
        return cmds


