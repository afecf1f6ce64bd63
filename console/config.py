"""Console settings: from the command line, optionally from a TOML config file.

A config file may hold the same keys as the flags (`nodes`, `readonly`, `theme`,
`ascii`, `utc`, `discover`, `admin_token_file`, `api_key_file`, `refresh_interval`, `layout`,
`view`, `admin`, `idle_minutes`);
flags given on the command line win. The admin token and the API key themselves are never
settings, only the files that hold them: a config file is shared and copied more than a secret should be.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from kvmesh.console.theme import DEFAULT_THEME

# Secrets a config might be given raw, by mistake: refused, naming the file setting to use instead.
_SECRETS = {"admin_token": "admin token", "api_key": "API key"}

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
    api_key_file: str | None = None  # the client API key nodes with keys want (console.apikey)
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
        hints = [f"put the {what} in a file ({key}_file), not in the config" for key, what in _SECRETS.items()
                 if key in unknown]
        raise ValueError(f"unknown config keys in {path}: {', '.join(sorted(unknown))}"
                         + (f" ({'; '.join(hints)})" if hints else ""))
    return data
