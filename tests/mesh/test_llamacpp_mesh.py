"""Two real `kvmesh node` processes serving a generated GGUF through llama.cpp: replicas are exact and reused.

The mesh is the sim tests' (helpers.Mesh over `launcher.write_mesh`), with `engine.kind = "llamacpp"` and
the same random-weight GGUF (node.lab.testmodels, byte vocabulary) on both nodes. Turns are pinned to a
node (peer-forwarded headers), so which node computes each reply is the test's choice, not placement's.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine.llamamodel import weight_buffers
from kvmesh.node.lab import testmodels
from kvmesh.node.lab.launcher import wait_for, write_mesh
from kvmesh.node.lab.workload import text

from .helpers import Mesh

BLOCK = 256
SMOL = "SmolLM2-135M-Instruct.Q4_1"  # the GGUF's name, served whatever alias chose the file


def _start(workdir: Path, engine: dict[str, Any], kvshare: dict[str, Any]) -> Mesh:
    admin, secret = "adm-" + secrets.token_hex(12), "msk-" + secrets.token_hex(16)
    extra = {"kvshare": {"fsync": "never", **kvshare}, "admin_token": admin,
             "mesh": {"poll_interval_s": 0.2, "stale_after_s": 3.0, "secret": secret}}
    base = write_mesh(workdir, ("a", "b"), engine=engine, extra=extra)
    m = Mesh(base.workdir, base.nodes, base.configs, admin, secret)
    m.start()
    return m


def _serve(m: Mesh, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A fixture's mesh for its test: the nodes' logs printed when the test failed, then stopped."""
    yield m
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(m.logs())
    m.stop()


