"""Request size limits and per-connection timeouts on the API and kv_share listeners.

On the shared two-process mesh (api.max_body_bytes = 64 KiB, kvshare.io_timeout_s = 2 s), so the
uvicorn settings are those `kvmesh node` really uses (node/server.py). Slow clients hold their
connection open while other clients are served; how long each listener tolerates them is measured.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import httpx

from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.server import HEADER_DEADLINE_S

from .conftest import KV_IO_TIMEOUT_S
from .helpers import Mesh, chat, openai_error

LIMIT = 64 << 10


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _kv(m: Mesh, name: str) -> tuple[str, int]:
    host, port = m.configs[name]["kvshare"]["listen"].rsplit(":", 1)
    return host, int(port)


def _padded_body(size: int) -> bytes:
    """A chat request of exactly `size` bytes of JSON."""
    base = json.dumps(chat([{"role": "user", "content": ""}])).encode()
    pad = size - len(base)
    assert pad >= 0
    return json.dumps(chat([{"role": "user", "content": "p" * pad}])).encode()


def test_body_over_the_limit_is_refused_with_413_with_or_without_content_length(mesh: Mesh) -> None:
    """Bodies over api.max_body_bytes: 413 request_too_large, declared (Content-Length) or chunked; a body at the limit is served."""
    url = mesh.api("a") + "/v1/chat/completions"
    at_limit, over = _padded_body(LIMIT), _padded_body(LIMIT + 1)
    assert len(at_limit) == LIMIT and len(over) == LIMIT + 1
    headers = {"content-type": "application/json", "X-Session-Id": "limits-body"}
    r = mesh.http.post(url, content=at_limit, headers=headers)
    assert r.status_code == 200, r.text[:300]
    r = mesh.http.post(url, content=over, headers=headers)
    assert openai_error(r, 413)["code"] == "request_too_large"

    def chunks(body: bytes) -> Iterator[bytes]:
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    r = mesh.http.post(url, content=chunks(over), headers=headers)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert openai_error(r, 413)["code"] == "request_too_large"
    r = mesh.http.post(url, content=chunks(at_limit), headers=headers)
    assert r.status_code == 200, r.text[:300]
    # Same on the peer and admin routes (the limit is the app's, not the route's).
    r = mesh.http.post(mesh.api("a") + "/v1/admin/sessions/x/migrate", content=chunks(over), headers=mesh.admin_headers())
    assert openai_error(r, 413)["code"] == "request_too_large"


def test_a_huge_declared_length_is_refused_at_once_without_reading_a_body(mesh: Mesh) -> None:
    """Content-Length: 10 GB with no body sent: 413 right away (the node does not wait for the bytes)."""
    with socket.create_connection(_hostport(mesh.api("a")), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10000000000\r\n\r\n{")
        t0 = time.monotonic()
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert time.monotonic() - t0 < 5


class Trickle:
    """A client that sends `data` one byte every `every_s` seconds and notes when the server closes on it."""

    def __init__(self, addr: tuple[str, int], data: bytes, every_s: float, first: bytes = b""):
        self.sock = socket.create_connection(addr, timeout=10)
        self.t0 = time.monotonic()
        self.closed_after: float | None = None
        self.sent = 0
        self._stop = threading.Event()
        if first:
            self.sock.sendall(first)
        self._thread = threading.Thread(target=self._run, args=(data, every_s), name="trickle", daemon=True)
        self._thread.start()

    def _run(self, data: bytes, every_s: float) -> None:
        self.sock.settimeout(every_s)
        for i in range(len(data)):
            if self._stop.is_set():
                return
            try:
                if self.sock.recv(1, socket.MSG_PEEK) == b"":
                    break  # the server closed
            except TimeoutError:
                pass
            except OSError:
                break
            try:
                self.sock.sendall(data[i : i + 1])
                self.sent += 1
            except OSError:
                break
        else:
            return
        self.closed_after = time.monotonic() - self.t0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


def _others_are_served(m: Mesh, name: str, session: str, seconds: float) -> int:
    """Normal requests to `name` for `seconds`: every one answers in time. Returns how many ran."""
    deadline, n = time.monotonic() + seconds, 0
    with httpx.Client(timeout=10) as c:
        while time.monotonic() < deadline:
            t = time.monotonic()
            assert c.get(m.api(name) + "/health").status_code == 200
            r = c.post(m.api(name) + "/v1/chat/completions", headers={"X-Session-Id": session}, json=chat())
            assert r.status_code == 200, r.text
            assert time.monotonic() - t < 5
            n += 1
            time.sleep(0.2)
    return n


def test_a_slowloris_api_client_does_not_block_others(mesh: Mesh, record_property: Callable[[str, object], None]) -> None:
    """A client trickling request headers is served no harm to others, and is closed once the header deadline passes."""
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"v" * 20) for i in range(40))
    slow = Trickle(_hostport(mesh.api("a")), headers, every_s=0.25,
                   first=b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n")
    try:
        assert _others_are_served(mesh, "a", "limits-slowloris", seconds=5.0) >= 3
        deadline = slow.t0 + HEADER_DEADLINE_S + 3.0
        while slow.closed_after is None and time.monotonic() < deadline:
            time.sleep(0.1)
        record_property("api_slowloris_closed_after_s", slow.closed_after)
        assert slow.closed_after is not None, f"a client trickling headers was still open after {HEADER_DEADLINE_S + 3:g}s"
        assert slow.closed_after <= HEADER_DEADLINE_S + 3.0
    finally:
        slow.close()


def test_idle_api_connections_do_not_lock_out_other_clients(mesh: Mesh) -> None:
    """1023 TCP connections to the API that send nothing: within 6 s another client's /health answers 200 again."""
    addr = _hostport(mesh.api("a"))
    idle: list[socket.socket] = []
    try:
        for _ in range(1023):
            idle.append(socket.create_connection(addr, timeout=10))
        time.sleep(0.5)  # let the node accept them all
        deadline, codes = time.monotonic() + 6.0, []
        while time.monotonic() < deadline:
            codes.append(httpx.get(mesh.api("a") + "/health", timeout=10).status_code)
            if codes[-1] == 200:
                break
            time.sleep(0.5)
        assert codes[-1] == 200, f"/health answered {codes} while 1023 idle connections were open"
    finally:
        for s in idle:
            s.close()
        wait_for(lambda: httpx.get(mesh.api("a") + "/health", timeout=5).status_code == 200, "a to answer again")
        mesh.wait_reachable()


