"""Discovered addresses from Kubernetes (`mesh.discovery = "kubernetes"`): a Service's EndpointSlices.

Each round lists the EndpointSlices labelled `kubernetes.io/service-name=<k8s_service>` in
`k8s_namespace` (the pod's own namespace by default) through the official client, and keeps the
endpoints that are ready and not terminating, at the slice's port named `api` (else its first
port). Listing afresh every round, rather than trusting a watch, means a lost DELETE can never
leave a dead pod in the peer set for longer than one interval (production-stack #1091 is a watch
that never re-listed). The client is synchronous; the list runs on a worker thread. Inside a pod
it uses the service account (in-cluster config); `k8s_api` names another API server (a kubeconfig
is used when neither applies). A failed list is None: the peers stay as they are.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from kvmesh.node.config import MeshConfig
from kvmesh.node.errors import ConfigError

log = logging.getLogger("kvmesh.mesh.kubesource")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
Address = tuple[str, int]


def _client(cfg: MeshConfig) -> Any:
    try:
        from kubernetes import client, config  # the official client: only nodes that discover through it need it
    except ImportError:
        raise ConfigError('mesh.discovery "kubernetes" needs the kubernetes package: pip install kubernetes') from None
    if cfg.k8s_api:
        conf = client.Configuration()
        conf.host = cfg.k8s_api
        token = (SA_DIR / "token").read_text().strip() if (SA_DIR / "token").exists() else ""
        if token:
            conf.api_key = {"authorization": "Bearer " + token}
        return client.DiscoveryV1Api(client.ApiClient(conf))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.DiscoveryV1Api()


def addresses(slices: list[dict[str, Any]]) -> set[Address]:
    """The ready, not-terminating endpoints of EndpointSlice objects (as the API's JSON), at their API port."""
    out: set[Address] = set()
    for sl in slices:
        ports = sl.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == "api"), ports[0].get("port") if ports else None)
        if not port:
            continue
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            out |= {(a, int(port)) for a in ep.get("addresses") or []}
    return out


class KubeSource:
    """A Service's ready endpoints, listed every round."""

    def __init__(self, cfg: MeshConfig) -> None:
        self.cfg = cfg
        ns_file = SA_DIR / "namespace"
        self.namespace = cfg.k8s_namespace or (ns_file.read_text().strip() if ns_file.exists() else "default")
        self.api = _client(cfg)

    @property
    def what(self) -> str:
        return f"service {self.namespace}/{self.cfg.k8s_service}"

    def _list(self) -> list[dict[str, Any]]:
        resp = self.api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.cfg.k8s_service}", _request_timeout=5)
        return [self.api.api_client.sanitize_for_serialization(item) for item in resp.items]

    async def resolve(self) -> set[Address] | None:
        try:
            return addresses(await asyncio.to_thread(self._list))
        except Exception as e:  # noqa: BLE001 - the API server's errors, transport errors: keep the peers
            log.warning("discovery: listing %s failed (%s: %s); keeping the peers as they are", self.what,
                        type(e).__name__, str(e)[:200])
            return None
