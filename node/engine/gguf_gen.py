"""Random-weight GGUF models for tests, benches and the demo: no download, same bytes on every host.

llama.cpp needs a real GGUF file to run; kvmesh's tests and benches need a small one that
every node of a test mesh holds byte for byte (the fingerprint covers the file's digest).
`write_gguf` writes one from a `GGUFSpec` with the `gguf` package: architecture `llama` (or
`qwen2`, which adds q/k/v biases), the metadata keys llama.cpp requires, and weights drawn
from a seeded generator, so two hosts that generate the same spec get identical files.

Vocabularies:
- `byte`: a byte-level SentencePiece-style vocabulary (`<unk>`, `<s>`, `</s>`, `<0x00>`..`<0xFF>`,
  and `▁` so a space decodes back to a space); every printable ASCII string tokenizes to one
  id per byte, so generated text round-trips through a client exactly. The file also names the
  ids a random model may emit (`kvmesh.allowed_tokens`), as the byte tokenizer's mask does.
- `llama-spm`, `llama-bpe`, `qwen2`, ...: every `tokenizer.*` key of one of llama.cpp's
  vocabulary-only GGUFs (`node.engine.vocab`), so the engine runs a real Llama or Qwen tokenizer
  and chat template; the model takes the vocabulary file's architecture.

Presets: `tiny` (2 layers, for tests), `bench` (a real model's proportions scaled down: GQA
with 4 query heads per KV head, head_dim 64, an FFN 3.5x wide), `moe-tiny` (tiny's attention, 4
experts), `hybrid-tiny` (architecture `lfm2`: short-convolution layers, whose state is recurrent,
between attention layers, as LFM2, Granite 4.0-H and Qwen3-Next mix them) and `mamba-tiny`
(architecture `mamba`: recurrent layers only). `ensure_model` writes a preset
once into a cache folder and returns its path.

    python -m kvmesh.node.engine.gguf_gen tiny /tmp/tiny.gguf
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ALLOWED_TOKENS_KEY = "kvmesh.allowed_tokens"  # ids a random-weight model may emit (see module docstring)
SPACE_PIECE = "\u2581"
# llama.cpp token types (llama_token_type in llama.h)
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class GGUFSpec:
    """Shape, vocabulary and seed of a generated model."""

    n_layers: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    context_length: int = 65536
    vocab: str = "byte"  # "byte", or a vocabulary name of node.engine.vocab ("llama-spm", "qwen2", ...)
    seed: int = 0
    logit_scale: float = 4.0  # spread of the output logits: greedy choices are far from ties
    name: str = "kvmesh-tiny"
    n_expert: int = 0  # > 0: a mixture of experts (Mixtral's layout under arch llama), n_expert_used routed a token
    n_expert_used: int = 0
    # Arch lfm2 (LFM2's hybrid layout): these layers are short convolutions with a recurrent state of
    # `conv_cache` positions, not attention; the others are attention with q/k norms.
    conv_layers: tuple[int, ...] = ()
    conv_cache: int = 3
    ssm_state: int = 0  # > 0: arch mamba (recurrent only, no attention, no FFN), this state size per channel

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS: dict[str, GGUFSpec] = {
    "tiny": GGUFSpec(),
    # Llama-3-8B's proportions, scaled down: 32 query heads over 8 KV heads becomes 8 over 2,
    # head_dim 128 becomes 64, FFN 3.5x n_embd; 4 layers. ~2 KiB of f16 KV per token.
    "bench": GGUFSpec(n_layers=4, n_embd=512, n_head=8, n_head_kv=2, n_ff=1792, name="kvmesh-bench"),
    # tiny's attention (so the same KV per token) with 4 experts, 2 routed per token.
    "moe-tiny": GGUFSpec(n_expert=4, n_expert_used=2, name="kvmesh-moe-tiny"),
    # A hybrid model (LFM2's layout): 4 layers, short-conv layers 0 and 2 with recurrent state, attention 1 and 3.
    "hybrid-tiny": GGUFSpec(n_layers=4, conv_layers=(0, 2), name="kvmesh-hybrid-tiny"),
    # A recurrent model (Mamba's layout): 2 selective-state-space layers, no attention at all.
    "mamba-tiny": GGUFSpec(ssm_state=16, name="kvmesh-mamba-tiny"),
}


def _byte_vocab() -> tuple[list[str], list[int], list[int]]:
    """Tokens, token types and the ids a random model may emit, of the byte vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [SPACE_PIECE]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL]
    # Printable ASCII but the space byte (a space is the ▁ piece), newline, ▁ and </s>: each
    # string of these re-tokenizes to the same ids, so a client's echo matches the cache.
    allowed = [3 + b for b in range(33, 127)] + [3 + 10, 259, 2]
    return tokens, types, sorted(allowed)


