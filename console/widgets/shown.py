"""What a keyed table shows, row by row, and what a new rendering of a row changes: no widget here.

`KeyedTable` (table.py) renders a row, asks `ShownRows` which cells differ from
what is on screen, and touches only those. A row's signature (a summary of what
its cells are made from) lets an unchanged row skip rendering altogether. Cells
that did not change keep the object the table already holds: the table's render
caches and its sort (`KeyedTable.sort_rows`) go by cell identity.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, KeysView

from rich.text import Text


class ShownRows:
    """Row key -> the cells as displayed, and the signature they were made from."""

    def __init__(self) -> None:
        self.cells: dict[str, tuple[Text, ...]] = {}  # row key -> cells as displayed
        self._sigs: dict[str, Hashable] = {}  # row key -> signature of what the cells were made from

    def __contains__(self, key: str) -> bool:
        return key in self.cells

    def __len__(self) -> int:
        return len(self.cells)

    def keys(self) -> KeysView[str]:
        return self.cells.keys()

    def unchanged(self, key: str, sig: Hashable | None) -> bool:
        """True if the row is shown and `sig` (when given) is the signature it was drawn from."""
        return sig is not None and key in self.cells and self._sigs.get(key) == sig

    def put(self, key: str, cells: tuple[Text, ...], sig: Hashable | None) -> list[int] | None:
        """Record `cells` as shown in row `key`; None if the row is new (to be added), else the
        indexes of the cells that differ from what was shown (to be set)."""
        if sig is not None:
            self._sigs[key] = sig
        old = self.cells.get(key)
        if old is None:
            self.cells[key] = cells
            return None
        if old == cells:
            return []
        changed = []
        merged = []
        for i, (new_cell, old_cell) in enumerate(zip(cells, old)):
            if new_cell != old_cell:
                changed.append(i)
                merged.append(new_cell)
            else:
                merged.append(old_cell)  # keep the object the table holds
        self.cells[key] = tuple(merged)
        return changed

    def put_cell(self, key: str, index: int, cell: Text) -> bool:
        """Record one cell of a shown row; True if it changed (False too when the row is not shown)."""
        old = self.cells.get(key)
        if old is None or old[index] == cell:
            return False
        self.cells[key] = old[:index] + (cell,) + old[index + 1 :]
        return True

    def forget(self, keys: Iterable[str]) -> None:
        """The rows are gone from the table."""
        for key in keys:
            self.cells.pop(key, None)
            self._sigs.pop(key, None)

    def forget_signatures(self) -> None:
        """Every row is to be rendered again (styles changed)."""
        self._sigs.clear()
