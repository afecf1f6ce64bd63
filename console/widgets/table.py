"""A DataTable patched in place by row key: the base of the hosts, sessions and links panels.

Rows are never cleared and refilled. Each refresh renders a row's cells, compares
them with what the table already shows, and calls `update_cell` only for cells
that differ; new rows are added, vanished rows removed, and the cursor is put back
on the same row key if the order moved under it. That keeps a slow SSH link quiet
and the operator's selection where they left it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from rich.text import Text
from textual._two_way_dict import TwoWayDict
from textual.coordinate import Coordinate
from textual.geometry import Region
from textual.widgets import DataTable
from textual.widgets.data_table import CellKey, ColumnKey, RowDoesNotExist, RowKey

# DataTable keys its render caches on a table-wide update counter, so one
# update_cell re-renders every visible cell (~0.3 ms each through Rich). With a
# cell changing somewhere every tick, that was most of a refresh. KeyedTable adds
# a cache keyed on the cell object itself (cells are immutable here: a changed
# cell is a new Text), so a tick re-renders only the cells that changed. It wraps
# a private method, so it is only installed when the signature is the one it
# was written against; otherwise tables are merely slower.
# The same reasoning one level up: a whole table line is reused while its row's
# cells (by identity), position, cursor/hover state and styles are unchanged.
_RENDER_CELL_PARAMS = ["self", "row_index", "column_index", "base_style", "width", "cursor", "hover"]
_RENDER_LINE_PARAMS = ["self", "y", "x1", "x2", "base_style"]
_PRIVATE_ATTRS = (
    "_row_locations", "_column_locations", "_data", "_pseudo_class_state", "_show_hover_cursor", "_header_row_key",
    "_updated_cells", "_require_update_dimensions",
)
_CACHE_OK = (
    list(inspect.signature(DataTable._render_cell).parameters) == _RENDER_CELL_PARAMS
    and list(inspect.signature(DataTable._render_line).parameters) == _RENDER_LINE_PARAMS
    and hasattr(DataTable, "_get_offsets")
)
_CELL_CACHE_MAX = 8192
_LINE_CACHE_MAX = 2048


class Cell(Text):
    """A table cell: rich Text that reports no intrinsic width.

    DataTable measures every cell of every new row to size auto-width columns,
    and each measurement asks the terminal for its size (a system call, three
    times over). Every column here has a fixed width, so the measurement only
    cost time: ~1 s to show a 2,000-session cluster view. Without `__rich_measure__`
    Textual takes the default width instead; rendering is unaffected.
    """

    __rich_measure__ = None  # type: ignore[assignment]


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
        self._sigs: dict[str, Hashable] = {}  # row key -> signature of what the cells were made from
        self._changed_rows: set[str] = set()  # cells set since the last flush()
        self.marked: set[str] = set()

    def on_mount(self) -> None:
        for col in self.COLUMNS:
            self.add_column(col.label, width=col.width, key=col.key)
        self._cell_cache: dict[tuple[Any, ...], tuple[object, Any]] = {}
        self._row_line_cache: dict[tuple[Any, ...], tuple[tuple[object, ...], Any]] = {}
        self._use_cell_cache = _CACHE_OK and all(hasattr(self, a) for a in _PRIVATE_ATTRS)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        # Theme or focus styling changed: the cached lines carry the old colours.
        if hasattr(self, "_cell_cache"):
            self._cell_cache.clear()
            self._row_line_cache.clear()

    def _get_offsets(self, y: int) -> tuple[Any, int]:  # type: ignore[override]
        # Every row here is one line high (rows are added with the default height=1),
        # so line y is simply row y; DataTable's version rebuilds a list of all rows
        # whenever any cell changes, which with 2,000 sessions was the biggest cost
        # left in a frame.
        if not getattr(self, "_use_cell_cache", False):
            return super()._get_offsets(y)  # type: ignore[misc]
        if self.show_header:
            if y < self.header_height:
                return self._header_row_key, y
            y -= self.header_height
        if not 0 <= y < self.row_count:
            raise LookupError(f"Y coord {y!r} is greater than total height")
        return self._row_locations.get_key(y), 0

    def _render_line(self, y: int, x1: int, x2: int, base_style: Any) -> Any:  # type: ignore[override]
        if not getattr(self, "_use_cell_cache", False):
            return super()._render_line(y, x1, x2, base_style)
        try:
            row_key, line_no = self._get_offsets(y)
        except LookupError:
            return super()._render_line(y, x1, x2, base_style)
        row = self._data.get(row_key)
        if row_key is self._header_row_key or row is None:
            return super()._render_line(y, x1, x2, base_style)
        row_index = self._row_locations.get(row_key)
        cursor_row = self.cursor_coordinate.row
        hover_row = self.hover_coordinate.row
        key = (
            row_key, line_no, row_index, x1, x2, self.size.width, base_style, cursor_row == row_index,
            hover_row == row_index, self.cursor_type, self.show_cursor, self._show_hover_cursor,
            self._pseudo_class_state,
        )
        cells = tuple(row.values())
        hit = self._row_line_cache.get(key)
        if hit is not None and len(hit[0]) == len(cells) and all(a is b for a, b in zip(hit[0], cells)):
            return hit[1]
        strip = super()._render_line(y, x1, x2, base_style)
        if len(self._row_line_cache) >= _LINE_CACHE_MAX:
            self._row_line_cache.clear()
        self._row_line_cache[key] = (cells, strip)
        return strip

    def _render_cell(  # type: ignore[override]
        self, row_index: int, column_index: int, base_style: Any, width: int, cursor: bool = False,
        hover: bool = False,
    ) -> Any:
        if row_index < 0 or column_index < 0 or not getattr(self, "_use_cell_cache", False):
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._row_locations.get_key(row_index)
        column_key = self._column_locations.get_key(column_index)
        if row_key is None or column_key is None:
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
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

    def sync_row(
        self, key: str, cells: tuple[Text, ...] | Callable[[], tuple[Text, ...]], sig: Hashable | None = None
    ) -> bool:
        """Show `cells` in row `key`; returns True if the row had to be added.

        `sig`, when given, summarises everything the cells are made from: an
        unchanged signature skips rendering and comparing the row altogether.
        """
        old = self._shown.get(key)
        if sig is not None and old is not None and self._sigs.get(key) == sig:
            return False
        if callable(cells):
            cells = cells()
        if sig is not None:
            self._sigs[key] = sig
        if old is None:
            self.add_row(*cells, key=key)
            self._shown[key] = cells
            return True
        if old != cells:
            merged = []
            for col, new_cell, old_cell in zip(self.COLUMNS, cells, old):
                if new_cell != old_cell:
                    self._set_cell(key, col.key, new_cell)
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
        self._set_cell(key, self.COLUMNS[column_index].key, cell)
        self._shown[key] = old[:column_index] + (cell,) + old[column_index + 1 :]

    def _set_cell(self, key: str, column_key: str, cell: Text) -> None:
        """update_cell without its per-call refresh: `flush()` refreshes once per patch."""
        if getattr(self, "_use_cell_cache", False):
            self._data[RowKey(key)][ColumnKey(column_key)] = cell
            self._changed_rows.add(key)
        else:
            self.update_cell(key, column_key, cell)

    def flush(self) -> None:
        """End of a patch: one cache invalidation, and a repaint of just the changed rows on screen.

        Rows that changed off screen cost no painting (and send nothing down a slow
        SSH link); they are drawn from the new cells when scrolled to. Adding,
        removing and sorting rows repaint the whole table themselves.
        """
        if not self._changed_rows:
            return
        changed, self._changed_rows = self._changed_rows, set()
        self._update_count += 1
        header = self.header_height if self.show_header else 0
        top = int(self.scroll_y)
        height = self.scrollable_content_region.height
        width = self.scrollable_content_region.width
        regions = []
        for key in changed:
            index = self._row_locations.get(RowKey(key))
            if index is None:
                continue
            y = header + index - top
            if header <= y < height:
                regions.append(Region(0, y, width, 1))
        if regions:
            self.refresh(*regions)

    def forget_signatures(self) -> None:
        """Styles changed (theme): render every row again on the next patch."""
        self._sigs.clear()

    def drop_row(self, key: str) -> None:
        self._sigs.pop(key, None)
        if self._shown.pop(key, None) is not None:
            try:
                self.remove_row(key)
            except RowDoesNotExist:
                pass

    def drop_rows(self, keys: Iterable[str]) -> None:
        """Remove many rows at once.

        DataTable.remove_row renumbers every remaining row, so removing most of
        2,000 rows one by one took seconds. When that would cost more than adding
        the kept rows back (about 250 renumberings per add), the table is cleared
        and the kept rows re-added in their current order, with their cells as
        shown. This is only for operator-driven changes (a filter narrowing, a
        cluster view that drops many sessions); refreshes always patch cell by cell.
        """
        drop = [k for k in keys if k in self._shown]
        if not drop:
            return
        if len(drop) > 1 and getattr(self, "_use_cell_cache", False):
            self._remove_many(drop)
            return
        keep_count = len(self._shown) - len(drop)
        if len(drop) * self.row_count <= 250 * max(1, keep_count):
            for key in drop:
                self.drop_row(key)
            return
        gone = set(drop)
        cursor = self.cursor_key
        keep = [k for k in self.ordered_keys() if k not in gone]
        for key in drop:
            self._shown.pop(key, None)
            self._sigs.pop(key, None)
        self._changed_rows -= gone
        self.clear()
        for key in keep:
            self.add_row(*self._shown[key], key=key)
        self.restore_cursor(cursor)

    def _remove_many(self, drop: list[str]) -> None:
        """remove_row for many rows with one renumbering (remove_row renumbers every row, each time)."""
        gone = {RowKey(k) for k in drop}
        locations = self._row_locations
        order = [rk for i in range(self.row_count) if (rk := locations.get_key(i)) is not None]
        for rk in gone:
            for ck in self._data.get(rk, {}):
                self._updated_cells.discard(CellKey(rk, ck))
            self.rows.pop(rk, None)
            self._data.pop(rk, None)
        self._row_locations = TwoWayDict({rk: i for i, rk in enumerate(r for r in order if r not in gone)})
        for key in drop:
            self._shown.pop(key, None)
            self._sigs.pop(key, None)
        self._changed_rows -= set(drop)
        self._require_update_dimensions = True
        self.check_idle()
        self.cursor_coordinate = self.cursor_coordinate  # re-validated against the new row count
        self.hover_coordinate = self.hover_coordinate
        self._update_count += 1
        self.refresh(layout=True)

    def ordered_keys(self) -> list[str]:
        """Row keys in display order."""
        if getattr(self, "_use_cell_cache", False):
            locations = self._row_locations
            return [k.value for i in range(self.row_count) if (k := locations.get_key(i)) is not None and k.value]
        keys = []
        for index in range(self.row_count):
            row_key, _ = self.coordinate_to_cell_key(Coordinate(index, 0))
            if row_key.value is not None:
                keys.append(row_key.value)
        return keys

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

    def restore_cursor(self, key: str | None, *, scroll: bool = False) -> None:
        """Put the cursor back on `key` if the row moved (sorting, rows added above); `scroll` brings it into view."""
        if key is None or key not in self._shown:
            return
        index = self.get_row_index(key)
        if index != self.cursor_row or scroll:
            self.move_cursor(row=index, animate=False, scroll=scroll)

    def set_order(self, keys: list[str]) -> None:
        """Show the rows in this order (`keys`: every row of the table, each once). Nothing is re-rendered."""
        if len(keys) != self.row_count or keys == self.ordered_keys():
            return
        if getattr(self, "_use_cell_cache", False):
            # What DataTable.sort does after its sort: only the row -> line map changes.
            self._row_locations = TwoWayDict({RowKey(k): i for i, k in enumerate(keys)})
            self._update_count += 1
            self.refresh()
        else:
            rank = {k: i for i, k in enumerate(keys)}
            self.sort_rows(lambda k: rank.get(k, 0))

    def sort_rows(self, sort_key: Callable[[str], object], reverse: bool = False) -> None:
        """Order rows by a key computed from the row key (the state knows the values)."""
        keys = list(self._shown)
        ranked = {k: i for i, k in enumerate(sorted(keys, key=cast(Any, sort_key), reverse=reverse))}
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
