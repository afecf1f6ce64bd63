"""The checkpoint directory vLLM serves for an `engine.model` value: a directory as given, or a packaged
GGUF converted once (node.engine.vllm.convert, run by vLLM's Python) into the cache folder. A model with
recurrent layers is refused first (node.engine.vllm.recurrent says why)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.hf import read_json
from kvmesh.node.engine.modelfiles import resolve
from kvmesh.node.engine.vllm.recurrent import gguf_recurrent, hf_recurrent, refusal
from kvmesh.node.engine.vllm.server import vllm_python
from kvmesh.node.errors import ConfigError
from kvmesh.node.modelnames import is_gguf

log = logging.getLogger("kvmesh.engine.vllm")

CONVERT = Path(__file__).resolve().parent / "convert.py"


def cache_dir(cfg: EngineConfig) -> Path:
    """Converted models, vLLM's compile caches and each server's run folder."""
    return Path(cfg.vllm.cache_dir) if cfg.vllm.cache_dir else Path.home() / ".cache" / "kvmesh" / "vllm"


def on_cuda(cfg: EngineConfig) -> bool:
    """Whether this engine's vLLM computes on a GPU (as the engine decides its device)."""
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def served_checkpoint(cfg: EngineConfig) -> Path:
    """The checkpoint directory an engine with this config serves (converted first where it must be)."""
    return checkpoint_dir(cfg.model, python=vllm_python(cfg.vllm.python), cache_dir=cache_dir(cfg), cuda=on_cuda(cfg))


def checkpoint_dir(model: str, *, python: str, cache_dir: Path, cuda: bool) -> Path:
    """`model` as a Hugging Face checkpoint directory; a GGUF (alias or path) is converted at first use.
    ConfigError for a model with recurrent layers (`cuda`: whether vLLM runs on a GPU, for the reason given).

    The converted folder's name carries a digest of the GGUF's path, size and mtime, so a changed
    file is converted again, never served stale."""
    if not is_gguf(model):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"engine.model {model!r} is neither a checkpoint directory (no config.json) nor a GGUF")
        return _servable(path, cuda)
    gguf = resolve(model)
    arch = gguf_recurrent(gguf)
    if arch is not None:  # before converting: a conversion takes minutes for a real model, to no use
        raise ConfigError(refusal(arch, cuda=cuda))
    st = gguf.stat()
    key = hashlib.blake2b(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=6).hexdigest()
    out = cache_dir / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return _servable(out, cuda)
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s for vLLM into %s (once)", gguf.name, out)
    done = subprocess.run([python, str(CONVERT), str(gguf), str(out)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if done.returncode != 0 or not (out / "config.json").is_file():
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise ConfigError(f"converting {gguf.name} for vLLM failed ({python}): {tail}")
    return _servable(out, cuda)


def _servable(checkpoint: Path, cuda: bool) -> Path:
    """The checkpoint, unless its config.json names recurrent layers."""
    arch = hf_recurrent(read_json(checkpoint / "config.json"))
    if arch is not None:
        raise ConfigError(refusal(arch, cuda=cuda))
    return checkpoint
