"""Fixtures for the kv_share tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.node.engine.engine import Engine

from .helpers import sim_engine


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = sim_engine()
    yield e
    e.close()


# ---- service tests: real node processes (see service_helpers.py) -------------------------------

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from .service_helpers import Pair


@pytest.fixture(scope="session")
def kv_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator["Pair"]:
    """Nodes a and b (sim engines, blocks of 64 tokens, a 64 MiB KV pool each), shared by the service tests:
    each test uses its own session ids; a -> b replicas cross `kv_pair.proxy`."""
    from .service_helpers import start_pair

    pair = start_pair(tmp_path_factory.mktemp("kv-pair"))
    try:
        yield pair
    finally:
        pair.proxy.resume()
        pair.stop()
