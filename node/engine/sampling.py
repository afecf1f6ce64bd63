"""Token sampling: greedy, or temperature + top-k + top-p with a per-request seed."""

from __future__ import annotations

import torch

# Below this, logits / temperature overflows fp32: such temperatures sample greedily.
MIN_TEMPERATURE = 1e-4


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    allowed: torch.Tensor | None = None,
    top_k: int = 0,
) -> int:
    """logits: [vocab] fp32; allowed: [vocab] bool, or None for every id; top_k 0 keeps every id."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    if 0 < top_k < logits.shape[-1]:
        # Ties at the k-th value stay in, as in llama.cpp's and Hugging Face's top-k.
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (always at least one id).
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
        drop[0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
