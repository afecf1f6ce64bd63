"""The decode loop: a turn's tokens after its prefill, sampled and streamed as text until a stop.

Stop tokens and stop strings, the text held back so a stop string split across tokens never
streams, log probabilities beside the text, and the hand-off to a runner that decodes ahead on
its compute thread (node.engine.batcher). The engine calls it once per turn, after the prefill.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator

import numpy as np
import torch

from kvmesh.node.engine.batcher import DecodeBatcher
from kvmesh.node.engine.boundary import GenerateRequest, TextDelta, TurnStats
from kvmesh.node.engine.constraint import Grammars
from kvmesh.node.engine.picker import LogprobFeed, Picker
from kvmesh.node.engine.runner import Runner
from kvmesh.node.engine.tokenizer import Tokenizer


class DecodeLoop:
    """Samples a turn's tokens through a runner and turns them into text deltas."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer, stop_ids: frozenset[int], max_context: int):
        self.runner, self.tokenizer, self.stop_ids, self.max_context = runner, tokenizer, stop_ids, max_context
        # The byte tokenizer masks what a random-weight model may emit; a real model is not masked.
        mask = tokenizer.generation_mask()
        self.allowed = None if mask is None else torch.from_numpy(mask)
        self.grammars = Grammars(tokenizer, stop_ids)  # constrained turns' vocabulary (node.engine.constraint)

    async def run(self, slot: int, req: GenerateRequest, pos: int, logits: torch.Tensor, out_ids: list[int],
                  stats: TurnStats, t0: float) -> AsyncGenerator[TextDelta, None]:
        """Sample from `logits` on, one token per step from position `pos`, until a stop or a limit.

        Appends every sampled token to `out_ids` and sets the stats' TTFT and finish reason.
        Text is held back by the longest stop string's length less one, so a stop string
        split across tokens is never streamed."""
        decoder = self.tokenizer.incremental_decoder()
        text, emitted = "", 0
        hold = max((len(s) for s in req.stop), default=1) - 1
        feed = None if req.top_logprobs is None else LogprobFeed(self.tokenizer.token_bytes, req.top_logprobs)
        async with contextlib.aclosing(self._tokens(slot, req, pos, logits, feed)) as tokens:
            async for tok in tokens:
                if not out_ids:
                    stats.ttft_s = time.monotonic() - t0
                if tok in self.stop_ids and not req.ignore_eos:
                    stats.finish_reason = "stop"
                    break
                out_ids.append(tok)
                text += decoder.decode(self.tokenizer.token_bytes(tok))
                if feed is not None:
                    feed.ends.append(len(text))
                hits = [(i, s) for s in req.stop if (i := text.find(s, max(0, emitted - len(s)))) >= 0]
                if hits:
                    cut, stats.stop_sequence = min(hits)
                    text = text[:cut]
                    stats.finish_reason = "stop"
                    break
                if len(text) - hold > emitted:
                    yield TextDelta(text[emitted : len(text) - hold], None if feed is None else feed.upto(len(text) - hold))
                    emitted = len(text) - hold
                if len(out_ids) >= req.max_tokens or pos + len(out_ids) >= self.max_context:
                    stats.finish_reason = "length"
                    break
        text += decoder.decode(b"", final=True) if stats.finish_reason == "length" else ""
        if len(text) > emitted or (feed is not None and feed.sent < len(feed.ends)):
            yield TextDelta(text[emitted:], None if feed is None else feed.upto(len(text)))

    async def _tokens(self, slot: int, req: GenerateRequest, pos: int, logits: torch.Tensor,
                      feed: LogprobFeed | None = None) -> AsyncGenerator[int, None]:
        """The turn's sampled tokens: the first from the prefill's logits, each next one fed at the
        following position, until a stop token or a limit. A runner with a `DecodeBatcher` decodes
        ahead on its compute thread (node.engine.batcher); others step through `forward`."""
        mask = None if req.constraint is None else await self.grammars.mask(req.constraint)
        pick = Picker(req, self.allowed, self.stop_ids, pos, self.max_context, mask, feed)  # constraint, logprobs
        tok, last = pick(logits)
        yield tok
        batcher = getattr(self.runner, "decoder", None)
        if last:
            return
        if isinstance(batcher, DecodeBatcher):
            async with contextlib.aclosing(batcher.run_ahead(slot, tok, pos, pick)) as ahead:
                async for tok in ahead:
                    yield tok
            return
        while not last:
            row = await self.runner.forward(slot, np.array([tok], dtype=np.int32), pos + pick.picked - 1)
            tok, last = pick(row)
            yield tok
