"""The sessions panel's order: every matching session in sort order, and the page of it the table holds.

Why a window. A Textual DataTable costs per row it holds: adding 20,000 rows took seconds, and any
re-sort rebuilt all of them (~0.2 s a refresh at 20,000 sessions). The filter and the sort work
over every session here, in plain Python (sort keys cached per session, recomputed only for the
sessions that changed, which are put back in place by bisection), and the table holds only `page` rows of
the result, the page the cursor is on. Moving the cursor past a page's edge, or finding a session
by id, moves the page; the title says which rows of how many are shown.
"""

from __future__ import annotations

import bisect
from typing import Any

PAGE = 400  # rows the table holds at once: a screen at any terminal size, with room to scroll
_NONE = object()


class Window:
    """Keys (session ids) with their sort keys, all of them in order, and the page shown.

    The order is kept ascending (`_asc`); `reverse` only changes how it is read. After a few changes the
    changed keys are taken out and put back by bisection, so a refresh costs what changed, not a sort of
    everything; sort keys are unique (each ends in the session id), so a key's place is found the same way.

    Groups (a client session's conversations, `state/threads.py`): a key put with a `group` other than itself
    is a thread of that group, and the group's rows read as one: they sit together, where the group's
    foremost member sorts (in display order, so either direction), its main (the key that is the group) first,
    then its threads in sort order. Each key's place is (group head, main first, own sort key); a change
    re-derives the head of that key's group only, once per settle, so a refresh costs the groups that changed."""

    def __init__(self, page: int = PAGE) -> None:
        self.page = page
        self.reverse = False
        self.start = 0  # the page's first row, counted in display order
        self._asc: list[str] = []
        self._keys: dict[str, Any] = {}  # key -> its place: (group head, rank, own sort key)
        self._own: dict[str, Any] = {}  # key -> its own sort key
        self._group: dict[str, str] = {}  # thread -> its group (a main, or a key of no group, is not listed)
        self._threads: dict[str, set[str]] = {}  # group -> its threads in the window
        self._dirty: set[str] = set()  # groups whose head must be derived again
        self._changed: set[str] = set()
        self._resort = False

    @property
    def total(self) -> int:
        return len(self._own)

    def __contains__(self, key: object) -> bool:
        return key in self._own

    def clear(self) -> None:
        self._keys.clear()
        self._own.clear()
        self._group.clear()
        self._threads.clear()
        self._dirty.clear()
        self._resort = True

    @property
    def _main_rank(self) -> int:
        # A group's main reads first either way: first in the ascending order, or last when it is read reversed.
        return 2 if self.reverse else 0

    def put(self, key: str, sort_key: object, group: str | None = None) -> None:
        """`key` matches, and sorts by `sort_key`; `group`: the group it is a thread of (None or `key`: none)."""
        thread_of = None if group == key else group
        old = self._group.get(key)
        if old != thread_of:
            if old is not None:
                self._leave(key, old)
            if thread_of is not None:
                self._group[key] = thread_of
                threads = self._threads.get(thread_of)
                if threads is None:
                    self._threads[thread_of] = {key}
                else:
                    threads.add(key)
        elif self._own.get(key, _NONE) == sort_key:
            return
        self._own[key] = sort_key
        if thread_of is not None:
            self._dirty.add(thread_of)
        elif key in self._threads:
            self._dirty.add(key)  # a main: its threads sit where the group's foremost member does
        else:
            place = (sort_key, 2 if self.reverse else 0, sort_key)
            if self._keys.get(key) != place:
                self._keys[key] = place
                self._changed.add(key)

    def discard(self, key: str) -> None:
        if key not in self._own:
            return
        del self._own[key]
        group = self._group.get(key)
        if group is not None:
            self._leave(key, group)
        elif key in self._threads:
            self._dirty.add(key)
        self._keys.pop(key, None)
        self._changed.add(key)

    def _leave(self, key: str, group: str) -> None:
        del self._group[key]
        threads = self._threads[group]
        threads.discard(key)
        if not threads:
            del self._threads[group]
        self._dirty.add(group)

    def _place_group(self, group: str) -> None:
        """Derive the group's head (its foremost member's sort key) and place each of its members under it."""
        own, places, changed = self._own, self._keys, self._changed
        members = [(t, 1) for t in self._threads.get(group, ())]
        if group in own and group not in self._group:  # (a key named as a group while a thread of another: a thread)
            members.append((group, self._main_rank))
        if not members:
            return
        head = (max if self.reverse else min)(own[k] for k, _ in members)
        for k, rank in members:
            place = (head, rank, own[k])
            if places.get(k) != place:
                places[k] = place
                changed.add(k)

    def set_reverse(self, reverse: bool) -> None:
        if reverse != self.reverse:
            self.reverse = reverse
            # A group's head and its main's rank follow the direction: every group is placed again.
            self._dirty.update(k for k in self._own if k not in self._group)
            self._dirty.update(self._threads)

    def settle(self) -> bool:
        """Bring the order up to date; True when it moved."""
        for group in self._dirty:
            self._place_group(group)
        self._dirty.clear()
        changed, self._changed = self._changed, set()
        if not (changed or self._resort):
            return False
        keys = self._keys
        if self._resort or len(changed) * 8 > len(keys):
            self._asc = sorted(keys, key=keys.__getitem__)
        else:
            self._asc = [k for k in self._asc if k not in changed]
            for k in changed:
                if k in keys:
                    bisect.insort(self._asc, k, key=keys.__getitem__)
        self._resort = False
        return True

    def at(self, i: int) -> str:
        """The key at display position `i`."""
        return self._asc[len(self._asc) - 1 - i] if self.reverse else self._asc[i]

    def index(self, key: str | None) -> int | None:
        """`key`'s display position (None: not in the order)."""
        if key is None or key not in self._keys:
            return None
        i = bisect.bisect_left(self._asc, self._keys[key], key=self._keys.__getitem__)
        if i >= len(self._asc) or self._asc[i] != key:
            return None  # not settled yet
        return len(self._asc) - 1 - i if self.reverse else i

    def show(self, key: str) -> bool:
        """Move the page so that `key` is on it (a quarter down when it has to move); False if no such key."""
        i = self.index(key)
        if i is None:
            return False
        if not self.start <= i < self.start + self.page:
            self.start = i - self.page // 4
        return True

    def rows(self) -> list[str]:
        """The page: at most `page` keys in display order, from `start` (clamped to the order)."""
        n = len(self._asc)
        self.start = max(0, min(self.start, n - self.page))
        if not self.reverse:
            return self._asc[self.start : self.start + self.page]
        hi = n - self.start
        return self._asc[max(0, hi - self.page) : hi][::-1]

    def label(self) -> str:
        """'rows 401-800 of 20000' when the order is longer than a page, else ''."""
        n = len(self._asc)
        if n <= self.page:
            return ""
        return f"rows {self.start + 1}-{min(n, self.start + self.page)} of {n}"