@pytest.fixture
def llama_mesh(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    gguf = testmodels.write_gguf(tmp_path / "tiny.gguf", testmodels.spec_for("tiny"))
    engine = {"kind": "llamacpp", "model": str(gguf), "slots": 2, "cache_bytes": 64 << 20, "max_context": 8192,
              "block_size": BLOCK, "llamacpp": {"threads": 1}}
    yield from _serve(_start(tmp_path / "mesh", engine, {"replicate_min_tokens": 512}), request)


@pytest.fixture
def smollm2_mesh(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Two nodes serving the real SmolLM2 by its alias, every size the model's own (context, blocks, threshold)."""
    engine = {"model": "smollm2", "slots": 1, "cache_tokens": 16384, "llamacpp": {"threads": 1}}
    yield from _serve(_start(tmp_path / "mesh", engine, {}), request)


def pinned_turn(m: Mesh, host: str, session: str, messages: list[dict[str, str]], max_tokens: int = 12,
                model: str = "tiny", prev_host: str | None = None) -> tuple[str, int]:
    """One greedy turn computed on `host` itself (moved there from `prev_host`); returns (reply, cached_tokens)."""
    headers = {"X-Session-Id": session, "X-Kvmesh-Forwarded": "1", **m.peer_headers(),
               **({"X-Kvmesh-Prev-Host": prev_host} if prev_host else {})}
    r = m.http.post(m.api(host) + "/v1/chat/completions", headers=headers, timeout=120,
                    json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["message"]["content"], int(details.get("cached_tokens") or 0)


def test_conversation_continues_on_second_node_with_same_greedy_text_and_survives_restart(llama_mesh: Mesh) -> None:
    """After a replica, node b continues a conversation begun on a with a's greedy text and reuses the
    replica (cached_tokens > 0); after b restarts, its stored copy is restored and reused again."""
    import random

    m, s = llama_mesh, "llama-conv"
    rng = random.Random(11)
    msgs = [{"role": "system", "content": text(rng, 900)}, {"role": "user", "content": text(rng, 700)}]
    r1, cached1 = pinned_turn(m, "a", s, msgs)
    assert cached1 == 0 and r1
    m.wait_replica(s, "a", 4 * BLOCK)
    follow = [*msgs, {"role": "assistant", "content": r1}, {"role": "user", "content": text(rng, 120)}]
    on_b, cached_b = pinned_turn(m, "b", s, follow)
    assert cached_b >= 4 * BLOCK  # the replica's whole blocks, imported into llama.cpp on b
    on_a, _ = pinned_turn(m, "a", s + "-ref", follow)  # the same prompt on the first node
    assert on_b == on_a  # a continues from its own cache (shared blocks by hash); b from the replica
    stats = m.http.get(m.api("b") + "/v1/stats", timeout=10).json()
    assert stats["kvshare"]["in"].get("a", {}).get("transfers", 0) >= 1
    # b restarts: its engine is empty, its store still holds the session; the next turn restores it.
    m.nodes["b"].stop()
    m.nodes["b"].start().wait_ready(60)
    again = [*follow, {"role": "assistant", "content": on_b}, {"role": "user", "content": text(rng, 60)}]
    after, cached_r = pinned_turn(m, "b", s, again)
    assert cached_r >= 4 * BLOCK
    ref, _ = pinned_turn(m, "a", s + "-ref2", again)
    assert after == ref
    with httpx.Client() as c:  # the node serves the GGUF's name as its model
        assert c.get(m.api("b") + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


def test_smollm2_session_moves_warm_and_answers_as_if_it_never_moved(smollm2_mesh: Mesh) -> None:
    """On two real SmolLM2 nodes (alias, 64-token blocks, threshold from its 8k context), a conversation begun on a
    continues on b from the replica, reusing >= 90% of the prompt (warm), with the greedy reply of a session that never moved."""
    import random

    m, s = smollm2_mesh, "smol-conv"
    stats = m.http.get(m.api("a") + "/v1/stats", timeout=10).json()
    assert (stats["max_context"], stats["block_size"], stats["replicate_min_tokens"]) == (8192, 64, 2048)
    # the node's weight buffers are this host's choice for the default setting, with its reason
    assert stats["engine"]["weights"] == weight_buffers(LlamaCppConfig()).as_dict()
    rng = random.Random(12)
    msgs = [{"role": "system", "content": "You are a coding agent.\n" + text(rng, 11000)},
            {"role": "user", "content": "Summarise the spec above in one sentence."}]
    r1, cached1 = pinned_turn(m, "a", s, msgs, max_tokens=16, model=SMOL)
    assert cached1 == 0 and r1
    m.wait_replica(s, "a", 2048)
    follow = [*msgs, {"role": "assistant", "content": r1}, {"role": "user", "content": "Now name the first step."}]
    r = m.http.post(m.api("b") + "/v1/chat/completions", timeout=300,
                    headers={"X-Session-Id": s, "X-Kvmesh-Forwarded": "1", **m.peer_headers()},
                    json={"model": SMOL, "messages": follow, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_tokens, cached_b = body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_b >= 0.9 * prompt_tokens, (cached_b, prompt_tokens)  # warm, though the partial tail never moved
    never_moved, _ = pinned_turn(m, "a", s, follow, max_tokens=24, model=SMOL)  # the same turn where the session began
    assert body["choices"][0]["message"]["content"] == never_moved
    assert body["model"] == SMOL


@pytest.fixture
def gemma_window_mesh(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Two nodes serving the real Gemma 3 270M with llama.cpp's windowed cache (llamacpp.swa = "window")."""
    engine = {"model": "gemma3-270m", "slots": 1, "max_context": 4096, "cache_tokens": 8192,
              "llamacpp": {"threads": 1, "swa": "window"}}
    yield from _serve(_start(tmp_path / "mesh", engine, {"replicate_min_tokens": 512}), request)


def test_gemma3_window_mode_moves_warm_with_its_snapshot_and_answers_as_if_it_never_moved(gemma_window_mesh: Mesh) -> None:
    """On two real Gemma 3 nodes in window mode, a's replica (bare blocks) lands on b and its window snapshot follows
    over /v1/peer/snapshots; b's next turn resumes at the snapshot and answers what a answers where the session began.
    The route refuses a snapshot of another model, a wrong digest, or a malformed body, and says why."""
    import hashlib
    import random

    from kvmesh.node.engine.snapshots import encode_snapshot

    m, s = gemma_window_mesh, "gemma-window"
    rng = random.Random(14)
    msgs = [{"role": "user", "content": "Read this:\n" + text(rng, 7000) + "\nWhat is it about?"}]
    model = "gemma-3-270m-q4_k_m"
    r1, cached1 = pinned_turn(m, "a", s, msgs, max_tokens=16, model=model)
    assert cached1 == 0
    m.wait_replica(s, "a", 512)
    received = lambda: m.http.get(m.api("b") + "/v1/stats", timeout=10).json()["snapshots"]["received"]  # noqa: E731
    wait_for(lambda: received() >= 1, "b to receive a's window snapshot", 30)
    sent = m.http.get(m.api("a") + "/v1/stats", timeout=10).json()["snapshots"]
    assert sent["sent"] >= 1 and sent["sent_bytes"] > 0 and sent["send_failed"] == 0
    follow = [*msgs, {"role": "assistant", "content": r1}, {"role": "user", "content": "In one word?"}]
    moved, cached_b = pinned_turn(m, "b", s, follow, max_tokens=24, model=model, prev_host="a")
    prompt_b = m.http.get(m.api("b") + "/v1/stats", timeout=10).json()
    assert cached_b > 0 and prompt_b["snapshots"]["restored"] >= 1, (cached_b, prompt_b["snapshots"])
    never_moved, cached_a = pinned_turn(m, "a", s, follow, max_tokens=24, model=model)
    assert moved == never_moved and cached_a > 0

    url, fingerprint = m.api("b") + "/v1/peer/snapshots", prompt_b["fingerprint"]
    assert m.http.get(m.api("b") + "/v1/models", timeout=10).json()["data"][0]["kvmesh"]["swa"] == "window"
    body = encode_snapshot(np.arange(512, dtype=np.int32), np.zeros(64, dtype=np.uint8))
    digest = hashlib.sha256(body).hexdigest()
    wrong_model = m.http.post(url, content=body, headers={**m.peer_headers(), "x-kvmesh-fingerprint": "0" * 32,
                                                         "x-kvmesh-digest": digest}, timeout=10)
    assert wrong_model.status_code == 409 and "fingerprint" in wrong_model.text
    bad_digest = m.http.post(url, content=body, headers={**m.peer_headers(), "x-kvmesh-fingerprint": fingerprint,
                                                        "x-kvmesh-digest": "0" * 64}, timeout=10)
    assert bad_digest.status_code == 409 and "sha256" in bad_digest.text
    cells = m.http.post(url, content=body, headers={**m.peer_headers(), "x-kvmesh-fingerprint": fingerprint,
                                                   "x-kvmesh-digest": digest}, timeout=10)
    assert cells.status_code == 409 and "window snapshot" in cells.text
    junk = b"junk"
    malformed = m.http.post(url, content=junk, headers={**m.peer_headers(), "x-kvmesh-fingerprint": fingerprint,
                                                       "x-kvmesh-digest": hashlib.sha256(junk).hexdigest()}, timeout=10)
    assert malformed.status_code == 400 and "KVWN" in malformed.text
    no_secret = m.http.post(url, content=body, timeout=10)
    assert no_secret.status_code == 401


@pytest.fixture(params=["hybrid-tiny", "mamba-tiny"])
def recurrent_mesh(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Two nodes serving a generated model with recurrent state by its alias: LFM2's hybrid layout, or Mamba's."""
    engine = {"model": request.param, "slots": 2, "cache_tokens": 8192, "max_context": 4096, "llamacpp": {"threads": 1}}
    yield from _serve(_start(tmp_path / "mesh", engine, {"replicate_min_tokens": 256}), request)


def test_a_session_with_recurrent_state_moves_warm_with_its_snapshot(recurrent_mesh: Mesh) -> None:
    """a's replica (blocks of the attention cache, if any) and its recurrent-state snapshot reach b; b's next turn
    resumes at the snapshot and answers what a answers where the session began; /v1/models says it replicates."""
    import random

    m, s = recurrent_mesh, "recurrent-warm"
    model = m.http.get(m.api("a") + "/v1/models", timeout=10).json()["data"][0]
    assert model["kvmesh"]["replicas"] is True and model["kvmesh"]["no_replicas_reason"] is None
    rng = random.Random(15)
    msgs = [{"role": "system", "content": text(rng, 900)}, {"role": "user", "content": text(rng, 300)}]
    r1, cached1 = pinned_turn(m, "a", s, msgs, model=model["id"])
    assert cached1 == 0
    m.wait_replica(s, "a", 256)
    wait_for(lambda: m.http.get(m.api("b") + "/v1/stats", timeout=10).json()["snapshots"]["received"] >= 1,
             "b to receive a's snapshot", 30)
    follow = [*msgs, {"role": "assistant", "content": r1}, {"role": "user", "content": text(rng, 80)}]
    on_b, cached_b = pinned_turn(m, "b", s, follow, model=model["id"], prev_host="a")
    on_a, cached_a = pinned_turn(m, "a", s, follow, model=model["id"])
    assert cached_b > 900 and cached_a >= cached_b and on_b == on_a, (cached_b, cached_a)
    moved = m.http.get(m.api("b") + "/v1/stats", timeout=10).json()
    assert moved["snapshots"]["restored"] >= 1 and moved["handoffs"]["cold"] == 0, moved["handoffs"]
