"""FastAPI dependencies shared by the route modules."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends
from starlette.requests import HTTPConnection

from kvmesh.node.node import Node


def node_of(conn: HTTPConnection) -> Node:
    """The Node this app serves (create_app puts it on the app's state); works for HTTP and websockets."""
    return cast(Node, conn.app.state.node)


# A route parameter annotated NodeDep receives the Node.
NodeDep = Annotated[Node, Depends(node_of)]
