"""Links panel: one row per directed host pair.

Throughput now as a sparkline (per-second history) and a number in Mb/s, the last
transfer's time and size, and its goodput (Gb/s). The row under
the cursor is the "selected link" whose handoff counts the counters panel shows.
"""

from __future__ import annotations

from rich.text import Text

from kvmesh.console.format import Glyphs, fmt_bytes, fmt_mbps, fmt_seconds, sparkline, truncate
from kvmesh.console.state import ConsoleState, LinkKey, LinkRow
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.table import Cell, Column, KeyedTable

SPARK_WIDTH = 10
LINKS_RENDER_ALL = 64  # up to this many links every row is rendered each patch


def link_row_key(key: LinkKey) -> str:
    # Host names cannot contain a space (they are URL path segments), so it separates.
    return f"{key[0]} {key[1]}"


def parse_link_row_key(row_key: str) -> LinkKey | None:
    src, _, dst = row_key.partition(" ")
    return (src, dst) if dst else None


class LinksTable(KeyedTable):
    COLUMNS = (
        Column("link", "Link", 15),
        Column("spark", "Throughput", SPARK_WIDTH),
        Column("mbps", "Mb/s", 6),
        Column("last", "Last xfer", 11),
        Column("goodput", "Goodput", 7),
    )

    @property
    def selected_link(self) -> LinkKey | None:
        key = self.cursor_key
        return parse_link_row_key(key) if key else None

    def patch(self, state: ConsoleState, palette: Palette, glyphs: Glyphs) -> None:
        cursor = self.cursor_key
        now = state.clock()
        added = False
        stale = {n for n in state.hosts if state.is_stale_host(n)}
        # Sparklines move with the clock, so rows are rendered every patch: in a big mesh (256 hosts, as many
        # links) only the rows on screen and new ones; the rest are rendered when scrolled to.
        keys = sorted(state.links)
        visible = None if len(keys) <= LINKS_RENDER_ALL else set(self.visible_keys())
        for key in keys:
            rk = link_row_key(key)
            if visible is None or rk in visible or not self.has_row(rk):
                added |= self.sync_row(rk, self.render_link(state.links[key], palette, glyphs, now, stale))
        self.flush()
        if added:
            self.sort_rows(lambda k: k)
            self.restore_cursor(cursor)
        title = f"Links {len(state.links)}"
        if self.border_title != title:
            self.border_title = title

    def render_link(
        self, link: LinkRow, palette: Palette, glyphs: Glyphs, now: float, stale_hosts: set[str]
    ) -> tuple[Text, ...]:
        base = palette.stale if (link.src in stale_hosts or link.dst in stale_hosts) else None

        def cell(text: str, style: object = None) -> Cell:
            return Cell(text, style=base or style or "", no_wrap=True)  # type: ignore[arg-type]

        name = truncate(f"{link.src}{glyphs.arrow}{link.dst}", 15, glyphs)
        last = "-"
        if link.last_transfer_s is not None:
            last = f"{fmt_seconds(link.last_transfer_s)} {fmt_bytes(link.last_transfer_bytes)}"
        goodput = f"{link.goodput_gbps:.1f}G" if link.goodput_gbps is not None else "-"
        return (
            cell(name, palette.bold),
            cell(sparkline(link.history_bps(now, SPARK_WIDTH), glyphs, SPARK_WIDTH), palette.ok),
            cell(fmt_mbps(link.now_bps(now))),
            cell(last),
            cell(goodput),
        )
