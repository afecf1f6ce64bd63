"""A mesh with client keys: its cluster view wants the key, and `?scope=mesh` still fans in over every host, whether
the peers accept each other's peer token (a mesh secret) or only the client's key, passed on (no mesh secret).

Two sim node processes with `directory_after_hosts = 1`, so each one's own view is partial and the fan-in is what
makes it whole; `LocalMesh.start` itself reads the keyed views (node.lab.launcher.wait_peers).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.node.lab.launcher import LocalMesh, wait_for, write_mesh

KEY = "sk-kvmesh-mesh-" + secrets.token_hex(8)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(params=["secret", "no-secret"])
def keyed_mesh(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalMesh]:
    mesh: dict[str, object] = {"directory_after_hosts": 1, "poll_interval_s": 0.2}
    if request.param == "secret":
        mesh["secret"] = "msk-" + secrets.token_hex(16)
    m = write_mesh(tmp_path, ["a", "b"], engine={"kind": "sim", "slots": 2, "cache_bytes": 16 << 20,
                                                 "sim": {"kv_scale": 0.02, "decode_tps": 2000.0}},
                   extra={"api": {"keys": [KEY]}, "mesh": mesh, "kvshare": {"fsync": "never"}})
    m.start()
    try:
        yield m
    finally:
        m.stop()


def _turn(http: httpx.Client, api: str, session: str) -> None:
    body = {"model": "kvmesh-sim", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"hello from {session}"}]}
    r = http.post(api + "/v1/chat/completions", json=body, headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text


def test_the_mesh_wide_view_fans_in_with_the_callers_key(keyed_mesh: LocalMesh) -> None:
    """Without the key ?scope=mesh is 401; with it the view is whole (every host answered) and lists every session."""
    a = keyed_mesh.api("a")
    assert httpx.get(a + "/v1/cluster", params={"scope": "mesh"}, timeout=10).status_code == 401
    with httpx.Client(timeout=30, headers=AUTH) as http:
        own = http.get(a + "/v1/cluster").json()
        assert own["scope"] == "partial", own["note"]
        sessions = {f"keyed-{i}" for i in range(6)}
        for i, s in enumerate(sorted(sessions)):
            _turn(http, keyed_mesh.api("ab"[i % 2]), s)

        def whole() -> bool | str:
            view = http.get(a + "/v1/cluster", params={"scope": "mesh"}).json()
            if view["scope"] != "mesh":
                return False  # a note naming the host that did not answer, e.g. "b (HTTP 401)"
            return sessions <= {s["session"] for s in view["sessions"]}

        wait_for(whole, "a's mesh-wide view to list every session, whole", timeout=20)
