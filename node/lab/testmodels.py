"""Random-weight GGUF models for tests, benches and the demo: the presets no alias serves, real vocabularies.

The writer is the runtime's (node.engine.gguf_gen: the generated aliases `moe-tiny`,
`hybrid-tiny` and `mamba-tiny` are written on first use by the node serving them); what only
tests and benches use lives here:

- presets: `tiny` (2 layers, for tests), `bench` (a real model's proportions scaled down: GQA
  with 4 query heads per KV head, head_dim 64, an FFN 3.5x wide), and the aliases' own;
- vocabularies other than the byte one: `llama-spm`, `llama-bpe`, `qwen2`, ...: every
  `tokenizer.*` key of one of llama.cpp's vocabulary-only GGUFs (`node.engine.vocab`), so the
  engine runs a real Llama or Qwen tokenizer and chat template; the model takes the vocabulary
  file's architecture;
- the command line:

    python -m kvmesh.node.lab.testmodels tiny /tmp/tiny.gguf [VOCAB]
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from kvmesh.node.engine import gguf_gen
from kvmesh.node.modelnames import GENERATED, GGUFSpec, generated_path

PRESETS: dict[str, GGUFSpec] = {
    "tiny": GGUFSpec(),
    # Llama-3-8B's proportions, scaled down: 32 query heads over 8 KV heads becomes 8 over 2,
    # head_dim 128 becomes 64, FFN 3.5x n_embd; 4 layers. ~2 KiB of f16 KV per token.
    "bench": GGUFSpec(n_layers=4, n_embd=512, n_head=8, n_head_kv=2, n_ff=1792, name="kvmesh-bench"),
    **GENERATED,
}


def spec_for(preset: str, **overrides: Any) -> GGUFSpec:
    if preset not in PRESETS:
        raise ValueError(f"unknown GGUF preset {preset!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


def write_gguf(path: str | Path, spec: GGUFSpec) -> Path:
    """Write the model `spec` describes to `path`, in its vocabulary (byte, or a real one copied)."""
    if spec.vocab == "byte":
        return gguf_gen.write_gguf(path, spec)
    arch = _vocab_arch(spec.vocab)  # the model takes its vocabulary's architecture
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"vocabulary {spec.vocab!r} is for architecture {arch!r}; the generator writes llama and qwen2")
    return gguf_gen.write_gguf(path, spec, arch=arch, write_vocab=lambda w: _copy_vocab(w, spec.vocab))


def ensure_model(spec: GGUFSpec, folder: str | Path | None = None) -> Path:
    """The model for `spec` in `folder` (default the generated models' cache), written once."""
    path = generated_path(spec, folder)
    return path if path.is_file() else write_gguf(path, spec)


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


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m kvmesh.node.lab.testmodels PRESET OUT.gguf [VOCAB]")
    extra = {"vocab": sys.argv[3]} if len(sys.argv) == 4 else {}
    print(write_gguf(sys.argv[2], spec_for(sys.argv[1], **extra)))
