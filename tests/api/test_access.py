"""Who may call the client routes: API keys (config and KVMESH_API_KEY), the open probes, CORS, model names."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from pydantic import ValidationError

from kvmesh.node.config import ApiConfig, EngineConfig, NodeConfig, SimConfig, describe
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

KEY, ENV_KEY = "sk-kvmesh-test-0123456789", "sk-kvmesh-env-9876543210"
SIM = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6)
HI = [{"role": "user", "content": "hi"}]
ORIGIN = "https://console.example"


@pytest.fixture(scope="module")
def keyed() -> Iterator[ThreadedServer]:
    """A sim node with one configured key, one from KVMESH_API_KEY, a CORS origin and model aliases."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_API_KEY", ENV_KEY)
    cfg = NodeConfig(name="keyed", api=ApiConfig(keys=[KEY], cors_origins=[ORIGIN]),
                     engine=EngineConfig(kind="sim", cache_bytes=64 << 20, slots=2, sim=SIM,
                                         served_names=["claude-*", "gpt-4o", "coder"]))
    srv = serve_in_thread(cfg)
    mp.undo()
    try:
        yield srv
    finally:
        srv.stop()


def _chat(url: str, headers: dict[str, str], model: str = "kvmesh-sim", path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(url + path, headers=headers, timeout=30, json={"model": model, "messages": HI, "max_tokens": 2})


def test_client_routes_want_a_key(keyed: ThreadedServer) -> None:
    """Without a key, or with a wrong one, every client route is a 401 in its dialect's shape."""
    u = keyed.url
    for headers in ({}, {"Authorization": "Bearer wrong-key-000"}, {"x-api-key": "wrong-key-000"}):
        r = _chat(u, headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        r = httpx.post(u + "/v1/messages", headers=headers, json={"model": "claude-x", "max_tokens": 2, "messages": HI})
        assert r.status_code == 401 and r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": r.json()["error"]["message"]}}
    for method, path in (("GET", "/v1/models"), ("GET", "/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/responses"), ("POST", "/v1/messages/count_tokens"), ("POST", "/chat/completions")):
        assert httpx.request(method, u + path, json={}).status_code == 401, path


def test_bearer_and_x_api_key_and_the_environment_key_are_accepted(keyed: ThreadedServer) -> None:
    """The configured key as Bearer or x-api-key, and KVMESH_API_KEY's, all run turns."""
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"Authorization": f"Bearer {ENV_KEY}"}):
        assert _chat(keyed.url, headers).status_code == 200


def test_official_sdks_authenticate_with_their_own_headers(keyed: ThreadedServer) -> None:
    """openai sends Bearer, anthropic sends x-api-key: both get in with the key, and get their SDK's 401 error without."""
    o = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert o.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2).choices  # type: ignore[arg-type]
    a = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)
    assert a.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=HI).type == "message"  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope-nope-nope", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.url, api_key="nope-nope-nope", max_retries=0).messages.create(
            model="claude-x", max_tokens=2, messages=HI)  # type: ignore[arg-type]


def test_probes_and_metrics_stay_open(keyed: ThreadedServer) -> None:
    """/health, /ready and /metrics answer without a key (probes and scrapers have none)."""
    assert httpx.get(keyed.url + "/health").status_code == 200
    r = httpx.get(keyed.url + "/ready")
    assert r.status_code == 200 and r.json()["ready"] is True
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_keys_are_never_logged(caplog: pytest.LogCaptureFixture, keyed: ThreadedServer) -> None:
    """A refused and an accepted key leave no trace of either key in the logs."""
    with caplog.at_level(logging.DEBUG):
        _chat(keyed.url, {"Authorization": "Bearer sk-wrong-but-secret-123"})
        _chat(keyed.url, {"Authorization": f"Bearer {KEY}"})
    assert KEY not in caplog.text and "sk-wrong-but-secret-123" not in caplog.text


def test_model_names_and_globs(keyed: ThreadedServer) -> None:
    """Served names and globs are accepted, /v1/models lists the exact ones, another name is a 404 naming what is served."""
    h = {"x-api-key": KEY}
    for model in ("kvmesh-sim", "claude-opus-4-1", "gpt-4o", "coder"):
        assert _chat(keyed.url, h, model).status_code == 200, model
    ids = [m["id"] for m in httpx.get(keyed.url + "/v1/models", headers=h).json()["data"]]
    assert ids == ["kvmesh-sim", "gpt-4o", "coder"]
    r = _chat(keyed.url, h, "gpt-5")
    assert r.status_code == 404 and "kvmesh-sim" in r.json()["error"]["message"]
    assert "'claude-*'" in r.json()["error"]["message"]


def test_cors_preflight_for_configured_origins_only(keyed: ThreadedServer) -> None:
    """OPTIONS from a configured origin is allowed (no key needed for the preflight); another origin gets no CORS header."""
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=pre | {"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = _chat(keyed.url, {"x-api-key": KEY, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_api_key_config_is_checked() -> None:
    """A short key, or one with a comma, is refused at load, and the message does not echo it."""
    for bad in ("sk-2sh", "abcdefgh,ijklmnop"):
        with pytest.raises(ValidationError) as ei:
            ApiConfig(keys=[bad])
        said = describe(ei.value, "node.toml")
        assert "api key" in said.lower() and bad not in said


def test_any_model_name_when_told() -> None:
    """accept_any_model takes every name (one model served)."""
    cfg = EngineConfig(kind="sim", accept_any_model=True)
    assert cfg.accepts_model("whatever-4") and not EngineConfig(kind="sim").accepts_model("whatever-4")
