"""Fixtures for the kv_share tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from node.engine.engine import Engine

from .helpers import sim_engine


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = sim_engine()
    yield e
    e.close()
