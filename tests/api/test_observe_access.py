"""Who may read the observer routes: the cluster view, stats and the `/v1/events` websocket want the client API key
(or the mesh's peer token) when keys are set; /health, /ready and /metrics stay open for probes and scrapers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from kvmesh.node.config import ApiConfig, EngineConfig, MeshConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

KEY = "sk-kvmesh-observe-0123456789"
SECRET = "msk-observe-test-secret-0123456789"
SIM = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6)
WRONG = {"x-api-key": "sk-wrong-but-secret-123"}


@pytest.fixture(scope="module")
def keyed() -> Iterator[ThreadedServer]:
    """A sim node with one client key and a mesh secret (so its peer token is accepted too)."""
    srv = serve_in_thread(NodeConfig(name="observe-keyed", api=ApiConfig(keys=[KEY]),
                                     engine=EngineConfig(kind="sim", cache_bytes=64 << 20, slots=2, sim=SIM),
                                     mesh=MeshConfig(secret=SECRET)))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def open_node() -> Iterator[ThreadedServer]:
    """A sim node with no client key: everything answers, as before keys."""
    srv = serve_in_thread(NodeConfig(name="observe-open", engine=EngineConfig(kind="sim", cache_bytes=64 << 20,
                                                                              slots=2, sim=SIM)))
    try:
        yield srv
    finally:
        srv.stop()


def _ws(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/events"


def _first_event(url: str, headers: dict[str, str]) -> dict[str, object]:
    with connect(_ws(url), additional_headers=headers, open_timeout=10, max_size=None) as ws:
        return dict(json.loads(ws.recv(timeout=10)))


def test_cluster_and_stats_want_a_key(keyed: ThreadedServer) -> None:
    """Without a key, or with a wrong one, /v1/cluster (either scope) and /v1/stats are 401 in OpenAI's shape, the key unechoed."""
    for headers in ({}, WRONG, {"Authorization": "Bearer sk-wrong-but-secret-123"}, {PEER_HEADER: peer_token(b"x" * 16)}):
        for path in ("/v1/cluster", "/v1/cluster?scope=mesh", "/v1/stats"):
            r = httpx.get(keyed.url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["message"], r.text
            assert "sk-wrong-but-secret-123" not in r.text


def test_cluster_and_stats_answer_with_the_key_or_the_peer_token(keyed: ThreadedServer) -> None:
    """The key as Bearer or x-api-key, or the mesh's peer token, reads the cluster view and the stats."""
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {PEER_HEADER: peer_token(SECRET.encode())}):
        r = httpx.get(keyed.url + "/v1/cluster", headers=headers, timeout=10)
        assert r.status_code == 200 and [h["name"] for h in r.json()["hosts"]] == ["observe-keyed"], r.text
        r = httpx.get(keyed.url + "/v1/stats", headers=headers, timeout=10)
        assert r.status_code == 200 and "engine" in r.json(), r.text


def test_events_websocket_is_refused_without_the_key(keyed: ThreadedServer) -> None:
    """The /v1/events handshake without a key, or with a wrong one, is refused with HTTP 401 and OpenAI's error body."""
    for headers in ({}, WRONG):
        with pytest.raises(InvalidStatus) as ei:
            _first_event(keyed.url, headers)
        resp = ei.value.response
        assert resp.status_code == 401, resp
        err = json.loads(bytes(resp.body or b""))["error"]
        assert err["type"] == "authentication_error" and "key" in err["message"], err
        assert "sk-wrong-but-secret-123" not in bytes(resp.body or b"").decode()


def test_events_websocket_streams_the_snapshot_with_the_key(keyed: ThreadedServer) -> None:
    """With the key (Bearer or x-api-key) or the peer token, /v1/events opens with the node's cluster view."""
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {PEER_HEADER: peer_token(SECRET.encode())}):
        first = _first_event(keyed.url, headers)
        assert first["type"] == "snapshot" and first["node"] == "observe-keyed", first


def test_probes_and_metrics_stay_open_on_a_keyed_node(keyed: ThreadedServer) -> None:
    """/health, /ready and /metrics answer without a key, and /metrics names no session."""
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
    assert httpx.get(keyed.url + "/ready", timeout=10).status_code == 200
    r = httpx.get(keyed.url + "/metrics", timeout=10)
    assert r.status_code == 200 and "kvmesh_turns" in r.text


def test_a_node_without_keys_keeps_its_observer_routes_open(open_node: ThreadedServer) -> None:
    """With no key configured, /v1/cluster, /v1/stats and /v1/events answer anyone (a loopback node, as before)."""
    assert httpx.get(open_node.url + "/v1/cluster", timeout=10).status_code == 200
    assert httpx.get(open_node.url + "/v1/stats", timeout=10).status_code == 200
    assert _first_event(open_node.url, {})["type"] == "snapshot"
