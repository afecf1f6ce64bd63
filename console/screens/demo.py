"""The demo view: warm switches shown to a room (`v`, or start with `--view demo`).

Warm / partial / cold handoff counters and the warm percentage in large digits,
each link's throughput as a sparkline, and the last few handoffs as they happen.
Everything is read from the same `ConsoleState` as the main screen and patched on
the same timer. The view offers no mesh-changing key at all; a console started
with `--view demo` is read-only as a whole unless it was started with `--admin`.
Fits 80x24 (4 links, 5 handoffs) and grows with the terminal.
"""

from __future__ import annotations

from typing import cast

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Digits, Footer, Static

from kvmesh.console.format import CLASS_WORDS, Glyphs, fmt_clock, fmt_mbps, sparkline, truncate
from kvmesh.console.host import ConsoleHost
from kvmesh.console.state import ConsoleState, LogEntry
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.changed import ChangedOnly
from kvmesh.console.widgets.topbar import TopBar

# Handoffs listed at most (the panel shows as many as fit).
MAX_HANDOFFS = 30


class DemoScreen(Screen[None]):
    BINDINGS = [
        Binding("q", "quit", "Quit", tooltip="quit the console (the mesh is not touched)"),
        Binding("v,escape", "close", "Main view", tooltip="back to the operator view"),
        Binding("t", "cycle_theme", "Theme", tooltip="cycle themes: dark, light, colour-blind safe"),
    ]

    def __init__(self, *, readonly: bool, ascii_only: bool) -> None:
        super().__init__()
        self.readonly = readonly
        self.ascii_only = ascii_only
        self._set = ChangedOnly(self).set

    @property
    def console_app(self) -> ConsoleHost:
        return cast(ConsoleHost, self.app)

    def compose(self) -> ComposeResult:
        yield TopBar(readonly=self.readonly, id="demo-topbar")
        with Horizontal(id="demo-counters"):
            for key in ("warm", "partial", "cold", "pct"):
                with Vertical(classes=f"demo-count -{key}"):
                    yield Static("", id=f"demo-label-{key}", classes="demo-label")
                    if self.ascii_only:
                        yield Static("", id=f"demo-count-{key}", classes="demo-ascii-count")
                    else:
                        yield Digits("", id=f"demo-count-{key}")
        links = Static("", id="demo-links")
        links.border_title = "Links: replica throughput"
        yield links
        handoffs = Static("", id="demo-handoffs")
        handoffs.border_title = "Handoffs as they happen"
        yield handoffs
        yield Footer()

    def on_mount(self) -> None:
        if self.ascii_only:
            self.add_class("-ascii")

    def patch(self, state: ConsoleState, palette: Palette, glyphs: Glyphs) -> None:
        app = self.console_app
        cfg = app.config
        self.query_one(TopBar).patch(state, palette, glyphs, theme=app.theme, utc=cfg.utc, show_clock=cfg.show_clock)
        c = state.counters
        for cls in ("warm", "partial", "cold"):
            self._set(f"demo-label-{cls}", Text(f"{glyphs.handoff(cls)} {CLASS_WORDS[cls]}", style=palette.handoff(cls)))
            self._count(f"demo-count-{cls}", str(getattr(c, cls)), palette.handoff(cls))
        self._set("demo-label-pct", Text(f"WARM % of {c.total}", style=palette.bold))
        self._count("demo-count-pct", f"{c.warm_pct():.1f}", palette.warm)
        self._set("demo-links", self._links_text(state, palette, glyphs))
        self._set("demo-handoffs", self._handoffs_text(state, palette, glyphs, cfg.utc))

    def _count(self, widget_id: str, value: str, style: object) -> None:
        self._set(widget_id, value if not self.ascii_only else Text(value, style=style))  # type: ignore[arg-type]

    def _links_text(self, state: ConsoleState, palette: Palette, glyphs: Glyphs) -> Text:
        now = state.clock()
        width = max(20, self.query_one("#demo-links").content_size.width or 76)
        name_w = 16
        spark_w = max(8, width - name_w - 14)
        t = Text(no_wrap=True, overflow=glyphs.overflow)  # type: ignore[arg-type]
        links = sorted(state.links.values(), key=lambda lk: lk.key)
        if not links:
            t.append("no replica traffic yet", style=palette.muted)
        for i, lk in enumerate(links):
            if i:
                t.append("\n")
            name = truncate(f"{lk.src}{glyphs.arrow}{lk.dst}", name_w, glyphs)
            t.append(f"{name:<{name_w}} ", style=palette.bold)
            t.append(sparkline(lk.history_bps(now, spark_w), glyphs, spark_w), style=palette.warm)
            t.append(f" {fmt_mbps(lk.now_bps(now)):>7} Mb/s")
        return t

    def _handoffs_text(self, state: ConsoleState, palette: Palette, glyphs: Glyphs, utc: bool) -> Text:
        t = Text(no_wrap=True, overflow=glyphs.overflow)  # type: ignore[arg-type]
        recent: list[LogEntry] = []
        for entry in reversed(state.log):
            if entry.kind == "handoff":
                recent.append(entry)
                if len(recent) >= MAX_HANDOFFS:
                    break
        if not recent:
            t.append("no handoff yet: a session's next turn on another host is one", style=palette.muted)
        level_style = {"ok": palette.warm, "warn": palette.partial, "error": palette.cold}
        for i, entry in enumerate(recent):  # newest first
            if i:
                t.append("\n")
            t.append(f"{fmt_clock(entry.ts, utc)} ", style=palette.muted)
            t.append(entry.text, style=level_style.get(entry.level, ""))
        return t

    async def action_quit(self) -> None:
        await self.app.action_quit()

    def action_close(self) -> None:
        self.dismiss(None)

    def action_cycle_theme(self) -> None:
        self.console_app.cycle_theme()
