"""A node served in-process, on its own event loop in a background thread: how tests run real servers on port 0."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import uvicorn

from kvmesh.node.api.app import create_app
from kvmesh.node.config import NodeConfig
from kvmesh.node.node import Node
from kvmesh.node.server import uvicorn_config


@dataclass
class ThreadedServer:
    """A node served by uvicorn on its own event loop in a background thread (tests run nodes so)."""

    url: str
    node: Node
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def model(self) -> str:
        return self.node.engine.model_name

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the uvicorn thread of {self.node.name} did not stop within {timeout_s:g}s")


def serve_in_thread(cfg: NodeConfig, *, port: int = 0, start_timeout_s: float = 60.0) -> ThreadedServer:
    """Build the node and serve it on 127.0.0.1:port (0: any free port); returns once it listens."""
    node = Node(cfg)
    server = uvicorn.Server(uvicorn_config(create_app(node), cfg, host="127.0.0.1", port=port))
    # Older uvicorn installs signal handlers from serve(); not from a background thread.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign,attr-defined,unused-ignore]
    failure: list[BaseException] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve())
        except BaseException as e:  # noqa: BLE001 - surfaced below
            failure.append(e)
        finally:
            loop.close()

    thread = threading.Thread(target=run, name=f"uvicorn-{cfg.name}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"server {cfg.name} exited before it started: {failure!r}")
        if time.monotonic() > deadline:
            server.should_exit = True
            thread.join(30)
            raise RuntimeError(f"server {cfg.name} did not start within {start_timeout_s:g}s")
        time.sleep(0.01)
    host, bound = server.servers[0].sockets[0].getsockname()[:2]
    url = f"http://{host}:{bound}"
    node.serving_at(url)  # as serve() does once bound
    return ThreadedServer(url, node, server, thread)
