"""The client API key the console presents to nodes, on each `/v1/events` websocket it opens.

Nodes with client keys configured (`kvmesh init` writes one) want one on their observer routes too, since
the cluster view names every session. The console reads it as `kvmesh load` does: from `KVMESH_API_KEY`
(the first of a comma-separated list, the variable a node reads its keys from) or from a file
(`--api-key-file`, or `api_key_file` in the config), never from a flag value (it would show in `ps`). The
file wins over the variable. The key is never logged or shown.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

KEY_ENV = "KVMESH_API_KEY"
# What the operator is told when a node refuses the console for want of a key.
KEY_HINT = f"set {KEY_ENV} or --api-key-file"


class ApiKeyError(Exception):
    """The API key file was given but cannot be used."""


@dataclass(frozen=True)
class ApiKey:
    key: str | None = field(default=None, repr=False)
    origin: str = "none"  # "env ...", "file <path>" or "none": shown to the operator, the key never is
    warning: str = ""

    def headers(self) -> dict[str, str]:
        """The headers that present it to a node (none without a key)."""
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


def read_secret_file(path_text: str, what: str) -> tuple[str, str]:
    """A secret from a file (stripped), and a warning if others may read the file; ValueError if unusable."""
    path = Path(path_text).expanduser()
    try:
        secret = path.read_text(encoding="utf-8").strip()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {path}: {exc.strerror}") from exc
    if not secret:
        raise ValueError(f"{what} file {path} is empty")
    warning = f"{what} file {path} is readable by group/others; chmod 600 it" if mode & (stat.S_IRGRP | stat.S_IROTH) else ""
    return secret, warning


def load_api_key(key_file: str | None, env: Mapping[str, str] = os.environ) -> ApiKey:
    if key_file:
        try:
            key, warning = read_secret_file(key_file, "API key")
        except ValueError as exc:
            raise ApiKeyError(str(exc)) from None
        return ApiKey(key, f"file {Path(key_file).expanduser()}", warning)
    first = next((k.strip() for k in env.get(KEY_ENV, "").split(",") if k.strip()), None)
    return ApiKey(first, f"env {KEY_ENV}") if first else ApiKey()


def refusal(node_url: str, status: int, *, keyed: bool) -> str | None:
    """What to tell the operator when a node answered the event stream's handshake with `status`; None unless it
    is a refusal of the credentials (401, or 403 from a server that can only refuse a websocket so)."""
    if status not in (401, 403):
        return None
    if keyed:
        return f"node {node_url} refused the console's API key (HTTP {status}): check {KEY_ENV} or --api-key-file"
    return f"node {node_url} wants an API key (HTTP {status}): {KEY_HINT}"
