"""The bench's nginx: its config for each policy, and a real nginx that keeps a session on one host.

The real-proxy test runs nginx (Debian's, which `make test` installs when missing and root) in
front of two small HTTP servers on loopback that say who they are."""

from __future__ import annotations

import http.server
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.node.lab.nginx import Proxy, config


def test_config_per_policy() -> None:
    """Sticky hashes X-Session-Id consistently; round robin does not; both stream unbuffered, never retry."""
    sticky, rr = config(9000, ["127.0.0.1:1", "127.0.0.1:2"], "sticky"), config(9000, ["127.0.0.1:1", "127.0.0.1:2"], "round_robin")
    assert "hash $http_x_session_id consistent;" in sticky and "hash " not in rr
    for c in (sticky, rr):
        assert "proxy_buffering off;" in c and "proxy_next_upstream off;" in c and "listen 127.0.0.1:9000;" in c
        assert "server 127.0.0.1:1;" in c and "server 127.0.0.1:2;" in c
    with pytest.raises(ValueError, match="sticky or round_robin"):
        config(9000, ["127.0.0.1:1"], "random")


class _Named(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstreams() -> Iterator[list[str]]:
    servers = []
    for name in ("one", "two"):
        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Named)
        s.name = name  # type: ignore[attr-defined]
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    yield [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                    reason="nginx is not installed (make test installs it as root)")
def test_real_nginx_sticky_and_round_robin(upstreams: list[str], tmp_path: Path) -> None:
    """Sticky: each session always reaches the same host and sessions spread; round robin alternates."""
    sticky = Proxy(tmp_path / "s", upstreams, "sticky").start()
    try:
        homes = {}
        for sid in (f"sess-{i}" for i in range(20)):
            got = {httpx.get(f"{sticky.url}/x", headers={"X-Session-Id": sid}).text for _ in range(4)}
            assert len(got) == 1
            homes[sid] = got.pop()
        assert set(homes.values()) == {"one", "two"}
    finally:
        sticky.stop()
    assert sticky.proc is None
    rr = Proxy(tmp_path / "r", upstreams, "round_robin").start()
    try:
        hits = Counter(httpx.get(f"{rr.url}/x", headers={"X-Session-Id": "same"}).text for _ in range(10))
        assert hits == Counter({"one": 5, "two": 5})
    finally:
        rr.stop()
