"""Local Hugging Face checkpoints: config.json -> ModelConfig, safetensors -> Decoder.

A checkpoint directory holds `config.json`, `model.safetensors` or shards listed
in `model.safetensors.index.json`, and `tokenizer.json` (+ `tokenizer_config.json`;
see `node.engine.tokenizer.HFTokenizer`). Supported: LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, all served by the one `Decoder`: their
differences (qkv bias, QK-norm, tied embeddings, RoPE theta and scaling) are
ModelConfig fields. Nothing is fetched: a missing file is a CheckpointError that
names it.

The checkpoint's identity is `ModelConfig.checkpoint`: a digest of config.json
and of every weight file's bytes (xxh3-128), so the engine fingerprint, and with
it every block hash, differs between different weights. Hashing a multi-GB
checkpoint is done once: digests are cached in-process and, where the directory
is writable, in a small `.kvmesh-fingerprint` file keyed by each weight file's
size, mtime, ctime and inode (any rewrite or copy of a file changes one of them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvmesh.node.engine.decoder import Decoder, ModelConfig
from kvmesh.node.errors import CheckpointError

log = logging.getLogger(__name__)

# architectures[0] in config.json -> the options that family sets on the decoder.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FINGERPRINT_FILE = ".kvmesh-fingerprint"
_DIGEST_ALGO = "xxh3-128"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory that has been read and identified (weights not loaded yet)."""

    path: Path
    config: ModelConfig  # .checkpoint holds the digest
    raw_config: dict[str, Any]
    weight_files: tuple[Path, ...]


# ---- config.json -------------------------------------------------------------------


def _need(raw: Mapping[str, Any], key: str, source: Path) -> Any:
    if raw.get(key) is None:
        raise CheckpointError(f"{source}: {key!r} is missing", path=str(source))
    return raw[key]


def _rope_fields(raw: Mapping[str, Any], source: Path) -> dict[str, Any]:
    """rope_theta and rope_scaling (transformers <= 4 layout) or rope_parameters (5.x)."""
    theta = raw.get("rope_theta")
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        scaling = params
    out: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0)}
    if not scaling:
        return out
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_factor": float(_need(scaling, "factor", source))}
    if kind == "llama3":
        return {
            **out,
            "rope_scaling": "llama3",
            "rope_factor": float(_need(scaling, "factor", source)),
            "rope_low_freq_factor": float(_need(scaling, "low_freq_factor", source)),
            "rope_high_freq_factor": float(_need(scaling, "high_freq_factor", source)),
            "rope_original_context": int(_need(scaling, "original_max_position_embeddings", source)),
        }
    raise CheckpointError(f"{source}: rope scaling {kind!r} is not supported (supported: linear, llama3)", path=str(source))


