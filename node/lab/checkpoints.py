"""Random-weight Hugging Face checkpoints for tests (and benchmarks at a real model's geometry).

The torch engine reads them as it reads a real one (node.engine.hf): config.json, safetensors
weights, one file or shards with their index; no tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvmesh.node.engine.decoder import Decoder
from kvmesh.node.engine.hf import INDEX_FILE, SINGLE_FILE, config_from_hf, hf_name


def write_random_checkpoint(
    d: str | Path, config: Mapping[str, Any], *, seed: int = 0, shards: int = 1, dtype: torch.dtype = torch.float32
) -> Path:
    """Write config.json and random safetensors weights in Hugging Face layout (no tokenizer).

    `config` is a config.json dict of a supported architecture. Weights ~ N(0, 1/fan_in),
    norms ~ 1 +- 0.2 (so every norm weight matters). `shards` > 1 writes
    model-0000i-of-0000n.safetensors and the index. Returns the directory."""
    from safetensors.torch import save_file

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(config), indent=1))
    cfg = config_from_hf(config, source=d / "config.json", max_context=1 << 30)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in Decoder(cfg).named_parameters()]
    names = [hf_name(n) for n, _ in shapes]
    files = [SINGLE_FILE] if shards == 1 else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    wmap: dict[str, str] = {}
    for i, fname in enumerate(files):
        part: dict[str, torch.Tensor] = {}
        for (n, shape), theirs in list(zip(shapes, names))[i::len(files)]:
            if "norm" in n:
                t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
            else:
                t = torch.randn(shape, generator=gen) * (0.2 if n.endswith("bias") else shape[-1] ** -0.5)
            part[theirs] = t.to(dtype).contiguous()
        save_file(part, str(d / fname), metadata={"format": "pt"})
        wmap.update(dict.fromkeys(part, fname))
    if shards > 1:
        (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wmap}, indent=1))
    return d
