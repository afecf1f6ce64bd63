"""node.lab.launcher: the one local-mesh builder (configs, start, stop) and the one poll-with-a-deadline."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvmesh.node.lab.launcher import (
    NodeProcess,
    free_port,
    mesh_configs,
    wait_for,
    write_mesh,
)


def test_mesh_configs_apply_fixed_ports_routes_and_per_node_overrides(tmp_path: Path) -> None:
    """Fixed ports are used, a routed link names its address, and an override changes only its own node."""
    names = ["a", "b", "c"]
    ports = {n: (free_port(), free_port()) for n in names}
    paths = mesh_configs(tmp_path, names, ports=ports, routes={("a", "b"): "127.0.0.1:9"},
                         engine={"kind": "sim", "slots": 2}, extra={"mesh": {"poll_interval_s": 0.2}},
                         overrides={"b": {"engine": {"slots": 3}}})
    cfg = {n: tomllib.loads(p.read_text()) for n, p in paths.items()}
    for n in names:
        assert cfg[n]["api"]["port"] == ports[n][0] and cfg[n]["kvshare"]["listen"] == f"127.0.0.1:{ports[n][1]}"
        assert cfg[n]["mesh"]["poll_interval_s"] == 0.2 and len(cfg[n]["mesh"]["peers"]) == 2
    peer = {(n, p["name"]): p for n in names for p in cfg[n]["mesh"]["peers"]}
    assert peer[("a", "b")]["kvshare"] == "127.0.0.1:9"  # a reaches b's kv_share through the route
    assert peer[("c", "b")]["kvshare"] == f"127.0.0.1:{ports['b'][1]}"  # everyone else directly
    assert peer[("a", "b")]["api"] == f"http://127.0.0.1:{ports['b'][0]}"
    assert [cfg[n]["engine"]["slots"] for n in names] == [2, 3, 2]
    assert cfg["b"]["engine"]["kind"] == "sim"


def test_wait_for_retries_a_node_not_answering_yet_and_returns_the_value() -> None:
    """A predicate that raises a not-yet error is retried; the first truthy value is returned."""
    calls: list[int] = []

    def pred() -> str | None:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionRefusedError("not listening yet")
        return "ready" if len(calls) >= 3 else None

    assert wait_for(pred, "the node", timeout=5, interval=0.001) == "ready"
    assert len(calls) == 3


def test_wait_for_times_out_naming_what_it_waited_for_and_the_last_error() -> None:
    """After the deadline, TimeoutError names what was awaited and the last error the predicate raised."""
    def pred() -> bool:
        raise KeyError("hosts")

    with pytest.raises(TimeoutError, match=r"waiting for every host to appear \(last error: KeyError\('hosts'\)\)"):
        wait_for(pred, "every host to appear", timeout=0.05, interval=0.01)


def test_a_mesh_that_fails_to_start_stops_the_nodes_it_started(tmp_path: Path) -> None:
    """When one node cannot start, start() raises and no node of the mesh is left running."""
    mesh = write_mesh(tmp_path, ["good", "bad"], engine={"kind": "sim", "cache_bytes": 16 << 20},
                      overrides={"bad": {"engine": {"kind": "no-such-engine"}}})
    with pytest.raises(RuntimeError, match="node bad exited"):
        mesh.start(ready_timeout=60)
    for name, p in mesh.nodes.items():
        assert p.proc is not None and p.proc.poll() is not None, f"{name} still runs"


def test_nodes_named_last_start_once_the_others_are_ready(tmp_path: Path) -> None:
    """A node named in `last` is started only after every other node has written its ready file."""
    early_ready_at_start: dict[str, bool] = {}

    class Recording(NodeProcess):
        def start(self) -> NodeProcess:
            early_ready_at_start[self.name] = (tmp_path / "early.ready.json").exists()
            return super().start()

    mesh = write_mesh(tmp_path, ["late", "early"], engine={"kind": "sim", "cache_bytes": 16 << 20}, node=Recording)
    mesh.start(last=["late"])
    mesh.stop()
    assert early_ready_at_start == {"early": False, "late": True}


def test_free_port_never_repeats_and_stays_out_of_the_ephemeral_range() -> None:
    """Ports handed out are distinct, bindable and below the kernel's ephemeral range (where clients' own ports come from)."""
    import socket

    from kvmesh.node.lab.launcher import _ephemeral_low

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
