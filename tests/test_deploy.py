"""deploy/: the systemd unit, Kubernetes manifests and Grafana dashboard, checked offline (no cluster, systemd or
Grafana here).

Each manifest is checked against the shape of the Kubernetes objects it declares (the fields kvmesh
relies on, with their types: a schema of our own, since no API server or OpenAPI document is here),
and against the node's own contract: readiness on /ready, liveness on /health, a grace period and a
stop timeout longer than the default drain (NodeConfig.drain_timeout_s), the ports init writes. Every PromQL query of
the dashboard names only metrics a real node exports: a sim node serves a few turns in-process and its /metrics is
scraped.
"""

from __future__ import annotations

import configparser
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig, load_config
from kvmesh.node.errors import ConfigError
from kvmesh.node.lab.inprocess import serve_in_thread

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


DASHBOARD = DEPLOY / "grafana" / "kvmesh.json"
# PromQL words that are neither metrics nor functions (a function is a word followed by "(").
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
# What an operator needs to see, each by the metric that shows it.
COVERED = {"handoffs": "kvmesh_handoffs_total", "shortfall": "kvmesh_handoff_shortfall_total", "ttft": "kvmesh_ttft_seconds_bucket",
           "overload refusals": "kvmesh_turns_refused_overloaded_total", "replica refusals": "kvmesh_replicas_refused_total",
           "queue": "kvmesh_queue_depth", "slots": "kvmesh_slots_busy", "link throughput": "kvmesh_kvshare_bytes_total",
           "store": "kvmesh_replica_store_bytes", "KV pool": "kvmesh_kv_cache_used_bytes"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges, grouping
    clauses, function names and keywords are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group() not in PROMQL_WORDS and not e[m.end():].lstrip().startswith("("):
            names.add(m.group())
    return names


def test_metric_names_sees_what_it_should() -> None:
    """The PromQL reader finds the metrics and skips functions, labels, grouping, ranges and variables."""
    expr = 'histogram_quantile(0.99, sum by (le, instance) (rate(a_bucket{x=~"$y", z!="w"}[$__rate_interval]))) / b * 8'
    assert metric_names(expr) == {"a_bucket", "b"}
    assert metric_names('sum(increase(c_total{cls="warm"}[$__range])) / sum without (d) (c_total) > bool 0') == {"c_total"}


def _queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and the templating queries (label_values reads its first argument)."""
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", v["definition"])
            assert m, v["definition"]
            out.append((f"variable {v['name']}", m.group(1)))
    return out


@pytest.fixture(scope="module")
def exported() -> Iterator[tuple[set[str], dict[str, str]]]:
    """A sim node in-process after two turns: the sample names its /metrics shows, and each family's type."""
    cfg = NodeConfig(name="dash", engine=EngineConfig(kind="sim", cache_bytes=64 << 20, slots=2,
                                                      sim=SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6)))
    srv = serve_in_thread(cfg)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            messages = [{"role": "user", "content": "Which files would you read first?"}]
            for _ in range(2):
                r = c.post("/v1/chat/completions", headers={"X-Session-Id": "dash-1"},
                           json={"model": srv.model, "messages": messages, "max_tokens": 8})
                assert r.status_code == 200, r.text
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
            text = c.get("/metrics").text
    finally:
        srv.stop()
    samples = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    yield samples, types


def _exported(name: str, samples: set[str], types: dict[str, str]) -> bool:
    """Whether a node exports `name`: as a sample, as a family (a labelled one before its first sample), or as a
    histogram's or summary's _bucket, _sum or _count series."""
    if name in samples or types.get(name) in ("counter", "gauge"):
        return True
    for suffix, kinds in (("_bucket", ("histogram",)), ("_sum", ("histogram", "summary")), ("_count", ("histogram", "summary"))):
        if name.endswith(suffix) and types.get(name[: -len(suffix)]) in kinds:
            return True
    return False


def test_dashboard_queries_name_metrics_the_node_exports(exported: tuple[set[str], dict[str, str]]) -> None:
    """Every PromQL query of deploy/grafana/kvmesh.json reads metrics a real sim node's /metrics exports."""
    samples, types = exported
    assert "kvmesh_turns_total" in samples and types["kvmesh_ttft_seconds"] == "histogram"
    dash = json.loads(DASHBOARD.read_text())
    queries = _queries(dash)
    assert len(queries) >= 10
    unknown = []
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown += [f"{where}: {n}" for n in sorted(names) if not _exported(n, samples, types)]
    assert not unknown, "the dashboard reads metrics no node exports:\n" + "\n".join(unknown)
    read = {n for _, expr in queries for n in metric_names(expr)}
    assert not {what for what, n in COVERED.items() if n not in read}, "the dashboard leaves out what an operator needs"


def test_dashboard_is_one_importable_grafana_dashboard() -> None:
    """The JSON is a dashboard Grafana imports: a data source input and variable, unique panel ids, every panel on
    the 24-column grid, every target with a refId and a query on the chosen data source."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dash["templating"]["list"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
