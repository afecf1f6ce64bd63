"""Start and stop node processes (demo, benchmarks, drills, multi-node tests).

Each node is a real `kvmesh node` process with its own config file; it is
ready once it writes its ready file. Only processes started here are ever
signalled, by their own PID.

`write_mesh` is the one builder of a full mesh on one machine (configs from
`mesh_configs`, one `NodeProcess` per name): `LocalMesh.start` starts every node
and waits until each is ready and sees every peer; `LocalMesh.stop` stops them
all. `wait_for` is the one poll-with-a-deadline loop (tests use it too).

Nodes with client keys want one on their cluster view, stats and event stream too: `client_key_headers`
is the key a lab tool presents (KVMESH_API_KEY's first, which nodes it starts inherit), and
`NodeProcess.key_headers` the one a given node accepts (its config's, else its environment's).
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
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

# What a predicate may raise while a node is still starting, restarting or answering without what is asked.
NOT_YET = (httpx.HTTPError, OSError, KeyError, ValueError)
KEY_ENV = "KVMESH_API_KEY"  # a node's extra client keys (node.config), comma-separated


def client_key_headers(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The client key a lab tool presents: the first of KVMESH_API_KEY's, as `x-api-key` (so an admin call's
    `Authorization` never displaces it); none without one."""
    key = next((k.strip() for k in env.get(KEY_ENV, "").split(",") if k.strip()), None)
    return {"x-api-key": key} if key else {}


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


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago and that this process has not handed out before.

    Peers' addresses must be known before they start, so a port is chosen, not bound. It is drawn
    below the kernel's ephemeral range: a port from bind(0) is one the kernel may hand again to the
    next bind(0) or to any client's outgoing connection before the node binds it (CI lost a mesh
    to exactly that: node c's kv_share port was node a's API port)."""
    import random
    import socket

    low = max(1024, min(_ephemeral_low(), 65536) - 22000)
    high = min(_ephemeral_low(), 65536) - 1
    for _ in range(200):
        port = random.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {low}-{high} after 200 tries")


def pinned(cores: Collection[int] | None) -> list[str]:
    """The command prefix that runs a process on these CPU cores only (`taskset`); none for None.

    The side-by-side benches give each "host" on one machine its own core, so a move between
    two hosts buys real capacity, as it would between two machines."""
    return ["taskset", "-c", ",".join(str(c) for c in sorted(cores))] if cores else []


def merge_config(cfg: dict[str, Any], sections: dict[str, Any]) -> None:
    """Merge config sections into `cfg`: a table's keys are updated one by one, anything else is replaced."""
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values


def mesh_configs(workdir: Path, names: list[str], *, host: str = "127.0.0.1", engine: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, hosts: dict[str, str] | None = None,
                 ports: dict[str, tuple[int, int]] | None = None, overrides: dict[str, dict[str, Any]] | None = None,
                 routes: dict[tuple[str, str], str] | None = None) -> dict[str, Path]:
    """Write one TOML per node of a full mesh (every node lists every other as a peer).

    `extra` is merged into every node's config, then `overrides[name]` into that node's. `ports` fixes a
    node's (api, kv_share) ports (a proxy must know them before the configs exist); `routes[(n, p)]` is
    the kv_share address node n uses for peer p instead of p's own listener (a proxy on that link)."""
    addr = {n: (hosts or {}).get(n, host) for n in names}
    if ports is None:
        ports = {n: (free_port(addr[n]) if not hosts else 8000, free_port(addr[n]) if not hosts else 7000) for n in names}
    out = {}
    for n in names:
        api_port, kv_port = ports[n]
        peers = [{"name": p, "api": f"http://{addr[p]}:{ports[p][0]}",
                  "kvshare": (routes or {}).get((n, p), f"{addr[p]}:{ports[p][1]}")}
                 for p in names if p != n]
        cfg: dict[str, Any] = {"name": n, "api": {"host": addr[n], "port": api_port},
                               "engine": dict(engine or {}),
                               "kvshare": {"listen": f"{addr[n]}:{kv_port}", "store_dir": str(workdir / f"store-{n}")},
                               "mesh": {"peers": peers}}
        merge_config(cfg, extra or {})
        merge_config(cfg, (overrides or {}).get(n, {}))
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

    @property
    def key_headers(self) -> dict[str, str]:
        """A client key this node accepts, as headers: its config's first `api.keys`, else its environment's."""
        try:
            keys = tomllib.loads(self.config.read_text()).get("api", {}).get("keys", [])
        except (OSError, tomllib.TOMLDecodeError):
            keys = []
        if keys:
            return {"x-api-key": str(keys[0])}
        return client_key_headers({**os.environ, **self.env} if self.inherit_env else self.env)

    def start(self) -> NodeProcess:
        self.ready_file.unlink(missing_ok=True)
        cmd = [*self.prefix, sys.executable, "-m", "kvmesh.node.cli", *self.cli_args, "node", "--config", str(self.config),
               "--ready-file", str(self.ready_file)]
        env = {**os.environ, **self.env} if self.inherit_env else dict(self.env)
        with open(self.log_file, "ab") as log:  # the child holds its own copy of the descriptor
            # No start_new_session-style flag asks for PR_SET_PDEATHSIG: only preexec_fn can set it.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509
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

    def terminate(self) -> None:
        """SIGTERM, without waiting; only this process's own PID is signalled."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float = 10.0, *, drain: bool = False) -> None:
        """Wait for the process to exit; SIGKILL it if it has not within `timeout` seconds.

        A node takes SIGTERM as a warm drain (node.shutdown); unless `drain`, a second SIGTERM after
        a moment tells it to exit now (a test's teardown wants the process gone, not its sessions warm)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            p.wait(timeout if drain else min(timeout, 0.5))
            return
        except subprocess.TimeoutExpired:
            if drain:
                p.kill()
                p.wait(5)
                return
        self.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def stop(self, timeout: float = 10.0, *, drain: bool = False) -> None:
        """SIGTERM (twice unless `drain`), then SIGKILL; only this process's own PID (and its session) is signalled."""
        self.terminate()
        self.wait_stopped(timeout, drain=drain)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 15.0, interval: float = 0.05) -> Any:
    """Poll `pred` until it returns something truthy, and return that.

    A predicate that raises one of NOT_YET counts as "not yet". After `timeout` seconds: TimeoutError
    naming `what` (and the last such error), so a failure says what it was waiting for."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except NOT_YET as e:
            last = e
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}"
                               + (f" (last error: {last!r})" if last else "")) from last
        time.sleep(interval)


def wait_peers(nodes: Iterable[NodeProcess], timeout: float = 30.0) -> None:
    """Wait until every node's /v1/cluster lists every node, each reachable and none draining."""
    nodes = list(nodes)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as http:
        for n in nodes:
            def seen(n: NodeProcess = n, key: dict[str, str] = n.key_headers) -> bool:
                hosts = http.get(n.api + "/v1/cluster", headers=key).json()["hosts"]
                return len(hosts) == len(nodes) and all(h["reachable"] and not h["draining"] for h in hosts)

            wait_for(seen, f"{n.name} to see every host reachable and undrained",
                     timeout=max(0.0, deadline - time.monotonic()), interval=0.1)


