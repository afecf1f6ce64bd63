"""Run a node: uvicorn on the configured address, a ready line once it listens."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvmesh.node.api.app import create_app
from kvmesh.node.config import NodeConfig
from kvmesh.node.node import Node
from kvmesh.node.shutdown import WarmStop, exit_watchdog

log = logging.getLogger("kvmesh.server")

HEADER_DEADLINE_S = 10.0


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for each request's headers.

    uvicorn has no header-read timeout, and any byte cancels its keep-alive timer,
    so a client that connects and sends nothing, or trickles its headers, would hold
    a connection forever. Here every request must have its headers complete within
    HEADER_DEADLINE_S of the connection opening (or of the previous response).
    """

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(HEADER_DEADLINE_S, self._header_deadline_passed)

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE:  # still no complete request line and headers
            self.timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._header_timer.cancel()
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)


def uvicorn_config(app: FastAPI, cfg: NodeConfig, *, host: str | None = None, port: int | None = None) -> uvicorn.Config:
    """The one uvicorn configuration of a node (node.lab.inprocess serves tests' nodes with it too)."""
    tls = cfg.api.tls
    return uvicorn.Config(
        app, host=host or cfg.api.host, port=cfg.api.port if port is None else port, log_level="warning",
        access_log=False, timeout_keep_alive=math.ceil(HEADER_DEADLINE_S), lifespan="on", http=HeaderDeadlineH11,
        ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
    )


class _WarmStopServer(uvicorn.Server):
    """uvicorn's server without its own signal handlers: SIGTERM and SIGINT drain the node warm
    first (node.shutdown.WarmStop), instead of uvicorn's stop within the second."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(cfg: NodeConfig, *, ready_file: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Prints `kvmesh node NAME ready api=URL` once bound."""
    # The event loop answers placement and streams tokens while kv_share threads hash and copy:
    # hand the GIL over sooner than the default 5 ms. Measured here (bench handoff, 60 s, same
    # load): decision p99 2-3 ms at 0.2 ms against 9.5 ms at 1 ms, loop lag p99 9-12 against
    # 14-22 ms; bench transfer's ratio to raw TCP moved within its run-to-run noise (0.7-1.2).
    sys.setswitchinterval(0.0002)
    # `kill -USR1 <pid>` writes every thread's stack to the log: where a stuck node is stuck, without a debugger.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    node = Node(cfg)
    app = create_app(node)
    server = _WarmStopServer(uvicorn_config(app, cfg))
    WarmStop(node, server, cfg.drain_timeout_s, watchdog=exit_watchdog).install(asyncio.get_running_loop())
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        await task
        raise SystemExit(f"node {cfg.name}: the API server did not start on {cfg.api.host}:{cfg.api.port}")
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    node.serving_at(f"{'https' if cfg.api.tls else 'http'}://{host}:{port}")
    info = {"name": cfg.name, "api": node.api_url, "kvshare": node.kvshare.address, "pid": os.getpid()}
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)
    print(f"kvmesh node {cfg.name} ready api={info['api']} kvshare={info['kvshare']}", flush=True)
    await task
