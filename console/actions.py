"""Mesh-changing actions as plain data: what the confirm modal names and the admin client runs.

One `MeshAction` describes one operator request (possibly over several marked
targets). The app sends every one of them through the same path: read-only check,
confirm modal, admin calls, results into the event log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["drain", "undrain", "migrate", "replicate"]

MESH_ACTIONS: frozenset[str] = frozenset({"drain", "undrain", "migrate", "replicate"})

_VERBS: dict[str, str] = {
    "drain": "Drain",
    "undrain": "Undrain",
    "migrate": "Migrate",
    "replicate": "Replicate now",
}


@dataclass(frozen=True)
class MeshAction:
    kind: ActionKind
    targets: tuple[str, ...]  # host names (drain/undrain) or session ids (migrate/replicate)
    target_host: str | None = None  # migrate destination

    @property
    def noun(self) -> str:
        one = "host" if self.kind in ("drain", "undrain") else "session"
        return one if len(self.targets) == 1 else one + "s"

    def title(self) -> str:
        what = self.targets[0] if len(self.targets) == 1 else f"{len(self.targets)} {self.noun}"
        dest = f" to {self.target_host}" if self.target_host else ""
        return f"{_VERBS[self.kind]} {what}{dest}?"

    def consequence(self) -> str:
        if self.kind == "drain":
            return "No new turns will land there; running turns finish and each session's cache is pushed to its next host first."
        if self.kind == "undrain":
            return "The host will take new turns again."
        if self.kind == "migrate":
            return "The replica is pushed to the target, then the session's home moves there."
        return "A delta replica of each session is shipped to its predicted next host now."

    def describe(self) -> str:
        """A one-line summary for the event log."""
        dest = f" -> {self.target_host}" if self.target_host else ""
        return f"{self.kind} {', '.join(self.targets)}{dest}"