@dataclass
class LocalMesh:
    """A full mesh of `kvmesh node` processes on this machine, one per name (see `write_mesh`).

    Tests extend it (more fields: secrets, clients, a proxy) and call `start`/`stop` as written here."""

    workdir: Path
    nodes: dict[str, NodeProcess]
    configs: dict[str, dict[str, Any]]  # each node's config as written to its TOML

    @property
    def names(self) -> list[str]:
        return list(self.nodes)

    def api(self, name: str) -> str:
        return self.nodes[name].api

    def start(self, ready_timeout: float = 60.0, peers_timeout: float | None = 30.0, *,
              last: Collection[str] = ()) -> Self:
        """Start every node; return once each is ready and (unless peers_timeout is None) sees every peer.

        Nodes named in `last` start only once every other node is ready (a node that polls its peers
        only when it starts must find them up). On any failure every node is stopped, the nodes' log
        tails go to stderr (a node that fails to start says why there), and the error is raised."""
        stages = ([p for n, p in self.nodes.items() if n not in last], [p for n, p in self.nodes.items() if n in last])
        try:
            for stage in stages:
                for p in stage:
                    p.start()
                for p in stage:
                    p.wait_ready(ready_timeout)
            if peers_timeout is not None:
                wait_peers(self.nodes.values(), peers_timeout)
        except BaseException as e:
            if isinstance(e, Exception):
                print(self.logs(), file=sys.stderr)
            self.stop()
            raise
        return self

    def logs(self, lines: int = 40) -> str:
        return "\n".join(f"--- {n} ---\n{p.tail(lines)}" for n, p in self.nodes.items())

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every node at once (each by its own PID), then wait for each; SIGKILL one that lingers."""
        for p in self.nodes.values():
            p.terminate()
        for p in self.nodes.values():
            try:
                p.wait_stopped(timeout)
            except Exception:  # noqa: BLE001 - stop the others whatever happens to one
                p.kill()


def write_mesh(workdir: Path, names: list[str] | tuple[str, ...], *, engine: dict[str, Any] | None = None,
               extra: dict[str, Any] | None = None, overrides: dict[str, dict[str, Any]] | None = None,
               ports: dict[str, tuple[int, int]] | None = None, routes: dict[tuple[str, str], str] | None = None,
               node: Callable[[str, Path, Path], NodeProcess] = NodeProcess) -> LocalMesh:
    """A full mesh on loopback: configs written by `mesh_configs` (same arguments), processes made, not started.

    `node(name, config_path, workdir)` makes each process (e.g. with an environment or CLI options)."""
    workdir.mkdir(parents=True, exist_ok=True)
    paths = mesh_configs(workdir, list(names), engine=engine, extra=extra, overrides=overrides, ports=ports,
                         routes=routes)
    return LocalMesh(workdir, {n: node(n, p, workdir) for n, p in paths.items()},
                     {n: tomllib.loads(p.read_text()) for n, p in paths.items()})
