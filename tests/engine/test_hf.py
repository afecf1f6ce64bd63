"""Local Hugging Face checkpoints in the torch engine (no downloads).

Each test writes a tiny random checkpoint in Hugging Face layout into tmp_path:
config.json (Llama with llama3 RoPE scaling, Qwen2 with qkv bias and linear
scaling, Qwen3 with QK-norm, tied embeddings and head_dim != hidden/heads),
safetensors weights (one sharded with an index), a byte-level BPE tokenizer.json
trained here with `tokenizers`, and tokenizer_config.json with a chat template.
Everything runs on the CPU in fp32, so reuse and import must match a full
prefill to float-reordering precision.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine import hf
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.hf import open_checkpoint
from kvmesh.node.engine.decoder import fingerprint, preset
from kvmesh.node.engine.tokenizer import HFTokenizer
from kvmesh.node.errors import CheckpointError, ConfigError, ImportRefused
from kvmesh.node.lab.checkpoints import write_random_checkpoint

CPU = torch.device("cpu")
# fp32 on the CPU: reuse/import only reorder float sums.
LOGITS_ATOL = 1e-4
# Against transformers (fp32, eager attention there, SDPA/flash here).
HF_ATOL = 1e-4

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = [
    "the cache of a session stays warm on the host that served it",
    "a replica of the blocks moves to the next host before the turn",
    "def build(spec): return engine.prefill(tokens) if cached else None",
    "héllo wörld — unicode text, tabs\tand newlines\n",
]

BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="float32",
)
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=False,
        rope_scaling={"type": "linear", "factor": 2.0}, use_sliding_window=False, sliding_window=None,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0, tie_word_embeddings=True,
        head_dim=32, attention_bias=False, rope_scaling=None, use_sliding_window=False, sliding_window=None,
    ),
}


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok.to_str()


_TOKENIZER: list[str] = []


def write_checkpoint(d: Path, variant: str, *, seed: int = 0, shards: int = 1, template: str | None = "auto",
                     vocab_pad: int = 16) -> Path:
    """A random checkpoint of `variant` in Hugging Face layout; returns the directory."""
    d.mkdir(parents=True, exist_ok=True)
    if not _TOKENIZER:
        _TOKENIZER.append(_tokenizer_json())
    (d / "tokenizer.json").write_text(_TOKENIZER[0])
    n_vocab = json.loads(_TOKENIZER[0])["model"]["vocab"].__len__()
    ids = {t: SPECIALS.index(t) for t in SPECIALS}  # trained specials take the first ids
    llama = variant == "llama"
    eos = "<|eot_id|>" if llama else "<|im_end|>"
    tc: dict[str, Any] = {"eos_token": eos, "bos_token": "<|begin_of_text|>" if llama else None}
    if template == "auto":
        tc["chat_template"] = LLAMA3 if llama else CHATML
    elif template is not None:
        tc["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg = {**BASE, **VARIANTS[variant], "vocab_size": n_vocab + vocab_pad,  # padded, like real checkpoints
           "bos_token_id": ids["<|begin_of_text|>"] if llama else None,
           "eos_token_id": [ids["<|eot_id|>"], ids["<|endoftext|>"]] if llama else ids["<|im_end|>"]}
    write_random_checkpoint(d, cfg, seed=seed, shards=shards)
    return d


def _cfg(model: Path, **kw: object) -> EngineConfig:
    base: dict[str, object] = dict(kind="torch", model=str(model), cache_bytes=4 << 20, max_context=1024, block_size=16,
                                   slots=1, prefill_chunk=64, first_chunk=128, device="cpu", dtype="float32")
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


MSGS = [
    {"role": "system", "content": "You are a coding agent. " + " ".join(CORPUS)},
    {"role": "user", "content": "Build the cache. " + CORPUS[2] * 3},
]
FOLLOW = MSGS + [{"role": "assistant", "content": "done: " + CORPUS[1]}, {"role": "user", "content": CORPUS[0] * 2}]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": write_checkpoint(root / "tiny-llama", "llama", seed=1, shards=2),
        "qwen2": write_checkpoint(root / "tiny-qwen2", "qwen2", seed=2),
        "qwen3": write_checkpoint(root / "tiny-qwen3", "qwen3", seed=3),
    }


@pytest.fixture
def engines():  # type: ignore[no-untyped-def]
    made: list[Engine] = []

    def make(cfg: EngineConfig) -> Engine:
        e = Engine(cfg)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _turn(engine: Engine, session: str, prompt: list[int], max_tokens: int = 8) -> tuple[str, Any]:
    from kvmesh.node.engine.engine import GenerateRequest, TextDelta, TurnDone

    async def go() -> tuple[str, Any]:
        text, stats = "", None
        async for ev in engine.generate(GenerateRequest(session, prompt, max_tokens=max_tokens, temperature=0.0)):
            if isinstance(ev, TextDelta):
                text += ev.text
            elif isinstance(ev, TurnDone):
                stats = ev.stats
        return text, stats

    return asyncio.run(go())


def _logits(engine: Engine, prompt: list[int], reuse_blocks: list[int] | None = None, reuse: int = 0) -> torch.Tensor:
    """Last-position logits for `prompt` on slot 0, after loading `reuse` tokens of these pool blocks."""
    r = engine.runner

    async def go() -> torch.Tensor:
        await r.load(0, reuse_blocks or [], np.asarray(prompt[:reuse], dtype=np.int32))
        return await r.forward(0, np.asarray(prompt[reuse:], dtype=np.int32), reuse)

    return asyncio.run(go())


# ---- loading --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loads_and_greedy_is_deterministic(ckpts: dict[str, Path], engines, variant: str) -> None:  # type: ignore[no-untyped-def]
    """The checkpoint loads into the one Decoder; two engines give the same greedy text and logits."""
    a, b = engines(_cfg(ckpts[variant])), engines(_cfg(ckpts[variant]))
    assert a.model_name == ckpts[variant].name
    assert a.model_cfg.checkpoint and a.fingerprint == b.fingerprint
    assert isinstance(a.tokenizer, HFTokenizer) and a.decode.allowed is None  # real models are not masked
    prompt = a.tokenizer.apply_chat_template(MSGS)
    ta, sa = _turn(a, "s", prompt, max_tokens=12)
    tb, sb = _turn(b, "s", prompt, max_tokens=12)
    assert (ta, sa.completion_tokens) == (tb, sb.completion_tokens)
    assert sa.completion_tokens >= 1
    torch.testing.assert_close(_logits(a, prompt), _logits(b, prompt), atol=0, rtol=0)


def test_config_options_reach_the_decoder(ckpts: dict[str, Path]) -> None:
    llama = open_checkpoint(ckpts["llama"], max_context=4096).config
    assert (llama.rope_scaling, llama.rope_factor, llama.rope_original_context) == ("llama3", 8.0, 64)
    assert llama.eos_ids == (SPECIALS.index("<|eot_id|>"), 0) and llama.max_context == 1024
    qwen2 = open_checkpoint(ckpts["qwen2"], max_context=4096).config
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.rope_scaling == "linear"
    qwen3 = open_checkpoint(ckpts["qwen3"], max_context=512).config
    assert qwen3.qk_norm and qwen3.tie_embeddings and qwen3.head_dim == 32 and qwen3.max_context == 512
    m = hf.load_decoder(open_checkpoint(ckpts["qwen3"], max_context=512), torch.float32, CPU)
    assert m.lm_head.weight is m.embed.weight


# ---- prefix reuse and replica import ---------------------------------------------------


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_prefix_reuse_and_import_match_full_prefill(ckpts: dict[str, Path], engines, variant: str) -> None:  # type: ignore[no-untyped-def]
    """Turn 2 reusing turn 1's cache, and a replica engine importing it, give a cold prefill's output and logits."""
    home, cold, replica = (engines(_cfg(ckpts[variant])) for _ in range(3))
    p1 = home.tokenizer.apply_chat_template(MSGS)
    p2 = home.tokenizer.apply_chat_template(FOLLOW)
    assert p2[: len(p1) - 3] == p1[: len(p1) - 3]  # the conversation grew at the end
    _turn(home, "s", p1)
    warm_text, warm = _turn(home, "s", p2)
    assert warm.cached_tokens >= (len(p1) - 3) // 16 * 16 > 0
    cold_text, cold_stats = _turn(cold, "s", p2)
    assert cold_stats.cached_tokens == 0 and warm_text == cold_text

    with home.export("s") as blocks:
        toks = home.session_tokens("s")
        assert toks is not None
        n = len(blocks) * home.block_size
        got = replica.import_blocks("s", home.fingerprint, toks[:n], [b.hash for b in blocks], [b.data for b in blocks])
    assert got == n > 0
    rep_text, rep = _turn(replica, "s", p2)
    assert rep.cached_tokens >= min(n, len(p2) - 1) - home.block_size and rep_text == cold_text

    # Logits: the imported blocks loaded into a slot, the rest prefilled == a full prefill.
    fresh = engines(_cfg(ckpts[variant]))
    with home.export("s") as blocks:
        toks = home.session_tokens("s")
        fresh.import_blocks("s2", home.fingerprint, toks[:n], [b.hash for b in blocks], [b.data for b in blocks])
    m = fresh.prefix.match("s2", np.asarray(p2, dtype=np.int32))
    reuse = min(m.tokens, len(p2) - 1)
    assert reuse > 0
    ids = m.block_ids[: -(-reuse // fresh.block_size)]
    torch.testing.assert_close(_logits(fresh, p2, ids, reuse), _logits(cold, p2), atol=LOGITS_ATOL, rtol=0)


def test_fingerprint_mismatch_refuses_import(ckpts: dict[str, Path], tmp_path: Path, engines) -> None:  # type: ignore[no-untyped-def]
    """Other weights, same config: another fingerprint, and the import is refused. A copy of the same
    checkpoint elsewhere has the same fingerprint (replicas cross between copies)."""
    other = write_checkpoint(tmp_path / "other", "qwen3", seed=99)
    copy = tmp_path / "copy"
    shutil.copytree(ckpts["qwen3"], copy)
    a, b, c = engines(_cfg(ckpts["qwen3"])), engines(_cfg(other)), engines(_cfg(copy))
    assert a.fingerprint != b.fingerprint and a.fingerprint == c.fingerprint
    assert a.seed_hash != b.seed_hash  # block hashes of the same tokens differ too
    _turn(a, "s", a.tokenizer.apply_chat_template(MSGS), max_tokens=2)
    with a.export("s") as blocks:
        toks = a.session_tokens("s")
        n = len(blocks) * a.block_size
        with pytest.raises(ImportRefused) as ei:
            b.import_blocks("s", a.fingerprint, toks[:n], [x.hash for x in blocks], [x.data for x in blocks])
        assert ei.value.reason == "fingerprint"
        assert c.import_blocks("s", a.fingerprint, toks[:n], [x.hash for x in blocks], [x.data for x in blocks]) == n
    assert b.resident_tokens("s") == 0


def test_digest_is_cached_and_follows_the_bytes(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", "llama", shards=2)
    first = open_checkpoint(d, max_context=512).config.checkpoint
    cache = json.loads((d / hf.FINGERPRINT_FILE).read_text())
    assert cache["algo"] == "xxh3-128" and len(cache["files"]) == 2
    hf._DIGESTS.clear()  # a new process: the file answers without hashing again
    calls: list[Path] = []
    real = hf._hash_file
    hf._hash_file = lambda f: calls.append(f) or real(f)  # type: ignore[assignment]
    try:
        assert open_checkpoint(d, max_context=512).config.checkpoint == first and calls == []
        # Rewriting a shard (other bytes) changes its stat, so it is hashed again and the digest moves.
        shard = sorted(d.glob("model-*.safetensors"))[0]
        from safetensors.torch import load_file

        t = load_file(str(shard))
        k = sorted(t)[0]
        t[k] = t[k] + 1.0
        save_file(t, str(shard), metadata={"format": "pt"})
        assert open_checkpoint(d, max_context=512).config.checkpoint != first and calls == [shard]
    finally:
        hf._hash_file = real  # type: ignore[assignment]
    # The engine's max_context does not change the checkpoint digest (it is in the fingerprint anyway).
    assert open_checkpoint(d, max_context=256).config.checkpoint == open_checkpoint(d, max_context=512).config.checkpoint


# ---- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model-00002-of-00002.safetensors", "all-weights"])
def test_a_missing_file_is_named(tmp_path: Path, missing: str) -> None:
    d = write_checkpoint(tmp_path / "m", "llama", shards=2)
    if missing == "all-weights":
        for f in d.glob("model*"):
            f.unlink()
        missing = "model.safetensors"
    else:
        (d / missing).unlink()
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        Engine(_cfg(d))


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", "qwen2")
    from safetensors.torch import load_file

    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.self_attn.k_proj.bias"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        Engine(_cfg(d))


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "GPT2LMHeadModel"])
def test_unsupported_architecture_is_refused_by_name(tmp_path: Path, arch: str) -> None:
    d = write_checkpoint(tmp_path / "m", "llama")
    raw = json.loads((d / "config.json").read_text())
    raw["architectures"] = [arch]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=arch):
        Engine(_cfg(d))


def test_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", "qwen2")
    raw = json.loads((d / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="yarn"):
        open_checkpoint(d, max_context=512)


def test_engine_config_kind_and_model() -> None:
    with pytest.raises(ValueError, match="needs engine.model"):
        EngineConfig(kind="torch")
    with pytest.raises(ValueError, match="kind = \"torch\""):
        EngineConfig(kind="tiny", model="/x")
    assert EngineConfig(kind="torch", model="/srv/models/Qwen3-8B/").served_model == "Qwen3-8B"
    assert EngineConfig(kind="torch", model="/m", model_name="q").served_model == "q"
    from kvmesh.node.config import load_config

    with pytest.raises(ConfigError, match="needs engine.model"):
        load_config(None, {"engine.kind": "torch"})


# ---- tokenizer -------------------------------------------------------------------------


def test_hf_tokenizer_chat_template_and_bytes(ckpts: dict[str, Path]) -> None:
    tok = HFTokenizer.from_dir(ckpts["qwen3"])
    ids = tok.apply_chat_template(MSGS)
    assert tok.decode(ids).startswith("system\nYou are a coding agent.")  # specials skipped
    text = tok._tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    starts = tok.message_starts(np.asarray(ids))
    assert len(starts) == 3 and starts[0] == 0 and ids[starts[1]] == SPECIALS.index("<|im_start|>")
    assert tok.eos_id == SPECIALS.index("<|im_end|>") and tok.generation_mask() is None
    # Token bytes through the incremental decoder rebuild the text, multi-byte characters included.
    s = CORPUS[3]
    dec = tok.incremental_decoder()
    assert "".join(dec.decode(tok.token_bytes(i)) for i in tok.encode(s)) + dec.decode(b"", final=True) == s
    assert tok.token_bytes(tok.vocab_size + 5) == b""  # padded embedding rows emit nothing
    llama = HFTokenizer.from_dir(ckpts["llama"])
    lids = llama.apply_chat_template(MSGS)
    assert lids[0] == SPECIALS.index("<|begin_of_text|>") and len(llama.message_starts(np.asarray(lids))) == 3


def test_hf_tokenizer_fallback_template(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", "qwen2", template=None)
    tok = HFTokenizer.from_dir(d)
    assert not tok.has_chat_template
    text = tok._tok.decode(tok.apply_chat_template(MSGS[1:]), skip_special_tokens=False)
    assert text == f"<|user|>\n{MSGS[1]['content']}<|im_end|>\n<|assistant|>\n"


def test_tiny_preset_fingerprint_is_unchanged() -> None:
    """New ModelConfig fields at their defaults leave the tiny fingerprint (and every stored hash) as it was."""
    assert fingerprint(preset("tiny", max_context=512), torch.float32, 256) == "0bc90429b4517eb17ace5afd48283411"
    assert fingerprint(preset("tiny"), torch.bfloat16, 256) == "7a67fbd7703487cc4b9373537d18bc05"


# ---- against transformers (the reference) ------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(ckpts: dict[str, Path], engines, variant: str) -> None:  # type: ignore[no-untyped-def]
    """Our last-position logits equal transformers' for the same checkpoint (fp32, atol 1e-4; measured ~1e-6)."""
    import transformers  # a test dependency: the reference implementation
    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[variant]
    ref = getattr(transformers, cls).from_pretrained(str(ckpts[variant]), torch_dtype=torch.float32).eval()
    e = engines(_cfg(ckpts[variant]))
    prompt = e.tokenizer.apply_chat_template(FOLLOW)
    assert len(prompt) > e.cfg.first_chunk  # chunked prefill on our side
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0].float()
    got = _logits(e, prompt)
    torch.testing.assert_close(got, want[-1], atol=HF_ATOL, rtol=0)
    # And after a decode step (one cached token more).
    got2 = asyncio.run(e.runner.forward(0, np.asarray([5], dtype=np.int32), len(prompt)))
    with torch.no_grad():
        want2 = ref(torch.tensor([prompt + [5]])).logits[0, -1].float()
    torch.testing.assert_close(got2, want2, atol=HF_ATOL, rtol=0)


