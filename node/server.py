"""Run a node: uvicorn on the configured address, a ready line once it listens."""

from __future__ import annotations

import asyncio
import json
import os
import logging
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from node.api.app import create_app
from node.config import NodeConfig
from node.node import Node

log = logging.getLogger("kvmesh.server")

HEADER_DEADLINE_S = 10.0


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for a request's headers.

    uvicorn arms its keep-alive timer only after a response, so a client that
    connects and sends nothing (or trickles its headers) would hold the
    connection forever. Arming the same timer at connect closes it unless the
    request's headers are complete in time; uvicorn cancels the timer then.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)


def uvicorn_config(app: FastAPI, cfg: NodeConfig, *, host: str | None = None, port: int | None = None) -> uvicorn.Config:
    """The one uvicorn configuration of a node (tests serve in-process with it too)."""
    tls = cfg.api.tls
    return uvicorn.Config(
        app, host=host or cfg.api.host, port=cfg.api.port if port is None else port, log_level="warning",
        access_log=False, timeout_keep_alive=HEADER_DEADLINE_S, lifespan="on", http=HeaderDeadlineH11,
        ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
    )


async def serve(cfg: NodeConfig, *, ready_file: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Prints `kvmesh node NAME ready api=URL` once bound."""
    # The event loop answers placement and streams tokens while kv_share threads hash
    # and copy: hand the GIL over sooner than the default 5 ms so the loop stays snappy.
    sys.setswitchinterval(0.001)
    node = Node(cfg)
    app = create_app(node)
    server = uvicorn.Server(uvicorn_config(app, cfg))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        await task
        raise SystemExit(f"node {cfg.name}: the API server did not start on {cfg.api.host}:{cfg.api.port}")
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    node.api_url = f"{'https' if cfg.api.tls else 'http'}://{host}:{port}"
    info = {"name": cfg.name, "api": node.api_url, "kvshare": node.kvshare.address, "pid": os.getpid()}
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)
    print(f"kvmesh node {cfg.name} ready api={info['api']} kvshare={info['kvshare']}", flush=True)
    await task
