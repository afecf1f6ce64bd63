"""The sessions panel's rows as pure functions over the state model: no widget here.

What a row shows and what it is drawn from (`render_session`, `signature`), the id
cell of a group's main and threads (`id_label`), the freshness cell (`fresh_text`,
`fresh_cell`), the filter (`matches`), the sort keys (`sort_key_fn`) and the words
of the title and the line under the table (`counts_label`, `group_text`).
`SessionsTable` (sessions.py) decides which rows to draw and patches them by key.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from heapq import nsmallest

from rich.text import Text

from kvmesh.console.format import CLASS_WORDS, Glyphs, fmt_age, fmt_tokens, truncate, truncate_middle
from kvmesh.console.state import ConsoleState, Lifecycle, ReplicaFreshness, SessionRow
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.table import Cell

SORTS: tuple[str, ...] = ("state", "session", "home", "tokens", "behind", "age", "last", "turns", "moves")
_CLASS_RANK = {"cold": 0, "partial": 1, "warm": 2}
_LIFE_RANK: dict[Lifecycle, int] = {"running": 0, "idle": 1, "ended": 2}


def matches(s: SessionRow, f: str) -> bool:
    """Whether the session passes the filter `f` (lower case; empty passes all)."""
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


def sort_key_fn(state: ConsoleState, by: str) -> Callable[[str], object]:
    """The sort key of a session id for the sort `by` (one of `SORTS`)."""
    sessions = state.sessions

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


def counts_label(state: ConsoleState, glyphs: Glyphs) -> str:
    """'3 running · 21 idle · 57 ended': the sessions in each lifecycle state."""
    n = state.lifecycle_counts
    return f" {glyphs.dot} ".join(f"{n[k]} {k}" for k in ("running", "idle", "ended"))


def id_label(state: ConsoleState, s: SessionRow, glyphs: Glyphs, listed: Container[str], width: int = 11) -> str:
    """The id cell: a group's main counts the group's other conversations known ("cc-1 +3"); a thread
    reads as a branch of its main listed above it ("› #a1b2c3d4"), or by its whole id when the main is
    not `listed` (ended, filtered out, not known); a session of no group by its id. A group's ids too long
    for the cell keep both ends ("sess…148 +3"): the end tells them apart."""
    group = s.group_id
    if group != s.sid:
        if group in listed:
            branch = s.sid[len(group):] if s.sid.startswith(group) else s.sid
            return truncate(f"{glyphs.thread} {branch}", width, glyphs)
        return truncate_middle(s.sid, width, glyphs)  # the group's threads share its head
    if n := state.thread_count(group):
        more = f" +{n}"
        return truncate_middle(s.sid, width - len(more), glyphs) + more
    return truncate(s.sid, width, glyphs)


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


def signature(
    s: SessionRow, life: Lifecycle, fresh: ReplicaFreshness, glyphs: Glyphs, now: float, *, marked: bool, stale: bool,
) -> tuple[object, ...]:
    """Everything a row is rendered from (times as displayed), so unchanged rows cost no rendering.

    `marked`: the row is marked; `stale`: its home host is stale."""
    return (
        marked, life, s.home, s.migrating_to, s.resident_tokens, s.replica_host,
        s.last_handoff, s.turns, s.moves, stale, fresh_text(fresh, glyphs, now),
    )


def render_session(
    s: SessionRow, life: Lifecycle, fresh: ReplicaFreshness, palette: Palette, glyphs: Glyphs, now: float,
    label: str | None = None, *, marked: bool, stale: bool,
) -> tuple[Text, ...]:
    """The row's cells, one per column of `SessionsTable`."""
    base = palette.stale if stale else (palette.muted if life == "ended" else None)
    mark = glyphs.mark if marked else " "
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
        fresh_cell(fresh, palette, glyphs, now, stale=stale),
        cell(last, palette.handoff(last_cls)),
        cell(str(s.turns)),
        cell(str(s.moves)),
    )


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


def fresh_cell(fresh: ReplicaFreshness, palette: Palette, glyphs: Glyphs, now: float, *, stale: bool) -> Cell:
    """The freshness cell, styled by its kind (`stale`: the session's home host is stale)."""
    kind = fresh.kind
    if kind == "none":
        return Cell(glyphs.none, style=palette.stale if stale else palette.muted)
    style = {"fresh": palette.ok, "behind": palette.warn, "inflight": palette.bold, "stale": palette.error}[kind]
    if stale:
        style = palette.stale
    return Cell(fresh_text(fresh, glyphs, now), style=style, no_wrap=True)
