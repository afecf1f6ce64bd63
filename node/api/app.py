"""The node's HTTP app: OpenAI-compatible API, health, cluster view, events, peer and admin actions, metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
    app.state.node = node  # what the routes' node_of dependency hands them
    app.include_router(openai_router)
    app.include_router(mesh_router)
    return app
