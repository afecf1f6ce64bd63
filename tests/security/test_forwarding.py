"""Forward only to configured peers: no header, Host trick, body field or admin/peer argument makes a
node connect to an address of the client's choosing. An "attacker" listener counts every connection
it gets; the turns are served by configured hosts only. Runs on the shared two-process mesh.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvmesh.node.lab.launcher import wait_for

from .helpers import Mesh, chat
from .test_auth import undrained_after


class Attacker:
    """A TCP listener on loopback that records every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        host, port = self.sock.getsockname()[:2]
        self.addr = f"{host}:{port}"
        self.connections: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attacker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(0.5)
                try:
                    self.connections.append(conn.recv(4096))
                except OSError:
                    self.connections.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    try:
        yield a
    finally:
        a.close()


def _header_attacks(att: str) -> dict[str, dict[str, str]]:
    return {
        "prev-host": {"X-Kvmesh-Prev-Host": att},
        "prev-host-url": {"X-Kvmesh-Prev-Host": f"http://{att}"},
        "forged-forward": {"X-Kvmesh-Forwarded": "1", "X-Kvmesh-Prev-Host": att, "X-Kvmesh-Predicted-Reuse": "999999"},
        "host-header": {"Host": att},
        "proxy-headers": {"X-Forwarded-Host": att, "X-Forwarded-For": att.split(":")[0], "Forwarded": f"host={att}",
                          "X-Real-IP": att.split(":")[0]},
        "kvmesh-host": {"X-Kvmesh-Host": att},
        "session-is-an-address": {"X-Session-Id": att},
    }


def _turns_with_attacks(m: Mesh, att: str, tag: str) -> set[str]:
    served: set[str] = set()
    for what, headers in _header_attacks(att).items():
        hdrs = {"X-Session-Id": f"fwd-{tag}-{what}", **headers}
        r = m.http.post(m.api("a") + "/v1/chat/completions", headers=hdrs, json=chat(user=f"http://{att}/"))
        assert r.status_code == 200, (what, r.status_code, r.text)
        assert r.headers["x-kvmesh-host"] in m.nodes, (what, dict(r.headers))
        served.add(r.headers["x-kvmesh-host"])
    return served


def test_request_headers_and_fields_never_choose_where_a_turn_goes(mesh: Mesh, attacker: Attacker) -> None:
    """Prev-host, Host, X-Forwarded-*, forged forward headers, an address as session id or user: served by a configured host, the attacker never connected to."""
    assert _turns_with_attacks(mesh, attacker.addr, "open") <= set(mesh.nodes)
    # Entry a drained: every turn is forwarded, and only to b's configured address.
    with undrained_after(mesh):
        assert mesh.http.post(mesh.api("a") + "/v1/admin/hosts/a/drain", headers=mesh.admin_headers()).status_code == 200
        wait_for(lambda: any(h["name"] == "a" and h["draining"]
                             for h in mesh.http.get(mesh.api("b") + "/v1/cluster").json()["hosts"]), "b to see a draining")
        assert _turns_with_attacks(mesh, attacker.addr, "drained") == {"b"}
    assert attacker.connections == [], attacker.connections


def test_admin_and_peer_arguments_never_name_an_address(mesh: Mesh, attacker: Attacker) -> None:
    """Admin drain of host "IP:port", migrate/replicate targets that are addresses or URLs: refused or a no-op, the attacker never connected to."""
    att, a = attacker.addr, mesh.api("a")
    admin, peer = mesh.admin_headers(), mesh.peer_headers()
    # A session resident on a (pinned there with peer auth), so a migrate would really push somewhere.
    r = mesh.http.post(a + "/v1/chat/completions", headers={"X-Session-Id": "fwd-resident", "X-Kvmesh-Forwarded": "1", **peer},
                       json=chat([{"role": "user", "content": "resident " * 80}]))
    assert r.status_code == 200 and r.headers["x-kvmesh-host"] == "a"
    with undrained_after(mesh):
        for path, body in ((f"/v1/admin/hosts/{att}/drain", None), (f"/v1/admin/hosts/{att}/undrain", None),
                           ("/v1/admin/sessions/fwd-resident/migrate", {"target": att}),
                           ("/v1/admin/sessions/fwd-resident/migrate", {"target": f"http://{att}"}),
                           (f"/v1/admin/sessions/fwd-resident/migrate?target={att}", None)):
            r = mesh.http.post(a + path, headers=admin, json=body)
            assert r.status_code == 404, (path, body, r.status_code, r.text)
        for target in (att, f"http://{att}", "../b", "b:1"):
            r = mesh.http.post(a + "/v1/peer/sessions/fwd-resident/migrate", params={"target": target}, headers=peer)
            assert r.status_code < 500, (target, r.status_code, r.text)
            assert r.status_code != 200 or r.json()["ok"] is False, (target, r.text)
        r = mesh.http.post(a + "/v1/peer/sessions/fwd-resident/replicate", headers=peer)
        assert r.status_code == 200
    # An absolute-form request target naming the attacker is served (or refused) locally.
    host, port = a.split("//", 1)[1].rsplit(":", 1)
    raw = b'{"model":"kvmesh-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST http://%s/v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (att.encode(), att.encode(), len(raw), raw))
        s.settimeout(10)
        reply = s.recv(65536)
    assert int(reply.split(b" ", 2)[1]) < 500, reply[:300]
    assert attacker.connections == [], attacker.connections
