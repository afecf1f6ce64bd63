"""Help screen: every key the console answers to, built from the bindings themselves."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from kvmesh.console.actions import MESH_ACTIONS
from kvmesh.console.format import UNICODE, Glyphs
from kvmesh.console.screens.ascii import use_ascii_scrollbars


def notes(g: Glyphs) -> str:
    """What the words and glyphs on the main screen mean (in the glyph set in use)."""
    return f"""\
Handoffs: WARM >= 90% of the prompt reused, PART 30-90%, COLD < 30%.
Sessions: {g.running} running = a turn in flight; idle = held in an engine or a replica
  store, last turn within the idle window; {g.ended} ended = no turn for longer, or
  held nowhere. The list shows live ones (running first); a shows all.
  Tokens "store: HOST": no engine holds it, HOST's replica store does.
Replica freshness (replicas move whole KV blocks; the partial last block never does):
  {g.fresh} fresh     holds every whole block of the session (age: when written)
  {g.behind} behind    whole blocks missing: tokens short, since when; a push may come
  {g.inflight} in flight a push is moving now: % done (estimated from the link's last
              rate) or tokens offered, and for how long
  {g.stale} stale     whole blocks missing and no push coming (refused, or none
              for a minute)
Esc closes."""


def format_key(key: str) -> str:
    names = {"question_mark": "?", "slash": "/", "space": "space", "escape": "esc", "tab": "tab"}
    return "/".join(names.get(k, k) for k in key.split(","))


def help_lines(bindings: list[Binding], readonly: bool) -> list[str]:
    lines = []
    for b in bindings:
        desc = b.description or b.action
        if b.tooltip:
            desc = f"{desc}: {b.tooltip}"
        if b.action in MESH_ACTIONS and readonly:
            desc += "  (disabled: read-only)"
        lines.append(f"  {format_key(b.key):<7} {desc}")
    lines.append(f"  {'ctrl+p':<7} Palette: the same actions by name (\"drain node-2\")")
    lines.append(f"  {'tab':<7} Focus: next panel (hosts, sessions, links, events)")
    lines.append(f"  {'up/down':<7} Cursor: move; pgup/pgdn and home/end scroll")
    lines.append(f"  {'enter':<7} In a modal: press the focused button (Cancel is first)")
    return lines


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,question_mark", "close", "Close"),
    ]

    def __init__(self, bindings: list[Binding], readonly: bool, glyphs: Glyphs = UNICODE) -> None:
        super().__init__()
        self.glyphs = glyphs
        self.lines = help_lines(bindings, readonly)
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-dialog", classes="dialog"):
            title = "kvmesh-console keys" + ("  (read-only: mesh actions are off)" if self.readonly else "")
            yield Static(title, classes="dialog-title")
            yield Static("\n".join(self.lines), id="help-keys", markup=False)
            yield Static(notes(self.glyphs), classes="dialog-note", markup=False)

    def on_mount(self) -> None:
        if self.has_class("-ascii"):
            use_ascii_scrollbars(self.query_one("#help-dialog"))

    def action_close(self) -> None:
        self.dismiss(None)
