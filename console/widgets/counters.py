"""Counters panel: warm / partial / cold handoffs, big enough to read across a room.

Mesh-wide numbers in large digits with their words and glyphs, the warm
percentage, stale-state colds, handoffs short of their predicted reuse by reason
(only reasons that occurred), and the same counts for the link selected in the
links panel. The compact layout (80x24) shows `CountersLine` instead: the same on
one line. With `--ascii` the digits are plain bold text (the big digits are
box-drawing glyphs).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Digits, Static

from kvmesh.console.format import CLASS_WORDS, Glyphs, fmt_pct, fmt_shortfall
from kvmesh.console.state import ConsoleState, LinkKey
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.changed import ChangedOnly


class CountersPanel(Vertical):
    DEFAULT_CSS = """
    CountersPanel { height: auto; }
    CountersPanel .count-block { width: 1fr; height: auto; }
    CountersPanel .count-label { height: 1; }
    CountersPanel Digits { width: auto; }
    CountersPanel .ascii-count { height: 1; text-style: bold; }
    CountersPanel .count-extra { height: auto; }
    """

    def __init__(self, *, ascii_only: bool, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.ascii_only = ascii_only
        self._set = ChangedOnly(self, layout=False).set  # fixed-size lines: no screen reflow

    def compose(self) -> ComposeResult:
        # One row per class: the word and glyph, then the number in big digits.
        for cls in ("warm", "partial", "cold"):
            with Horizontal(classes=f"count-block -{cls}"):
                yield Static("", id=f"label-{cls}", classes="count-label")
                if self.ascii_only:
                    yield Static("0", id=f"count-{cls}", classes="ascii-count")
                else:
                    yield Digits("0", id=f"count-{cls}")
        yield Static("", id="counters-pct", classes="count-extra")
        yield Static("", id="counters-link", classes="count-extra")

    def patch(self, state: ConsoleState, palette: Palette, glyphs: Glyphs, link: LinkKey | None) -> None:
        c = state.counters
        for cls in ("warm", "partial", "cold"):
            n = getattr(c, cls)
            style = palette.handoff(cls)
            self._set(f"label-{cls}", Text.assemble((f"{glyphs.handoff(cls)} {CLASS_WORDS[cls]}", style)))
            self._set(f"count-{cls}", str(n) if not self.ascii_only else Text(str(n), style=style))
        pct = c.warm_pct()
        pct_text = Text.assemble(
            ("warm ", palette.muted), (fmt_pct(pct), palette.warm), (" of ", palette.muted), (str(c.total), ""),
        )
        if c.stale_state_cold:
            pct_text.append(f"\n{c.stale_state_cold} cold from stale state", style=palette.cold)
        short = fmt_shortfall(c.shortfall)
        if short:
            pct_text.append(f"\nshort of predicted: {short}", style=palette.warn)
        self._set("counters-pct", pct_text)
        self._set("counters-link", self._link_line(state, palette, glyphs, link))

    def _link_line(self, state: ConsoleState, palette: Palette, glyphs: Glyphs, link: LinkKey | None) -> Text:
        lk = state.links.get(link) if link else None
        if lk is None:
            return Text("no link selected", style=palette.muted)
        total = lk.warm + lk.partial + lk.cold
        pct = 100.0 * lk.warm / total if total else 100.0
        t = Text(no_wrap=True, overflow=glyphs.overflow)  # type: ignore[arg-type]
        t.append(f"link {lk.src}{glyphs.arrow}{lk.dst}\n", style=palette.bold)
        for cls in ("warm", "partial", "cold"):
            t.append(f"{glyphs.handoff(cls)} {CLASS_WORDS[cls]} {getattr(lk, cls)} ", style=palette.handoff(cls))
        t.append(f"\nwarm {fmt_pct(pct)}", style=palette.muted)
        return t


class CountersLine(Static):
    """The compact layout's counters: one line, words and glyphs beside the numbers."""

    DEFAULT_CSS = """
    CountersLine { height: 1; }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__("", **kwargs)  # type: ignore[arg-type]
        self._last: Text | None = None

    def patch(self, state: ConsoleState, palette: Palette, glyphs: Glyphs, link: LinkKey | None) -> None:
        c = state.counters
        line = Text(no_wrap=True, overflow=glyphs.overflow)  # type: ignore[arg-type]
        for cls in ("warm", "partial", "cold"):
            line.append(f"{glyphs.handoff(cls)} {CLASS_WORDS[cls]} {getattr(c, cls)}", style=palette.handoff(cls))
            line.append("  ")
        line.append("warm ", style=palette.muted)
        line.append(fmt_pct(c.warm_pct()), style=palette.warm)
        if c.stale_state_cold:
            line.append(f"  stale-state cold {c.stale_state_cold}", style=palette.cold)
        short = fmt_shortfall(c.shortfall)
        if short:
            line.append(f"  short: {short}", style=palette.warn)
        lk = state.links.get(link) if link else None
        if lk is not None:
            line.append(f"  {lk.src}{glyphs.arrow}{lk.dst} ", style=palette.muted)
            line.append(f"W{lk.warm} P{lk.partial} C{lk.cold}")
        if line != self._last:
            self._last = line
            self.update(line, layout=False)
