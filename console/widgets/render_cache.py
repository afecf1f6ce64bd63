"""DataTable's rendering, cached by cell object and by table line: the base of `KeyedTable`.

DataTable re-renders every visible cell after any cell changes; here a cell is
rendered again only when it is a new object, a line only when its row's cells,
place, cursor/hover state or styles changed, and line y is row y (every row is
one line). Rows are patched by key in `table.py`; this module only draws them.
"""

from __future__ import annotations

import inspect
from typing import Any

from textual.widgets import DataTable

# DataTable keys its render caches on a table-wide update counter, so one
# update_cell re-renders every visible cell (~0.3 ms each through Rich). With a
# cell changing somewhere every tick, that was most of a refresh. CachedDataTable adds
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



class CachedDataTable(DataTable):
    """DataTable whose cells and lines are rendered from caches keyed on the cells themselves."""

    def _install_render_cache(self) -> None:
        """Start caching (once mounted: the private state it checks for exists by then)."""
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
