"""Stored Responses on one node (node.api.responses_stored), through the official `openai` client: store: true
keeps a response and its conversation, GET / DELETE / input_items read them in OpenAI's shapes,
previous_response_id chains turns on the stored conversation (warm: the cache it left is reused), store: false
keeps nothing, another API key sees a 404 exactly as an unknown id, and an expired response is gone.

Two module-scope sim nodes: one open (no keys), one with two client keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import SecretStr

from kvmesh.node.config import ApiConfig, EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

MODEL = "gpt-5"
SIM = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6)
INSTRUCTIONS = "You are a terse assistant. " * 20
KEY_A, KEY_B = "sk-kvmesh-responses-a", "sk-kvmesh-responses-b"


def _node(name: str, keys: list[str] | None = None) -> NodeConfig:
    return NodeConfig(name=name, api=ApiConfig(keys=[SecretStr(k) for k in keys or []]), engine=EngineConfig(
        kind="sim", cache_bytes=64 << 20, slots=2, queue_max=2, sim=SIM, served_names=["gpt-*"]))


@pytest.fixture(scope="module")
def srv() -> Iterator[ThreadedServer]:
    server = serve_in_thread(_node("api-stored"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keyed() -> Iterator[ThreadedServer]:
    server = serve_in_thread(_node("api-stored-keyed", [KEY_A, KEY_B]))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(srv: ThreadedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


def _create(client: openai.OpenAI, input_: Any, **kw: Any) -> Any:
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("instructions", INSTRUCTIONS)
    return client.responses.create(model=MODEL, input=input_, temperature=0, **kw)


def test_a_stored_response_is_read_back_whole(client: openai.OpenAI, srv: ThreadedServer) -> None:
    """GET /v1/responses/{id} (and without /v1) returns the response as it was answered."""
    r = _create(client, "Store this answer.")
    assert r.store is True
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    plain = httpx.get(f"{srv.url}/responses/{r.id}", timeout=30).json()
    assert plain["id"] == r.id and plain["output"][0]["content"][0]["text"] == r.output_text


def test_a_chain_continues_the_stored_conversation_warm(client: openai.OpenAI) -> None:
    """previous_response_id: each turn's prompt is the stored conversation plus the new input, its cache reused."""
    r1 = _create(client, "First question of a chain.")
    r2 = _create(client, "Second question.", previous_response_id=r1.id)
    r3 = _create(client, [{"role": "user", "content": "Third question."}], previous_response_id=r2.id)
    assert r2.previous_response_id == r1.id and r3.previous_response_id == r2.id
    for prev, cur in ((r1, r2), (r2, r3)):
        assert cur.usage.input_tokens > prev.usage.input_tokens + prev.usage.output_tokens
        # the previous prompt and its answer, less the answer's last token (never prefilled)
        assert cur.usage.input_tokens_details.cached_tokens >= prev.usage.input_tokens + prev.usage.output_tokens - 1
    items = client.responses.input_items.list(r3.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in items.data]  # type: ignore[union-attr]
    assert texts == [("user", "First question of a chain."), ("assistant", r1.output_text), ("user", "Second question."),
                     ("assistant", r2.output_text), ("user", "Third question.")]


def test_instructions_are_not_carried_over(client: openai.OpenAI) -> None:
    """A follow-up without instructions has none (OpenAI's rule): its prompt is shorter by them."""
    r1 = _create(client, "Instructions test.")
    with_ = _create(client, "Again.", previous_response_id=r1.id)
    without = _create(client, "Again.", previous_response_id=r1.id, instructions=None)
    assert without.instructions is None
    assert without.usage.input_tokens < with_.usage.input_tokens - len(INSTRUCTIONS) // 2


