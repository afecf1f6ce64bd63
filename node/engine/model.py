"""The decoder: RMSNorm, RoPE, GQA attention, SwiGLU. Plain torch.

One implementation for every preset. Weights are seeded from the config, so
every host computes bit-identical KV for identical tokens. The KV cache is
not owned here: `forward` writes into, and attends over, a caller-supplied
per-slot workspace `ws: [layers, 2, kv_heads, max_ctx, head_dim]`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

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


def fingerprint(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> str:
    """Names everything that makes two caches interchangeable: arch, config, seed, dtype, block size."""
    blob = json.dumps({"arch": "kvmesh-decoder/v1", **asdict(cfg), "dtype": str(dtype), "block": block_size}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin: [max_context, head_dim // 2], fp32."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim))
    t = torch.arange(cfg.max_context, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [1, heads, q, head_dim]; cos/sin: [q, head_dim // 2] (rotate-half layout)
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, None], sin[None, None]
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
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [1, q, d_model]; kv: [2, kv_heads, max_ctx, head_dim] (this layer's workspace)
        c = self.cfg
        q_len = x.shape[1]
        q = self.wq(x).view(1, q_len, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(1, q_len, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(1, q_len, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = start + q_len
        kv[0, :, start:end] = k[0]
        kv[1, :, start:end] = v[0]
        keys, values = kv[0, :, :end][None], kv[1, :, :end][None]
        gqa = c.n_heads != c.n_kv_heads
        if start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        elif q_len == 1:
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        elif x.device.type == "cpu" and not gqa:
            out = _attend_after_cache(q, keys, values, start)
        else:
            # A chunk after the first: query i sits at absolute position start+i and
            # may see keys 0..start+i. This is the lower-right-aligned causal mask;
            # is_causal=True would align top-left and hide most of the cache.
            mask = torch.arange(end, device=x.device)[None, :] <= torch.arange(start, end, device=x.device)[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(1, q_len, c.n_heads * c.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), kv, start, cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
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

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ws: torch.Tensor, start: int) -> torch.Tensor:
        """tokens: [q] at positions start..start+q; ws: [layers, 2, kv_heads, max_ctx, head_dim].

        Returns logits of the last position: [vocab], fp32.
        """
        q_len = tokens.shape[0]
        cos, sin = self.rope_cos[start : start + q_len], self.rope_sin[start : start + q_len]
        x = self.embed(tokens)[None]
        for i, layer in enumerate(self.layers):
            x = layer(x, ws[i], start, cos, sin)
        return self.lm_head(self.norm(x[:, -1]))[0].float()