def _write_byte_vocab(w: Any) -> None:
    import gguf

    tokens, types, allowed = _byte_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)  # a prompt's first space is the client's, not the tokenizer's
    w.add_key_value(ALLOWED_TOKENS_KEY, allowed, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)


def _vocab_arch(name: str) -> str:
    import gguf

    from kvmesh.node.engine.vocab import vocab_path

    return str(gguf.GGUFReader(vocab_path(name)).fields["general.architecture"].contents())


def _copy_vocab(w: Any, name: str) -> int:
    """Copy every tokenizer.* key of a vocabulary GGUF; returns its vocabulary size."""
    import gguf

    from kvmesh.node.engine.vocab import vocab_path

    r = gguf.GGUFReader(vocab_path(name))
    n_vocab = 0
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        val = f.contents()
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(val)
        w.add_key_value(key, val, vtype, sub)
    return n_vocab


def _weights(spec: GGUFSpec, arch: str, n_vocab: int) -> dict[str, np.ndarray]:
    """Seeded random weights in numpy's (out, in) order; the gguf writer reverses to ggml's."""
    rng = np.random.default_rng(spec.seed)
    d = spec.n_embd

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        # 1/sqrt(fan_in) keeps activations O(1) through the layers, so attention really mixes.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(np.float16)

    t: dict[str, np.ndarray] = {
        "token_embd.weight": (rng.standard_normal((n_vocab, d), dtype=np.float32)).astype(np.float16),
        "output_norm.weight": np.ones(d, dtype=np.float32),
        "output.weight": mat(n_vocab, d, spec.logit_scale),
    }
    if spec.conv_layers:  # lfm2 names the final norm after the embeddings
        t["token_embd_norm.weight"] = t.pop("output_norm.weight")
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = np.ones(d, dtype=np.float32)
        if spec.ssm_state:
            t.update(_mamba(p, spec, mat))
            continue
        if i in spec.conv_layers:
            t[p + "shortconv.conv.weight"] = mat(d, spec.conv_cache).astype(np.float32)  # ggml_ssm_conv reads f32
            t[p + "shortconv.in_proj.weight"] = mat(3 * d, d)
            t[p + "shortconv.out_proj.weight"] = mat(d, d)
        else:
            t.update(_attention(p, spec, arch, rng, mat))
        t[p + "ffn_norm.weight"] = np.ones(d, dtype=np.float32)
        if spec.n_expert:
            t.update(_experts(p, spec, mat))
            continue
        t[p + "ffn_gate.weight"] = mat(spec.n_ff, d)
        t[p + "ffn_up.weight"] = mat(spec.n_ff, d)
        t[p + "ffn_down.weight"] = mat(d, spec.n_ff)
    return t


def _attention(p: str, spec: GGUFSpec, arch: str, rng: np.random.Generator, mat: Any) -> dict[str, np.ndarray]:
    """One attention layer's projections (and qwen2's biases, lfm2's q/k norms)."""
    d, hd, kv = spec.n_embd, spec.head_dim, spec.n_head_kv * spec.head_dim
    t = {p + "attn_q.weight": mat(spec.n_head * hd, d, 2.0), p + "attn_k.weight": mat(kv, d, 2.0),
         p + "attn_v.weight": mat(kv, d), p + "attn_output.weight": mat(d, spec.n_head * hd)}
    if arch == "qwen2":
        for n, size in (("q", spec.n_head * hd), ("k", kv), ("v", kv)):
            t[p + f"attn_{n}.bias"] = (rng.standard_normal(size, dtype=np.float32) * 0.1).astype(np.float32)
    if spec.conv_layers:
        t[p + "attn_q_norm.weight"] = np.ones(hd, dtype=np.float32)
        t[p + "attn_k_norm.weight"] = np.ones(hd, dtype=np.float32)
    return t


def _mamba(p: str, spec: GGUFSpec, mat: Any) -> dict[str, np.ndarray]:
    """One Mamba layer: input and output projections, a causal conv, the selective scan's parameters."""
    d, inner, n, rank = spec.n_embd, 2 * spec.n_embd, spec.ssm_state, _dt_rank(spec)
    f32 = np.float32
    return {p + "ssm_in.weight": mat(2 * inner, d), p + "ssm_conv1d.weight": mat(inner, 4).astype(f32),
            p + "ssm_conv1d.bias": np.zeros(inner, dtype=f32), p + "ssm_x.weight": mat(rank + 2 * n, inner),
            p + "ssm_dt.weight": mat(inner, rank), p + "ssm_dt.bias": np.full(inner, -2.0, dtype=f32),
            # A = -exp(A_log), stored negated: a decaying state
            p + "ssm_a": -np.tile(np.arange(1, n + 1, dtype=f32), (inner, 1)),
            p + "ssm_d": np.ones(inner, dtype=f32), p + "ssm_out.weight": mat(d, inner)}


