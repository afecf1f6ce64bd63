"""A GGUF model loaded by llama.cpp (llama-cpp-python's low-level API): its handle, vocabulary,
tokenizer and digest, llama.cpp's log routed to Python's, and the fingerprint of a cache.

`LlamaModel.open` notes whether a model keeps recurrent state (alone or beside attention layers),
which the runner keeps in snapshots. The fingerprint covers the GGUF file's digest (cached by
size, mtime and inode), the KV types, the V layout (flash attention) and the state format, so
replicas never cross between incompatible engines. The runner over it is `node.engine.llamacpp`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import xxhash

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine import llamastate, repack
from kvmesh.node.engine.llamatok import LlamaTokenizer
from kvmesh.node.engine.modelfiles import resolve as resolve_model
from kvmesh.node.errors import CheckpointError, ConfigError
from kvmesh.node.modelnames import GENERATED, PACKAGED

log = logging.getLogger("kvmesh.engine.llamacpp")

STATE_FORMAT = "llama-state-seq/unified/v1"  # our reading of state_write's layout (llamastate)
_LOG_WARN = 3


def _lib() -> ModuleType:
    try:
        import llama_cpp
    except ImportError as e:
        raise ConfigError("engine kind 'llamacpp' needs llama-cpp-python: pip install 'kvmesh[llamacpp]' "
                          f"(it compiles llama.cpp; CMAKE_ARGS selects CUDA, ROCm or Metal): {e}") from None
    return llama_cpp


# ---- the GGUF file's digest, cached ---------------------------------------------------

def _digest_cache() -> Path:
    from kvmesh.node.modelnames import gguf_cache_dir

    return gguf_cache_dir().parent / "gguf-digests.json"


def gguf_digest(path: str | Path) -> str:
    """xxh3-128 of the file's bytes, remembered by (path, size, mtime, inode): a 20 GB GGUF is
    read once per change, not once per start."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    cache = _digest_cache()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return str(known[key])
    h = xxhash.xxh3_128()
    with open(p, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    known = {k: v for k, v in (known if isinstance(known, dict) else {}).items() if not k.startswith(f"{p}|")}
    known[key] = digest
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
    except OSError as e:  # a read-only home: the digest is recomputed next start, nothing breaks
        log.warning("could not cache the digest of %s: %s", p, e)
    return digest


# ---- the model -------------------------------------------------------------------------

_log_cb: Any = None  # keeps the ctypes callback alive for as long as llama.cpp may call it
_last_error = threading.local()


def llama_error(default: str = "") -> str:
    """The last warning or error llama.cpp logged on this thread (what a failed call says)."""
    return str(getattr(_last_error, "text", default))


def _install_logging(lib: ModuleType) -> None:
    """llama.cpp's log lines go to Python logging (warnings and errors only), not to stderr."""
    global _log_cb
    if _log_cb is not None:
        return

    def cb(level: int, text: bytes, _user: Any) -> None:
        if level >= _LOG_WARN and text:
            msg = text.decode("utf-8", "replace").rstrip()
            if msg:
                _last_error.text = msg
                log.debug("llama.cpp: %s", msg)

    _log_cb = lib.llama_log_callback(cb)
    lib.llama_log_set(_log_cb, ctypes.c_void_p())


def has_recurrent_state(lib: ModuleType, model: Any) -> bool:
    """Recurrent layers, alone (Mamba) or beside attention (hybrid): the state travels in snapshots."""
    hybrid = hasattr(lib, "llama_model_is_hybrid") and lib.llama_model_is_hybrid(model)
    return bool(hybrid or lib.llama_model_is_recurrent(model))


@dataclass
class LlamaModel:
    """A loaded GGUF model: its handle, vocabulary, tokenizer and digest."""

    path: Path
    lib: ModuleType
    handle: Any
    vocab: Any
    n_layer: int
    n_vocab: int
    digest: str
    tokenizer: LlamaTokenizer
    n_ctx_train: int  # the context the model was trained for (GGUF `context_length`)
    n_swa: int = 0  # the sliding window of its SWA layers (0: none)
    recurrent: bool = False  # recurrent layers, with attention ones (hybrid) or alone (node.engine.snapshots)
    weights: repack.WeightBuffers | None = None  # repacked weight buffers or not, and why (node.engine.repack)

    @classmethod
    def open(cls, path: str | Path, cfg: LlamaCppConfig) -> LlamaModel:
        p = resolve_model(path)
        if not p.is_file():
            raise CheckpointError(f"{p} does not exist: engine.model must be a GGUF file or one of "
                                  f"{', '.join([*PACKAGED, *GENERATED])}", path=str(p))
        lib = _lib()
        _install_logging(lib)
        lib.llama_backend_init()
        weights = weight_buffers(cfg, lib)
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 10**6 if cfg.gpu_layers < 0 else cfg.gpu_layers
        mp.use_mmap = cfg.use_mmap
        mp.use_extra_bufts = weights.extra_bufts
        handle = lib.llama_model_load_from_file(str(p).encode(), mp)
        if not handle:
            raise CheckpointError(f"llama.cpp could not load {p}: {llama_error('see the log')}", path=str(p))
        vocab = lib.llama_model_get_vocab(handle)
        template = lib.llama_model_chat_template(handle, None)
        if not template:  # a base model (Gemma 3 270M): chats still render, in a plain role-tag form
            log.warning("%s has no chat template; chats render with kvmesh's fallback (<|role|> lines)", p.name)
        tok = LlamaTokenizer(lib, vocab, chat_template=template.decode("utf-8") if template else None,
                             allowed=_allowed_tokens(p))
        return cls(p, lib, handle, vocab, int(lib.llama_model_n_layer(handle)), int(lib.llama_vocab_n_tokens(vocab)),
                   gguf_digest(p), tok, int(lib.llama_model_n_ctx_train(handle)), int(lib.llama_model_n_swa(handle)),
                   has_recurrent_state(lib, handle), weights)

    def close(self) -> None:
        if self.handle:
            self.lib.llama_model_free(self.handle)
            self.handle = None


def system_info(lib: ModuleType) -> str:
    """ggml's report of the CPU features it was built for (`AVX2 = 1 | AMX_INT8 = 1 | ...`)."""
    raw = lib.llama_print_system_info()
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw or "")


