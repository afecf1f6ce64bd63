"""The llama.cpp engine: exact prefix reuse and imports, failed restores, fingerprints, tokenizers.

Every test runs llama.cpp (llama-cpp-python, installed by `make test`) on a random-weight GGUF
written at test time (node.lab.testmodels), 2 layers, with blocks of 64 tokens so a few
hundred tokens span several blocks.

Tolerances: a restored or imported prefix gives logits bit-identical (0.0) to the home engine's
continuation of the same prefix: same KV bytes, and with flash attention (the default) masked
cells are skipped, so where llama.cpp places the cells does not matter. Against one full prefill
of the whole prompt they agree to within 2e-2 absolute (logits are O(10), K/V are f16) with the
same greedy token: llama.cpp's CPU kernels sum in an order that depends on the batch's shape, so
a prompt computed in different chunks differs in the last bits of f16 KV, as it does in llama.cpp itself.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine import llamastate
from kvmesh.node.engine.engine import Engine, GenerateRequest, TurnDone
from kvmesh.node.engine.llamacpp import LlamaRunner, RestoreFailed
from kvmesh.node.engine.llamamodel import gguf_digest, has_recurrent_state
from kvmesh.node.engine.vocab import vocab_dir
from kvmesh.node.errors import ImportRefused
from kvmesh.node.lab import testmodels

TOL = 2e-2
BS = 64


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testmodels.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", testmodels.spec_for("tiny"))


@pytest.fixture
def llama(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Factory: llama(**engine_overrides, llamacpp=LlamaCppConfig(...)) -> Engine; closed at teardown."""
    monkeypatch.setenv("KVMESH_GGUF_CACHE", str(tmp_path / "cache"))
    made: list[Engine] = []

    def make(**kw: object) -> Engine:
        base: dict[str, object] = dict(kind="llamacpp", model=str(tiny_gguf), slots=1, block_size=BS, max_context=2048,
                                       cache_bytes=64 << 20, llamacpp=LlamaCppConfig(threads=2, n_batch=256))
        base.update(kw)
        e = Engine(EngineConfig(**base))  # type: ignore[arg-type]
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def prompt(n: int, seed: int = 0) -> list[int]:
    """n ids of printable bytes (the byte vocabulary: byte b is id 3 + b)."""
    rng = np.random.default_rng(seed)
    return [1] + [3 + int(b) for b in rng.integers(33, 127, n - 1)]


