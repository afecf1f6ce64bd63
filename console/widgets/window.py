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


class Window:
    """Keys (session ids) with their sort keys, all of them in order, and the page shown.

    The order is kept ascending (`_asc`); `reverse` only changes how it is read. After a few changes the
    changed keys are taken out and put back by bisection, so a refresh costs what changed, not a sort of
    everything; sort keys are unique (each ends in the session id), so a key's place is found the same way."""

    def __init__(self, page: int = PAGE) -> None:
        self.page = page
        self.reverse = False
        self.start = 0  # the page's first row, counted in display order
        self._asc: list[str] = []
        self._keys: dict[str, Any] = {}
        self._changed: set[str] = set()
        self._resort = False

    @property
    def total(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()
        self._resort = True

    def put(self, key: str, sort_key: object) -> None:
        """`key` matches, and sorts by `sort_key`."""
        if key not in self._keys or self._keys[key] != sort_key:
            self._keys[key] = sort_key
            self._changed.add(key)

    def discard(self, key: str) -> None:
        if self._keys.pop(key, None) is not None:
            self._changed.add(key)

    def set_reverse(self, reverse: bool) -> None:
        self.reverse = reverse

    def settle(self) -> bool:
        """Bring the order up to date; True when it moved."""
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
