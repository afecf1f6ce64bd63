"""Peers from DNS: a real DNS server on loopback (dnslib) whose records change while real nodes run.

The nodes list no static peers; `mesh.discovery = "dns"` points them at a name whose A records are the
hosts (a Kubernetes headless Service's shape: one address per pod, the API on the same port), here
127.0.0.1-3 on one port. A host in DNS that cannot prove it holds the mesh secret is never admitted.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord, SRV
from dnslib.server import BaseResolver, DNSServer
from support.conversation import Conversation

from kvmesh.node.config import MeshConfig
from kvmesh.node.lab.launcher import LocalMesh, NodeProcess, free_port, mesh_configs, wait_for
from kvmesh.node.mesh.discovery import DnsSource

NAME = "kvmesh.test."
SECRET = "msk-" + "d1" * 16
HOSTS = {"a": "127.0.0.1", "b": "127.0.0.2", "c": "127.0.0.3"}
IMPOSTOR = "127.0.0.9"


class Zone(BaseResolver):  # type: ignore[misc]
    """An authoritative zone whose records the test edits: name -> [(qtype, rdata)]."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, Any]]] = {}
        self.lock = threading.Lock()

    def set(self, name: str, records: list[tuple[str, Any]]) -> None:
        with self.lock:
            self.records[name] = records

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        qname, qtype = str(request.q.qname), QTYPE[request.q.qtype]
        with self.lock:
            found = self.records.get(qname)
        if found is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for t, rdata in found:
            if t == qtype:
                reply.add_answer(RR(qname, getattr(QTYPE, t), rdata=rdata, ttl=1))
        return reply


@pytest.fixture
def dns() -> Iterator[tuple[Zone, str]]:
    zone = Zone()
    port = free_port()
    server = DNSServer(zone, address="127.0.0.1", port=port)
    server.start_thread()
    try:
        yield zone, f"127.0.0.1:{port}"
    finally:
        server.stop()


def _a(*names: str) -> list[tuple[str, Any]]:
    return [("A", A(HOSTS.get(n, n))) for n in names]