def _dt_rank(spec: GGUFSpec) -> int:
    return -(-spec.n_embd // 16)


def _experts(p: str, spec: GGUFSpec, mat: Any) -> dict[str, np.ndarray]:
    """One layer's router and stacked experts (ggml's [n_expert, rows, cols] tensors)."""
    d, ff, n = spec.n_embd, spec.n_ff, spec.n_expert
    return {p + "ffn_gate_inp.weight": mat(n, d, 4.0).astype(np.float32),  # a router far from ties
            p + "ffn_gate_exps.weight": np.stack([mat(ff, d) for _ in range(n)]),
            p + "ffn_up_exps.weight": np.stack([mat(ff, d) for _ in range(n)]),
            p + "ffn_down_exps.weight": np.stack([mat(d, ff) for _ in range(n)])}


def write_gguf(path: str | Path, spec: GGUFSpec) -> Path:
    """Write the model `spec` describes to `path` (through a temp name, renamed when complete)."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        if spec.vocab == "byte":
            arch = "mamba" if spec.ssm_state else "lfm2" if spec.conv_layers else "llama"
            n_vocab = len(_byte_vocab()[0])
            w = gguf.GGUFWriter(tmp, arch)
            _write_byte_vocab(w)
        else:
            arch = _vocab_arch(spec.vocab)  # the model takes its vocabulary's architecture
            if arch not in ("llama", "qwen2"):
                raise ValueError(f"vocabulary {spec.vocab!r} is for architecture {arch!r}; the generator writes llama and qwen2")
            w = gguf.GGUFWriter(tmp, arch)
            n_vocab = _copy_vocab(w, spec.vocab)
        _write_hparams(w, spec, n_vocab)
        for name, arr in _weights(spec, arch, n_vocab).items():
            w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the model from other users of the cache
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _write_hparams(w: Any, spec: GGUFSpec, n_vocab: int) -> None:
    import gguf

    w.add_name(spec.name)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(0 if spec.ssm_state else spec.n_ff)
    w.add_head_count(0 if spec.ssm_state else spec.n_head)
    if spec.ssm_state:  # mamba: no attention heads; its scan's sizes
        for key, v in (("conv_kernel", 4), ("inner_size", 2 * spec.n_embd), ("state_size", spec.ssm_state),
                       ("time_step_rank", _dt_rank(spec))):
            w.add_uint32(f"{w.arch}.ssm.{key}", v)
    elif spec.conv_layers:  # lfm2: a layer without KV heads is a short convolution
        w.add_head_count_kv([0 if i in spec.conv_layers else spec.n_head_kv for i in range(spec.n_layers)])
        w.add_uint32(f"{w.arch}.shortconv.l_cache", spec.conv_cache)
    else:
        w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def spec_for(preset: str, **overrides: Any) -> GGUFSpec:
    if preset not in PRESETS:
        raise ValueError(f"unknown GGUF preset {preset!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


def cache_dir() -> Path:
    env = os.environ.get("KVMESH_GGUF_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvmesh" / "gguf"
    return base


def model_path(spec: GGUFSpec, folder: str | Path | None = None) -> Path:
    """Where `ensure_model` keeps the model for `spec`: the name carries a digest of the spec."""
    key = hashlib.blake2b(repr(dataclasses.astuple(spec)).encode(), digest_size=6).hexdigest()
    return Path(folder or cache_dir()) / f"{spec.name}-{spec.vocab}-{key}.gguf"


def ensure_model(spec: GGUFSpec, folder: str | Path | None = None) -> Path:
    """The generated model for `spec` in `folder` (default `cache_dir()`), written once.

    The file name carries a digest of the spec, so a changed spec never reuses a stale file."""
    path = model_path(spec, folder)
    if not path.is_file():
        write_gguf(path, spec)
    return path


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m kvmesh.node.engine.gguf_gen PRESET OUT.gguf [VOCAB]")
    extra = {"vocab": sys.argv[3]} if len(sys.argv) == 4 else {}
    print(write_gguf(sys.argv[2], spec_for(sys.argv[1], **extra)))
