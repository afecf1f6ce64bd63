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
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from heapq import nsmallest

from rich.text import Text

from kvmesh.console.format import CLASS_WORDS, Glyphs, fmt_age, fmt_tokens, truncate, truncate_middle
from kvmesh.console.state import Changes, ConsoleState, Lifecycle, ReplicaFreshness, SessionRow
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.table import Cell, Column, KeyedTable
from kvmesh.console.widgets.window import Window

SORTS: tuple[str, ...] = ("state", "session", "home", "tokens", "behind", "age", "last", "turns", "moves")
_CLASS_RANK = {"cold": 0, "partial": 1, "warm": 2}
_LIFE_RANK: dict[Lifecycle, int] = {"running": 0, "idle": 1, "ended": 2}


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

    def matches(self, s: SessionRow) -> bool:
        f = self.filter_text
        if not f:
            return True
        return (
            f in s.sid.lower()
            or (s.home is not None and f in s.home.lower())
            or (s.replica_host is not None and f in s.replica_host.lower())
            or (s.last_handoff is not None and f in CLASS_WORDS[s.last_handoff].lower())
            or f in s.id_source.lower()
            or (s.group is not None and f in s.group.lower())  # a thread's key names its group anyway
        )

    def sort_key_fn(self, state: ConsoleState) -> Callable[[str], object]:
        sessions = state.sessions
        by = self.sort_by

        def key(sid: str) -> object:
            s = sessions.get(sid)
            if s is None or by == "session":
                return sid
            if by == "state":
                return (_LIFE_RANK[state.lifecycle(sid)], sid)
            if by == "home":
                return (s.home or "", sid)
            if by == "tokens":
                return (s.resident_tokens, sid)
            if by == "behind":
                return (s.replica_behind_tokens if s.replica_host else -1, sid)
            if by == "age":
                # Oldest replica first when reversed; by write time, so a key never goes stale with the clock.
                return (-s.replica_at if s.replica_at else float("-inf"), sid)
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
        key = self.sort_key_fn(state)
        show_all = self.show_all
        # A thread's id cell says whether its main is listed: rows of mains that came or went are drawn again.
        regrouped: set[str] = set()
        for sid in candidates:
            s = state.sessions.get(sid)
            was = not full and sid in win
            if s is None or not (show_all or state.lifecycle(sid) != "ended") or not self.matches(s):
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
                label = self.id_label(state, s, glyphs)
                render = partial(self.render_session, s, life, fresh, palette, glyphs, now, label)
                self.sync_row(sid, render, (label, *self.signature(s, life, fresh, glyphs, now)))
        self.set_order(rows)
        self.restore_cursor(follow or cursor, scroll=follow is not None)
        self._patch_subtitle(state, glyphs)
        # Ages move with the clock alone; paused means frozen, so they wait too.
        for sid in [] if state.paused else self.visible_keys():
            s = state.sessions.get(sid)
            if s is not None:
                self.sync_cell(sid, self.FRESH, self.fresh_cell(s, state.replica_freshness(s, now), palette, glyphs, now))
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
        if self.filter_text and not self.matches(sessions[sid]):
            self.set_filter("")
            note += "; filter cleared"
        if not self.show_all and state.lifecycle(sid) == "ended":
            self.toggle_all()
            note += "; showing all sessions (it has ended)"
        self._follow = sid
        self._refilter = True
        return sid, f"found {sid}{note}"

    def counts_label(self, state: ConsoleState, glyphs: Glyphs) -> str:
        """'3 running · 21 idle · 57 ended': the sessions in each lifecycle state."""
        n = state.lifecycle_counts
        return f" {glyphs.dot} ".join(f"{n[k]} {k}" for k in ("running", "idle", "ended"))

    def id_label(self, state: ConsoleState, s: SessionRow, glyphs: Glyphs, width: int = 11) -> str:
        """The id cell: a group's main counts the group's other conversations known ("cc-1 +3"); a thread
        reads as a branch of its main listed above it ("› #a1b2c3d4"), or by its whole id when the main is
        not listed (ended, filtered out, not known); a session of no group by its id. A group's ids too long
        for the cell keep both ends ("sess…148 +3"): the end tells them apart."""
        group = s.group_id
        if group != s.sid:
            if group in self.window:
                branch = s.sid[len(group):] if s.sid.startswith(group) else s.sid
                return truncate(f"{glyphs.thread} {branch}", width, glyphs)
            return truncate_middle(s.sid, width, glyphs)  # the group's threads share its head
        if n := state.thread_count(group):
            more = f" +{n}"
            return truncate_middle(s.sid, width - len(more), glyphs) + more
        return truncate(s.sid, width, glyphs)

    @staticmethod
    def group_text(state: ConsoleState, group: str, most: int = 4) -> str:
        """The group's conversations in words: 'main + 3 threads: #a1b2c3d4, #0f0e0d0c, #12345678' (the
        first `most` threads by id, then how many more; each by its key past the group's id)."""
        threads = state.threads_of(group)
        n = len(threads)
        text = f"{n} thread{'' if n == 1 else 's'}"
        text = f"main + {text}" if group in state.sessions else f"{text} (main not known)"
        if n:
            names = [t[len(group):] if t.startswith(group) else t for t in nsmallest(most, threads)]
            text += ": " + ", ".join(names) + (f" +{n - most} more" if n > most else "")
        return text

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
                parts.append(f"thread of {name}: {self.group_text(state, group)}")
            elif state.thread_count(group):
                parts.append(self.group_text(state, group))
            subtitle = f" {glyphs.dot} ".join(parts) if len(parts) > 1 or s.id_source else ""
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle

    def _patch_title(self, state: ConsoleState, glyphs: Glyphs) -> None:
        dot = glyphs.dot
        label = f"Sessions {self.counts_label(state, glyphs)}" + ("" if self.show_all else f" {dot} live shown")
        if self.filter_text:
            label += f" {dot} {self.window.total} match '{self.filter_text}'"
        if rows := self.window.label():
            label += f" {dot} {rows}"
        arrow = "v" if self.sort_reverse else "^"
        title = f"{label} {dot} sort {self.sort_by} {arrow}"
        if self.border_title != title:
            self.border_title = title

    def signature(
        self, s: SessionRow, life: Lifecycle, fresh: ReplicaFreshness, glyphs: Glyphs, now: float
    ) -> tuple[object, ...]:
        """Everything a row is rendered from (times as displayed), so unchanged rows cost no rendering."""
        return (
            s.sid in self.marked, life, s.home, s.migrating_to, s.resident_tokens, s.replica_host,
            s.last_handoff, s.turns, s.moves, s.home in self._stale_homes, self.fresh_text(fresh, glyphs, now),
        )

    def render_session(
        self, s: SessionRow, life: Lifecycle, fresh: ReplicaFreshness, palette: Palette, glyphs: Glyphs, now: float,
        label: str | None = None,
    ) -> tuple[Text, ...]:
        base = palette.stale if s.home in self._stale_homes else (palette.muted if life == "ended" else None)
        mark = glyphs.mark if s.sid in self.marked else " "
        life_glyph = {"running": glyphs.running, "idle": " ", "ended": glyphs.ended}[life]

        def cell(text: str, style: object = None) -> Cell:
            return Cell(text, style=base or style or "", no_wrap=True)  # type: ignore[arg-type]

        home = s.home or glyphs.none
        if s.migrating_to:
            home = f"{home}{glyphs.arrow}{s.migrating_to}"
        last_cls = s.last_handoff
        last = f"{glyphs.handoff(last_cls)} {CLASS_WORDS[last_cls]}" if last_cls else glyphs.none
        # Held by no engine but kept in a replica store: say where, not "0".
        tokens = fmt_tokens(s.resident_tokens)
        if s.resident_tokens <= 0 and s.replica_host:
            tokens = f"store: {s.replica_host}"
            if len(tokens) > 12:
                tokens = f"store:{s.replica_host}"  # "store:node-1" still fits the column
        return (
            Cell.assemble(
                (mark, palette.marked), (life_glyph, palette.bold),
                (truncate(s.sid, 11, glyphs) if label is None else label, base or ""),
                no_wrap=True,
            ),
            cell(truncate(home, 7, glyphs), palette.bold if s.active else None),
            cell(truncate(tokens, 12, glyphs)),
            cell(truncate(s.replica_host or glyphs.none, 7, glyphs)),
            self.fresh_cell(s, fresh, palette, glyphs, now),
            cell(last, palette.handoff(last_cls)),
            cell(str(s.turns)),
            cell(str(s.moves)),
        )

    @staticmethod
    def fresh_text(fresh: ReplicaFreshness, glyphs: Glyphs, now: float) -> str:
        """The freshness cell: a glyph, then what it means in numbers (11 columns)."""
        kind = fresh.kind
        if kind == "none":
            return glyphs.none
        ago = fmt_age(now - fresh.since) if fresh.since is not None else "-"
        if kind == "fresh":
            return f"{glyphs.fresh} fresh {ago:>3}"
        if kind == "inflight":
            if fresh.progress is not None:
                return f"{glyphs.inflight} {fresh.progress * 100:3.0f}% {ago:>3}"
            return f"{glyphs.inflight} {fmt_tokens(fresh.tokens):>4} {ago:>3}"
        glyph = glyphs.behind if kind == "behind" else glyphs.stale
        return f"{glyph} {fmt_tokens(fresh.tokens):>4} {ago:>4}"

    def fresh_cell(self, s: SessionRow, fresh: ReplicaFreshness, palette: Palette, glyphs: Glyphs, now: float) -> Cell:
        kind = fresh.kind
        if kind == "none":
            return Cell(glyphs.none, style=palette.stale if s.home in self._stale_homes else palette.muted)
        style = {"fresh": palette.ok, "behind": palette.warn, "inflight": palette.bold, "stale": palette.error}[kind]
        if s.home in self._stale_homes:
            style = palette.stale
        return Cell(self.fresh_text(fresh, glyphs, now), style=style, no_wrap=True)
