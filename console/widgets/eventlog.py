"""Event log panel: newest first (or tail), capped, filterable by type and text.

A Line-API widget: it renders only the lines in view straight from the state's
log, so thousands of entries cost nothing until scrolled to, and a new event is
one refresh rather than a rebuilt widget. Scopes (key `e`): "mesh" hides the
high-volume turn/host-status events, "all" shows them, "actions" shows only
drains, migrations, replicas and the console's own action requests and results.
"""

from __future__ import annotations

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from kvmesh.console.format import Glyphs, fmt_clock, truncate
from kvmesh.console.state import ConsoleState, LogEntry
from kvmesh.console.theme import Palette

SCOPES: tuple[str, ...] = ("mesh", "all", "actions")
ACTION_KINDS = frozenset({
    "drain_started", "drain_progress", "drain_completed", "undrained", "migrate_started",
    "migrate_completed", "replica_sent", "replica_ready", "replica_refused", "action",
})
KIND_WIDTH = 16


class EventLog(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    EventLog { overflow-x: hidden; }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.newest_first = True
        self.scope = "mesh"
        self.filter_text = ""
        self.utc = False
        self._entries: list[LogEntry] = []
        self._version = -1
        self._palette: Palette | None = None
        self._glyphs: Glyphs | None = None
        self._strips: dict[tuple[int, int], Strip] = {}
        self._base_style = Style()
        self._dirty = True

    # ---- operator controls --------------------------------------------------------------

    def set_filter(self, text: str) -> None:
        text = text.strip().lower()
        if text != self.filter_text:
            self.filter_text = text
            self._dirty = True

    def cycle_scope(self) -> str:
        self.scope = SCOPES[(SCOPES.index(self.scope) + 1) % len(SCOPES)]
        self._dirty = True
        return self.scope

    def toggle_order(self) -> bool:
        self.newest_first = not self.newest_first
        self._dirty = True
        return self.newest_first

    def matches(self, e: LogEntry) -> bool:
        if self.scope == "actions" and e.kind not in ACTION_KINDS:
            return False
        f = self.filter_text
        return not f or f in e.kind or f in e.text.lower() or f in e.node.lower()

    @property
    def entries(self) -> list[LogEntry]:
        """What the log shows, top line first (for tests and the bench)."""
        return self._entries

    # ---- patching ---------------------------------------------------------------------

    def patch(self, state: ConsoleState, palette: Palette, glyphs: Glyphs, *, utc: bool, force: bool = False) -> None:
        base = self.rich_style
        if palette is not self._palette or glyphs is not self._glyphs or utc != self.utc or base != self._base_style:
            self._palette, self._glyphs, self.utc = palette, glyphs, utc
            self._base_style = base  # the widget's colours (theme, focus), read once per patch
            self._strips.clear()
            force = True
        if not (force or self._dirty or state.log_version != self._version):
            return
        self._version = state.log_version
        self._dirty = False
        at_end = self.scroll_y >= self.max_scroll_y - 1
        entries = [e for e in state.log_entries(include_noisy=self.scope == "all") if self.matches(e)]
        if self.newest_first:
            entries.reverse()
        self._entries = entries
        size = Size(self.size.width, len(entries))
        if size != self.virtual_size:
            self.virtual_size = size  # a layout pass: only when the line count changes
        if not self.newest_first and at_end:
            self.scroll_end(animate=False, immediate=True)
        order = "newest first" if self.newest_first else "tail"
        dot = glyphs.dot
        title = f"Events {dot} {self.scope} {dot} {order}" + (f" {dot} filter '{self.filter_text}'" if self.filter_text else "")
        if self.border_title != title:
            self.border_title = title
        if len(self._strips) > 2000:
            self._strips.clear()
        self.refresh()

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        index = int(self.scroll_y) + y
        if index >= len(self._entries) or self._palette is None or self._glyphs is None:
            return Strip.blank(width, self._base_style)
        entry = self._entries[index]
        cache_key = (entry.order, width)
        strip = self._strips.get(cache_key)
        if strip is None:
            strip = self._render_entry(entry, width)
            self._strips[cache_key] = strip
        return strip

    def _render_entry(self, e: LogEntry, width: int) -> Strip:
        # Segments built directly (not a rich Text rendered per line): the newest
        # lines are new on nearly every refresh of a busy mesh, so this is hot.
        p = self._palette
        g = self._glyphs
        assert p is not None and g is not None
        base = self._base_style
        kind_style = p.level(e.level) if e.level != "info" else p.muted
        text_style = p.level(e.level) if e.level in ("warn", "error") else None
        head = f"{fmt_clock(e.ts, self.utc)}{' R ' if e.replay else '   '}"
        kind = f"{truncate(e.kind, KIND_WIDTH, g):<{KIND_WIDTH}} "
        room = width - len(head) - len(kind)
        body = e.text
        if cell_len(body) > room:
            body = set_cell_size(body, max(0, room - 1)) + (g.ellipsis if room > 0 else "")
        segments = [
            Segment(head, base + p.muted),
            Segment(kind, base + kind_style),
            Segment(body, base + text_style if text_style else base),
        ]
        return Strip(segments).crop_extend(0, width, base)
