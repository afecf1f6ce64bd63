"""Hosts panel: one row per host, in name order, never reordered by load.

Columns: host, state (UP / DRAINING / DRAIN n/m / UNREACHABLE / MISSING /
DISCONNECTED), the time it went stale, slots busy/free as a bar with numbers,
queue depth, memory, and kv_share bytes in/out now. A disconnected host stays,
dimmed, with "stale since" in the panel's subtitle.
"""

from __future__ import annotations

from rich.text import Text

from kvmesh.console.format import Glyphs, fmt_bps, fmt_clock, fmt_mem, slot_bar, truncate
from kvmesh.console.state import ConsoleState
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.table import Cell, Column, KeyedTable


class HostsTable(KeyedTable):
    COLUMNS = (
        Column("host", "Host", 11),
        Column("state", "State", 12),
        Column("since", "Stale", 8),
        Column("slots", "Slots", 8),
        Column("queue", "Q", 2),
        Column("mem", "Mem", 9),
        Column("kv_in", "KV in", 6),
        Column("kv_out", "KV out", 6),
    )

    def patch(self, state: ConsoleState, palette: Palette, glyphs: Glyphs, *, utc: bool, full: bool) -> None:
        cursor = self.cursor_key
        added = False
        stale_notes = []
        for name in state.host_names():
            cells, note = self.render_host(state, name, palette, glyphs, utc)
            added |= self.sync_row(name, cells)
            if note:
                stale_notes.append(note)
        self.flush()
        if added:
            self.sort_rows(lambda k: k)  # name order, set once when a host appears
            self.restore_cursor(cursor)
        subtitle = "; ".join(stale_notes)
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle

    def render_host(
        self, state: ConsoleState, name: str, palette: Palette, glyphs: Glyphs, utc: bool
    ) -> tuple[tuple[Text, ...], str]:
        row = state.hosts[name]
        info = row.info
        word, level, since = state.host_state(name)
        stale = level == "stale"
        base = palette.stale if stale else None
        mark = glyphs.mark if name in self.marked else " "

        def cell(text: str, style: object = None) -> Cell:
            return Cell(text, style=base or style or "", no_wrap=True)  # type: ignore[arg-type]

        since_text = fmt_clock(since, utc) if (stale and since) else ""
        # A host whose model keeps no replicas moves no KV: say so, not 0 B/s.
        kv = ((cell("none", palette.warn),) * 2 if info.no_replicas
              else (cell(fmt_bps(info.kvshare_in_bps)), cell(fmt_bps(info.kvshare_out_bps))))
        note = f"{name} {word}, stale since {since_text}" if stale and since_text else ""
        cells = (
            Cell.assemble((mark, palette.marked), (truncate(name, 10, glyphs), base or palette.bold), no_wrap=True),
            cell(word, palette.level(level)),
            cell(since_text),
            cell(slot_bar(info.busy, info.slots, glyphs)),
            cell(str(info.queued) if info.queued else "0", palette.warn if info.queued else None),
            cell(fmt_mem(info.mem_used_bytes, info.mem_total_bytes)),
            *kv,
        )
        if info.no_replicas and not note:
            note = f"{name}: no replicas ({info.no_replicas})"
        return cells, note
