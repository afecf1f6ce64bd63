"""What the screens and the command palette may ask of the running console app.

`MainScreen` and `MeshCommands` call back into the app (the state, the config,
the one action path, modals). They name this protocol instead of the app class,
so neither imports `console.app`, which imports both of them: the dependency runs
one way only (app -> screens, palette -> host), with no cycle even under
TYPE_CHECKING. `KvmeshConsole` satisfies it structurally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from textual.screen import ModalScreen

from kvmesh.console.config import ConsoleConfig
from kvmesh.console.state import ConsoleState

# (name shown in the palette, help text, what selecting it does)
PaletteCommand = tuple[str, str, Callable[[], object]]


class ConsoleHost(Protocol):
    """The console app as its screens see it."""

    config: ConsoleConfig
    state: ConsoleState

    @property
    def theme(self) -> str: ...

    def schedule_refresh(self) -> None: ...

    def refresh_view(self) -> None: ...

    def toggle_pause(self) -> None: ...

    def cycle_theme(self) -> None: ...

    def show_demo_view(self) -> None: ...

    def request_action(self, kind: str, targets: list[str] | None = None, target_host: str | None = None) -> None: ...

    def push_modal(self, screen: ModalScreen[Any], callback: Callable[[Any], object] | None = None) -> None: ...

    def palette_commands(self, include_sessions: bool) -> list[PaletteCommand]: ...
