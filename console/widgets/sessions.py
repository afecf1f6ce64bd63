"""Sessions panel: one row per session, patched by session id, filterable and sortable.

Columns: lifecycle glyph and id, home host, resident tokens (or "store: HOST" when
no engine holds it but a replica store does), replica host, replica freshness
(fresh / behind / in flight / stale, see `state.ReplicaFreshness`), last handoff
class (glyph + WARM/PART/COLD), turns, moves.

By default only live sessions are listed (running, then idle: `state.Lifecycle`);
`a` shows ended ones too. The title counts each lifecycle state.
Only rows the state marked dirty are re-rendered; the freshness column, which
changes with time alone, is refreshed for the rows on screen. The cursor stays on
the same session id whatever moves.

A row is one conversation; a client session's conversations (an affinity group, `state/threads.py`)
read as one: whatever the sort, a group's rows sit together, its main first ("cc-1 +3": the other
conversations of it known), then its threads ("› #a1b2c3d4", or the whole id when the main is not
listed). The line under the table names the group and the threads of the session under the cursor.

What a row shows (cells, signature, id label, freshness, filter, sort keys) is `session_rows.py`;
this widget chooses the rows, patches them by key and keeps the cursor, the page and the titles.
"""

from __future__ import annotations

from functools import partial

from kvmesh.console.format import Glyphs, truncate
from kvmesh.console.state import Changes, ConsoleState
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.session_rows import (
    SORTS,
    counts_label,
    fresh_cell,
    group_text,
    id_label,
    matches,
    render_session,
    signature,
    sort_key_fn,
)
from kvmesh.console.widgets.table import Column, KeyedTable
from kvmesh.console.widgets.window import Window


