"""Random-weight GGUF models: the generated aliases' files (`--model moe-tiny`), no download, same bytes on every host.

The runtime keeps this writer because those aliases (node.modelnames.GENERATED: `moe-tiny`,
`hybrid-tiny`, `mamba-tiny`, for model kinds no package ships) are written on first use by the
node that serves them; the presets only tests and benches use, real vocabularies and the
command line are node.lab.testmodels'.

llama.cpp needs a real GGUF file to run, and every node of a mesh must hold it byte for byte
(the fingerprint covers the file's digest). `write_gguf` writes one from a `GGUFSpec` with the
`gguf` package: architecture `llama` (or `qwen2`, which adds q/k/v biases), `lfm2` for a spec
with short-convolution layers (recurrent state between attention layers, as LFM2, Granite
4.0-H and Qwen3-Next mix them), `mamba` for a recurrent-only one; the metadata keys llama.cpp
requires, and weights drawn from a seeded generator, so two hosts that generate the same spec
get identical files. `ensure_model` writes a spec once into the cache folder and returns its path.

The vocabulary is byte-level, SentencePiece-style (`<unk>`, `<s>`, `</s>`, `<0x00>`..`<0xFF>`,
and `▁` so a space decodes back to a space): every printable ASCII string tokenizes to one id per
byte, so generated text round-trips through a client exactly. The file also names the ids a
random model may emit (`kvmesh.allowed_tokens`), as the byte tokenizer's mask does. A caller may
bring another vocabulary (`write_vocab`: node.lab.testmodels copies a real one).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.node.modelnames import GGUFSpec, generated_path

ALLOWED_TOKENS_KEY = "kvmesh.allowed_tokens"  # ids a random-weight model may emit (see module docstring)
SPACE_PIECE = "\u2581"
# llama.cpp token types (llama_token_type in llama.h)
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6

VocabWriter = Callable[[Any], int]  # writes a vocabulary's tokenizer.* keys into a GGUFWriter; returns its size


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


def write_gguf(path: str | Path, spec: GGUFSpec, *, arch: str = "llama", write_vocab: VocabWriter | None = None) -> Path:
    """Write the model `spec` describes to `path` (through a temp name, renamed when complete).

    The byte vocabulary unless `write_vocab` brings `spec.vocab` (then the model is `arch`: llama or qwen2)."""
    import gguf

    path = Path(path)
    if write_vocab is None and spec.vocab != "byte":
        raise ValueError(f"vocabulary {spec.vocab!r} needs its writer (node.lab.testmodels.write_gguf copies it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        if write_vocab is None:
            arch = "mamba" if spec.ssm_state else "lfm2" if spec.conv_layers else "llama"
            n_vocab = len(_byte_vocab()[0])
            w = gguf.GGUFWriter(tmp, arch)
            _write_byte_vocab(w)
        else:
            w = gguf.GGUFWriter(tmp, arch)
            n_vocab = write_vocab(w)
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


def ensure_model(spec: GGUFSpec, folder: str | Path | None = None) -> Path:
    """The generated model for `spec` in `folder` (default node.modelnames.gguf_cache_dir()), written once.

    The file name carries a digest of the spec, so a changed spec never reuses a stale file."""
    path = generated_path(spec, folder)
    if not path.is_file():
        write_gguf(path, spec)
    return path

