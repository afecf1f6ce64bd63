"""ASCII-mode helpers for screens: scrollbars without block characters."""

from __future__ import annotations

from textual.scrollbar import ScrollBarRender
from textual.widget import Widget


class AsciiScrollBarRender(ScrollBarRender):
    """Scrollbar thumbs normally end in eighth-blocks; draw them with spaces (the colour shows the thumb)."""

    VERTICAL_BARS = [" "] * 8
    HORIZONTAL_BARS = [" "] * 8


def use_ascii_scrollbars(*widgets: Widget) -> None:
    for widget in widgets:
        # Per-instance renderer, as Textual's ScrollBar docs show (the class default stays).
        widget.vertical_scrollbar.renderer = AsciiScrollBarRender  # type: ignore[misc]
        widget.horizontal_scrollbar.renderer = AsciiScrollBarRender  # type: ignore[misc]
