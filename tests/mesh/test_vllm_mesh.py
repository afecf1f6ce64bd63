"""Two real `kvmesh node` processes with `engine.kind = "vllm"`: each drives its own vLLM (one core each), and
a session begun on one continues on the other warm, from the replica kv_share pushed into its shared pool."""

from __future__ import annotations

import random
import secrets
from pathlib import Path
from typing import Any

import pytest

from kvmesh.node.lab.launcher import write_mesh
from kvmesh.node.lab.workload import text

from .helpers import Mesh

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's venv is absent: run `make vllm` (make test does)"),
              pytest.mark.timeout(900)]
SMOL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture
def vllm_mesh(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    admin, secret = "adm-" + secrets.token_hex(12), "msk-" + secrets.token_hex(16)
    engine = {"kind": "vllm", "model": "smollm2", "slots": 2, "max_context": 4096, "cache_tokens": 16384,
              "vllm": {"kvcache_gib": 1}}
    extra = {"kvshare": {"fsync": "never", "replicate_min_tokens": 512}, "admin_token": admin,
             "mesh": {"poll_interval_s": 0.2, "stale_after_s": 30.0, "secret": secret}}
    base = write_mesh(tmp_path / "mesh", ("a", "b"), engine=engine, extra=extra,
                      overrides={"a": {"engine": {"vllm": {"cpu_cores": "0"}}}, "b": {"engine": {"vllm": {"cpu_cores": "1"}}}})
    m = Mesh(base.workdir, base.nodes, base.configs, admin, secret)
    try:
        m.start(ready_timeout=600)
        yield m
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            print(m.logs())
    finally:
        m.stop(timeout=60)


def pinned_turn(m: Mesh, host: str, session: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One greedy turn computed on `host` itself."""
    r = m.http.post(m.api(host) + "/v1/chat/completions", timeout=300,
                    headers={"X-Session-Id": session, "X-Kvmesh-Forwarded": "1", **m.peer_headers()},
                    json={"model": SMOL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_two_vllm_nodes_carry_a_session_across_hosts_warm(vllm_mesh: Mesh) -> None:
    """A conversation begun on a's vLLM continues on b's from the replica kv_share pushed (>= 90% of the prompt
    cached, loaded by b's connector), with the greedy reply the session would have had on a."""
    m, s = vllm_mesh, "vllm-conv"
    rng = random.Random(5)
    msgs = [{"role": "system", "content": "You are a coding agent.\n" + text(rng, 12000)},
            {"role": "user", "content": "Summarise the spec above in one sentence."}]
    first = pinned_turn(m, "a", s, msgs, 16)
    reply = first["choices"][0]["message"]["content"]
    assert reply
    m.wait_replica(s, "a", 512, timeout=60)
    follow = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "Now name the first step."}]
    there = pinned_turn(m, "b", s, follow, 24)
    prompt_tokens = there["usage"]["prompt_tokens"]
    cached = there["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * prompt_tokens, (cached, prompt_tokens)  # warm: b's vLLM loaded the replica's blocks
    assert m.transfers_in("b", "a") >= 1
    here = pinned_turn(m, "a", s + "-ref", follow, 24)  # the same turn where the session began (blocks by hash)
    assert there["choices"][0]["message"]["content"] == here["choices"][0]["message"]["content"]
    assert there["model"] == SMOL
