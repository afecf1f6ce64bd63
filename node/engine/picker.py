"""One turn's sampler: each next token from a row of logits, and whether it is the turn's last;
and, when a request asks for them, each token's log probability (`LogprobFeed`).

It runs where the logits are, the compute thread for a runner that decodes ahead
(node.engine.batcher), and applies what narrows the choice: the byte tokenizer's mask of what a
random-weight model may emit, and the turn's constraint (node.engine.constraint), whose matcher
is told each token chosen. So a constrained turn decodes in the same batches as any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import xxhash

from kvmesh.node.engine.boundary import GenerateRequest, TokenLogprob
from kvmesh.node.engine.constraint import TokenMask
from kvmesh.node.engine.sampling import sample


def generator(seed: int | None) -> torch.Generator | None:
    """A sampling generator from a 64-bit seed: hashed first, so high bits matter too."""
    if seed is None:
        return None
    mixed = xxhash.xxh64_intdigest(seed.to_bytes(8, "little", signed=True))
    return torch.Generator().manual_seed(mixed & ((1 << 63) - 1))


class LogprobFeed:
    """Log probabilities of a turn's tokens, handed out with the text deltas their tokens' text is in.

    The picker appends one entry per token chosen (the stop token's too, never handed out); the
    decode loop says where each token's text ends, and `upto(n)` gives the entries of the tokens
    whose text lies within the first n characters, each once."""

    def __init__(self, token_bytes: Callable[[int], bytes], k: int) -> None:
        self.token_bytes, self.k = token_bytes, k
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.ends: list[int] = []
        self.sent = 0

    def record(self, row: torch.Tensor, tok: int) -> None:
        """Compute thread: the model's own log-softmax of the row (before the constraint), at `tok` and its top k."""
        lp = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(lp, self.k) if self.k else None
        alts = [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)]
        self.entries.append((tok, float(lp[tok]), alts))

    def upto(self, n: int) -> list[TokenLogprob]:
        k = self.sent
        while k < len(self.ends) and k < len(self.entries) and self.ends[k] <= n:
            k += 1
        b = self.token_bytes
        out = [TokenLogprob(b(t), lp, tuple((b(i), v) for i, v in alts)) for t, lp, alts in self.entries[self.sent:k]]
        self.sent = k
        return out


class Picker:
    """Callable on a row of logits -> (token, last): the engine's `pick` for one turn."""

    def __init__(self, req: GenerateRequest, allowed: torch.Tensor | None, stop_ids: frozenset[int], pos: int,
                 max_context: int, mask: TokenMask | None, feed: LogprobFeed | None = None) -> None:
        self.req, self.allowed, self.stop_ids, self.pos, self.max_context = req, allowed, stop_ids, pos, max_context
        self.mask, self.feed = mask, feed
        self.gen = generator(req.seed)
        self._uniform = torch.Generator().manual_seed(0)
        self.picked = 0

    def __call__(self, row: torch.Tensor) -> tuple[int, bool]:
        req, allowed = self.req, self.allowed
        temperature, gen = req.temperature, self.gen
        # Logprobs are the model's: over what it may emit at all (a byte model's mask), not the turn's constraint.
        raw = row if allowed is None or self.feed is None else row.masked_fill(~allowed, float("-inf"))
        if self.mask is not None:
            m = self.mask.allowed(row.shape[-1])
            allowed = m if allowed is None else m & allowed
            if not torch.isfinite(row.masked_fill(~allowed, float("-inf"))).any():
                # The logits rule out every allowed id (a scripted test reply does): no preference is left, so
                # a uniform choice among them, from a fixed seed so that a turn stays reproducible.
                row, temperature = torch.zeros_like(row), 1.0
                gen = gen if gen is not None else self._uniform
        tok = sample(row, temperature, req.top_p, gen, allowed, req.top_k)
        if self.mask is not None:
            self.mask.consume(tok)
        if self.feed is not None:
            self.feed.record(raw, tok)
        self.picked += 1
        last = ((tok in self.stop_ids and not req.ignore_eos) or self.picked >= req.max_tokens
                or self.pos + self.picked >= self.max_context)
        return tok, last