def _reply_json(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    """A fake server's whole JSON answer."""
    h.send_response(status)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


class _Impostor(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        _reply_json(self, 200, json.dumps({"name": "evil", "api_port": self.server.server_address[1], "kvshare_port": 1,
                                           "scheme": "http", "mac": "00" * 32}).encode())

    def log_message(self, *args: Any) -> None:
        pass


def _peers(m: LocalMesh, node: str) -> set[str]:
    return {h["name"] for h in httpx.get(m.api(node) + "/v1/cluster", timeout=5).json()["hosts"]} - {node}


def test_peers_come_and_go_with_dns(tmp_path: Path, dns: tuple[Zone, str]) -> None:
    """Hosts in the name's records are admitted after a signed hello and forwarded to; an impostor in DNS is
    not; a host added later joins every node's peer set; a host removed from DNS leaves it."""
    zone, server = dns
    api_port = free_port()
    ports = {n: (api_port, free_port(h)) for n, h in HOSTS.items()}
    mesh_cfg = {"peers": [], "secret": SECRET, "discovery": "dns", "dns_name": NAME, "dns_server": server,
                "discovery_interval_s": 0.3, "poll_interval_s": 0.2, "stale_after_s": 1.5}
    impostor = ThreadingHTTPServer((IMPOSTOR, api_port), _Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    zone.set(NAME, _a("a", "b", IMPOSTOR))
    paths = mesh_configs(tmp_path, list(HOSTS), hosts=HOSTS, ports=ports,
                         engine={"kind": "sim", "slots": 2, "cache_bytes": 64 << 20, "sim": {"kv_scale": 0.02}},
                         extra={"mesh": mesh_cfg, "kvshare": {"replicate_min_tokens": 1024, "fsync": "never"}})
    m = LocalMesh(tmp_path, {n: NodeProcess(n, p, tmp_path) for n, p in paths.items()}, {})
    try:
        m.start(peers_timeout=None)
        wait_for(lambda: _peers(m, "a") == {"b"} and _peers(m, "b") == {"a"}, "a and b to find each other")
        wait_for(lambda: _peers(m, "c") == {"a", "b"}, "c (not listed itself) to find a and b, and not the impostor")
        # A session homed on a, entered at c: forwarded to the discovered peer, and its cache reused there.
        conv = Conversation("dns-1", chars=3000)
        client = httpx.Client(timeout=60)

        def turn(entry: str) -> httpx.Response:
            r = client.post(m.api(entry) + "/v1/chat/completions", headers={"X-Session-Id": conv.session},
                            json={"model": "kvmesh-sim", "messages": conv.messages, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            conv.grow(r.json()["choices"][0]["message"]["content"] or "")
            return r

        home = turn("a").headers["x-kvmesh-host"]
        wait_for(lambda: (next((s for s in httpx.get(m.api("c") + "/v1/cluster").json()["sessions"]
                                if s["session"] == conv.session), {}) or {}).get("home") == home, "c to see the home")
        again = turn("c")
        assert again.headers["x-kvmesh-host"] == home and int(again.headers["x-kvmesh-cached-tokens"]) > 0
        # c joins the records: a and b admit it.
        zone.set(NAME, _a("a", "b", "c", IMPOSTOR))
        wait_for(lambda: _peers(m, "a") == {"b", "c"} and _peers(m, "b") == {"a", "c"}, "a and b to admit c")
        # b leaves the records: after two resolutions without it, a and c drop it.
        zone.set(NAME, _a("a", "c", IMPOSTOR))
        wait_for(lambda: _peers(m, "a") == {"c"} and _peers(m, "c") == {"a"}, "a and c to drop b")
        logs = (tmp_path / "a.log").read_text()
        assert "not admitted" in logs and "admitted b" in logs
    finally:
        m.stop()
        impostor.shutdown()


def test_srv_records_give_hosts_and_ports(dns: tuple[Zone, str]) -> None:
    """A name starting with "_" is read as SRV: each record's target and port; a failed lookup is None, not empty."""
    zone, server = dns
    zone.set("_api._tcp.kvmesh.test.", [("SRV", SRV(priority=0, weight=1, port=8101, target="n1.test.")),
                                         ("SRV", SRV(priority=0, weight=1, port=8102, target="n2.test."))])
    cfg = MeshConfig(discovery="dns", dns_name="_api._tcp.kvmesh.test.", dns_server=server, secret=SECRET)
    assert asyncio.run(DnsSource(cfg, lambda: 8000).resolve()) == {("n1.test", 8101), ("n2.test", 8102)}
    gone = MeshConfig(discovery="dns", dns_name="_none._tcp.kvmesh.test.", dns_server=server, secret=SECRET)
    assert asyncio.run(DnsSource(gone, lambda: 8000).resolve()) == set()
    dead = MeshConfig(discovery="dns", dns_name=NAME, dns_server=f"127.0.0.1:{free_port()}", secret=SECRET)
    assert asyncio.run(DnsSource(dead, lambda: 8000).resolve()) is None


FIXTURE = Path(__file__).parent / "fixtures" / "endpointslices.json"


class _FakeApi(BaseHTTPRequestHandler):
    """A Kubernetes API server that answers the EndpointSlice list with a recorded response (or fails)."""

    seen: list[str] = []
    fail = False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append(self.path)
        if type(self).fail or not self.path.startswith("/apis/discovery.k8s.io/v1/namespaces/ns1/endpointslices"):
            _reply_json(self, 500 if type(self).fail else 404, b'{"kind":"Status","status":"Failure","code":500}')
            return
        _reply_json(self, 200, FIXTURE.read_bytes())

    def log_message(self, *args: Any) -> None:
        pass


def test_kubernetes_endpointslices_give_ready_pods_at_the_api_port() -> None:
    """Against a recorded EndpointSlice list (no cluster here): ready, non-terminating endpoints of every slice of the
    Service, IPv4 and IPv6, at the port named api; the list asks by the service-name label; a failed list is None."""
    from kvmesh.node.mesh.kubesource import KubeSource

    api = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    try:
        cfg = MeshConfig(discovery="kubernetes", k8s_service="kvmesh", k8s_namespace="ns1", secret=SECRET,
                         k8s_api=f"http://127.0.0.1:{api.server_address[1]}")
        src = KubeSource(cfg)
        assert asyncio.run(src.resolve()) == {("10.244.1.17", 8000), ("10.244.2.9", 8000), ("fd00:10:244::5", 8000)}
        assert any("labelSelector=kubernetes.io/service-name=kvmesh" in unquote(p) for p in _FakeApi.seen), _FakeApi.seen
        _FakeApi.fail = True
        assert asyncio.run(src.resolve()) is None
    finally:
        _FakeApi.fail = False
        api.shutdown()
