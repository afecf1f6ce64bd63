"""deploy/: the systemd unit and Kubernetes manifests, checked offline (no cluster, no systemd here).

Each manifest is checked against the shape of the Kubernetes objects it declares (the fields kvmesh
relies on, with their types: a schema of our own, since no API server or OpenAPI document is here),
and against the node's own contract: readiness on /ready, liveness on /health, a grace period and a
stop timeout longer than the default drain (NodeConfig.drain_timeout_s), the ports init writes.
"""

from __future__ import annotations

import configparser
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.node.config import NodeConfig, load_config
from kvmesh.node.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DRAIN_S = NodeConfig().drain_timeout_s

# (path of keys, type) every object of the kind must have.
SCHEMA: dict[str, list[tuple[tuple[str, ...], type]]] = {
    "Service": [(("metadata", "name"), str), (("spec", "selector"), dict), (("spec", "ports"), list)],
    "ConfigMap": [(("metadata", "name"), str), (("data",), dict)],
    "StatefulSet": [(("metadata", "name"), str), (("spec", "serviceName"), str), (("spec", "replicas"), int),
                    (("spec", "selector", "matchLabels"), dict), (("spec", "template", "metadata", "labels"), dict),
                    (("spec", "template", "spec", "containers"), list),
                    (("spec", "template", "spec", "terminationGracePeriodSeconds"), int)],
}
API_VERSIONS = {"Service": "v1", "ConfigMap": "v1", "StatefulSet": "apps/v1"}


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        assert isinstance(obj, dict) and k in obj, f"missing {'.'.join(path)}"
        obj = obj[k]
    return obj


def _objects() -> list[dict[str, Any]]:
    docs = []
    for f in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def test_manifests_match_the_kinds_they_declare() -> None:
    """Every object has its kind's apiVersion and required fields with the right types; ports are named and numbered."""
    objs = _objects()
    assert {o["kind"] for o in objs} == {"Service", "ConfigMap", "StatefulSet"}
    for o in objs:
        assert o["apiVersion"] == API_VERSIONS[o["kind"]], o["metadata"]
        for path, typ in SCHEMA[o["kind"]]:
            assert isinstance(_get(o, path), typ), (o["metadata"]["name"], path)
        if o["kind"] == "Service":
            for p in o["spec"]["ports"]:
                assert isinstance(p["name"], str) and isinstance(p["port"], int) and 0 < p["port"] < 65536, p


def test_statefulset_follows_the_nodes_contract() -> None:
    """Readiness on /ready, liveness on /health, a grace period covering preStop + the drain, the pod's own config."""
    objs = {(o["kind"], o["metadata"]["name"]): o for o in _objects()}
    sts = objs[("StatefulSet", "kvmesh")]
    headless = objs[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"] == labels
    for svc in (o for (k, _), o in objs.items() if k == "Service"):
        assert svc["spec"]["selector"].items() <= labels.items(), svc["metadata"]["name"]
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"api": 8000, "kvshare": 9000}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "api"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + DRAIN_S + 10
    assert c["command"] == ["kvmesh", "node", "--config", "/etc/kvmesh/node.toml", "--name", "$(POD_NAME)"]
    assert any(e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" for e in c["env"])
    assert c["envFrom"] == [{"secretRef": {"name": "kvmesh-secrets"}}]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["config"] == "/etc/kvmesh"
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert ("ConfigMap", volume["configMap"]["name"]) in objs


def test_the_shared_node_config_loads_as_each_pod_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ConfigMap's node.toml, with the Secret's mesh secret in the environment and the pod's --name, is a valid
    node config: DNS discovery of the headless Service on the API port, listening on the ports the pod exposes."""
    objs = {(o["kind"], o["metadata"]["name"]): o for o in _objects()}
    path = tmp_path / "node.toml"
    path.write_text(objs[("ConfigMap", "kvmesh-config")]["data"]["node.toml"])
    monkeypatch.setenv("KVMESH_MESH_SECRET", "s" * 32)
    cfg = load_config(path, {"name": "kvmesh-0"})
    headless = objs[("Service", "kvmesh")]
    assert cfg.name == "kvmesh-0" and cfg.mesh.discovery == "dns"
    assert cfg.mesh.dns_name.split(".")[0] == headless["metadata"]["name"] and cfg.mesh.dns_port == cfg.api.port == 8000
    assert cfg.kvshare.listen.endswith(":9000") and cfg.drain_timeout_s == DRAIN_S
    monkeypatch.delenv("KVMESH_MESH_SECRET")
    with pytest.raises(ConfigError, match="mesh.secret"):
        load_config(path, {"name": "kvmesh-0"})


def test_systemd_unit_gives_the_drain_its_time() -> None:
    """The unit runs the node with its config, stops it with SIGTERM and waits longer than the drain before SIGKILL."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "kvmesh-node.service")
    svc = unit["Service"]
    assert svc["ExecStart"].split()[1:3] == ["node", "--config"] and svc["ExecStart"].split()[0].endswith("/kvmesh")
    assert svc["KillSignal"] == "SIGTERM" and svc["KillMode"] == "mixed"
    assert int(svc["TimeoutStopSec"]) > DRAIN_S
    assert unit["Install"]["WantedBy"] == "multi-user.target" and "network-online.target" in unit["Unit"]["After"]