_choice_logged: set[repack.WeightBuffers] = set()


def weight_buffers(cfg: LlamaCppConfig, lib: ModuleType | None = None) -> repack.WeightBuffers:
    """This host's weight buffers for `cfg.extra_bufts` (node.engine.repack), said once per process.

    Everything that loads a GGUF here, or starts llama-server beside kvmesh, takes its choice from this."""
    lib = lib or _lib()
    w = repack.decide(cfg.extra_bufts, system_info(lib), repack.read_cpuinfo())
    if w not in _choice_logged:
        _choice_logged.add(w)
        log.info("llama.cpp weight buffers: %s (%s)", "repacked" if w.extra_bufts else "plain CPU", w.reason)
    return w


def _allowed_tokens(path: Path) -> list[int] | None:
    """A generated model's `kvmesh.allowed_tokens` (node.engine.gguf_gen); None for real models."""
    try:
        import gguf
    except ImportError:
        return None
    from kvmesh.node.engine.gguf_gen import ALLOWED_TOKENS_KEY

    f = gguf.GGUFReader(path).fields.get(ALLOWED_TOKENS_KEY)
    return None if f is None else [int(x) for x in f.contents()]


def fingerprint(model: LlamaModel, cfg: LlamaCppConfig, layout: llamastate.Layout | None, block_size: int) -> str:
    """Names what makes two llama.cpp caches interchangeable: the GGUF bytes, KV types, V layout,
    the state format (ours and the binding's version), the block size. A model with live caches only
    (no layout) has blocks nowhere, and its fingerprint says so."""
    if layout is None:
        return hashlib.sha256(json.dumps({"arch": "llamacpp/live", "gguf": model.digest}).encode()).hexdigest()[:32]
    blob = json.dumps({"arch": "llamacpp/v1", "gguf": model.digest, "type_k": cfg.type_k, "type_v": cfg.type_v,
                       "flash_attn": cfg.flash_attn, "v_trans": layout.v_trans, "cell_ext": layout.ext,
                       "state": STATE_FORMAT, "binding": getattr(model.lib, "__version__", "?"), "block": block_size,
                       # a sliding-window model's blocks hold its two caches, every position of both (swa "full"),
                       # or the full-attention cache alone, the window travelling as snapshots (swa "window")
                       **({"swa": cfg.swa, "caches": len(layout.sections)} if model.n_swa else {}),
                       **({"recurrent": layout.recurrent} if model.recurrent else {})},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# ---- the runner --------------------------------------------------------------------------
