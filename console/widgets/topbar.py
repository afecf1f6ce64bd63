"""The one-line header: title, node connectivity, event rate, RO, pause state, theme."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvmesh.console.format import Glyphs, fmt_clock
from kvmesh.console.state import ConsoleState
from kvmesh.console.theme import Palette
from kvmesh.console.widgets.hosts import HOSTS_GROUP_AFTER, state_counts


class TopBar(Static):
    """Rendered from the state on each refresh; only re-set when its text changes."""

    DEFAULT_CSS = """
    TopBar { height: 1; width: 1fr; }
    """

    def __init__(self, *, readonly: bool, **kwargs: object) -> None:
        super().__init__("", **kwargs)  # type: ignore[arg-type]
        self.readonly = readonly
        self._last: Text | None = None

    def patch(
        self, state: ConsoleState, palette: Palette, glyphs: Glyphs, *, theme: str, utc: bool, show_clock: bool
    ) -> None:
        up, total = state.connected_count()
        t = Text(no_wrap=True, overflow=glyphs.overflow)  # type: ignore[arg-type]
        t.append(" kvmesh ", style=palette.bold)
        if self.readonly:
            t.append(" RO ", style=palette.warn + palette.bold)
            t.append(" ")
        node_style = palette.ok if total and up == total else (palette.error if up == 0 else palette.warn)
        t.append(f"nodes {up}/{total}", style=node_style)
        if total and up < total:
            t.append(" DISCONNECTED" if up == 0 else " degraded", style=node_style)
        t.append(f"  hosts {len(state.hosts)}")
        if len(state.hosts) > HOSTS_GROUP_AFTER:
            # Too many to read off the hosts rows at 80x24: what needs a look is counted here.
            down = state_counts({n: state.host_state(n) for n in state.hosts}, skip_up=True)
            if down:
                t.append(f" ({', '.join(down)})", style=palette.warn)
        t.append(f"  sessions {len(state.sessions)}  {state.events_per_s:.0f} ev/s")
        if state.paused:
            n = state.pending_count
            t.append("  PAUSED", style=palette.warn + palette.bold)
            t.append(f" {n} update{'s' if n != 1 else ''} pending", style=palette.warn)
        t.append(f"  {theme}", style=palette.muted)
        if show_clock:
            t.append(f"  {fmt_clock(state.clock(), utc)}", style=palette.muted)
        if t != self._last:
            self._last = t
            self.update(t, layout=False)  # fixed size: no screen reflow
