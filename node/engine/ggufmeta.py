"""What a GGUF file's metadata says of its KV cache, read without loading it into llama.cpp.

`kvmesh init` sizes a host's config from these facts (context, KV bytes per token) on the
machine where it runs, which need not have llama.cpp's library built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

F16_BYTES = 2


@dataclass(frozen=True)
class GGUFFacts:
    name: str  # the file's stem: the id a node serves it as
    arch: str
    context: int  # tokens the model was trained for
    layers: int
    kv_bytes_per_token: int  # K and V of every layer at f16 (the engine's default cache type)
    sliding_window: int | None
    recurrent_layers: int = 0  # layers with no KV heads: recurrent state (Mamba, LFM2's convolutions)


def read_facts(path: Path) -> GGUFFacts:
    """The facts of one GGUF file; ValueError when its metadata lacks what they need."""
    from gguf import GGUFReader  # the llamacpp extra's dependency, needed only here

    fields = GGUFReader(str(path)).fields

    def value(key: str) -> object:
        f = fields.get(key)
        return None if f is None else f.contents()

    def ints(key: str) -> list[int]:
        v = value(key)  # a number, or one per layer (hybrid models: 0 KV heads on a recurrent layer)
        return [] if v is None else [int(x) for x in v] if isinstance(v, list) else [int(str(v))]

    arch = str(value("general.architecture") or "")
    layers, heads, width, context = (ints(f"{arch}.{k}") for k in ("block_count", "attention.head_count",
                                                                    "embedding_length", "context_length"))
    if not (arch and layers and width and context):
        raise ValueError(f"{path.name} lacks block_count, embedding_length or context_length for {arch!r}")
    most = max(heads, default=0)
    head = width[0] // most if most else 0  # no heads at all: a recurrent-only model
    k_dim, v_dim = (ints(f"{arch}.attention.{k}") or [head] for k in ("key_length", "value_length"))
    kv_heads = ints(f"{arch}.attention.head_count_kv") or heads or [0]
    per_layer = kv_heads if len(kv_heads) > 1 else kv_heads * layers[0]
    window = ints(f"{arch}.attention.sliding_window")
    return GGUFFacts(path.stem, arch, context[0], layers[0], sum(per_layer) * (k_dim[0] + v_dim[0]) * F16_BYTES,
                     window[0] if window else None, sum(1 for n in per_layer if n == 0))
