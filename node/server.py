"""Run a node: uvicorn on the configured address, a ready line once it listens."""

from __future__ import annotations

import asyncio
import json
import os
import logging
import sys
from pathlib import Path

import uvicorn

from node.api.app import create_app
from node.config import NodeConfig
from node.node import Node

log = logging.getLogger("kvmesh.server")


async def serve(cfg: NodeConfig, *, ready_file: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM. Prints `kvmesh node NAME ready api=URL` once bound."""
    # The event loop answers placement and streams tokens while kv_share threads hash
    # and copy: hand the GIL over sooner than the default 5 ms so the loop stays snappy.
    sys.setswitchinterval(0.001)
    node = Node(cfg)
    app = create_app(node)
    server = uvicorn.Server(
        uvicorn.Config(app, host=cfg.api.host, port=cfg.api.port, log_level="warning", access_log=False,
                       timeout_keep_alive=30, lifespan="on", limit_concurrency=1024,
                       ssl_certfile=cfg.api.tls.cert_file if cfg.api.tls else None,
                       ssl_keyfile=cfg.api.tls.key_file if cfg.api.tls else None)
    )
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
