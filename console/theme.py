"""Themes: load the definitions in `themes/`, register them, and derive cell styles.

Theme colours live in `themes/themes.toml` and layout/styling in
`themes/kvmesh.tcss` (see `themes_dir` for where they are found: `KVMESH_THEMES_DIR`,
the checkout, or an installed wheel's copy). Table cells are Rich `Text`, which cannot use CSS
variables, so `Palette` turns the active theme's variables into Rich styles; the
app rebuilds it and re-renders cells when the theme changes.
"""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rich.style import Style
from textual.theme import Theme

THEME_NAMES: tuple[str, ...] = ("kvmesh-dark", "kvmesh-light", "kvmesh-cb")
DEFAULT_THEME = "kvmesh-dark"

_THEME_FIELDS = (
    "primary", "secondary", "warning", "error", "success", "accent", "foreground",
    "background", "surface", "panel", "boost", "dark", "luminosity_spread", "text_alpha",
)


def themes_dir() -> Path:
    """$KVMESH_THEMES_DIR, else the checkout's themes/ (source or editable install), else the
    copy an installed wheel put under <prefix>/share/kvmesh/themes."""
    env = os.environ.get("KVMESH_THEMES_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parent.parent / "themes"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "kvmesh" / "themes"


def css_path() -> Path:
    return themes_dir() / "kvmesh.tcss"


def load_themes(path: Path | None = None) -> list[Theme]:
    """The console's themes from themes.toml; Textual's own as a fallback if it is missing."""
    path = path or themes_dir() / "themes.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        # An install without the themes/ directory still runs, in Textual's colours.
        from textual.theme import BUILTIN_THEMES

        dark, light = BUILTIN_THEMES["textual-dark"], BUILTIN_THEMES["textual-light"]
        cb = Theme(name="kvmesh-cb", primary="#56B4E9", success="#56B4E9", warning="#F0E442",
                   error="#D55E00", accent="#F0E442", dark=True)
        return [
            Theme(**{**dark.__dict__, "name": "kvmesh-dark"}),
            Theme(**{**light.__dict__, "name": "kvmesh-light"}),
            cb,
        ]
    themes = []
    for name, spec in data.items():
        kwargs = {k: spec[k] for k in _THEME_FIELDS if k in spec}
        variables = {str(k): str(v) for k, v in spec.get("variables", {}).items()}
        themes.append(Theme(name=name, variables=variables, **kwargs))
    return themes


def fill_kvm_variables(variables: dict[str, str]) -> dict[str, str]:
    """Give any theme (a built-in one picked by name, say) the kvm-* variables the .tcss uses."""
    out = dict(variables)
    out.setdefault("kvm-warm", variables.get("success", "green"))
    out.setdefault("kvm-partial", variables.get("warning", "yellow"))
    out.setdefault("kvm-cold", variables.get("error", "red"))
    out.setdefault("kvm-stale", variables.get("foreground-muted", variables.get("text-muted", "grey50")))
    return out


@dataclass(frozen=True)
class Palette:
    """Rich styles for table cells and log lines, derived from the active theme."""

    warm: Style
    partial: Style
    cold: Style
    ok: Style
    warn: Style
    error: Style
    stale: Style
    muted: Style
    bold: Style
    marked: Style

    @classmethod
    def from_variables(cls, v: dict[str, str]) -> Palette:
        v = fill_kvm_variables(v)

        def fg(name: str, bold: bool | None = None, dim: bool | None = None) -> Style:
            return Style(color=_plain_color(v.get(name, "")), bold=bold, dim=dim)

        return cls(
            warm=fg("kvm-warm", bold=True), partial=fg("kvm-partial", bold=True), cold=fg("kvm-cold", bold=True),
            ok=fg("kvm-warm"), warn=fg("kvm-partial"), error=fg("kvm-cold", bold=True),
            stale=fg("kvm-stale", dim=True), muted=fg("kvm-stale"), bold=Style(bold=True),
            marked=fg("accent", bold=True),
        )

    def handoff(self, cls: str | None) -> Style:
        return {"warm": self.warm, "partial": self.partial, "cold": self.cold}.get(cls or "", self.muted)

    def level(self, level: str) -> Style:
        return {"ok": self.ok, "warn": self.warn, "error": self.error, "stale": self.stale}.get(level, Style())


def _plain_color(value: str) -> str | None:
    """Theme variables may carry alpha ('#rrggbbaa') or names Rich cannot parse; keep what Rich takes."""
    value = value.strip()
    if value.startswith("#") and len(value) == 9:
        value = value[:7]
    try:
        Style.parse(value)
    except Exception:  # noqa: BLE001 - an odd theme value just means no colour for that style
        return None
    return value or None