# ---- batched decode ----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_decode_batch_equals_per_slot_steps(ckpts: dict[str, Path], variant: str) -> None:
    """Decoder.decode over 3 slots at different positions == each slot's own one-token forward."""
    ck = open_checkpoint(ckpts[variant], max_context=256)
    m = hf.load_decoder(ck, torch.float32, CPU)
    c = m.cfg
    lens = [40, 97, 5]
    gen = torch.Generator().manual_seed(0)
    wss, single = [], []
    for n in lens:
        ws = torch.zeros(c.n_layers, 2, c.n_kv_heads, c.max_context, c.head_dim)
        m(torch.randint(0, 300, (n,), generator=gen), ws, 0)
        wss.append(ws)
    nxt = torch.tensor([7, 123, 250])
    copies = [ws.clone() for ws in wss]
    for b, n in enumerate(lens):
        single.append(m(nxt[b : b + 1], copies[b], n))
    batch = m.decode(nxt, wss, lens)
    assert batch.shape == (3, c.vocab_size)
    torch.testing.assert_close(batch, torch.stack(single), atol=LOGITS_ATOL, rtol=0)
    for b, n in enumerate(lens):  # each row's KV landed in its own workspace, at its position
        torch.testing.assert_close(wss[b][:, :, :, : n + 1], copies[b][:, :, :, : n + 1], atol=1e-5, rtol=0)


