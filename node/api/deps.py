"""FastAPI dependencies shared by the route modules."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends
from fastapi.responses import Response
from starlette.requests import HTTPConnection

from kvmesh.node.errors import InvalidRequest
from kvmesh.node.node import Node
from kvmesh.node.protocol import session_id_problem


def node_of(conn: HTTPConnection) -> Node:
    """The Node this app serves (create_app puts it on the app's state); works for HTTP and websockets."""
    return cast(Node, conn.app.state.node)


# A route parameter annotated NodeDep receives the Node.
NodeDep = Annotated[Node, Depends(node_of)]


def json_response(body: str) -> Response:
    """A body pydantic already serialised, sent as it is."""
    return Response(body, media_type="application/json")


def valid_session(session: str) -> str:
    """A session id from a URL path (`{session:path}`: '/' in an id is fine, encoded or not): 400 naming it if refused."""
    problem = session_id_problem(session)
    if problem is not None:
        raise InvalidRequest(f"session: the session id {problem}", param="session")
    return session
