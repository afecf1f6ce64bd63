"""Admin API client and admin-token loading.

The token comes from `KVMESH_ADMIN_TOKEN` or a file (`--admin-token-file`), never
from a command-line value (that would show in `ps`), and is never logged or shown.
Every node is an entry point, so a call goes to the first node that answers; a
node that cannot be reached is skipped, a node that answers (even 4xx) is final.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from kvmesh.console.apikey import read_secret_file
from kvmesh.node.protocol import ActionResult, MigrateCommand

TOKEN_ENV = "KVMESH_ADMIN_TOKEN"


class TokenError(Exception):
    """The admin token file was given but cannot be used."""


@dataclass(frozen=True)
class TokenSource:
    token: str | None
    origin: str  # "env", "file <path>", or "none": shown to the operator, the token never is
    warning: str = ""


def load_admin_token(token_file: str | None, env: Mapping[str, str] = os.environ) -> TokenSource:
    if token_file:
        try:
            token, warning = read_secret_file(token_file, "admin token")
        except ValueError as exc:
            raise TokenError(str(exc)) from None
        return TokenSource(token, f"file {Path(token_file).expanduser()}", warning)
    token = env.get(TOKEN_ENV, "").strip()
    if token:
        return TokenSource(token, f"env {TOKEN_ENV}")
    return TokenSource(None, "none")


class AdminClient:
    """POSTs admin commands to the mesh; results come back as `ActionResult`."""

    def __init__(
        self,
        node_urls: Callable[[], list[str]],
        token: str | None,
        *,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._node_urls = node_urls
        self._token = token
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False)
        self.calls: list[tuple[str, dict | None]] = []  # (path, body): what was asked, for the log and tests

    def __repr__(self) -> str:  # never let the token reach a log through repr
        return f"AdminClient(token={'set' if self._token else 'unset'})"

    async def aclose(self) -> None:
        await self._client.aclose()

    async def drain(self, host: str) -> ActionResult:
        return await self._post(f"/v1/admin/hosts/{quote(host, safe='')}/drain")

    async def undrain(self, host: str) -> ActionResult:
        return await self._post(f"/v1/admin/hosts/{quote(host, safe='')}/undrain")

    async def migrate(self, session: str, target: str) -> ActionResult:
        body = MigrateCommand(target=target).model_dump()  # {"target": "<host>"}
        return await self._post(f"/v1/admin/sessions/{quote(session, safe='')}/migrate", body)

    async def replicate(self, session: str) -> ActionResult:
        return await self._post(f"/v1/admin/sessions/{quote(session, safe='')}/replicate")

    async def _post(self, path: str, body: dict | None = None) -> ActionResult:
        self.calls.append((path, body))
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        urls = self._node_urls()
        if not urls:
            return ActionResult(ok=False, message="no node to send it to")
        last_error = ""
        for base in urls:
            try:
                resp = await self._client.post(base.rstrip("/") + path, headers=headers, json=body)
            except httpx.TransportError as exc:
                last_error = f"{base}: {type(exc).__name__}"
                continue
            return _result(resp)
        return ActionResult(ok=False, message=f"no node reachable ({last_error})")


def _result(resp: httpx.Response) -> ActionResult:
    try:
        parsed = ActionResult.model_validate_json(resp.content)
    except ValidationError:
        parsed = None
    if resp.status_code < 300:
        return parsed or ActionResult(ok=True, message=f"HTTP {resp.status_code}")
    detail = parsed.message if parsed else _error_text(resp)
    prefix = {
        401: "unauthorized (admin token missing or wrong)",
        403: "forbidden",
        404: "not found",
        409: "conflict",
    }.get(resp.status_code, f"HTTP {resp.status_code}")
    return ActionResult(ok=False, message=f"{prefix}: {detail}" if detail else prefix)


def _error_text(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            value = data.get(key)
            if isinstance(value, str):
                return value[:200]
            if isinstance(value, dict) and isinstance(value.get("message"), str):
                return value["message"][:200]
    return str(data)[:200]
