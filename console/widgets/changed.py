"""Widgets updated by id only when their content changed (keeps the SSH stream quiet)."""

from __future__ import annotations

from textual.dom import DOMNode
from textual.widgets import Digits


class ChangedOnly:
    """`set(widget_id, value)` updates the widget under `root` only when `value` differs from the last one.

    Digits take the value as text; other widgets (Static) take it as is, with a layout refresh
    unless `layout` is False (for widgets of a fixed size)."""

    def __init__(self, root: DOMNode, *, layout: bool = True) -> None:
        self._root, self._layout = root, layout
        self._last: dict[str, object] = {}

    def set(self, widget_id: str, value: object) -> None:
        if self._last.get(widget_id) == value:
            return
        self._last[widget_id] = value
        widget = self._root.query_one(f"#{widget_id}")
        if isinstance(widget, Digits):
            widget.update(str(value))
        else:
            widget.update(value, layout=self._layout)  # type: ignore[attr-defined]
