"""The drills' cleanup registry: every process, proxy and mount a drill starts registers its undo here.

Undo actions run most recent first, on scenario end, on error, on Ctrl-C and at interpreter exit,
so an interrupted `kvmesh chaos` leaves nothing behind. Only what was started here is undone.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable


class Cleanup:
    """Undo actions, most recent first; run on scenario end, on error, on Ctrl-C and at exit."""

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def push(self, what: str, fn: Callable[[], None]) -> Callable[[], None]:
        """Register `fn` (named `what` in error messages); returns it, to `discard` once done."""
        with self._lock:
            self._actions.append((what, fn))
        return fn

    def discard(self, fn: Callable[[], None]) -> None:
        """Forget `fn`: its owner undid it already."""
        with self._lock:
            self._actions = [(w, f) for w, f in self._actions if f is not fn]

    def run(self) -> None:
        """Run and forget every action, most recent first; one failing never stops the rest."""
        while True:
            with self._lock:
                if not self._actions:
                    return
                what, fn = self._actions.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - undo everything else whatever happens
                print(f"chaos: cleanup of {what} failed: {type(e).__name__}: {e}", file=sys.stderr)


CLEANUP = Cleanup()
atexit.register(CLEANUP.run)
