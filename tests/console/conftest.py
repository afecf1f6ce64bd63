"""Fixtures for the console tests (helpers live in kvm_helpers.py)."""

from __future__ import annotations

import pytest
from kvm_helpers import Clock

from kvmesh.console.state import ConsoleState


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state(clock: Clock) -> ConsoleState:
    return ConsoleState(clock=clock)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests here run on asyncio (Textual's loop), via anyio's pytest plugin."""
    return "asyncio"
