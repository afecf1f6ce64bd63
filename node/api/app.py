"""The node's HTTP app, its routes by audience: clients (OpenAI chat, completions and Responses; Anthropic
Messages), health probes (`health_routes`), observers (`observe_routes`: cluster view, events, stats,
metrics), peers (`peer_routes`, the mesh secret) and operators (`admin_routes`, the admin token)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from kvmesh.node.api.admin_routes import router as admin_router
from kvmesh.node.api.anthropic_routes import router as anthropic_router
from kvmesh.node.api.completions_routes import router as completions_router
from kvmesh.node.api.errors import BodyLimit, install_error_handlers
from kvmesh.node.api.health_routes import router as health_router
from kvmesh.node.api.observe_routes import router as observe_router
from kvmesh.node.api.openai_routes import router as openai_router
from kvmesh.node.api.openapi import install_openapi
from kvmesh.node.api.peer_routes import router as peer_router
from kvmesh.node.api.responses_routes import router as responses_router
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
    if node.cfg.api.cors_origins:
        # Preflight (OPTIONS) and CORS headers for the configured origins only; added last, so it
        # answers a preflight before the body limit or the key check sees it.
        app.add_middleware(CORSMiddleware, allow_origins=list(node.cfg.api.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Kvmesh-Host", "X-Kvmesh-Handoff",
                                                                "X-Kvmesh-Cached-Tokens", "X-Session-Id"])
    install_error_handlers(app)
    app.state.node = node  # what the routes' node_of dependency hands them
    for router in (openai_router, completions_router, anthropic_router, responses_router, health_router,
                   observe_router, peer_router, admin_router):
        app.include_router(router)
    install_openapi(app)
    return app
