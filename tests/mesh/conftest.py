"""Fixtures for the mesh integration tests (the mesh is in helpers.py; conversations and events in tests/support).

- `shared_mesh` (session scope): three nodes, 2 slots each, a mesh secret and an admin token; tests on it
  use their own session ids and leave every host undrained.
- `make_mesh` (function scope): a factory for tests that drain, kill or need a particular engine; every
  mesh it made is stopped when the test ends (the nodes' log tails are printed if the test failed).
- `events`: opens /v1/events websockets, closed at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.events import EventStream

from .helpers import Mesh, start_mesh


@pytest.fixture(scope="session")
def shared_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("shared-mesh"))
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def make_mesh(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Mesh]]:
    made: list[Mesh] = []

    def make(**kw: Any) -> Mesh:
        m = start_mesh(tmp_path / f"mesh{len(made)}", **kw)
        made.append(m)
        return m

    try:
        yield make
    finally:
        failed = getattr(request.node, "rep_call", None)
        for m in made:
            if failed is not None and failed.failed:
                print(m.logs())
            m.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


@pytest.fixture
def events() -> Iterator[Callable[[str], EventStream]]:
    """Open /v1/events websockets (base URL of a node -> EventStream); all closed at the end."""
    opened: list[EventStream] = []

    def open_(api: str) -> EventStream:
        s = EventStream(api)
        opened.append(s)
        return s

    try:
        yield open_
    finally:
        for s in opened:
            s.close()