class Capture:
    """Wraps a runner's forward: the logits of each turn's first forward (the prefill) are kept."""

    def __init__(self, engine: Engine) -> None:
        self.logits: list[torch.Tensor] = []
        inner = engine.runner.forward
        self._armed = False

        async def forward(slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
            out = await inner(slot, tokens, start)
            if self._armed:
                self.logits.append(out)
                self._armed = False
            return out

        engine.runner.forward = forward  # type: ignore[method-assign]
        self.engine = engine

    def turn(self, session: str, ids: list[int], max_tokens: int = 1) -> tuple[torch.Tensor, TurnDone]:
        self._armed = True
        done: list[TurnDone] = []

        async def go() -> None:
            async for ev in self.engine.generate(GenerateRequest(session, ids, max_tokens=max_tokens)):
                if isinstance(ev, TurnDone):
                    done.append(ev)

        asyncio.run(go())
        return self.logits[-1], done[0]


def full_prefill(make: Callable[..., Engine], ids: list[int]) -> torch.Tensor:
    logits, done = Capture(make()).turn("ref", ids)
    assert done.stats.cached_tokens == 0
    return logits


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference; greedy decoding must pick the same token too."""
    assert int(a.argmax()) == int(b.argmax())
    return float((a - b).abs().max())


def test_prefix_reuse_in_slot_and_from_pool_equals_full_prefill(llama) -> None:  # type: ignore[no-untyped-def]
    """Logits after reusing a cached prefix (kept in the slot, or restored from pool blocks) equal a full prefill
    (with `reuse_tail`, the session's partial last block too)."""
    p1, p2 = prompt(300), prompt(300) + prompt(90, seed=1)[1:]
    ref = full_prefill(llama, p2)
    e = llama(reuse_tail=True)
    cap = Capture(e)
    cap.turn("s", p1)
    got, done = cap.turn("s", p2)  # same slot: the sequence still holds p1
    assert done.stats.cached_tokens == 300 and close(got, ref) <= TOL
    p3 = p2 + prompt(5, seed=3)[1:]
    home = llama(reuse_tail=True)
    hcap = Capture(home)
    hcap.turn("s", p1)
    hcap.turn("s", p2)
    in_slot, _ = hcap.turn("s", p3)  # the home engine continues in its slot
    cap.turn("other", prompt(200, seed=2))  # e's slot now holds another session
    got, done = cap.turn("s", p3)
    assert done.stats.cached_tokens == len(p2) and isinstance(e.runner, LlamaRunner) and e.runner.restored_blocks >= 6
    assert torch.equal(got, in_slot)  # restored from pool blocks: bit-identical
    assert close(got, full_prefill(llama, p3)) <= TOL


def test_every_turn_keeps_the_common_prefix_and_computes_what_a_replica_host_does(llama) -> None:  # type: ignore[no-untyped-def]
    """Unset `reuse_tail`: over four turns adding 10, 100, 3 and 70 tokens after a reply of 8, the home keeps every
    token its slot shares with the prompt, reply included, and its logits are bit-identical to those of a host that
    imported the session's whole blocks and computed the rest."""
    home = llama()
    cap = Capture(home)
    cap.turn("s", prompt(300), max_tokens=8)
    assert home.own_tail is not None and isinstance(home.runner, LlamaRunner)
    for i, added in enumerate((10, 100, 3, 70)):
        asyncio.run(home.own_tail.ready(0))
        held = [int(t) for t in home.runner.held_tokens(0)]
        p = held + prompt(added + 1, seed=i + 1)[1:]
        toks, hashes, data = _export(home, "s")
        away = llama()
        assert away.import_blocks("s", home.fingerprint, toks, hashes, data) == len(held) // BS * BS
        on_home, done = cap.turn("s", p, max_tokens=8)
        moved, moved_done = Capture(away).turn("s", p)
        assert (done.stats.cached_tokens, moved_done.stats.cached_tokens) == (len(held), len(held) // BS * BS), i
        assert torch.equal(on_home, moved), i
    assert home.runner.settled > 0


def test_a_retried_prompt_of_whole_blocks_leaves_its_cells_as_the_pool_holds_them(llama) -> None:  # type: ignore[no-untyped-def]
    """Unset `reuse_tail`: a prompt of five whole blocks asked again recomputes only its last token, and in the
    kind its first prefill computed it (not as a decode step), so the next turn at home is bit-identical to a
    replica host's that imported the blocks."""
    p1 = prompt(5 * BS + 20)
    p2 = p1[: 5 * BS] + prompt(60, seed=4)[1:]
    home, away = llama(), llama()
    cap = Capture(home)
    cap.turn("s", p1)
    toks, hashes, data = _export(home, "s")
    assert away.import_blocks("s", home.fingerprint, toks, hashes, data) == 5 * BS
    _, retried = cap.turn("s", p1[: 5 * BS])
    assert retried.stats.cached_tokens == 5 * BS - 1
    on_home, done = cap.turn("s", p2)
    moved, _ = Capture(away).turn("s", p2)
    assert done.stats.cached_tokens == 5 * BS
    assert torch.equal(on_home, moved)


@pytest.mark.parametrize(("first", "added"), [(300, 10), (200, 100)], ids=["small-batch", "large-batch"])
def test_a_llamacpp_session_keeps_its_own_cells_past_whole_blocks_where_exact(llama, first: int, added: int) -> None:  # type: ignore[no-untyped-def]
    """Unset `reuse_tail`: where the slot's cells past the last full block are of the kind the replica host's own
    prefill computes (44 small-batch cells, 10 tokens more; 8 large-batch ones, 100 more), the home keeps every
    token of the common prefix and its logits are still bit-identical to the replica host's."""
    p1, p2 = prompt(first), prompt(first) + prompt(added + 1, seed=1)[1:]
    home, away = llama(), llama()
    Capture(home).turn("s", p1)
    assert home.own_tail is not None
    asyncio.run(home.own_tail.ready(0))  # a client that took its time: the turn's end has settled the last block
    toks, hashes, data = _export(home, "s")
    assert away.import_blocks("s", home.fingerprint, toks, hashes, data) == (first // BS) * BS
    on_home, done = Capture(home).turn("s", p2)
    moved, moved_done = Capture(away).turn("s", p2)
    assert done.stats.cached_tokens == first and moved_done.stats.cached_tokens == (first // BS) * BS
    assert torch.equal(on_home, moved)


def test_a_turns_end_settles_its_reply_so_the_next_short_turn_keeps_it(llama) -> None:  # type: ignore[no-untyped-def]
    """A short turn's reply (decode steps, a kind no prefill has) is recomputed as one batch once the turn ends (as
    were the first turn's last 44 cells, a 44-row ubatch of a 256-token call), so the next short turn keeps the
    whole conversation, reply included, bit-identical to a replica host's."""
    home, away = llama(), llama()
    cap = Capture(home)
    p1 = prompt(300)
    cap.turn("s", p1)
    assert home.own_tail is not None
    asyncio.run(home.own_tail.ready(0))
    cap.turn("s", p1 + prompt(6, seed=1)[1:], max_tokens=8)  # 5 tokens more: the reply goes into block 4 as decodes
    asyncio.run(home.own_tail.ready(0))
    held = [int(t) for t in home.runner.held_tokens(0)]  # type: ignore[attr-defined]
    assert len(held) > 305 and isinstance(home.runner, LlamaRunner) and home.runner.settled == (300 - 256) + (len(held) - 305)
    p3 = held + prompt(6, seed=2)[1:]
    toks, hashes, data = _export(home, "s")
    assert away.import_blocks("s", home.fingerprint, toks, hashes, data) == 256
    on_home, done = Capture(home).turn("s", p3)
    moved, moved_done = Capture(away).turn("s", p3)
    assert done.stats.cached_tokens == len(held) and moved_done.stats.cached_tokens == 256
    assert torch.equal(on_home, moved)


def test_a_turn_that_comes_at_once_drops_the_last_turns_settle_and_recomputes_its_reply(llama) -> None:  # type: ignore[no-untyped-def]
    """A next turn sent the moment the last one ended (within the settle's grace period) finds nothing running: the
    settle is dropped, the turn keeps the cells before the reply's decode steps and recomputes the rest in its own
    prefill, bit-identical to a replica host's."""
    home, away = llama(), llama()
    cap = Capture(home)
    p1 = prompt(300)
    cap.turn("s", p1)
    assert home.own_tail is not None
    asyncio.run(home.own_tail.ready(0))  # [256, 300) settled: of the kind a turn keeps
    assert isinstance(home.runner, LlamaRunner)
    before = home.runner.settled
    cap.turn("s", p1 + prompt(6, seed=1)[1:], max_tokens=8)  # the reply: decode steps from position 305
    held = [int(t) for t in home.runner.held_tokens(0)]
    p3 = held[:312] + prompt(6, seed=2)[1:]
    toks, hashes, data = _export(home, "s")
    assert away.import_blocks("s", home.fingerprint, toks, hashes, data) == 256
    on_home, done = Capture(home).turn("s", p3)  # at once: the settle of [305, 312) is still in its grace period
    moved, moved_done = Capture(away).turn("s", p3)
    assert home.runner.settled == before and done.stats.cached_tokens == 305 and moved_done.stats.cached_tokens == 256
    assert torch.equal(on_home, moved)


def _export(e: Engine, session: str) -> tuple[np.ndarray, list[bytes], list[bytes]]:
    with e.export(session) as blocks:
        toks = np.concatenate([b.tokens for b in blocks])
        return toks, [b.hash for b in blocks], [bytes(b.data) for b in blocks]


def test_import_block_by_block_on_fresh_engine_equals_full_prefill(llama) -> None:  # type: ignore[no-untyped-def]
    """Blocks exported on one engine and imported into a fresh one, restored one by one, give a full prefill's logits."""
    a = llama()
    p1 = prompt(5 * BS + 20)
    Capture(a).turn("s", p1)
    toks, hashes, data = _export(a, "s")
    assert len(hashes) == 5 and all(len(d) == a.block_bytes for d in data)
    b = llama()
    assert b.fingerprint == a.fingerprint
    for k in range(1, 6):  # one block per import, each extending the session
        assert b.import_blocks("s", a.fingerprint, toks[: k * BS], hashes[:k], data[:k]) == k * BS
    p2 = p1[: 5 * BS] + prompt(60, seed=4)[1:]
    got, done = Capture(b).turn("s", p2)
    assert done.stats.cached_tokens == 5 * BS
    assert isinstance(b.runner, LlamaRunner) and b.runner.restored_blocks == 5
    home = llama()  # the same prefix kept on its home engine, continued there
    hcap = Capture(home)
    hcap.turn("s", p1[: 5 * BS])
    at_home, _ = hcap.turn("s", p2)
    assert torch.equal(got, at_home)
    assert close(got, full_prefill(llama, p2)) <= TOL


def test_failed_restore_leaves_sequence_erased_and_next_turn_correct(llama) -> None:  # type: ignore[no-untyped-def]
    """A block llama.cpp refuses mid-restore leaves the slot's sequence erased; the turn recomputes and is right."""
    a = llama()
    p1 = prompt(4 * BS + 10)
    Capture(a).turn("s", p1)
    toks, hashes, data = _export(a, "s")
    bad = bytearray(data[2])
    # Layer 0's K type: the header still checks, llama.cpp's state_read refuses it after blocks 0-1 went in.
    off = 16 + BS * 12 + 8
    bad[off : off + 4] = (99).to_bytes(4, "little")
    b = llama()
    b.import_blocks("s", a.fingerprint, toks, hashes, [data[0], data[1], bytes(bad), data[3]])
    runner = b.runner
    assert isinstance(runner, LlamaRunner)
    bids = b.sessions["s"].block_ids
    with pytest.raises(RestoreFailed) as err:
        runner._load(0, bids, toks)
    assert err.value.block == 2
    assert runner.lib.llama_memory_seq_pos_max(runner.mem, 0) == -1  # erased: blocks 0-1 are not left behind
    assert runner.streams  # one stream per slot: no scratch sequence to leave cells in
    p2 = p1 + prompt(30, seed=5)[1:]
    got, done = Capture(b).turn("s", p2, max_tokens=8)
    assert done.stats.cached_tokens == 0 and b.counters.restores_failed == 1
    assert close(got, full_prefill(llama, p2)) <= TOL
    # The refused block is no longer advertised; the recomputed blocks are, and restore.
    assert b.cached_prefix("other", p2) == len(p2) - len(p2) % BS or b.cached_prefix("other", p2) >= 4 * BS
    got2, done2 = Capture(b).turn("s", p2 + prompt(3, seed=6)[1:])
    assert done2.stats.cached_tokens > 0


def test_checked_block_with_wrong_positions_is_refused_before_llama_cpp(llama) -> None:  # type: ignore[no-untyped-def]
    """A block whose cells are not at its positions is refused by the check; the sequence is erased."""
    a = llama()
    Capture(a).turn("s", prompt(3 * BS + 5))
    toks, hashes, data = _export(a, "s")
    layout = a.runner.layout  # type: ignore[attr-defined]
    assert llamastate.check(data[1], layout, BS, BS) is None
    assert "positions" in (llamastate.check(data[1], layout, 2 * BS, BS) or "")
    b = llama()
    b.import_blocks("s", a.fingerprint, toks[: 2 * BS], hashes[:2], [data[0], data[0]])  # block 1 holds block 0's cells
    runner = b.runner
    assert isinstance(runner, LlamaRunner)
    with pytest.raises(RestoreFailed, match="positions"):
        runner._load(0, b.sessions["s"].block_ids, toks[: 2 * BS])
    assert runner.lib.llama_memory_seq_pos_max(runner.mem, 0) == -1


def test_fingerprint_names_gguf_kv_types_and_v_layout(llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A different KV type, V layout or GGUF changes the fingerprint, and an import across it is refused with the reason."""
    a = llama()
    Capture(a).turn("s", prompt(2 * BS + 3))
    toks, hashes, data = _export(a, "s")
    q8 = llama(llamacpp=LlamaCppConfig(threads=2, n_batch=256, type_k="q8_0"))
    vt = llama(llamacpp=LlamaCppConfig(threads=2, n_batch=256, flash_attn=False))
    other = testmodels.write_gguf(tmp_path / "seed1.gguf", testmodels.spec_for("tiny", seed=1))
    og = llama(model=str(other))
    assert len({a.fingerprint, q8.fingerprint, vt.fingerprint, og.fingerprint}) == 4
    assert vt.runner.layout.v_trans and not a.runner.layout.v_trans  # type: ignore[attr-defined]
    for e in (q8, vt, og):
        with pytest.raises(ImportRefused, match="fingerprint") as err:
            e.import_blocks("s", a.fingerprint, toks, hashes, data)
        assert err.value.reason == "fingerprint"


def test_digest_is_cached_by_size_mtime_inode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF digest is read once per (size, mtime, inode) and recomputed after the file changes."""
    monkeypatch.setenv("KVMESH_GGUF_CACHE", str(tmp_path / "c" / "gguf"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 1000)
    d1 = gguf_digest(f)
    assert (tmp_path / "c" / "gguf-digests.json").is_file()
    f.write_bytes(b"b" * 1000)
    import os

    os.utime(f, ns=(1, 1))
    d2 = gguf_digest(f)
    assert d1 != d2
    reads: list[str] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (reads.append(str(p)), real_open(p, *a, **k))[1])
    assert gguf_digest(f) == d2 and str(f) not in reads


def test_models_with_recurrent_state_are_named_so() -> None:
    """Recurrent layers, alone or beside attention, mean snapshots (tests/engine/test_hybrid_replicas.py); a
    dense or sliding-window model has none."""

    class Lib:
        def __init__(self, rec: bool, hyb: bool) -> None:
            self.rec, self.hyb = rec, hyb

        def llama_model_is_recurrent(self, m: object) -> bool:
            return self.rec

        def llama_model_is_hybrid(self, m: object) -> bool:
            return self.hyb

    assert not has_recurrent_state(Lib(False, False), None)  # type: ignore[arg-type]
    assert has_recurrent_state(Lib(True, False), None) and has_recurrent_state(Lib(False, True), None)  # type: ignore[arg-type]


def test_scratch_cut_equals_parse_cut_of_whole_sequence(llama) -> None:  # type: ignore[no-untyped-def]
    """The two ways to cut a block (scratch sequence, parsing the sequence's blob) give the same K/V bytes."""
    e = llama()
    Capture(e).turn("s", prompt(3 * BS + 7))
    r = e.runner
    assert isinstance(r, LlamaRunner)
    with e.export("s") as blocks:
        scratch_cut = [bytes(b.data) for b in blocks]
    size = r.lib.llama_state_seq_get_size(r.ctx, 0)
    whole = (ctypes.c_uint8 * size)()
    r.lib.llama_state_seq_get_data(r.ctx, whole, size, 0)
    out = np.zeros(r.block_bytes, dtype=np.uint8)
    meta = 16 + BS * 12
    for j, want in enumerate(scratch_cut):
        n = llamastate.cut(memoryview(whole), r.layout, j * BS, (j + 1) * BS, out)
        got = out[:n].tobytes()
        assert n == len(want) and got[meta:] == want[meta:]  # K/V and headers; cell meta differs only in seq id
        pos = np.frombuffer(got[16:meta], dtype="<i4").reshape(BS, 3)[:, 0]
        assert (pos == np.arange(j * BS, (j + 1) * BS)).all()


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe"])
def test_real_vocab_tokenizer_and_chat_template(vocab: str, tmp_path: Path, llama) -> None:  # type: ignore[no-untyped-def]
    """A generated model with a real vocabulary: llama.cpp's tokenizer matches its test pairs and the
    GGUF's chat template renders, with its special tokens as single ids."""
    path = testmodels.write_gguf(tmp_path / f"{vocab}.gguf", testmodels.spec_for("tiny", vocab=vocab))
    e = llama(model=str(path))
    tok = e.tokenizer
    inp = (vocab_dir() / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    out = (vocab_dir() / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8").splitlines()
    for text, ids in list(zip(inp, out))[:20]:
        assert tok.encode(text) == [int(x) for x in ids.split()], text
        assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    if vocab == "qwen2":
        im_start = tok.encode("<|im_start|>")
        assert len(im_start) == 1 and ids.count(im_start[0]) == 3  # Qwen2's default system message, the user's, the assistant's
        assert tok.eos_ids and tok.decode(ids).endswith("assistant\n")
    _, done = Capture(e).turn("s", ids, max_tokens=4)
    assert done.stats.prompt_tokens == len(ids)


def test_config_needs_a_gguf_and_serves_its_name() -> None:
    """engine.kind 'llamacpp' without engine.model is refused; the served model id is the GGUF's file stem."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="needs engine.model: the path of a GGUF file"):
        EngineConfig(kind="llamacpp")
    assert EngineConfig(kind="llamacpp", model="/m/qwen2.5-7b-q4.gguf").served_model == "qwen2.5-7b-q4"


def test_a_session_goes_back_to_the_slot_that_holds_it(llama) -> None:  # type: ignore[no-untyped-def]
    """Two slots, two sessions taking turns: each turn takes the slot still holding its session, so no turn
    restores a block from the pool (a newcomer takes the empty slot, not the one just freed)."""
    e = llama(slots=2)
    cap = Capture(e)
    pa, pb = prompt(300), prompt(300, seed=7)
    cap.turn("a", pa)
    cap.turn("b", pb)
    for _ in range(2):
        for s, p in (("a", pa), ("b", pb)):
            held = e.session_tokens(s)
            assert held is not None
            p[:] = [*map(int, held), *prompt(20, seed=8)[1:]]
            cap.turn(s, p)
    assert isinstance(e.runner, LlamaRunner) and e.runner.restored_blocks == 0
