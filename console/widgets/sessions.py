"""Sessions panel: one row per session, patched by session id, filterable and sortable.

Columns: id, home host, resident tokens, replica host, replica freshness (glyph,
tokens behind, age), last handoff class (glyph + WARM/PART/COLD), turns, moves.
Only rows the state marked dirty are re-rendered; the age column, which changes
with time alone, is refreshed for the rows on screen. The cursor stays on the
same session id whatever moves.
"""

from __future__ import annotations

from functools import partial
from typing import Callable


from rich.text import Text

from kvmesh.console.format import CLASS_WORDS, Glyphs, fmt_age, fmt_tokens, truncate
from kvmesh.console.state import Changes, ConsoleState, SessionRow
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.table import Cell, Column, KeyedTable

SORTS: tuple[str, ...] = ("session", "home", "tokens", "behind", "age", "last", "turns", "moves")
_CLASS_RANK = {"cold": 0, "partial": 1, "warm": 2}


class SessionsTable(KeyedTable):
    COLUMNS = (
        Column("session", "Session", 14),
        Column("home", "Home", 8),
        Column("tokens", "Tokens", 6),
        Column("replica", "Replica", 8),
        Column("fresh", "Fresh", 12),
        Column("last", "Last", 6),
        Column("turns", "Turns", 5),
        Column("moves", "Mv", 3),
    )
    FRESH = 4  # index of the time-dependent column

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.filter_text = ""
        self.sort_by = "session"
        self.sort_reverse = False
        self._refilter = True
        self._resort = False
        self._stale_homes: frozenset[str] = frozenset()
        self._styles: tuple[object, object] | None = None

    # ---- operator controls ---------------------------------------------------------------

    def set_filter(self, text: str) -> None:
        text = text.strip().lower()
        if text != self.filter_text:
            self.filter_text = text
            self._refilter = True

    def cycle_sort(self) -> str:
        i = SORTS.index(self.sort_by)
        self.set_sort(SORTS[(i + 1) % len(SORTS)])
        return self.sort_by

    def set_sort(self, column: str, reverse: bool | None = None) -> None:
        if column == "fresh":
            column = "behind"
        if column not in SORTS:
            return
        if reverse is None:
            # Numbers read best largest-first; names alphabetically.
            reverse = column in ("tokens", "behind", "age", "turns", "moves")
        self.sort_by, self.sort_reverse = column, reverse
        self._resort = True

    def on_data_table_header_selected(self, event: KeyedTable.HeaderSelected) -> None:
        key = event.column_key.value or ""
        if key == self.sort_by:
            self.set_sort(key, not self.sort_reverse)
        else:
            self.set_sort(key)
        event.stop()
        self.app.call_later(self.app.refresh_view)  # type: ignore[attr-defined]

    def matches(self, s: SessionRow) -> bool:
        f = self.filter_text
        if not f:
            return True
        return (
            f in s.sid.lower()
            or (s.home is not None and f in s.home.lower())
            or (s.replica_host is not None and f in s.replica_host.lower())
            or (s.last_handoff is not None and f in CLASS_WORDS[s.last_handoff].lower())
        )

    def sort_key_fn(self, state: ConsoleState) -> Callable[[str], object]:
        sessions = state.sessions
        now = state.clock()
        by = self.sort_by

        def key(sid: str) -> object:
            s = sessions.get(sid)
            if s is None or by == "session":
                return sid
            if by == "home":
                return (s.home or "", sid)
            if by == "tokens":
                return (s.resident_tokens, sid)
            if by == "behind":
                return (s.replica_behind_tokens if s.replica_host else -1, sid)
            if by == "age":
                return (now - s.replica_at if s.replica_at else -1.0, sid)
            if by == "last":
                return (_CLASS_RANK.get(s.last_handoff or "", 3), sid)
            if by == "turns":
                return (s.turns, sid)
            return (s.moves, sid)

        return key

    # ---- patching -----------------------------------------------------------------------

    def patch(self, state: ConsoleState, changes: Changes, palette: Palette, glyphs: Glyphs, *, full: bool) -> None:
        cursor = self.cursor_key
        stale_homes = frozenset(n for n in state.hosts if state.is_stale_host(n))
        if stale_homes != self._stale_homes:
            self._stale_homes = stale_homes
            full = True  # rows homed on a host that went stale (or came back) change style
        full = full or changes.full or self._refilter
        self._refilter = False
        if self._styles != (palette, glyphs):
            self._styles = (palette, glyphs)
            self.forget_signatures()
            full = True  # every row must be drawn in the new theme
        now = state.clock()
        drop = set(changes.removed_sessions)
        if full:
            drop.update(k for k in self.shown_keys() if k not in state.sessions)
        candidates = state.sessions.keys() if full else changes.sessions
        keep = []
        for sid in candidates:
            s = state.sessions.get(sid)
            if s is None or not self.matches(s):
                drop.add(sid)
            else:
                keep.append(s)
        self.drop_rows(drop)  # first, in bulk: a narrowing filter can remove thousands
        added = False
        touched = False
        for s in keep:
            render = partial(self.render_session, s, palette, glyphs, now)
            added |= self.sync_row(s.sid, render, self.signature(s, now))
            touched = True
        dynamic = self.sort_by not in ("session", "home")
        if added or self._resort or (touched and dynamic):
            self.sort_rows(self.sort_key_fn(state), reverse=self.sort_reverse)
            self._resort = False
        self.restore_cursor(cursor)
        # Ages move with the clock alone; paused means frozen, so they wait too.
        for sid in [] if state.paused else self.visible_keys():
            s = state.sessions.get(sid)
            if s is not None:
                self.sync_cell(sid, self.FRESH, self.fresh_cell(s, palette, glyphs, now))
        self.flush()
        label = f"Sessions {self.row_count}/{len(state.sessions)}" if self.filter_text else f"Sessions {len(state.sessions)}"
        arrow = "v" if self.sort_reverse else "^"
        dot = glyphs.dot
        title = f"{label} {dot} sort {self.sort_by} {arrow}" + (f" {dot} filter '{self.filter_text}'" if self.filter_text else "")
        if self.border_title != title:
            self.border_title = title

    def signature(self, s: SessionRow, now: float) -> tuple[object, ...]:
        """Everything a row is rendered from (the age as displayed), so unchanged rows cost no rendering."""
        kind, age = s.freshness(now)
        return (
            s.sid in self.marked, s.home, s.migrating_to, s.active, s.resident_tokens, s.replica_host,
            s.last_handoff, s.turns, s.moves, s.home in self._stale_homes, kind, s.replica_behind_tokens,
            fmt_age(age) if kind != "none" else "",
        )

    def render_session(self, s: SessionRow, palette: Palette, glyphs: Glyphs, now: float) -> tuple[Text, ...]:
        base = palette.stale if s.home in self._stale_homes else None
        mark = glyphs.mark if s.sid in self.marked else " "

        def cell(text: str, style: object = None) -> Cell:
            return Cell(text, style=base or style or "", no_wrap=True)  # type: ignore[arg-type]

        home = s.home or glyphs.none
        if s.migrating_to:
            home = f"{home}{glyphs.arrow}{s.migrating_to}"
        last_cls = s.last_handoff
        last = f"{glyphs.handoff(last_cls)} {CLASS_WORDS[last_cls]}" if last_cls else glyphs.none
        return (
            Cell.assemble((mark, palette.marked), (truncate(s.sid, 13, glyphs), base or ""), no_wrap=True),
            cell(truncate(home, 8, glyphs), palette.bold if s.active else None),
            cell(fmt_tokens(s.resident_tokens)),
            cell(truncate(s.replica_host or glyphs.none, 8, glyphs)),
            self.fresh_cell(s, palette, glyphs, now),
            cell(last, palette.handoff(last_cls)),
            cell(str(s.turns)),
            cell(str(s.moves)),
        )

    def fresh_cell(self, s: SessionRow, palette: Palette, glyphs: Glyphs, now: float) -> Cell:
        kind, age = s.freshness(now)
        if kind == "none":
            return Cell(glyphs.none, style=palette.stale if s.home in self._stale_homes else palette.muted)
        glyph = {"fresh": glyphs.fresh, "behind": glyphs.behind, "stale": glyphs.stale}[kind]
        style = {"fresh": palette.ok, "behind": palette.warn, "stale": palette.error}[kind]
        if s.home in self._stale_homes:
            style = palette.stale
        text = f"{glyph} {fmt_tokens(s.replica_behind_tokens):>5} {fmt_age(age):>4}"
        return Cell(text, style=style, no_wrap=True)