class ClosedWatch:
    """Waits on a socket for the server to close it; notes how long after `t0` that happened."""

    def __init__(self, sock: socket.socket, t0: float, limit_s: float):
        self.sock, self.t0 = sock, t0
        self.closed_after: float | None = None
        self.sock.settimeout(limit_s)
        self._thread = threading.Thread(target=self._run, name="closed-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self.sock.recv(4096):
                pass
        except TimeoutError:
            return
        except OSError:
            pass
        self.closed_after = time.monotonic() - self.t0

    def wait(self) -> float | None:
        self._thread.join(30)
        return self.closed_after


def test_a_silent_kvshare_connection_is_closed_within_io_timeout_while_replicas_flow(mesh: Mesh) -> None:
    """A kv_share client that sends nothing (or half an offer prefix) is closed within io_timeout_s; a real replica lands meanwhile."""
    addr = _kv(mesh, "a")
    stats0 = mesh.http.get(mesh.api("a") + "/v1/stats").json()["kvshare"]["in"].get("b", {}).get("transfers", 0)
    t0 = time.monotonic()
    silent = socket.create_connection(addr, timeout=30)
    partial = socket.create_connection(addr, timeout=30)
    partial.sendall(b"KVSH\x01\x01\x00")
    watches = [ClosedWatch(s, t0, limit_s=KV_IO_TIMEOUT_S + 10) for s in (silent, partial)]
    try:
        # Meanwhile: a turn pinned on b (peer-forwarded) replicates to a, its only peer.
        msgs = [{"role": "system", "content": "silent-kv " + "words " * 150}, {"role": "user", "content": "go"}]
        r = mesh.http.post(mesh.api("b") + "/v1/chat/completions", json=chat(msgs, max_tokens=2),
                           headers={"X-Session-Id": "limits-kv-silent", "X-Kvmesh-Forwarded": "1", **mesh.peer_headers()})
        assert r.status_code == 200 and r.headers["x-kvmesh-host"] == "b", r.text
        wait_for(lambda: mesh.http.get(mesh.api("a") + "/v1/stats").json()["kvshare"]["in"].get("b", {}).get("transfers", 0)
                 > stats0, "b's replica to land on a while the silent connections hang", timeout=15)
        assert mesh.http.get(mesh.api("a") + "/health").status_code == 200
        closed = [w.wait() for w in watches]
        assert all(c is not None for c in closed), f"kv_share kept a silent connection open: {closed}"
        assert all(KV_IO_TIMEOUT_S - 0.5 <= c <= KV_IO_TIMEOUT_S + 2.5 for c in closed), closed  # type: ignore[operator]
    finally:
        silent.close()
        partial.close()


def test_a_trickling_kvshare_client_does_not_block_others(mesh: Mesh, record_property: Callable[[str, object], None]) -> None:
    """A kv_share client sending its offer one byte per io_timeout/2 holds only its own thread: replicas and the API still flow (hold time measured)."""
    addr = _kv(mesh, "a")
    # A well-formed prefix announcing a 60 KiB header (under the limits): the receiver waits for all of it.
    prefix = b"KVSH" + bytes([1, 1]) + (60_000).to_bytes(4, "little") + (0).to_bytes(4, "little") + (0).to_bytes(4, "little")
    slow = Trickle(addr, prefix + b"{" * 1000, every_s=KV_IO_TIMEOUT_S / 2)
    try:
        stats0 = mesh.http.get(mesh.api("a") + "/v1/stats").json()["kvshare"]["in"].get("b", {}).get("transfers", 0)
        msgs = [{"role": "system", "content": "trickle-kv " + "words " * 150}, {"role": "user", "content": "go"}]
        r = mesh.http.post(mesh.api("b") + "/v1/chat/completions", json=chat(msgs, max_tokens=2),
                           headers={"X-Session-Id": "limits-kv-trickle", "X-Kvmesh-Forwarded": "1", **mesh.peer_headers()})
        assert r.status_code == 200
        wait_for(lambda: mesh.http.get(mesh.api("a") + "/v1/stats").json()["kvshare"]["in"].get("b", {}).get("transfers", 0)
                 > stats0, "b's replica to land on a during the trickle", timeout=10)
        _others_are_served(mesh, "a", "limits-kv-trickle-api", seconds=1.0)
        time.sleep(max(0.0, 3 * KV_IO_TIMEOUT_S - (time.monotonic() - slow.t0)))
        held = time.monotonic() - slow.t0
        record_property("kvshare_trickle_closed_after_s", slow.closed_after)
        if slow.closed_after is None:
            warnings.warn(f"FINDING: kv_share kept an unauthenticated connection open for {held:.1f}s "
                          f"(> 3 x io_timeout_s) while it trickled {slow.sent} bytes of an offer: io_timeout_s bounds "
                          "each recv, not the offer", UserWarning)
    finally:
        slow.close()
