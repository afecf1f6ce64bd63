"""A model whose llama.cpp state kvmesh cannot read is served with live caches only: reuse by extending the slot's
sequence, no blocks, no replicas, and it says why. Every model here parses (the generated hybrid and Mamba GGUFs keep
blocks and snapshots: test_hybrid_replicas), so the unknown format is simulated: the state parser refuses the
generated Mamba model's, as it would a layout a newer llama.cpp writes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
from test_llamacpp import Capture, prompt

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine import llamastate
from kvmesh.node.engine.engine import Engine, GenerateRequest, TurnBegin
from kvmesh.node.engine.live import LivePrefix
from kvmesh.node.engine.prefix import BlockPrefix
from kvmesh.node.errors import ImportRefused
from kvmesh.node.lab import testmodels


@pytest.fixture(scope="module", params=["mamba-tiny"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testmodels.write_gguf(tmp_path_factory.mktemp("live") / f"{request.param}.gguf", testmodels.spec_for(request.param))


def _engine(path: Path, slots: int = 1, *, readable: bool = False) -> Engine:
    """An engine on `path`; unless `readable`, one whose state parser refuses the model's state (an unknown format)."""
    cfg = EngineConfig(model=str(path), slots=slots, block_size=64, max_context=2048, cache_tokens=2048,
                       llamacpp=LlamaCppConfig(threads=2, n_batch=256))
    if readable:
        return Engine(cfg)
    with mock.patch.object(llamastate, "learn", side_effect=ValueError("a state layout this kvmesh does not know")):
        return Engine(cfg)


def test_the_generated_models_are_hybrid_and_recurrent(tmp_path: Path) -> None:
    """hybrid-tiny is arch lfm2 with KV heads only on its attention layers, mamba-tiny arch mamba: both load with blocks
    (mamba's hold no attention cell) and snapshots; an unreadable state is served with live caches and says why."""
    hy = testmodels.write_gguf(tmp_path / "h.gguf", testmodels.spec_for("hybrid-tiny"))
    fields = gguf.GGUFReader(hy).fields
    assert fields["general.architecture"].contents() == "lfm2"
    assert list(fields["lfm2.attention.head_count_kv"].contents()) == [0, 2, 0, 2]
    ma = testmodels.write_gguf(tmp_path / "m.gguf", testmodels.spec_for("mamba-tiny"))
    assert gguf.GGUFReader(ma).fields["general.architecture"].contents() == "mamba"
    h, m, unknown = _engine(hy, readable=True), _engine(ma, readable=True), _engine(ma)
    try:
        assert h.inexact_reason is None and isinstance(h.prefix, BlockPrefix) and h.snapshots is not None
        assert m.inexact_reason is None and isinstance(m.prefix, BlockPrefix) and m.snapshots is not None
        assert h.kv_bytes_per_token > 100 and m.block_bytes < 100  # only lfm2's attention layers grow
        assert unknown.inexact_reason is not None and "cannot read its llama.cpp sequence state" in unknown.inexact_reason
        assert isinstance(unknown.prefix, LivePrefix) and unknown.snapshots is None and unknown.kv_bytes_per_token == 1
    finally:
        h.close()
        m.close()
        unknown.close()


def test_a_turn_that_extends_the_slot_reuses_it_and_equals_a_cold_turn(hybrid: Path) -> None:
    """The second turn reuses every token its slot holds; its logits equal a cold engine's full prefill
    to within chunking noise, and a prompt that edits an earlier token recomputes from the start."""
    home, cold = _engine(hybrid), _engine(hybrid)
    try:
        cap = Capture(home)
        p1 = prompt(300)
        cap.turn("s", p1, max_tokens=4)
        held = home.session_tokens("s")
        assert held is not None and home.resident_tokens("s") == len(held) == 300 + 3
        p2 = [int(t) for t in held] + prompt(40, seed=1)[1:]
        got, done = cap.turn("s", p2)
        assert done.stats.cached_tokens == len(held)
        ref, ref_done = Capture(cold).turn("s", p2)
        assert ref_done.stats.cached_tokens == 0
        assert float((got - ref).abs().max()) <= 2e-2 and int(got.argmax()) == int(ref.argmax())
        edited = [*p2[:10], p2[10] + 1, *p2[11:]]
        _, done = cap.turn("s", edited)
        assert done.stats.cached_tokens == 0  # a recurrent state cannot roll back to position 10
    finally:
        home.close()
        cold.close()


def test_another_session_on_the_slot_takes_its_cache(hybrid: Path) -> None:
    """One slot, two sessions: the second's turn overwrites the first's cache, which is reported gone (evicted,
    resident 0) and recomputed on its next turn, never reused from a memory of it."""
    e = _engine(hybrid)
    gone: list[str] = []
    e.on_evict = gone.append
    try:
        cap = Capture(e)
        cap.turn("a", prompt(200))
        assert e.resident_tokens("a") == 200
        cap.turn("b", prompt(150, seed=2))
        assert gone == ["a"] and e.resident_tokens("a") == 0 and e.resident_tokens("b") == 150
        _, done = cap.turn("a", prompt(200) + prompt(20, seed=3)[1:])
        assert done.stats.cached_tokens == 0
    finally:
        e.close()


def test_a_session_returns_to_its_own_slot(hybrid: Path) -> None:
    """Two slots: each session's next turn takes the slot that holds its cache, so both reuse."""
    e = _engine(hybrid, slots=2)
    try:
        cap = Capture(e)
        pa, pb = prompt(120), prompt(130, seed=4)
        cap.turn("a", pa)
        cap.turn("b", pb)
        for s, p in (("a", pa), ("b", pb), ("a", pa)):
            held = e.session_tokens(s)
            assert held is not None
            _, done = cap.turn(s, [*map(int, held), *prompt(10, seed=5)[1:]])
            assert done.stats.cached_tokens == len(held), s
    finally:
        e.close()


def test_it_has_no_blocks_to_send_or_take(hybrid: Path) -> None:
    """No pin, no export and an import refused with the reason: a replica of a recurrent state would be wrong."""
    e = _engine(hybrid)
    try:
        Capture(e).turn("s", prompt(300))
        assert e.pin("s") is None
        with e.export("s") as blocks:
            assert blocks == []
        with pytest.raises(ImportRefused, match="keeps no blocks") as err:
            e.import_blocks("s", e.fingerprint, np.asarray(prompt(64), dtype=np.int32), [b"x" * 16], [b""])
        assert err.value.reason == "inexact"
        assert e.evict("s") and e.resident_tokens("s") == 0
    finally:
        e.close()


def test_a_turn_that_ends_badly_leaves_the_slot_nobodys(hybrid: Path) -> None:
    """A turn abandoned on another session's slot takes that session's cache away (resident 0) and claims none
    itself: what the slot holds is nobody's until a turn ends well there."""
    e = _engine(hybrid)
    gone: list[str] = []
    e.on_evict = gone.append

    async def abandoned() -> None:
        turn = e.generate(GenerateRequest("b", prompt(150, seed=2), max_tokens=4))
        assert isinstance(await anext(turn), TurnBegin)
        await turn.aclose()  # the client went away before the prefill

    try:
        Capture(e).turn("a", prompt(200))
        asyncio.run(abandoned())
        assert gone == ["a"] and e.resident_tokens("a") == 0 and e.resident_tokens("b") == 0
        _, done = Capture(e).turn("b", prompt(150, seed=2) + prompt(10, seed=6)[1:])
        assert done.stats.cached_tokens == 0 and e.resident_tokens("b") > 150
    finally:
        e.close()