def config_from_hf(raw: Mapping[str, Any], *, source: Path, max_context: int, digest: str = "") -> ModelConfig:
    """A Hugging Face config.json (parsed) as this decoder's ModelConfig.

    The context is the smaller of `max_context` (the engine's limit) and the
    checkpoint's max_position_embeddings."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
            path=str(source),
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (SwiGLU with silu only)", path=str(source))
    layer_types = raw.get("layer_types") or []
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"{source}: sliding-window attention is not supported", path=str(source))
    d_model = int(_need(raw, "hidden_size", source))
    n_heads = int(_need(raw, "num_attention_heads", source))
    attention_bias = bool(raw.get("attention_bias", False))
    ctx = int(raw.get("max_position_embeddings") or max_context)
    eos = raw.get("eos_token_id")
    eos_ids = (eos,) if isinstance(eos, int) else tuple(i for i in (eos or []) if isinstance(i, int))
    return ModelConfig(
        name=str(raw.get("model_type") or arch),
        vocab_size=int(_need(raw, "vocab_size", source)),
        n_layers=int(_need(raw, "num_hidden_layers", source)),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or d_model // n_heads),
        ffn_dim=int(_need(raw, "intermediate_size", source)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context=min(max_context, ctx),
        # Qwen2 always has q/k/v bias; Llama and Qwen3 put a bias on q/k/v/o with attention_bias.
        qkv_bias=arch == "Qwen2ForCausalLM",
        o_bias=attention_bias and arch != "Qwen2ForCausalLM",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        eos_ids=eos_ids,
        checkpoint=digest,
        **_rope_fields(raw, source),
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist", path=str(path)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}", path=str(path)) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object", path=str(path))
    return data


# ---- weight files and the checkpoint digest -------------------------------------------


def weight_files(d: Path) -> tuple[Path, ...]:
    """The safetensors files: the shards an index names, else model.safetensors, else every *.safetensors."""
    index = d / INDEX_FILE
    if index.exists():
        wmap = read_json(index).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise CheckpointError(f"{index} has no weight_map", path=str(index))
        files = tuple(d / name for name in sorted(set(wmap.values())))
    elif (d / SINGLE_FILE).exists():
        files = (d / SINGLE_FILE,)
    else:
        files = tuple(sorted(d.glob("*.safetensors")))
        if not files:
            other = [p.name for p in d.glob("*.bin")] + [p.name for p in d.glob("*.pt")]
            hint = f" ({', '.join(sorted(other))} found: only safetensors weights are loaded)" if other else ""
            raise CheckpointError(f"{d / SINGLE_FILE} does not exist, nor {INDEX_FILE}: no weights{hint}", path=str(d / SINGLE_FILE))
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight file {f} does not exist (named in {INDEX_FILE})", path=str(f))
    return files


# (resolved path, size, mtime_ns, ctime_ns, inode) -> hex digest: each file is hashed once per process.
_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def _file_key(f: Path) -> tuple[str, int, int, int, int]:
    st = f.stat()  # follows symlinks (a hub cache's snapshot links name blobs)
    return (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _hash_file(f: Path) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(f, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def _read_disk_cache(d: Path) -> dict[str, Any]:
    try:
        data = json.loads((d / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("algo") != _DIGEST_ALGO or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def _write_disk_cache(d: Path, files: dict[str, Any]) -> None:
    """Best effort: a read-only checkpoint directory just means hashing again next process."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=FINGERPRINT_FILE, dir=d)
    except OSError as e:
        log.debug("cannot write %s: %s", d / FINGERPRINT_FILE, e)
        return
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"algo": _DIGEST_ALGO, "files": files}, fh, indent=1, sort_keys=True)
        os.replace(tmp, d / FINGERPRINT_FILE)  # atomic: a reader sees the old file or the new one
    except OSError as e:
        log.debug("cannot write %s: %s", d / FINGERPRINT_FILE, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def checkpoint_digest(d: Path, config_bytes: bytes, files: tuple[Path, ...]) -> str:
    """Digest of config.json's bytes and of each weight file's bytes (names included)."""
    disk = _read_disk_cache(d)
    changed = False
    h = hashlib.sha256(b"kvmesh-checkpoint/v1\n")
    h.update(hashlib.sha256(config_bytes).digest())
    for f in files:
        key = _file_key(f)
        digest = _DIGESTS.get(key)
        if digest is None:
            stamp = {"size": key[1], "mtime_ns": key[2], "ctime_ns": key[3], "ino": key[4]}
            entry = disk.get(f.name)
            if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and isinstance(entry.get("digest"), str):
                digest = entry["digest"]
            else:
                log.info("hashing %s (%.1f GB), once", f, key[1] / 1e9)
                digest = _hash_file(f)
                disk[f.name] = {**stamp, "digest": digest}
                changed = True
            _DIGESTS[key] = digest
        h.update(f"{f.name}\0{digest}\n".encode())
    if changed:
        _write_disk_cache(d, disk)
    return h.hexdigest()[:32]


def open_checkpoint(path: str | Path, *, max_context: int) -> Checkpoint:
    """Read config.json, find the weight files and identify the checkpoint (no weights loaded)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist", path=str(d))
    cfg_path = d / "config.json"
    try:
        config_bytes = cfg_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path} does not exist: a checkpoint needs its config.json", path=str(cfg_path)) from None
    except OSError as e:
        raise CheckpointError(f"{cfg_path} cannot be read: {e}", path=str(cfg_path)) from None
    raw = read_json(cfg_path)
    config_from_hf(raw, source=cfg_path, max_context=max_context)  # refuse an unsupported config before hashing GBs
    files = weight_files(d)
    digest = checkpoint_digest(d, config_bytes, files)
    return Checkpoint(d, config_from_hf(raw, source=cfg_path, max_context=max_context, digest=digest), raw, files)


# ---- weights -------------------------------------------------------------------------

# Decoder parameter names -> Hugging Face names, inside one layer.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "ffn.w1": "mlp.gate_proj",
    "ffn.w3": "mlp.up_proj",
    "ffn.w2": "mlp.down_proj",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
# Tensors some checkpoints carry that the decoder recomputes (old Llama exports).
_IGNORED_RE = re.compile(r".*\.rotary_emb\.inv_freq")


def hf_name(name: str) -> str:
    """A Decoder parameter name as the Hugging Face checkpoint spells it."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def load_decoder(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> Decoder:
    """The checkpoint's weights in the Decoder, read memory-mapped one tensor at a time."""
    from safetensors import safe_open

    cfg = ckpt.config
    with torch.device("meta"):
        wanted = {hf_name(n): n for n, _ in Decoder(cfg).named_parameters()}  # tied lm_head listed once
    with contextlib.ExitStack() as stack:
        where: dict[str, tuple[Any, Path]] = {}
        for f in ckpt.weight_files:
            try:
                h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"weight file {f} cannot be opened: {e}", path=str(f)) from None
            for k in h.keys():
                where[k] = (h, f)
        missing = [n for n in wanted if n not in where]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(
                f"{ckpt.path}: weight {', '.join(missing[:3])}{more} is in none of {', '.join(f.name for f in ckpt.weight_files)}",
                path=str(ckpt.path),
            )
        extra = [k for k in where if k not in wanted and not _IGNORED_RE.fullmatch(k)
                 and not (cfg.tie_embeddings and k == "lm_head.weight")]
        if extra:
            # Weights this decoder would silently drop mean it is not this architecture.
            raise CheckpointError(
                f"{ckpt.path}: tensors this decoder does not use: {', '.join(sorted(extra)[:5])}"
                + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""),
                path=str(ckpt.path),
            )
        by_ours = {ours: theirs for theirs, ours in wanted.items()}

        def get(name: str) -> torch.Tensor:
            theirs = by_ours[name]
            h, _ = where[theirs]
            return h.get_tensor(theirs)

        try:
            return Decoder.from_weights(cfg, get, dtype, device)
        except ValueError as e:  # a shape that does not match config.json
            raise CheckpointError(f"{ckpt.path}: {e} (from config.json)", path=str(ckpt.path)) from None

