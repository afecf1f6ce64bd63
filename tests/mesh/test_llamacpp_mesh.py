"""Two real `kvmesh node` processes serving a generated GGUF through llama.cpp: replicas are exact and reused.

The mesh is the sim tests' (helpers.Mesh over `launcher.write_mesh`), with `engine.kind = "llamacpp"` and
the same random-weight GGUF (node.lab.testmodels, byte vocabulary) on both nodes. Turns are pinned to a
node (peer-forwarded headers), so which node computes each reply is the test's choice, not placement's.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine.hashing import block_hashes, chain_seed
from kvmesh.node.engine.llamamodel import weight_buffers
from kvmesh.node.kvshare import wire
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


def _manifests(m: Mesh, host: str) -> list[dict[str, Any]]:
    """The replica manifests in `host`'s store directory (manifest.json of each stored session)."""
    return [json.loads(p.read_bytes()) for p in Path(m.configs[host]["kvshare"]["store_dir"]).glob("*/manifest.json")]


def read_reply(sock: socket.socket, tx: wire.Sender) -> wire.SenderEvent | str:
    """The receiver's next reply as an event, or why none came ('closed', 'protocol:<reason>')."""
    try:
        while True:
            data = sock.recv(max(1, tx.want()))
            events = tx.feed(data) if data else tx.eof()
            if events:
                return events[0]
    except wire.ProtocolError as e:
        return "closed" if e.reason == "truncated" else f"protocol:{e.reason}"