class SessionsTable(KeyedTable):
    COLUMNS = (
        Column("session", "Session", 13),
        Column("home", "Home", 7),
        Column("tokens", "Tokens", 12),
        Column("replica", "Replica", 7),
        Column("fresh", "Fresh", 11),
        Column("last", "Last", 6),
        Column("turns", "Turn", 4),
        Column("moves", "Mv", 2),
    )
    FRESH = 4  # index of the time-dependent column

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.filter_text = ""
        self.sort_by = "state"  # running first, then idle, then ended; by id within each
        self.sort_reverse = False
        self.show_all = False  # False: live sessions only (running and idle)
        self._refilter = True
        self._resort = False
        self._stale_homes: frozenset[str] = frozenset()
        self._styles: tuple[object, object] | None = None
        self.window = Window()
        self._follow: str | None = None  # a session to bring onto the page and put the cursor on (find, paging)

    # ---- operator controls ---------------------------------------------------------------

    def set_filter(self, text: str) -> None:
        text = text.strip().lower()
        if text != self.filter_text:
            self.filter_text = text
            self._refilter = True

    def toggle_all(self) -> bool:
        """Show ended sessions too, or live ones only; returns whether all are shown now."""
        self.show_all = not self.show_all
        self._refilter = True
        return self.show_all

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

    # ---- patching -----------------------------------------------------------------------

    def patch(self, state: ConsoleState, changes: Changes, palette: Palette, glyphs: Glyphs, *, full: bool) -> None:
        cursor = self.cursor_key
        stale_homes = frozenset(n for n in state.hosts if state.is_stale_host(n))
        if stale_homes != self._stale_homes:
            self._stale_homes = stale_homes
            full = True  # rows homed on a host that went stale (or came back) change style
        full = full or changes.full or self._refilter or self._resort
        self._refilter = self._resort = False
        if self._styles != (palette, glyphs):
            self._styles = (palette, glyphs)
            self.forget_signatures()
            full = True  # every row must be drawn in the new theme
        now = state.clock()
        win = self.window
        win.set_reverse(self.sort_reverse)
        if full:
            win.clear()
        # The filter and the sort run over every session (window.py); the table holds one page of them.
        candidates = state.sessions.keys() if full else changes.sessions | changes.removed_sessions
        key = sort_key_fn(state, self.sort_by)
        show_all = self.show_all
        # A thread's id cell says whether its main is listed: rows of mains that came or went are drawn again.
        regrouped: set[str] = set()
        for sid in candidates:
            s = state.sessions.get(sid)
            was = not full and sid in win
            if s is None or not (show_all or state.lifecycle(sid) != "ended") or not matches(s, self.filter_text):
                win.discard(sid)
            else:
                win.put(sid, key(sid), s.group_id)
            if not full and was != (sid in win):
                regrouped.update(state.threads_of(sid))
        follow, self._follow = self._follow, None
        if (win.settle() or follow) and (follow or cursor):
            win.show(follow or cursor or "")  # the cursor stays on its session, whatever moves
        rows = win.rows()
        on_page = set(rows)
        self.drop_rows([k for k in self.shown_keys() if k not in on_page])  # in bulk: a filter can drop thousands
        for sid in rows:
            if full or sid in candidates or sid in regrouped or not self.has_row(sid):
                s = state.sessions[sid]
                life = state.lifecycle(sid)
                fresh = state.replica_freshness(s, now)
                label = id_label(state, s, glyphs, win)
                marked, stale = s.sid in self.marked, s.home in self._stale_homes
                render = partial(render_session, s, life, fresh, palette, glyphs, now, label, marked=marked, stale=stale)
                self.sync_row(sid, render, (label, *signature(s, life, fresh, glyphs, now, marked=marked, stale=stale)))
        self.set_order(rows)
        self.restore_cursor(follow or cursor, scroll=follow is not None)
        self._patch_subtitle(state, glyphs)
        # Ages move with the clock alone; paused means frozen, so they wait too.
        for sid in [] if state.paused else self.visible_keys():
            s = state.sessions.get(sid)
            if s is not None:
                fresh = state.replica_freshness(s, now)
                self.sync_cell(sid, self.FRESH, fresh_cell(fresh, palette, glyphs, now, stale=s.home in self._stale_homes))
        self.flush()
        self._patch_title(state, glyphs)

    # ---- paging and finding -------------------------------------------------------------

    def _past_edge(self, delta: int) -> bool:
        """A cursor move past the page's edge moves the page instead (at the next patch); True if it did."""
        row = self.cursor_row + delta
        pos = self.window.index(self.cursor_key)
        if pos is None or 0 <= row < self.row_count:
            return False
        target = max(0, min(self.window.total - 1, pos + delta))
        if target == pos:
            return False
        self._follow = self.window.at(target)
        self.app.call_later(self.app.refresh_view)  # type: ignore[attr-defined]
        return True

    def action_cursor_down(self) -> None:
        if not self._past_edge(1):
            super().action_cursor_down()

    def action_cursor_up(self) -> None:
        if not self._past_edge(-1):
            super().action_cursor_up()

    def action_page_down(self) -> None:
        if not self._past_edge(max(1, self.scrollable_content_region.height - 1)):
            super().action_page_down()

    def action_page_up(self) -> None:
        if not self._past_edge(-max(1, self.scrollable_content_region.height - 1)):
            super().action_page_up()

    def find(self, state: ConsoleState, text: str) -> tuple[str | None, str]:
        """Jump to a session by the id its user reads out (exact, else the shortest id starting with it, else
        the first containing it), across every session: the filter and live-only view give way if they hide it.
        Returns (session id or None, what to tell the operator)."""
        text = text.strip()
        if not text:
            return None, ""
        sessions = state.sessions
        low = text.lower()
        sid = text if text in sessions else None
        if sid is None and (threads := state.threads_of(text)):
            sid = min(threads)  # a client session whose main conversation is not known: its first thread
            note = f" (a thread of {text})"
        elif sid is None:
            hits = [k for k in sessions if low in k.lower()]
            starts = [k for k in hits if k.lower().startswith(low)]
            pool = starts or hits
            sid = min(pool, key=lambda k: (len(k), k)) if pool else None
            if sid is None:
                return None, f"no session id contains {text!r}"
            note = f" (1 of {len(hits)} containing {text!r})" if len(hits) > 1 else ""
        elif n := state.thread_count(sid):
            note = f" (main + {n} thread{'s' if n > 1 else ''})"
        else:
            note = ""
        if self.filter_text and not matches(sessions[sid], self.filter_text):
            self.set_filter("")
            note += "; filter cleared"
        if not self.show_all and state.lifecycle(sid) == "ended":
            self.toggle_all()
            note += "; showing all sessions (it has ended)"
        self._follow = sid
        self._refilter = True
        return sid, f"found {sid}{note}"

    def _patch_subtitle(self, state: ConsoleState, glyphs: Glyphs) -> None:
        """Under the table, the session under the cursor: what named it (which client header or field), and
        the client session it is a conversation of, with that group's threads."""
        s = state.sessions.get(self.cursor_key or "")
        subtitle = ""
        if s is not None:
            parts = [f"{s.sid} named by {s.id_source}" if s.id_source else s.sid]
            group = s.group_id
            if group != s.sid:
                # the id says the group already when it begins with it: there a shortened name will do
                name = truncate(group, 13, glyphs) if s.sid.startswith(group) else group
                parts.append(f"thread of {name}: {group_text(state, group)}")
            elif state.thread_count(group):
                parts.append(group_text(state, group))
            subtitle = f" {glyphs.dot} ".join(parts) if len(parts) > 1 or s.id_source else ""
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle

    def _patch_title(self, state: ConsoleState, glyphs: Glyphs) -> None:
        dot = glyphs.dot
        label = f"Sessions {counts_label(state, glyphs)}" + ("" if self.show_all else f" {dot} live shown")
        if self.filter_text:
            label += f" {dot} {self.window.total} match '{self.filter_text}'"
        if rows := self.window.label():
            label += f" {dot} {rows}"
        arrow = "v" if self.sort_reverse else "^"
        title = f"{label} {dot} sort {self.sort_by} {arrow}"
        if self.border_title != title:
            self.border_title = title
