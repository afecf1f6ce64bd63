"""Fixtures for the console tests (helpers live in kvm_helpers.py)."""

from __future__ import annotations

import pytest
from kvm_helpers import Clock

from console.state import ConsoleState


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def state(clock: Clock) -> ConsoleState:
    return ConsoleState(clock=clock)
