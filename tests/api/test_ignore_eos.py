"""`ignore_eos` (llama.cpp's and vLLM's extension): a turn decodes max_tokens whatever it samples.

The sim engine's test-only `scripted_reply` ends every reply with its end-of-turn token, so a
turn without the field stops there and one with it runs to max_tokens; through the official
OpenAI client (chat) and raw HTTP (legacy completions), on a real server on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread


@pytest.fixture(scope="module")
def scripted() -> Iterator[ThreadedServer]:
    sim = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6, scripted_reply="short answer")
    srv = serve_in_thread(NodeConfig(name="eos", engine=EngineConfig(kind="sim", cache_bytes=64 << 20, slots=2, sim=sim)))
    try:
        yield srv
    finally:
        srv.stop()


def test_chat_ignore_eos_runs_to_max_tokens(scripted: ThreadedServer) -> None:
    """Without ignore_eos the scripted reply stops at its end token; with it the turn decodes all 40."""
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none")
    msgs = [{"role": "user", "content": "say something"}]
    stopped = client.chat.completions.create(model="kvmesh-sim", messages=msgs, max_tokens=40)  # type: ignore[arg-type]
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage and stopped.usage.completion_tokens < 40
    full = client.chat.completions.create(model="kvmesh-sim", messages=msgs, max_tokens=40,  # type: ignore[arg-type]
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage and full.usage.completion_tokens == 40
    assert full.choices[0].message.content and full.choices[0].message.content.startswith("short answer")


def test_completions_ignore_eos_runs_to_max_tokens(scripted: ThreadedServer) -> None:
    """Legacy completions honour ignore_eos too; a non-boolean value is a 400 naming the field."""
    body = {"model": "kvmesh-sim", "prompt": "once upon a time", "max_tokens": 30}
    stopped = httpx.post(f"{scripted.url}/v1/completions", json=body, timeout=30).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    full = httpx.post(f"{scripted.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=30).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 30
    bad = httpx.post(f"{scripted.url}/v1/completions", json={**body, "ignore_eos": "perhaps"}, timeout=30)
    assert bad.status_code == 400 and "ignore_eos" in bad.text