def _hand_push(m: Mesh, host: str, offer: wire.Offer, tokens: np.ndarray, blob: np.ndarray, *,
               secret: str | None = None, flip: bool = False, size: int | None = None) -> wire.SenderEvent | str:
    """A push by hand to `host`'s kv_share listener: the offer, zero blocks, the snapshot `blob` (a bit flipped in
    flight with `flip`; its header claiming `size` bytes with `size`), END; the receiver's verdict."""
    tx = wire.Sender((secret or m.secret or "").encode())
    hashes = block_hashes(chain_seed(offer.fingerprint), tokens, offer.block_size)
    addr, port = m.configs[host]["kvshare"]["listen"].rsplit(":", 1)
    with socket.create_connection((addr, int(port)), timeout=30) as sock:
        sock.sendall(tx.offer_bytes(offer, tokens, hashes))
        ev = read_reply(sock, tx)
        if not isinstance(ev, wire.Accepted):
            return ev
        zero = bytes(offer.block_bytes)
        for i in range(ev.first_missing, offer.n_blocks):
            sock.sendall(tx.block_header(i, zero) + zero)
        data = bytearray(blob.tobytes())
        hdr = tx.snapshot_header(blob)
        if flip:
            data[len(data) // 2] ^= 0x01
        if size is not None:
            hdr = wire.encode_snapshot_header(offer.snapshot_pos, size, hdr[-16:])
        sock.sendall(hdr + bytes(data) + tx.end())
        return read_reply(sock, tx)


def test_gemma3_window_mode_moves_warm_with_its_snapshot_and_answers_as_if_it_never_moved(gemma_window_mesh: Mesh) -> None:
    """On two real Gemma 3 nodes in window mode, a's replica (bare blocks) lands on b with its window snapshot, a frame of
    the same kv_share push counted on the link; b's next turn resumes at the snapshot and answers what a answers where the
    session began. b's kv_share refuses a snapshot of another model, a wrong digest, cells that do not check, a malformed
    frame or an unsigned push, and says why. After b restarts, its store resumes the session (blocks and snapshot) and b
    answers what a does."""
    import random

    m, s = gemma_window_mesh, "gemma-window"
    rng = random.Random(14)
    msgs = [{"role": "user", "content": "Read this:\n" + text(rng, 7000) + "\nWhat is it about?"}]
    model = "gemma-3-270m-q4_k_m"
    r1, cached1 = pinned_turn(m, "a", s, msgs, max_tokens=16, model=model)
    assert cached1 == 0
    m.wait_replica(s, "a", 512)
    received = lambda: m.http.get(m.api("b") + "/v1/stats", timeout=10).json()["snapshots"]["received"]  # noqa: E731
    wait_for(lambda: received() >= 1, "b to receive a's window snapshot", 30)
    sent_stats = m.http.get(m.api("a") + "/v1/stats", timeout=10).json()
    sent = sent_stats["snapshots"]
    assert sent["sent"] >= 1 and sent["sent_bytes"] > 0 and sent["send_failed"] == 0
    link = sent_stats["kvshare"]["out"]["b"]
    assert link["snapshot_bytes"] == sent["sent_bytes"] and link["bytes"] > link["snapshot_bytes"]
    follow = [*msgs, {"role": "assistant", "content": r1}, {"role": "user", "content": "In one word?"}]
    moved, cached_b = pinned_turn(m, "b", s, follow, max_tokens=24, model=model, prev_host="a")
    prompt_b = m.http.get(m.api("b") + "/v1/stats", timeout=10).json()
    assert cached_b > 0 and prompt_b["snapshots"]["restored"] >= 1, (cached_b, prompt_b["snapshots"])
    assert prompt_b["kvshare"]["in"]["a"]["snapshot_bytes"] == sent["sent_bytes"]
    never_moved, cached_a = pinned_turn(m, "a", s, follow, max_tokens=24, model=model)
    assert moved == never_moved and cached_a > 0

    fingerprint, bs = prompt_b["fingerprint"], prompt_b["block_size"]
    assert m.http.get(m.api("b") + "/v1/models", timeout=10).json()["data"][0]["kvmesh"]["swa"] == "window"
    wait_for(lambda: any(d["session"] == s for d in _manifests(m, "b")), "b to store the session", 30)
    block_bytes = next(d["block_bytes"] for d in _manifests(m, "b") if d["session"] == s)
    tokens, blob = np.arange(2 * bs, dtype=np.int32), np.zeros(64, dtype=np.uint8)
    offer = wire.Offer(session="gemma-hand", sender="hand", fingerprint=fingerprint, block_size=bs, block_bytes=block_bytes,
                       n_blocks=2, generation=1, sent_at=time.time(), snapshot_pos=2 * bs, snapshot_bytes=blob.nbytes)
    wrong_model = _hand_push(m, "b", offer.model_copy(update={"fingerprint": "0" * 32}), tokens, blob)
    assert isinstance(wrong_model, wire.PeerRefused) and wrong_model.reason == "fingerprint", wrong_model
    bad_digest = _hand_push(m, "b", offer, tokens, blob, flip=True)
    assert isinstance(bad_digest, wire.PeerRefused) and bad_digest.reason == "digest", bad_digest
    cells = _hand_push(m, "b", offer, tokens, blob)
    assert isinstance(cells, wire.PeerRefused) and cells.reason == "snapshot" and "window snapshot" in cells.message, cells
    malformed = _hand_push(m, "b", offer, tokens, blob, size=blob.nbytes + 1)
    assert isinstance(malformed, wire.PeerRefused) and malformed.reason == "malformed", malformed
    no_secret = _hand_push(m, "b", offer, tokens, blob, secret="not-the-mesh-secret")
    assert isinstance(no_secret, wire.PeerRefused) and no_secret.reason == "unauthenticated", no_secret
    refused = m.http.get(m.api("b") + "/v1/stats", timeout=10).json()["kvshare"]["in"]["hand"]["refused"]
    assert refused == {"fingerprint": 1, "digest": 1, "snapshot": 1, "malformed": 1}, refused

    # b restarts: its engine and snapshots are empty; its store holds the session's blocks and newest snapshot.
    wait_for(lambda: any(d["session"] == s and d["snapshot"] for d in _manifests(m, "b")), "b to store its snapshot", 30)
    m.nodes["b"].stop()
    m.nodes["b"].start().wait_ready(120)
    again = [*follow, {"role": "assistant", "content": moved}, {"role": "user", "content": "And in two words?"}]
    after, cached_r = pinned_turn(m, "b", s, again, max_tokens=24, model=model)
    restarted = m.http.get(m.api("b") + "/v1/stats", timeout=10).json()["snapshots"]
    assert cached_r >= 1024 and restarted["restored"] >= 1, (cached_r, restarted)  # the newest boundary its prompt reaches
    home, _ = pinned_turn(m, "a", s, again, max_tokens=24, model=model)
    assert after == home


@pytest.fixture(params=["hybrid-tiny", "mamba-tiny"])
def recurrent_mesh(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Two nodes serving a generated model with recurrent state by its alias: LFM2's hybrid layout, or Mamba's."""
    engine = {"model": request.param, "slots": 2, "cache_tokens": 8192, "max_context": 4096, "llamacpp": {"threads": 1}}
    yield from _serve(_start(tmp_path / "mesh", engine, {"replicate_min_tokens": 256}), request)


def test_a_session_with_recurrent_state_moves_warm_with_its_snapshot(recurrent_mesh: Mesh) -> None:
    """a's replica (blocks of the attention cache, if any) and its recurrent-state snapshot reach b in one push; b's next
    turn resumes at the snapshot and answers what a answers where the session began; /v1/models says it replicates.
    After b restarts it resumes the session from its store (blocks and snapshot) and answers as a does; with the
    stored snapshot corrupted it recomputes (cached 0) and still answers as a does."""
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
    assert moved["kvshare"]["in"]["a"]["snapshot_bytes"] > 0, moved["kvshare"]["in"]
    # b restarts: the session resumes from b's store (its blocks and its newest snapshot), as a would answer.
    wait_for(lambda: any(d["session"] == s and d["snapshot"] for d in _manifests(m, "b")), "b to store its snapshot", 30)
    m.nodes["b"].stop()
    m.nodes["b"].start().wait_ready(60)
    again = [*follow, {"role": "assistant", "content": on_b}, {"role": "user", "content": text(rng, 60)}]
    after, cached_r = pinned_turn(m, "b", s, again, model=model["id"])
    home, _ = pinned_turn(m, "a", s, again, model=model["id"])
    assert cached_r > 900 and after == home, (cached_r, after, home)
    # A snapshot corrupted on b's disk is refused (the stored replica dropped): b recomputes, never resumes from it.
    m.nodes["b"].stop()
    for snap in Path(m.configs["b"]["kvshare"]["store_dir"]).glob("*/snap-*.bin"):
        raw = bytearray(snap.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        snap.write_bytes(bytes(raw))
    m.nodes["b"].start().wait_ready(60)
    last = [*again, {"role": "assistant", "content": after}, {"role": "user", "content": text(rng, 40)}]
    recomputed, cached_c = pinned_turn(m, "b", s, last, model=model["id"])
    home2, _ = pinned_turn(m, "a", s, last, model=model["id"])
    assert cached_c == 0 and recomputed == home2, (cached_c, recomputed, home2)
