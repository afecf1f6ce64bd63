"""Tiny stand-ins for a node, on 127.0.0.1 port 0, run in a background thread.

`FakeEventsServer` speaks `WS /v1/events` like a node: a snapshot, the replay
ring (replay=True), then live events; it can drop its clients (slow-consumer
close) or refuse new ones (node down). `FakeAdminServer` answers the admin POSTs
with ActionResult JSON and 401/404/409, recording what it was sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

from kvmesh.node.protocol import ClusterViewEvent, Event


class FakeEventsServer:
    def __init__(self, view: Callable[[], ClusterViewEvent]) -> None:
        self.view = view
        self.ring: list[Event] = []  # what a reconnecting client gets replayed
        self.refuse = False
        self.connections = 0
        self._clients: set[ServerConnection] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-events-server")
        self.port = 0

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake events server did not start")
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self._handler, "127.0.0.1", 0, close_timeout=0.5) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            self._ready.set()
            await self._stop.wait()

    async def _handler(self, ws: ServerConnection) -> None:
        if ws.request is None or ws.request.path != "/v1/events":
            await ws.close(code=1008, reason="not found")
            return
        if self.refuse:
            await ws.close(code=1013, reason="down")
            return
        self.connections += 1
        await ws.send(self.view().model_dump_json())
        for ev in list(self.ring):
            await ws.send(ev.model_copy(update={"replay": True}).model_dump_json())
        self._clients.add(ws)
        try:
            await ws.wait_closed()
        finally:
            self._clients.discard(ws)

    # ---- driving it from the test thread -------------------------------------------------

    def publish(self, *events: Event) -> None:
        """Send live events to every client and keep them in the replay ring (returns at once)."""
        asyncio.run_coroutine_threadsafe(self._publish(list(events)), self._loop)

    async def _publish(self, events: list[Event]) -> None:
        for ev in events:
            self.ring.append(ev)
            for ws in list(self._clients):
                await ws.send(ev.model_dump_json())

    def drop_clients(self) -> None:
        """Close every client's socket, as a node does to a consumer that fell behind (returns at once).

        Not waited for: the closing handshake needs the client, which may be
        running on the calling thread's event loop.
        """
        asyncio.run_coroutine_threadsafe(self._drop(), self._loop)

    async def _drop(self) -> None:
        for ws in list(self._clients):
            asyncio.ensure_future(ws.close(code=1013, reason="consumer too slow; reconnect for a fresh snapshot"))

    @property
    def client_count(self) -> int:
        return len(self._clients)


class FakeAdminServer:
    """Admin API double: token check, known hosts/sessions, one conflict case."""

    def __init__(self, token: str, hosts: set[str], sessions: set[str]) -> None:
        self.token = token
        self.hosts = hosts
        self.sessions = sessions
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep pytest output clean
                return

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                status, payload = outer.answer(self.path, self.headers.get("Authorization"), body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="fake-admin")

    def start(self) -> str:
        self._thread.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, path: str, auth: str | None, body: Any) -> tuple[int, dict[str, Any]]:
        if auth != f"Bearer {self.token}":
            return 401, {"error": {"message": "missing or wrong admin token", "code": "unauthorized"}}
        parts = path.strip("/").split("/")  # v1 admin hosts|sessions <name> <action>
        if len(parts) != 5 or parts[:2] != ["v1", "admin"]:
            return 404, {"error": {"message": "no such route"}}
        kind, name, action = parts[2], parts[3], parts[4]
        if kind == "hosts":
            if name not in self.hosts:
                return 404, {"error": {"message": f"no host {name!r}"}}
            return 200, {"ok": True, "message": f"{action} {name}: started"}
        if name not in self.sessions:
            return 404, {"error": {"message": f"no session {name!r}"}}
        if action == "migrate":
            target = (body or {}).get("target")
            if target not in self.hosts:
                return 409, {"error": {"message": f"cannot migrate to {target!r}"}}
            return 200, {"ok": True, "message": f"migrating {name} to {target}"}
        return 200, {"ok": True, "message": f"{action} {name}: started"}
