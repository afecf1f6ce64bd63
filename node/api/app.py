"""The node's HTTP app: OpenAI-compatible API, health, and (as they land) admin, events, metrics."""

from __future__ import annotations

from contextlib import asynccontextmanager
from collections.abc import AsyncIterator

from fastapi import FastAPI

from kvmesh.node.api.errors import BodyLimit, install_error_handlers
from kvmesh.node.api.mesh_routes import router as mesh_router
from kvmesh.node.api.openai_routes import router as openai_router
from kvmesh.node.node import Node


def create_app(node: Node) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await node.start()
        try:
            yield
        finally:
            await node.stop()

    app = FastAPI(title="kvmesh node", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=node.cfg.api.max_body_bytes)
    install_error_handlers(app)
    app.include_router(openai_router(node))
    app.include_router(mesh_router(node))
    app.state.node = node
    return app