def test_concurrent_turns_decode_in_batches(ckpts: dict[str, Path], engines) -> None:  # type: ignore[no-untyped-def]
    """Three turns at once on three slots: their steps share batches, and each turn's text is the
    text it has alone."""
    from kvmesh.node.engine.engine import GenerateRequest, TextDelta

    e = engines(_cfg(ckpts["qwen3"], slots=3))
    prompts = [e.tokenizer.apply_chat_template([{"role": "user", "content": CORPUS[i] * (i + 1)}]) for i in range(3)]
    alone = [_turn(e, f"alone{i}", p, max_tokens=10)[0] for i, p in enumerate(prompts)]
    b0, s0 = e.runner.decoder.batches, e.runner.decoder.steps

    async def one(i: int) -> str:
        out = ""
        async for ev in e.generate(GenerateRequest(f"s{i}", prompts[i], max_tokens=10, temperature=0.0)):
            if isinstance(ev, TextDelta):
                out += ev.text
        return out

    async def all_three() -> list[str]:
        return list(await asyncio.gather(*(one(i) for i in range(3))))

    together = asyncio.run(all_three())
    assert together == alone
    batches, steps = e.runner.decoder.batches - b0, e.runner.decoder.steps - s0
    assert steps > batches  # some steps ran together


def test_bench_ttft_runs_on_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh bench ttft --json --model DIR`: cold and warm (imported) turns on the checkpoint."""
    import argparse

    from kvmesh.node.lab.bench.ttft import run_ttft

    d = write_checkpoint(tmp_path / "bench-qwen3", "qwen3")
    raw = json.loads((d / "config.json").read_text())
    raw["max_position_embeddings"] = 8192
    (d / "config.json").write_text(json.dumps(raw))
    args = argparse.Namespace(json=True, tokens=3000, engine="tiny", model=d, store_dir=tmp_path / "store")
    assert run_ttft(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["engine"] == "torch" and out["model"] == "bench-qwen3"
    assert abs(out["prompt_tokens"] - 3000) <= 0.05 * 3000  # sized in the checkpoint's tokens
    assert out["warm_cached_tokens"] > 0 and out["cold_ttft_s"] > 0
