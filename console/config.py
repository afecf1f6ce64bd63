"""Console settings: from the command line, optionally from a TOML config file.

A config file may hold the same keys as the flags (`nodes`, `readonly`, `theme`,
`ascii`, `utc`, `discover`, `admin_token_file`, `refresh_interval`, `layout`, `view`,
`admin`, `idle_minutes`);
flags given on the command line win. The admin token itself is never a setting.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from kvmesh.console.theme import DEFAULT_THEME

Layout = Literal["auto", "compact", "large"]
View = Literal["main", "demo"]


@dataclass
class ConsoleConfig:
    nodes: list[str] = field(default_factory=list)
    readonly: bool = False
    ascii: bool = False
    theme: str = DEFAULT_THEME
    utc: bool = False
    discover: bool = True
    refresh_interval: float = 0.5
    layout: Layout = "auto"
    show_clock: bool = True
    admin_token_file: str | None = None
    demo: bool = False  # play a synthetic mesh instead of connecting (for trying the UI)
    view: View = "main"  # the view on start: the operator's, or the demo view for a room
    # The demo view and the browser view are shown to people who are not operators: they are
    # read-only unless this is set (`--admin`).
    admin: bool = False
    idle_minutes: float = 5.0  # a session with no turn for longer has ended (hidden by default)


def load_config_file(path: str) -> dict[str, Any]:
    data = tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    data = data.get("console", data)  # accept a [console] table or top-level keys
    known = {f.name for f in fields(ConsoleConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown config keys in {path}: {', '.join(sorted(unknown))}")
    if "admin_token" in data:  # pragma: no cover - caught by the unknown-key check above
        raise ValueError("put the admin token in a file (admin_token_file), not in the config")
    return data