def test_input_items_pages_in_openai_list_shape(srv: ThreadedServer, client: openai.OpenAI) -> None:
    """input_items: newest first by default, limit / after / order=asc, first_id, last_id and has_more."""
    r1 = _create(client, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "user", "content": "c"}])
    url = f"{srv.v1}/responses/{r1.id}/input_items"
    whole = httpx.get(url, timeout=30).json()
    assert whole["object"] == "list" and whole["has_more"] is False
    assert [i["content"][0]["text"] for i in whole["data"]] == ["c", "b", "a"]
    assert all(i["id"] and i["type"] == "message" and i["status"] == "completed" for i in whole["data"])
    first = httpx.get(url, params={"limit": 2}, timeout=30).json()
    assert len(first["data"]) == 2 and first["has_more"] is True and first["last_id"] == first["data"][1]["id"]
    rest = httpx.get(url, params={"limit": 2, "after": first["last_id"]}, timeout=30).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["a"] and rest["has_more"] is False
    asc = httpx.get(url, params={"order": "asc"}, timeout=30).json()
    assert [i["content"][0]["text"] for i in asc["data"]] == ["a", "b", "c"]
    assert httpx.get(url, params={"limit": 0}, timeout=30).status_code == 400
    assert httpx.get(url, params={"after": "msg_nothing"}, timeout=30).status_code == 404


def test_delete_removes_it(client: openai.OpenAI, srv: ThreadedServer) -> None:
    """DELETE answers OpenAI's deleted object; then GET, a second DELETE and a follow-up are 404s."""
    r = _create(client, "Delete me.")
    resp = httpx.delete(f"{srv.v1}/responses/{r.id}", timeout=30)
    assert resp.status_code == 200 and resp.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert httpx.delete(f"{srv.v1}/responses/{r.id}", timeout=30).status_code == 404
    with pytest.raises(openai.NotFoundError) as ei:
        _create(client, "Continue?", previous_response_id=r.id)
    assert ei.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert ei.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_store_false_keeps_nothing(client: openai.OpenAI, srv: ThreadedServer) -> None:
    """store: false answers as before and keeps nothing: GET is a 404, nothing is added to the node's store."""
    before = httpx.get(srv.url + "/v1/stats", timeout=30).json()["responses"]
    r = _create(client, "Do not keep me.", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert httpx.get(srv.url + "/v1/stats", timeout=30).json()["responses"] == before


def test_an_unknown_or_edited_id_is_a_404(client: openai.OpenAI, srv: ThreadedServer) -> None:
    """An id that is not ours, or one whose conversation part was edited, is a 404, never a 400 or a 500."""
    r = _create(client, "Mine.")
    for rid in ("resp_nothing", r.id[:-2], r.id[:5] + "0" * 32 + r.id[37:], "x" * 2000):
        assert httpx.get(f"{srv.v1}/responses/{rid}", timeout=30).status_code == 404, rid
        assert httpx.delete(f"{srv.v1}/responses/{rid}", timeout=30).status_code == 404, rid


def test_another_key_gets_a_404(keyed: ThreadedServer) -> None:
    """A response made with one key is not found with another (GET, input_items, DELETE, previous_response_id)."""
    a = openai.OpenAI(base_url=keyed.v1, api_key=KEY_A, max_retries=0, timeout=60.0)
    b = openai.OpenAI(base_url=keyed.v1, api_key=KEY_B, max_retries=0, timeout=60.0)
    r = _create(a, "Key A's secret.")
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        _create(b, "Continue it.", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    assert a.responses.retrieve(r.id).id == r.id  # still there for its own key
    assert _create(a, "Continue it.", previous_response_id=r.id).previous_response_id == r.id
    assert httpx.get(f"{keyed.v1}/responses/{r.id}", timeout=30).status_code == 401
    a.close()
    b.close()


def test_an_expired_response_is_gone(client: openai.OpenAI, srv: ThreadedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past responses.ttl_s a response is a 404 and cannot be continued; a sweep frees its bytes."""
    r = _create(client, "Expire me.")
    kept = srv.node.responses
    later = time.time() + kept.ttl_s + 1
    monkeypatch.setattr(kept, "clock", lambda: later)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        _create(client, "Continue?", previous_response_id=r.id)
    monkeypatch.setattr(kept.store, "clock", lambda: later)
    kept.store.sweep()
    assert kept.store.usage_bytes() == 0
