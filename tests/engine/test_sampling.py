"""Token sampling: greedy, seeded temperature sampling, top-k, top-p, the allowed-ids mask."""

from __future__ import annotations

import torch

from kvmesh.node.engine.sampling import sample

VOCAB = 50


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax() -> None:
    """temperature 0 returns the argmax as a Python int."""
    for seed in range(5):
        lg = _logits(seed)
        tok = sample(lg, 0.0, 1.0, None)
        assert isinstance(tok, int)
        assert tok == int(lg.argmax())


def test_greedy_respects_allowed_mask() -> None:
    """Greedy picks the best allowed id, not the global argmax."""
    lg = _logits()
    best = int(lg.argmax())
    allowed = torch.ones(VOCAB, dtype=torch.bool)
    allowed[best] = False
    tok = sample(lg, 0.0, 1.0, None, allowed)
    assert tok != best
    assert tok == int(lg.masked_fill(~allowed, float("-inf")).argmax())


def test_same_seed_same_tokens() -> None:
    """Two generators with the same seed draw the same token sequence; another seed differs."""
    lg = _logits()
    g1, g2, g3 = _gen(7), _gen(7), _gen(8)
    a = [sample(lg, 1.0, 1.0, g1) for _ in range(40)]
    b = [sample(lg, 1.0, 1.0, g2) for _ in range(40)]
    c = [sample(lg, 1.0, 1.0, g3) for _ in range(40)]
    assert a == b
    assert a != c


def test_temperature_sampling_explores() -> None:
    """With temperature 1 and flat-ish logits, sampling yields more than one distinct id."""
    lg = torch.zeros(VOCAB)
    g = _gen(0)
    assert len({sample(lg, 1.0, 1.0, g) for _ in range(50)}) > 5


def test_tiny_top_p_is_argmax() -> None:
    """top_p near zero keeps only the most likely id."""
    g = _gen(1)
    for seed in range(5):
        lg = _logits(seed)
        assert all(sample(lg, 1.5, 1e-6, g) == int(lg.argmax()) for _ in range(20))


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    """top_p 0.6 over probs (0.5, 0.3, 0.2) only ever samples ids 0 and 1."""
    lg = torch.tensor([0.5, 0.3, 0.2]).log()
    g = _gen(2)
    seen = {sample(lg, 1.0, 0.6, g) for _ in range(300)}
    assert seen == {0, 1}


def test_sampling_respects_allowed_mask() -> None:
    """Temperature sampling never returns an id outside the allowed mask."""
    lg = torch.zeros(VOCAB)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[3, 17, 41]] = True
    g = _gen(3)
    seen = {sample(lg, 1.0, 1.0, g, allowed) for _ in range(200)}
    assert seen == {3, 17, 41}
    seen_p = {sample(lg, 1.0, 0.5, g, allowed) for _ in range(200)}
    assert seen_p <= {3, 17, 41}


def test_top_p_zero_is_greedy() -> None:
    """top_p 0 (allowed by OpenAI's range [0, 1]) behaves like the smallest set: the argmax."""
    lg = _logits()
    assert sample(lg, 1.0, 0.0, _gen(0)) == int(lg.argmax())


def test_top_k_samples_only_the_k_most_likely() -> None:
    """top_k 3 at a high temperature only ever samples the three highest logits; top_k 0 keeps every id."""
    lg = _logits(7)
    top3 = set(torch.topk(lg, 3).indices.tolist())
    g = _gen(3)
    assert {sample(lg, 5.0, 1.0, g, top_k=3) for _ in range(400)} == top3
    assert len({sample(lg, 5.0, 1.0, g, top_k=0) for _ in range(400)}) > 3


def test_top_k_one_is_greedy() -> None:
    """top_k 1 samples the argmax whatever the temperature."""
    g = _gen(4)
    for seed in range(5):
        lg = _logits(seed)
        assert all(sample(lg, 2.0, 1.0, g, top_k=1) == int(lg.argmax()) for _ in range(20))
