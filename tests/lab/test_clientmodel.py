"""The client model (node.lab.clientmodel): the SDKs' retries of an overloaded turn, and the flags that set them."""

from __future__ import annotations

import argparse
import random

from kvmesh.node.lab.clientmodel import ClientModel, add_client_args, check_client_args, client_from_args


def test_the_client_gives_up_after_its_retries() -> None:
    """Two retries (the SDKs'): a delay for the first and second refusal, None (the turn failed) for the third."""
    c, rng = ClientModel(retries=2), random.Random(1)
    assert c.retry_delay(0, 5, rng) == 5 and c.retry_delay(1, 5, rng) == 5
    assert c.retry_delay(2, 5, rng) is None
    assert ClientModel(retries=0).retry_delay(0, 5, rng) is None


def test_retry_after_is_honoured_up_to_60_s_then_the_backoff_takes_over() -> None:
    """Retry-After 60 s is waited out; 61 s, 0 or none falls back to 0.5 s x 2^n, shortened by up to a quarter, at most 8 s."""
    c, rng = ClientModel(retries=10), random.Random(2)
    assert c.retry_delay(0, 60, rng) == 60
    for n, full in ((0, 0.5), (1, 1.0), (3, 4.0), (4, 8.0), (9, 8.0)):
        for ra in (61, 0, None):
            d = c.retry_delay(n, ra, rng)
            assert d is not None and 0.75 * full <= d <= full, (n, ra, d)


def test_the_flags_pick_a_preset_and_the_retries_override_it() -> None:
    """--client claude-code retries 10 times, --client-retries wins over the preset, the default is the SDKs' 2 and 600 s."""
    p = argparse.ArgumentParser()
    add_client_args(p)
    assert client_from_args(p.parse_args([])) == ClientModel(retries=2, timeout_s=600.0)
    assert client_from_args(p.parse_args(["--client", "claude-code"])).retries == 10
    assert client_from_args(p.parse_args(["--client", "claude-code", "--client-retries", "3"])).retries == 3
    assert check_client_args(p.parse_args(["--client-retries", "-1"])) == "--client-retries must be 0 or more, got -1"
    assert check_client_args(p.parse_args(["--client-timeout-s", "0"])) is not None
