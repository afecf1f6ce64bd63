"""Admin routes need the admin token; peer routes the mesh secret (current or previous); a forwarded
turn is only trusted with peer auth. Runs on the shared two-process mesh (`mesh` fixture).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

from .helpers import Mesh, chat, openai_error


def _bad_admin_headers(m: Mesh) -> dict[str, dict[str, str]]:
    t = m.admin_token
    return {
        "missing": {},
        "wrong": {"Authorization": "Bearer wrong-admin-token-000000"},
        "bare-scheme": {"Authorization": "Bearer"},
        "token-plus-char": {"Authorization": f"Bearer {t}x"},
        "token-minus-char": {"Authorization": f"Bearer {t[:-1]}"},
        "no-scheme": {"Authorization": t},
        "basic-scheme": {"Authorization": f"Basic {t}"},
        "mesh-secret": {"Authorization": f"Bearer {m.secret}"},
        "peer-token": {"Authorization": f"Bearer {m.peer_token}"},
        "peer-header-only": {PEER_HEADER: m.peer_token},
    }


def _bad_peer_headers(m: Mesh) -> dict[str, dict[str, str]]:
    return {
        "missing": {},
        "wrong": {PEER_HEADER: peer_token(b"not-the-mesh-secret-at-all")},
        "empty": {PEER_HEADER: ""},
        "raw-secret": {PEER_HEADER: m.secret},
        "raw-previous-secret": {PEER_HEADER: m.previous_secret},
        "upper-case-token": {PEER_HEADER: m.peer_token.upper()},
        "truncated-token": {PEER_HEADER: m.peer_token[:-1]},
        "admin-token": {PEER_HEADER: m.admin_token},
        "admin-bearer-only": {"Authorization": f"Bearer {m.admin_token}"},
    }


def _good_peer_headers(m: Mesh) -> dict[str, dict[str, str]]:
    return {"current": {PEER_HEADER: m.peer_token}, "previous": {PEER_HEADER: m.previous_peer_token}}


def _status(m: Mesh, name: str) -> str:
    return str(m.http.get(m.api(name) + "/health").json()["status"])


@contextmanager
def undrained_after(m: Mesh) -> Iterator[None]:
    """Whatever the test drains, both hosts are undrained (and seen so by each other) afterwards."""
    try:
        yield
    finally:
        for n in m.nodes:
            m.http.post(m.api(n) + f"/v1/admin/hosts/{n}/undrain", headers=m.admin_headers())
        m.wait_reachable()


def _unauthorized(r: httpx.Response, presented: dict[str, str]) -> None:
    err = openai_error(r, 401)
    assert err["type"] == "authentication_error", err
    for v in presented.values():  # the credential presented is never echoed back
        if len(v) >= 8:
            assert v not in r.text and v.split(" ", 1)[-1] not in r.text, r.text


ADMIN_ROUTES = [
    ("/v1/admin/hosts/a/drain", None),
    ("/v1/admin/hosts/a/undrain", None),
    ("/v1/admin/hosts/b/drain", None),
    ("/v1/admin/sessions/auth-admin-1/migrate", {"target": "b"}),
    ("/v1/admin/sessions/auth-admin-1/replicate", None),
]


def test_admin_routes_refuse_missing_and_wrong_tokens_and_change_nothing(mesh: Mesh) -> None:
    """drain/undrain/migrate/replicate without the admin token, or with a wrong one: 401, and no host drains."""
    with undrained_after(mesh):
        for route, body in ADMIN_ROUTES:
            for what, headers in _bad_admin_headers(mesh).items():
                r = mesh.http.post(mesh.api("a") + route, headers=headers, json=body)
                assert r.status_code == 401, (route, what, r.status_code, r.text)
                _unauthorized(r, headers)
        assert _status(mesh, "a") == "ok" and _status(mesh, "b") == "ok"


def test_admin_routes_with_the_admin_token_are_not_refused(mesh: Mesh) -> None:
    """With the admin token: drain and undrain (here and relayed to b) answer 200; migrate and replicate 200 or a non-401 4xx."""
    good = mesh.admin_headers()
    with undrained_after(mesh):
        for host in ("a", "b"):
            r = mesh.http.post(mesh.api("a") + f"/v1/admin/hosts/{host}/drain", headers=good)
            assert r.status_code == 200 and r.json()["ok"], (host, r.text)
            assert _status(mesh, host) == "draining"
            r = mesh.http.post(mesh.api("a") + f"/v1/admin/hosts/{host}/undrain", headers=good)
            assert r.status_code == 200 and r.json()["ok"], (host, r.text)
            assert _status(mesh, host) == "ok"
        for route, body in ADMIN_ROUTES[3:]:
            r = mesh.http.post(mesh.api("a") + route, headers=good, json=body)
            assert r.status_code == 200 or (400 <= r.status_code < 500 and r.status_code != 401), (route, r.status_code, r.text)


PEER_ROUTES = [("GET", "/v1/peer/status"), ("POST", "/v1/peer/drain"), ("POST", "/v1/peer/sessions/auth-peer-1/adopt")]


def test_peer_routes_refuse_missing_and_wrong_mesh_auth(mesh: Mesh) -> None:
    """Peer status, drain and adopt without the peer token, or with a wrong, raw, truncated or admin one: 401; nothing drains."""
    with undrained_after(mesh):
        for method, route in PEER_ROUTES:
            for what, headers in _bad_peer_headers(mesh).items():
                r = mesh.http.request(method, mesh.api("a") + route, headers=headers)
                assert r.status_code == 401, (route, what, r.status_code, r.text)
                _unauthorized(r, headers)
        assert _status(mesh, "a") == "ok"
        sessions = mesh.http.get(mesh.api("a") + "/v1/cluster").json()["sessions"]
        assert not any(s["session"] == "auth-peer-1" for s in sessions), sessions


@pytest.mark.parametrize("which", ["current", "previous"])
def test_peer_routes_accept_the_current_and_the_previous_mesh_secret(mesh: Mesh, which: str) -> None:
    """Peer status, drain (then undrain) and adopt with the peer token of the current or the previous secret: 200."""
    headers = _good_peer_headers(mesh)[which]
    with undrained_after(mesh):
        for method, route in PEER_ROUTES:
            r = mesh.http.request(method, mesh.api("a") + route, headers=headers)
            assert r.status_code == 200, (which, route, r.status_code, r.text)
        assert _status(mesh, "a") == "draining"
        r = mesh.http.post(mesh.api("a") + "/v1/peer/undrain", headers=headers)
        assert r.status_code == 200 and _status(mesh, "a") == "ok"


def test_forwarded_turns_without_valid_peer_auth_are_placed_normally(mesh: Mesh) -> None:
    """X-Kvmesh-Forwarded: 1 without (or with a wrong) peer token is placed like any turn (a drained entry sends it on); with the current or previous token it runs here."""
    a = mesh.api("a")
    with undrained_after(mesh):
        r = mesh.http.post(a + "/v1/admin/hosts/a/drain", headers=mesh.admin_headers())
        assert r.status_code == 200
        wait_for(lambda: any(h["name"] == "a" and h["draining"]
                             for h in mesh.http.get(mesh.api("b") + "/v1/cluster").json()["hosts"]), "b to see a draining")
        cases = {
            "no-auth": ({"X-Kvmesh-Forwarded": "1"}, "b"),
            "wrong-auth": ({"X-Kvmesh-Forwarded": "1", PEER_HEADER: peer_token(b"an-attacker-guess-0000")}, "b"),
            "raw-secret": ({"X-Kvmesh-Forwarded": "1", PEER_HEADER: mesh.secret}, "b"),
            "no-auth-prev-host": ({"X-Kvmesh-Forwarded": "1", "X-Kvmesh-Prev-Host": "a"}, "b"),
            "previous-secret": ({"X-Kvmesh-Forwarded": "1", PEER_HEADER: mesh.previous_peer_token}, "a"),
            "current-secret": ({"X-Kvmesh-Forwarded": "1", PEER_HEADER: mesh.peer_token}, "a"),
        }
        for what, (headers, served_by) in cases.items():
            r = mesh.http.post(a + "/v1/chat/completions", headers={"X-Session-Id": f"auth-fwd-{what}", **headers},
                               json=chat())
            assert r.status_code == 200, (what, r.text)
            assert r.headers["x-kvmesh-host"] == served_by, (what, dict(r.headers))
