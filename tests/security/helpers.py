"""Helpers for the bad-input and security tests.

- `start_mesh(workdir)`: a `node.lab.launcher.LocalMesh` of real `kvmesh node` processes (sim engine) with a mesh
  secret, a previous secret and an admin token, every node at `--log-level DEBUG` so that whatever a node can
  log is in its log file.
- `tree(path)`: a snapshot of a directory tree (relative names, sizes), to prove nothing touched a disk.
- `openai_error(resp)`: asserts an OpenAI-shaped error body.

Every server, process, socket and thread started here is stopped by its owner.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.config import NodeConfig
from kvmesh.node.lab.launcher import LocalMesh, NodeProcess, wait_peers, write_mesh
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

MODEL = "kvmesh-sim"
# Engine settings for fast, bounded turns: a 2048-token context caps any decode at ~20 ms of sim time.
FAST_SIM = {"kv_scale": 0.01, "prefill_tps": 1e7, "decode_tps": 1e5, "max_context": 2048}
SECRET_ENV = ("KVMESH_ADMIN_TOKEN", "KVMESH_MESH_SECRET")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child `kvmesh` process: no secrets inherited from whoever runs the tests."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env.update(extra)
    return env


def openai_error(resp: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error: JSON {"error": {"message", "type", "code"}}, a non-empty message, no traceback."""
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers.get("content-type", "").startswith("application/json"), (resp.status_code, resp.headers, resp.text[:300])
    assert "Traceback" not in resp.text, resp.text[:500]
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict), body
    for key in ("message", "type", "code"):
        assert key in err, body
    assert isinstance(err["message"], str) and err["message"].strip(), body
    assert isinstance(err["type"], str) and err["type"], body
    assert isinstance(err["code"], str) and err["code"], body
    return err


def tree(root: Path) -> dict[str, int]:
    """Every file and directory under root (relative name -> size, -1 for directories)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (-1 if p.is_dir() else p.stat().st_size) for p in sorted(root.rglob("*"))}


def chat(messages: list[dict[str, str]] | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages or [{"role": "user", "content": "hello"}],
                            "max_tokens": 2, "temperature": 0}
    body.update(kw)
    return body


# ---- in-process servers ----------------------------------------------------------------------------------


def sim_config(name: str = "sec", *, engine: dict[str, Any] | None = None, **fields: Any) -> NodeConfig:
    """A sim node config (fast, bounded turns); `fields` are NodeConfig fields as plain data."""
    eng: dict[str, Any] = {"kind": "sim", "slots": 2, "queue_max": 8, "queue_timeout_s": 20.0, "cache_bytes": 16 << 20,
                           "block_size": 64, "sim": dict(FAST_SIM)}
    eng.update(engine or {})
    data: dict[str, Any] = {"name": name, "engine": eng}
    for k, v in fields.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k].update(v)
        else:
            data[k] = v
    data.setdefault("kvshare", {}).setdefault("fsync", "never")
    return NodeConfig.model_validate(data)


# ---- real node processes -----------------------------------------------------------------------------------


def debug_node(name: str, config: Path, workdir: Path) -> NodeProcess:
    """A node process at DEBUG log level, with no secrets inherited from the test runner's environment."""
    return NodeProcess(name, config, workdir, env=clean_env(), inherit_env=False, cli_args=["--log-level", "DEBUG"])


@dataclass
class Mesh(LocalMesh):
    """The security tests' mesh: its secrets, and the headers that present them."""

    secret: str
    previous_secret: str
    admin_token: str
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60.0))

    def store_dir(self, name: str) -> Path:
        return Path(self.configs[name]["kvshare"]["store_dir"])

    @property
    def peer_token(self) -> str:
        return peer_token(self.secret.encode())

    @property
    def previous_peer_token(self) -> str:
        return peer_token(self.previous_secret.encode())

    def peer_headers(self) -> dict[str, str]:
        return {PEER_HEADER: self.peer_token}

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def secret_strings(self) -> dict[str, str]:
        return {"mesh.secret": self.secret, "mesh.previous_secret": self.previous_secret,
                "admin_token": self.admin_token, "peer token (current)": self.peer_token,
                "peer token (previous)": self.previous_peer_token}

    def wait_reachable(self) -> None:
        """Every node sees every host reachable and undrained (after a test drained or overloaded one)."""
        wait_peers(self.nodes.values())

    def stop(self, timeout: float = 15.0) -> None:
        self.http.close()
        super().stop(timeout)


def start_mesh(workdir: Path, names: tuple[str, ...] = ("a", "b"), *, kvshare: dict[str, Any] | None = None,
               api: dict[str, Any] | None = None) -> Mesh:
    """A full mesh of `kvmesh node` processes on loopback, with every secret configured, started."""
    secret = "MESHSECRET-" + secrets.token_hex(16)
    previous = "PREVSECRET-" + secrets.token_hex(16)
    admin = "ADMINTOKEN-" + secrets.token_hex(12)
    base = write_mesh(
        workdir, names, node=debug_node,
        engine={"kind": "sim", "slots": 2, "cache_bytes": 32 << 20, "block_size": 64,
                "sim": {"kv_scale": 0.02, "prefill_tps": 1e6, "decode_tps": 2000.0}},
        extra={"admin_token": admin, "api": dict(api or {}),
               "kvshare": {"replicate_min_tokens": 0, "fsync": "never", **(kvshare or {})},
               "mesh": {"secret": secret, "previous_secret": previous, "poll_interval_s": 0.2, "stale_after_s": 2.0}})
    return Mesh(base.workdir, base.nodes, base.configs, secret, previous, admin).start(ready_timeout=90.0)


def anthropic_error(resp: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """An Anthropic-shaped error: JSON {"type": "error", "error": {"type", "message"}}, a non-empty message, no traceback."""
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers.get("content-type", "").startswith("application/json"), (resp.status_code, resp.text[:300])
    assert "Traceback" not in resp.text, resp.text[:500]
    body = resp.json()
    assert isinstance(body, dict) and body.get("type") == "error" and set(body) == {"type", "error"}, body
    err = body["error"]
    assert isinstance(err, dict) and isinstance(err.get("type"), str) and err["type"], body
    assert isinstance(err.get("message"), str) and err["message"].strip(), body
    return err
