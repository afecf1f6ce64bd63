"""The one confirm modal every mesh-changing action goes through.

It names the action and every target, says what will happen, and opens with
Cancel focused, so a stray Enter never drains a host.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from kvmesh.console.actions import MeshAction

MAX_LISTED = 10


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("left,h", "focus_cancel", show=False),
        Binding("right,l", "focus_confirm", show=False),
    ]

    def __init__(self, action: MeshAction) -> None:
        super().__init__()
        self.action_spec = action

    def compose(self) -> ComposeResult:
        a = self.action_spec
        listed = list(a.targets[:MAX_LISTED])
        lines = [f"  - {t}" for t in listed]
        if len(a.targets) > MAX_LISTED:
            lines.append(f"  ... and {len(a.targets) - MAX_LISTED} more")
        with Vertical(id="confirm-dialog", classes="dialog"):
            # markup=False: host names and session ids come from the mesh, not from us
            yield Static(a.title(), id="confirm-title", classes="dialog-title", markup=False)
            yield Static(f"{a.noun.capitalize()}:\n" + "\n".join(lines), id="confirm-targets", markup=False)
            if a.target_host:
                yield Static(f"Target host: {a.target_host}", id="confirm-dest", markup=False)
            yield Static(a.consequence(), id="confirm-consequence", classes="dialog-note", markup=False)
            with Horizontal(classes="dialog-buttons"):
                # compact buttons in ASCII mode: the default ones are drawn with half blocks
                compact = self.has_class("-ascii")
                yield Button("Cancel", id="cancel", variant="primary", compact=compact)
                yield Button(Text(a.title().rstrip("?")), id="confirm", variant="error", compact=compact)

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "confirm")

    def action_cancel(self) -> None:
        self.dismiss(False)

    def action_focus_cancel(self) -> None:
        self.query_one("#cancel", Button).focus()

    def action_focus_confirm(self) -> None:
        self.query_one("#confirm", Button).focus()
