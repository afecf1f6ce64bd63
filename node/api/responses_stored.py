"""Stored Responses over HTTP: `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`
(each also without `/v1`), and what `POST /v1/responses` (node.api.responses_routes) asks of them: the
conversation a `previous_response_id` continues, and the record a `store: true` answer is kept in.

Where they are kept, and how any entry finds them, is node.responses. Here: a response is the caller's only
in the scope of the API key it presents (node.responses.ids); anything else, an unknown id, an expired
or deleted one, is the same 404. `DELETE` answers OpenAI's `{"id", "object": "response", "deleted": true}`;
`input_items` OpenAI's list (`object`, `data`, `first_id`, `last_id`, `has_more`), newest first unless
`order=asc`, `limit` 1-100 (20), after the item `after` names. Input items are the response's whole input
as the model saw it, the conversation it continued included; its `instructions` are not items.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from kvmesh.node.api.clientauth import ClientKey, presented_key
from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.jsonbody import StrictJSONRoute
from kvmesh.node.api.responses_schema import Item, ResponsesRequest
from kvmesh.node.api.sessionid import SessionName
from kvmesh.node.errors import NotFound
from kvmesh.node.node import Node
from kvmesh.node.responses.ids import scope_of
from kvmesh.node.responses.record import StoredEntry, StoredRecord
from kvmesh.node.responses.service import Found

router = APIRouter(route_class=StrictJSONRoute)
_ITEMS = TypeAdapter(list[Item])


def caller_scope(request: Request, node: Node) -> str:
    """The scope the caller's key gives it ("" on a node with no keys)."""
    return scope_of(presented_key(request), keyed=bool(node.client_keys))


def _missing(response_id: str, param: str | None = None) -> NotFound:
    what = "previous response" if param else "response"
    return NotFound(f"{what} {response_id!r} not found (never stored, store=false, expired, deleted, or made with "
                    "another API key)", param=param, code="previous_response_not_found" if param else None)


async def _found(node: Node, response_id: str, scope: str, param: str | None = None) -> Found:
    found = await node.responses.find(response_id, scope) if node.responses.enabled else None
    if found is None:
        raise _missing(response_id, param)
    return found


async def continued(node: Node, body: ResponsesRequest, scope: str) -> tuple[Found, list[Item]] | None:
    """The stored response `previous_response_id` names and the conversation to continue (its whole input, then its
    output), or None without one; a 404 naming the field if the caller has no such response."""
    rid = body.previous_response_id
    if rid is None:
        return None
    found = await _found(node, rid, scope, "previous_response_id")
    try:
        return found, _ITEMS.validate_python(found.record.conversation(rid) or [])
    except ValidationError:
        raise NotFound(f"previous response {rid!r}: its stored conversation is unreadable", param="previous_response_id",
                       code="previous_response_not_found") from None


def kept_record(body: ResponsesRequest, response: dict[str, Any], session: SessionName, conversation: str, scope: str,
                ttl_s: float, prior: Found | None) -> StoredRecord:
    """The record a new stored response is filed in: the one it continued with it appended (its input kept as what
    this request added), or a record of its own with its whole input (a first turn; or a follow-up whose
    conversation is another, its instructions changed)."""
    same = prior is not None and prior.session == conversation
    items = body.stored_items()
    if prior is not None and not same:
        items = (prior.record.conversation(prior.entry.id) or []) + items
    created = float(response["created_at"])
    entry = StoredEntry(id=response["id"], scope=scope, group=session.id, source=session.source[:64], created=created,
                        expires=created + ttl_s, parent=prior.entry.id if same and prior else None, items=items,
                        response=response)
    base = list(prior.record.entries.values()) if same and prior else []
    return StoredRecord(session=conversation, entries=[*base, entry])


async def get_response(response_id: str, request: Request, node: NodeDep) -> JSONResponse:
    found = await _found(node, response_id, caller_scope(request, node))
    return JSONResponse(found.entry.response)


async def delete_response(response_id: str, request: Request, node: NodeDep) -> JSONResponse:
    if not (node.responses.enabled and await node.responses.delete(response_id, caller_scope(request, node))):
        raise _missing(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def input_items(response_id: str, request: Request, node: NodeDep, order: Literal["asc", "desc"] = "desc",
                      limit: Annotated[int, Query(ge=1, le=100)] = 20,
                      after: Annotated[str | None, Query(max_length=256)] = None,
                      include: Annotated[list[str] | None, Query()] = None) -> JSONResponse:
    """`include` is accepted with no effect: the items have nothing more to include."""
    found = await _found(node, response_id, caller_scope(request, node))
    items = found.record.input_items(response_id) or []
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, it in enumerate(items) if it.get("id") == after), None)
        if at is None:
            raise NotFound(f"after: no input item {after!r} in response {response_id!r}", param="after")
        items = items[at + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


for _prefix in ("/v1", ""):
    router.add_api_route(_prefix + "/responses/{response_id}", get_response, methods=["GET"], response_model=None,
                         dependencies=[ClientKey])
    router.add_api_route(_prefix + "/responses/{response_id}", delete_response, methods=["DELETE"],
                         response_model=None, dependencies=[ClientKey])
    router.add_api_route(_prefix + "/responses/{response_id}/input_items", input_items, methods=["GET"],
                         response_model=None, dependencies=[ClientKey])
