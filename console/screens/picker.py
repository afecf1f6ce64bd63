"""Migrate target picker: choose the host a session moves to.

Every host is listed with its state word; hosts that cannot take the session
(its current home, draining, unreachable, disconnected) are shown but disabled,
so the operator sees why a host is missing from the choice.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from kvmesh.console.screens.ascii import use_ascii_scrollbars


class TargetPicker(ModalScreen["str | None"]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, sessions: list[str], homes: set[str], hosts: list[tuple[str, str, bool]]) -> None:
        """hosts: (name, state word, selectable)."""
        super().__init__()
        self.sessions = sessions
        self.homes = homes
        self.hosts = hosts

    def compose(self) -> ComposeResult:
        what = self.sessions[0] if len(self.sessions) == 1 else f"{len(self.sessions)} sessions"
        home = ", ".join(sorted(h for h in self.homes if h)) or "?"
        options = []
        for name, word, ok in self.hosts:
            reason = "" if ok else ("  (current home)" if name in self.homes and len(self.homes) == 1 else f"  ({word})")
            # Text, not a str: a str prompt is parsed as markup, and host names come from the mesh
            options.append(Option(Text(f"{name:<12} {word}{reason}"), id=name, disabled=not ok))
        with Vertical(id="picker-dialog", classes="dialog"):
            yield Static(f"Migrate {what} (home {home}) to:", id="picker-title", classes="dialog-title", markup=False)
            yield OptionList(*options, id="picker-list")
            yield Static("Enter picks, Esc cancels. The move is confirmed next.", classes="dialog-note")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        if self.has_class("-ascii"):
            use_ascii_scrollbars(ol)
        ol.focus()
        for i, (_, _, ok) in enumerate(self.hosts):
            if ok:
                ol.highlighted = i
                break

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
