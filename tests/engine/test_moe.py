"""A mixture-of-experts GGUF (generated, Mixtral's layout) is served and replicated exactly: MoE changes nothing in KV."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from test_llamacpp import BS, Capture, _export, prompt

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.lab import testmodels


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("moe")
    return {name: testmodels.write_gguf(d / f"{name}.gguf", testmodels.spec_for(name)) for name in ("tiny", "moe-tiny")}


def _engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), slots=1, block_size=BS, max_context=2048, cache_tokens=2048,
                               llamacpp=LlamaCppConfig(threads=2, n_batch=256)))


def test_moe_replica_restores_bit_identically(ggufs: dict[str, Path]) -> None:
    """A MoE model (4 experts, 2 routed) has the dense model's KV bytes per token; its blocks, imported into another
    engine, continue the conversation with logits bit-identical to the home engine's continuation."""
    fields = gguf.GGUFReader(ggufs["moe-tiny"]).fields
    assert (fields["llama.expert_count"].contents(), fields["llama.expert_used_count"].contents()) == (4, 2)
    dense, home, away = _engine(ggufs["tiny"]), _engine(ggufs["moe-tiny"]), _engine(ggufs["moe-tiny"])
    try:
        assert home.kv_bytes_per_token == dense.kv_bytes_per_token  # the experts are FFN: no KV of their own
        assert home.fingerprint != dense.fingerprint  # a replica never crosses between the two
        p1 = prompt(5 * BS + 20)
        dense_logits, _ = Capture(dense).turn("s", p1)
        hcap = Capture(home)
        moe_logits, _ = hcap.turn("s", p1)
        assert not torch.allclose(dense_logits, moe_logits)  # the experts do compute
        toks, hashes, data = _export(home, "s")
        assert away.import_blocks("s", home.fingerprint, toks, hashes, data) == 5 * BS
        p2 = p1[: 5 * BS] + prompt(60, seed=4)[1:]
        got, done = Capture(away).turn("s", p2)
        assert done.stats.cached_tokens == 5 * BS
        assert isinstance(away.runner, LlamaRunner) and away.runner.restored_blocks == 5
        hcap.turn("s", p1[: 5 * BS])  # home: the same whole-block prefix, continued there
        at_home, _ = hcap.turn("s", p2)
        assert torch.equal(got, at_home)
    finally:
        for e in (dense, home, away):
            e.close()
