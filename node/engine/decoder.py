"""The decoder: RMSNorm, RoPE, GQA attention, SwiGLU. Plain torch.

One implementation for every preset and for real checkpoints (Llama, Qwen2,
Qwen3: see `node.engine.hf`): the options those families add (qkv bias,
QK-norm, tied embeddings, RoPE scaling) are config fields of the same layers.
Preset weights are seeded from the config, so every host computes bit-identical
KV for identical tokens; checkpoint weights come in through `Decoder.from_weights`.
The KV cache is not owned here: `forward` writes into, and attends over, a
caller-supplied per-slot workspace `ws: [layers, 2, kv_heads, max_ctx, head_dim]`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 262
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 64
    ffn_dim: int = 768
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_context: int = 32768
    seed: int = 1234
    # Options of real checkpoint families. The defaults are the tiny preset's (and
    # leave its weights, outputs and fingerprint exactly as before they existed).
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama `attention_bias`: bias on q/k/v *and* o
    mlp_bias: bool = False  # Llama `mlp_bias`
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    rope_scaling: str = ""  # "" (none), "linear" or "llama3"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_context: int = 8192  # llama3: original_max_position_embeddings
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()  # extra stop ids (the tokenizer has its own)
    checkpoint: str = ""  # digest of config.json + weight files (node.engine.hf); "" for seeded presets

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    # Real-model geometry with random weights (for GPU measurements).
    "small-1b": ModelConfig(
        name="small-1b", n_layers=28, d_model=1536, n_heads=12, n_kv_heads=2, head_dim=128, ffn_dim=8960
    ),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


# The fields the fingerprint has always covered. Fields added since enter the blob
# only when they differ from their default, so a preset's fingerprint (and with it
# every block hash and every replica already on disk) is unchanged by their addition.
_V1_FIELDS = frozenset(
    ("name", "vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
     "rope_theta", "norm_eps", "max_context", "seed")
)


def fingerprint(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> str:
    """Names everything that makes two caches interchangeable: arch, config, seed or
    checkpoint digest, dtype, block size."""
    default = ModelConfig()
    cfg_d = {
        f.name: getattr(cfg, f.name)
        for f in fields(cfg)
        if f.name in _V1_FIELDS or getattr(cfg, f.name) != getattr(default, f.name)
    }
    blob = json.dumps({"arch": "kvmesh-decoder/v1", **cfg_d, "dtype": str(dtype), "block": block_size}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """Rotation frequencies per pair of dims: [head_dim // 2], fp32, after the config's scaling."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim))
    if cfg.rope_scaling == "linear":
        # Position interpolation: position p rotates as p / factor.
        inv = inv / cfg.rope_factor
    elif cfg.rope_scaling == "llama3":
        # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) are
        # interpolated by `factor`, short ones (below original / high_freq_factor) kept,
        # and the band between is blended linearly in 1/wavelength.
        orig = cfg.rope_original_context
        low_wavelen = orig / cfg.rope_low_freq_factor
        high_wavelen = orig / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (orig / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        blended = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, blended, scaled)
    elif cfg.rope_scaling:
        raise ValueError(f"unsupported rope scaling {cfg.rope_scaling!r} (supported: linear, llama3)")
    return inv


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin: [max_context, head_dim // 2], fp32."""
    inv = rope_inv_freq(cfg, device)
    t = torch.arange(cfg.max_context, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [1, heads, q, head_dim]; cos/sin: [q, head_dim // 2] (rotate-half layout)
    return _rotate(x, cos[None, None], sin[None, None])


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, q, head_dim]; c/s broadcast to [B, heads, q, head_dim // 2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).type_as(x)


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_after_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of a chunk that follows `start` cached tokens, without a mask.

    The cached keys are all visible (no mask) and the chunk's own keys are causal with
    q_len == kv_len (so is_causal is correctly aligned there); the two halves are merged
    by their log-sum-exp. Same result as the lower-right mask, and it keeps the flash
    kernel's causal skipping: ~20% faster than a masked SDPA on these CPUs.
    q: [1, heads, q, hd]; k, v: [1, heads, start + q, hd]
    """
    if _flash_cpu is None:
        end = k.shape[2]
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    o_a, lse_a = _flash_cpu(q, k[:, :, :start], v[:, :, :start], 0.0, False)[:2]
    o_b, lse_b = _flash_cpu(q, k[:, :, start:], v[:, :, start:], 0.0, True)[:2]
    lse = torch.logaddexp(lse_a, lse_b)
    return (o_a * torch.exp(lse_a - lse).unsqueeze(-1) + o_b * torch.exp(lse_b - lse).unsqueeze(-1)).type_as(q)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        qkv_bias = cfg.qkv_bias or cfg.o_bias
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.o_bias)
        # Qwen3's QK-norm: one weight of head_dim shared by every head.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, kvs: list[torch.Tensor], starts: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        # x: [B, q, d_model]: row b is one slot's tokens at starts[b]..; kvs[b]: [2, kv_heads,
        # max_ctx, head_dim] (that slot's workspace for this layer); cos/sin broadcast to
        # [B, heads, q, head_dim // 2]. Projections run batched; the cache write and the
        # attention run per row (each row has its own cache length).
        c = self.cfg
        batch, q_len = x.shape[0], x.shape[1]
        q = self.wq(x).view(batch, q_len, c.n_heads, c.head_dim)
        k = self.wk(x).view(batch, q_len, c.n_kv_heads, c.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over head_dim, before RoPE
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(batch, q_len, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = [self._attend(q[b : b + 1], k[b], v[b], kvs[b], starts[b]) for b in range(batch)]
        out = outs[0] if batch == 1 else torch.cat(outs, dim=0)
        return self.wo(out.transpose(1, 2).reshape(batch, q_len, c.n_heads * c.head_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
        """Write one row's k/v at start.. and attend over the cache: q [1, heads, q, hd]; k, v [kv_heads, q, hd]."""
        c = self.cfg
        q_len = q.shape[2]
        end = start + q_len
        kv[0, :, start:end] = k
        kv[1, :, start:end] = v
        keys, values = kv[0, :, :end][None], kv[1, :, :end][None]
        gqa = c.n_heads != c.n_kv_heads
        if start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        elif q_len == 1:
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        elif q.device.type == "cpu" and not gqa:
            out = _attend_after_cache(q, keys, values, start)
        else:
            # A chunk after the first: query i sits at absolute position start+i and
            # may see keys 0..start+i. This is the lower-right-aligned causal mask;
            # is_causal=True would align top-left and hide most of the cache.
            mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        return out


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # w1 = gate, w3 = up, w2 = down (Hugging Face: gate_proj, up_proj, down_proj).
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, kvs: list[torch.Tensor], starts: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), kvs, starts, cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    rope_cos: torch.Tensor  # [max_context, head_dim // 2] fp32 (buffers, not weights)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @classmethod
    def seeded(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Decoder:
        """Deterministic weights from cfg.seed: identical on every host."""
        gen = torch.Generator().manual_seed(cfg.seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
        model = model.to(device=device, dtype=dtype).eval()
        model.rope_cos, model.rope_sin = rope_tables(cfg, device)
        return model

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, get: Callable[[str], torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> Decoder:
        """Weights from a source, one tensor at a time: `get(name)` returns the tensor for
        one of this module's parameter names (`embed.weight`, `layers.3.attn.wq.weight`, ...).

        The module is built on the meta device first, so no memory is spent on an
        initialisation that would be overwritten, and the peak is the model plus one tensor.
        A tied lm_head is asked for once, as `embed.weight`.
        """
        with torch.device("meta"):
            model = cls(cfg)
        for name, p in list(model.named_parameters()):  # tied parameters appear once
            t = get(name)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"weight {name}: shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            setattr(owner, attr, nn.Parameter(t.to(device=device, dtype=dtype).contiguous(), requires_grad=False))
        if cfg.tie_embeddings:
            model.lm_head.weight = model.embed.weight
        model.rope_cos, model.rope_sin = rope_tables(cfg, device)
        return model.eval()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ws: torch.Tensor, start: int) -> torch.Tensor:
        """tokens: [q] at positions start..start+q; ws: [layers, 2, kv_heads, max_ctx, head_dim].

        Returns logits of the last position: [vocab], fp32.
        """
        q_len = tokens.shape[0]
        cos, sin = self.rope_cos[start : start + q_len], self.rope_sin[start : start + q_len]
        return self._run(tokens[None], [ws], [start], cos[None, None], sin[None, None])[0]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, wss: list[torch.Tensor], positions: list[int]) -> torch.Tensor:
        """One decode step for B slots at once: tokens [B], token b at positions[b] of the slot
        whose workspace is wss[b] ([layers, 2, kv_heads, max_ctx, head_dim]).

        Returns logits: [B, vocab], fp32. The weights are read once for the whole batch."""
        idx = torch.tensor(positions, device=self.rope_cos.device)
        cos, sin = self.rope_cos[idx][:, None, None], self.rope_sin[idx][:, None, None]  # [B, 1, 1, hd/2]
        return self._run(tokens[:, None], wss, positions, cos, sin)

    def _run(self, tokens: torch.Tensor, wss: list[torch.Tensor], starts: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # tokens: [B, q]; cos/sin broadcast to [B, heads, q, hd/2] -> logits of each row's last position [B, vocab]
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, [ws[i] for ws in wss], starts, cos, sin)
        return self.lm_head(self.norm(x[:, -1])).float()
