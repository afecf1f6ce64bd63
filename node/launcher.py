"""Start and stop node processes (demo, benchmarks, drills, multi-node tests).

Each node is a real `kvmesh node` process with its own config file; it is
ready once it writes its ready file. Only processes started here are ever
signalled, by their own PID.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def write_toml(path: Path, data: dict[str, Any]) -> None:
    """A minimal TOML writer for node configs (tables of scalars, lists and inline tables)."""
    lines: list[str] = []

    def table(prefix: str, d: dict[str, Any]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_toml_value(v)}")
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}" if prefix else k, v)

    table("", data)
    path.write_text("\n".join(lines) + "\n")
    tomllib.loads(path.read_text())  # what we wrote must read back


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux), so a
    demo or benchmark killed by a hang-up or SIGKILL never leaves nodes behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (peers' addresses must be known before they start)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def mesh_configs(workdir: Path, names: list[str], *, host: str = "127.0.0.1", engine: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, hosts: dict[str, str] | None = None) -> dict[str, Path]:
    """Write one TOML per node of a full mesh (every node lists every other as a peer)."""
    addr = {n: (hosts or {}).get(n, host) for n in names}
    ports = {n: (free_port(addr[n]) if not hosts else 8000, free_port(addr[n]) if not hosts else 7000) for n in names}
    out = {}
    for n in names:
        api_port, kv_port = ports[n]
        peers = [{"name": p, "api": f"http://{addr[p]}:{ports[p][0]}", "kvshare": f"{addr[p]}:{ports[p][1]}"}
                 for p in names if p != n]
        cfg: dict[str, Any] = {"name": n, "api": {"host": addr[n], "port": api_port},
                               "engine": dict(engine or {}),
                               "kvshare": {"listen": f"{addr[n]}:{kv_port}", "store_dir": str(workdir / f"store-{n}")},
                               "mesh": {"peers": peers}}
        for section, values in (extra or {}).items():
            if isinstance(values, dict):
                cfg.setdefault(section, {}).update(values)
            else:
                cfg[section] = values
        out[n] = workdir / f"{n}.toml"
        write_toml(out[n], cfg)
    return out


@dataclass
class NodeProcess:
    name: str
    config: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", "ns1"]
    cli_args: list[str] = field(default_factory=list)  # `kvmesh` options before `node`, e.g. --log-level
    inherit_env: bool = True  # False: the child gets `env` only
    proc: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ready_file(self) -> Path:
        return self.workdir / f"{self.name}.ready.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def api(self) -> str:
        return str(self.info["api"])

    @property
    def kvshare(self) -> str:
        return str(self.info["kvshare"])

    def start(self) -> NodeProcess:
        self.ready_file.unlink(missing_ok=True)
        cmd = [*self.prefix, sys.executable, "-m", "kvmesh.node.cli", *self.cli_args, "node", "--config", str(self.config),
               "--ready-file", str(self.ready_file)]
        env = {**os.environ, **self.env} if self.inherit_env else dict(self.env)
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        return self

    def wait_ready(self, timeout: float = 60.0) -> NodeProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.name} exited with {self.proc.returncode}; log:\n{self.tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"node {self.name} not ready within {timeout:g}s; log:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL; only this process's own PID (and its session) is signalled."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
