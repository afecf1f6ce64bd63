"""Hosts panel: one row per host, grouped so that 256 of them stay readable at 80x24.

Columns: host, state (UP / DRAINING / DRAIN n/m / UNREACHABLE / MISSING /
DISCONNECTED), the time it went stale, slots busy/free as a bar with numbers,
queue depth, memory, and kv_share bytes in/out now. A disconnected host stays,
dimmed, with "stale since" in the panel's subtitle.

Grouping (`g` cycles it): by name; by state, the hosts that need a look (disconnected,
missing, unreachable, draining) first, each group in name order; or by zone, when the
hosts report a rack/zone label (`HostInfo.zone`). Past HOSTS_GROUP_AFTER hosts the
default is by zone if any host has one, else by state; below it, by name, as always.
Load never moves a row: only a state change moves it between groups. The title counts
the hosts in each state, so the mesh reads at a glance however few rows fit; the table
scrolls (PgUp/PgDn) through the rest. Only rows whose inputs changed are rendered.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

from rich.text import Text

from kvmesh.console.format import Glyphs, fmt_bps, fmt_clock, fmt_mem, slot_bar, truncate
from kvmesh.console.state import ConsoleState
from kvmesh.console.state.hosts import HostLevel
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.table import Cell, Column, KeyedTable

HOSTS_GROUP_AFTER = 16
GROUPINGS: tuple[str, ...] = ("auto", "name", "state", "zone")
_LEVEL_RANK: dict[HostLevel, int] = {"stale": 0, "error": 1, "warn": 2, "ok": 3}


def state_counts(states: dict[str, tuple[str, HostLevel, float | None]], *, skip_up: bool = False) -> list[str]:
    """['250 UP', '4 DRAINING', '2 DISCONNECTED']: how many hosts are in each state, in a fixed order."""
    words = Counter("DRAINING" if w.startswith("DRAIN") else w for w, _, _ in states.values())
    order = ["DRAINING", "UNREACHABLE", "MISSING", "DISCONNECTED"] if skip_up else [
        "UP", "DRAINING", "UNREACHABLE", "MISSING", "DISCONNECTED"]
    return [f"{words[w]} {w}" for w in order if words[w]]


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

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.grouping = "auto"

    def cycle_grouping(self) -> str:
        self.grouping = GROUPINGS[(GROUPINGS.index(self.grouping) + 1) % len(GROUPINGS)]
        return self.grouping

    def effective_grouping(self, state: ConsoleState) -> str:
        if self.grouping != "auto":
            return self.grouping
        if len(state.hosts) <= HOSTS_GROUP_AFTER:
            return "name"
        return "zone" if any(r.info.zone for r in state.hosts.values()) else "state"

    def patch(self, state: ConsoleState, palette: Palette, glyphs: Glyphs, *, utc: bool, full: bool) -> None:
        cursor = self.cursor_key
        names = state.host_names()
        states = {n: state.host_state(n) for n in names}
        notes = []
        for name in names:
            word, level, since = states[name]
            info = state.hosts[name].info
            stale = level == "stale"
            since_text = fmt_clock(since, utc) if (stale and since) else ""
            sig = (word, level, since_text, name in self.marked, info.busy, info.slots, info.queued,
                   fmt_mem(info.mem_used_bytes, info.mem_total_bytes), fmt_bps(info.kvshare_in_bps),
                   fmt_bps(info.kvshare_out_bps), info.no_replicas, info.zone, id(palette), id(glyphs))
            self.sync_row(name, partial(self.render_host, state, name, palette, glyphs, since_text), sig)
            if stale and since_text:
                notes.append(f"{name} {word}, stale since {since_text}")
            elif info.no_replicas:
                notes.append(f"{name}: no replicas ({info.no_replicas})")
        self.flush()
        grouping = self.effective_grouping(state)
        self.set_order(sorted(names, key=partial(self._group_key, state, states, grouping)))
        self.restore_cursor(cursor)
        subtitle = "; ".join(notes)
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle
        title = self.title_for(states, grouping, glyphs)
        if self.border_title != title:
            self.border_title = title

    @staticmethod
    def _group_key(state: ConsoleState, states: dict[str, tuple[str, HostLevel, float | None]], grouping: str,
                   name: str) -> tuple[object, ...]:
        if grouping == "state":
            return (_LEVEL_RANK[states[name][1]], name)
        if grouping == "zone":
            return (state.hosts[name].info.zone or "~", name)  # hosts without a zone last
        return (name,)

    @staticmethod
    def title_for(states: dict[str, tuple[str, HostLevel, float | None]], grouping: str, glyphs: Glyphs) -> str:
        """'Hosts 256 · 250 UP · 4 DRAINING · 2 DISCONNECTED · by state': the mesh at a glance."""
        parts = state_counts(states)
        dot = glyphs.dot
        if len(states) <= HOSTS_GROUP_AFTER and grouping == "name":
            return "Hosts"  # a small mesh reads from its rows
        return f"Hosts {len(states)} {dot} " + f" {dot} ".join([*parts, f"by {grouping}"])

    def render_host(
        self, state: ConsoleState, name: str, palette: Palette, glyphs: Glyphs, since_text: str
    ) -> tuple[Text, ...]:
        row = state.hosts[name]
        info = row.info
        word, level, _ = state.host_state(name)
        base = palette.stale if level == "stale" else None
        mark = glyphs.mark if name in self.marked else " "

        def cell(text: str, style: object = None) -> Cell:
            return Cell(text, style=base or style or "", no_wrap=True)  # type: ignore[arg-type]

        # A host whose model keeps no replicas moves no KV: say so, not 0 B/s.
        kv = ((cell("none", palette.warn),) * 2 if info.no_replicas
              else (cell(fmt_bps(info.kvshare_in_bps)), cell(fmt_bps(info.kvshare_out_bps))))
        host = truncate(name, 10, glyphs)
        if info.zone:
            host = truncate(f"{name} {info.zone}", 10, glyphs)
        return (
            Cell.assemble((mark, palette.marked), (host, base or palette.bold), no_wrap=True),
            cell(word, palette.level(level)),
            cell(since_text),
            cell(slot_bar(info.busy, info.slots, glyphs)),
            cell(str(info.queued) if info.queued else "0", palette.warn if info.queued else None),
            cell(fmt_mem(info.mem_used_bytes, info.mem_total_bytes)),
            *kv,
        )
