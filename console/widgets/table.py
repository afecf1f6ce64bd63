"""A DataTable patched in place by row key: the base of the hosts, sessions and links panels.

Rows are never cleared and refilled. Each refresh renders a row's cells, compares
them with what the table already shows, and calls `update_cell` only for cells
that differ; new rows are added, vanished rows removed, and the cursor is put back
on the same row key if the order moved under it. That keeps a slow SSH link quiet
and the operator's selection where they left it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import DataTable
from textual.widgets.data_table import RowDoesNotExist

# DataTable keys its render caches on a table-wide update counter, so one
# update_cell re-renders every visible cell (~0.3 ms each through Rich). With a
# cell changing somewhere every tick, that was most of a refresh. KeyedTable adds
# a cache keyed on the cell object itself (cells are immutable here: a changed
# cell is a new Text), so a tick re-renders only the cells that changed. It wraps
# a private method, so it is only installed when the signature is the one it
# was written against; otherwise tables are merely slower.
_RENDER_CELL_PARAMS = ["self", "row_index", "column_index", "base_style", "width", "cursor", "hover"]
_CELL_CACHE_OK = list(inspect.signature(DataTable._render_cell).parameters) == _RENDER_CELL_PARAMS
_CELL_CACHE_MAX = 8192


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int


class KeyedTable(DataTable):
    """DataTable with a render cache per row key, for cell-by-cell patching."""

    COLUMNS: Sequence[Column] = ()

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._shown: dict[str, tuple[Text, ...]] = {}  # row key -> cells as displayed
        self.marked: set[str] = set()

    def on_mount(self) -> None:
        for col in self.COLUMNS:
            self.add_column(col.label, width=col.width, key=col.key)
        self._cell_cache: dict[tuple[Any, ...], tuple[object, Any]] = {}
        self._use_cell_cache = _CELL_CACHE_OK and all(
            hasattr(self, a) for a in ("_row_locations", "_column_locations", "_data", "_pseudo_class_state")
        )

    def _render_cell(  # type: ignore[override]
        self, row_index: int, column_index: int, base_style: Any, width: int, cursor: bool = False,
        hover: bool = False,
    ) -> Any:
        if row_index < 0 or column_index < 0 or not getattr(self, "_use_cell_cache", False):
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._row_locations.get_key(row_index)
        column_key = self._column_locations.get_key(column_index)
        cell = self._data[row_key][column_key]
        key = (
            row_key, column_key, row_index, base_style, width, cursor, hover,
            self._show_hover_cursor, self._pseudo_class_state,
        )
        hit = self._cell_cache.get(key)
        if hit is not None and hit[0] is cell:
            return hit[1]
        lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        if len(self._cell_cache) >= _CELL_CACHE_MAX:
            self._cell_cache.clear()
        self._cell_cache[key] = (cell, lines)
        return lines

    # ---- patching ---------------------------------------------------------------------

    def has_row(self, key: str) -> bool:
        return key in self._shown

    def sync_row(self, key: str, cells: tuple[Text, ...]) -> bool:
        """Show `cells` in row `key`; returns True if the row had to be added."""
        old = self._shown.get(key)
        if old is None:
            self.add_row(*cells, key=key)
            self._shown[key] = cells
            return True
        if old != cells:
            merged = []
            for col, new_cell, old_cell in zip(self.COLUMNS, cells, old):
                if new_cell != old_cell:
                    self.update_cell(key, col.key, new_cell)
                    merged.append(new_cell)
                else:
                    merged.append(old_cell)  # keep the object the table holds (see sort_rows)
            self._shown[key] = tuple(merged)
        return False

    def sync_cell(self, key: str, column_index: int, cell: Text) -> None:
        """Update one cell (for columns that change with time, like ages)."""
        old = self._shown.get(key)
        if old is None or old[column_index] == cell:
            return
        self.update_cell(key, self.COLUMNS[column_index].key, cell)
        self._shown[key] = old[:column_index] + (cell,) + old[column_index + 1 :]

    def drop_row(self, key: str) -> None:
        if self._shown.pop(key, None) is not None:
            try:
                self.remove_row(key)
            except RowDoesNotExist:
                pass

    def shown_keys(self) -> Iterable[str]:
        return self._shown.keys()

    # ---- cursor -----------------------------------------------------------------------

    @property
    def cursor_key(self) -> str | None:
        if not self.row_count:
            return None
        try:
            row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        except Exception:  # noqa: BLE001 - no valid cursor (empty table) means no selection
            return None
        return row_key.value

    def restore_cursor(self, key: str | None) -> None:
        """Put the cursor back on `key` if the row moved (sorting, rows added above)."""
        if key is None or key not in self._shown:
            return
        index = self.get_row_index(key)
        if index != self.cursor_row:
            self.move_cursor(row=index, animate=False, scroll=False)

    def sort_rows(self, sort_key: Callable[[str], object], reverse: bool = False) -> None:
        """Order rows by a key computed from the row key (the state knows the values)."""
        keys = list(self._shown)
        ranked = {k: i for i, k in enumerate(sorted(keys, key=sort_key, reverse=reverse))}
        first = self.COLUMNS[0].key
        # DataTable.sort only hands the key function cell values, so the first
        # column's cell object (the one the table holds) is mapped back to its row key.
        owner = {id(cells[0]): k for k, cells in self._shown.items()}
        self.sort(first, key=lambda cell: ranked.get(owner.get(id(cell), ""), 0))

    def visible_keys(self) -> list[str]:
        """Row keys currently inside the viewport (for columns that change with time)."""
        top = int(self.scroll_y)
        height = max(0, self.size.height - 1)  # minus the header row
        keys = []
        # Coordinate lookups are O(1); `ordered_rows` would rebuild a list of every row.
        for index in range(top, min(self.row_count, top + height + 1)):
            row_key, _ = self.coordinate_to_cell_key(Coordinate(index, 0))
            if row_key.value is not None:
                keys.append(row_key.value)
        return keys

    def toggle_mark(self) -> str | None:
        key = self.cursor_key
        if key is None:
            return None
        if key in self.marked:
            self.marked.discard(key)
        else:
            self.marked.add(key)
        return key
