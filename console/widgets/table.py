"""A DataTable patched in place by row key: the base of the hosts, sessions and links panels.

Rows are never cleared and refilled. Each refresh renders a row's cells, compares
them with what the table already shows, and calls `update_cell` only for cells
that differ; new rows are added, vanished rows removed, and the cursor is put back
on the same row key if the order moved under it. That keeps a slow SSH link quiet
and the operator's selection where they left it. What each row shows and which of
its cells a new rendering changes is `shown.py` (no widget); the render caches
under it are `render_cache.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from rich.text import Text
from textual._two_way_dict import TwoWayDict
from textual.coordinate import Coordinate
from textual.geometry import Region
from textual.widgets.data_table import CellKey, ColumnKey, RowDoesNotExist, RowKey

from kvmesh.console.widgets.render_cache import CachedDataTable
from kvmesh.console.widgets.shown import ShownRows


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


class KeyedTable(CachedDataTable):
    """DataTable patched cell by cell by row key (rendering cached: `render_cache.py`)."""

    COLUMNS: Sequence[Column] = ()

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._shown = ShownRows()  # what each row shows, and the signature it was drawn from
        self._changed_rows: set[str] = set()  # cells set since the last flush()
        self.marked: set[str] = set()

    def on_mount(self) -> None:
        for col in self.COLUMNS:
            self.add_column(col.label, width=col.width, key=col.key)
        self._install_render_cache()

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
        if self._shown.unchanged(key, sig):
            return False
        if callable(cells):
            cells = cells()
        changed = self._shown.put(key, cells, sig)
        if changed is None:
            self.add_row(*cells, key=key)
            return True
        for index in changed:
            self._set_cell(key, self.COLUMNS[index].key, cells[index])
        return False

    def sync_cell(self, key: str, column_index: int, cell: Text) -> None:
        """Update one cell (for columns that change with time, like ages)."""
        if self._shown.put_cell(key, column_index, cell):
            self._set_cell(key, self.COLUMNS[column_index].key, cell)

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
        self._shown.forget_signatures()

    def drop_row(self, key: str) -> None:
        shown = key in self._shown
        self._shown.forget((key,))
        if shown:
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
        self._shown.forget(drop)
        self._changed_rows -= gone
        self.clear()
        for key in keep:
            self.add_row(*self._shown.cells[key], key=key)
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
        self._shown.forget(drop)
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
        keys = list(self._shown.keys())
        ranked = {k: i for i, k in enumerate(sorted(keys, key=cast(Any, sort_key), reverse=reverse))}
        first = self.COLUMNS[0].key
        # DataTable.sort only hands the key function cell values, so the first
        # column's cell object (the one the table holds) is mapped back to its row key.
        owner = {id(cells[0]): k for k, cells in self._shown.cells.items()}
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
