"""Run one kvmesh node inside each host of a `TwoHostLab`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvmesh.node.lab.launcher import NodeProcess, write_toml
from kvmesh.node.lab.netlab.netns import TwoHostLab

API_PORT, KV_PORT = 8000, 7000
LAB_SECRET = "kvmesh-netlab-mesh-secret-0001"  # the lab's own namespaces only


def lab_nodes(lab: TwoHostLab, work: Path, *, engine: dict[str, Any], extra: dict[str, Any] | None = None,
              pins: list[list[str]] | None = None) -> list[NodeProcess]:
    """Write configs and start (not wait for) one node per lab host.

    API on all of the host's interfaces (the driver reaches it over the management
    link, peers over the data link); kv_share on the data link only. `pins[i]`: a command
    prefix run inside host i's namespace (e.g. `taskset -c 0`)."""
    nodes: list[NodeProcess] = []
    for h in lab.hosts:
        peers = [{"name": p.name, "api": f"http://{p.data_ip}:{API_PORT}", "kvshare": f"{p.data_ip}:{KV_PORT}"}
                 for p in lab.hosts if p is not h]
        cfg: dict[str, Any] = {
            "name": h.name,
            "api": {"host": "0.0.0.0", "port": API_PORT},
            "engine": dict(engine),
            "kvshare": {"listen": f"{h.data_ip}:{KV_PORT}", "store_dir": str(work / f"store-{h.name}")},
            "mesh": {"peers": peers, "secret": LAB_SECRET},
        }
        for section, values in (extra or {}).items():
            if isinstance(values, dict):
                cfg.setdefault(section, {}).update(values)
            else:
                cfg[section] = values
        path = work / f"{h.name}.toml"
        write_toml(path, cfg)
        pin = pins[len(nodes)] if pins else []
        nodes.append(NodeProcess(h.name, path, work, prefix=[*h.exec_prefix(), *pin]).start())
    return nodes


def lab_api(lab: TwoHostLab, name: str) -> str:
    h = next(h for h in lab.hosts if h.name == name)
    return f"http://{h.mgmt_ip}:{API_PORT}"
