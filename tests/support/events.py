"""A reader of one node's /v1/events websocket, for tests that watch what a node announces.

It connects, takes the snapshot (so every event after that is this reader's to see), then reads on a
thread of its own: every message is kept in order, as sent (text) and parsed as a `node.protocol` event.
A message that does not parse is kept as text and its error in `error` (the first one): the wire
contract is part of what the tests check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TypeVar

from pydantic import BaseModel
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.protocol import ClusterViewEvent, Event, parse_event

E = TypeVar("E", bound=BaseModel)
WAIT_S = 15.0


def events_url(api: str) -> str:
    """The /v1/events websocket URL of a node's API base URL."""
    if api.startswith("https://"):
        return "wss://" + api.removeprefix("https://") + "/v1/events"
    return "ws://" + api.removeprefix("http://") + "/v1/events"


class EventStream:
    """Every message of one /v1/events connection, from its snapshot until `close()`."""

    def __init__(self, api: str, *, open_timeout: float = 10.0) -> None:
        self.url = events_url(api)
        self.error: BaseException | None = None
        self._raw: list[str] = []
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._stack = ExitStack()  # the connection is a context manager: closed by close()
        self._ws = self._stack.enter_context(connect(self.url, open_timeout=open_timeout, max_size=None))
        try:
            self._take(self._ws.recv(timeout=open_timeout))
            first = self.received()
            assert first and isinstance(first[0], ClusterViewEvent), f"{self.url} opened with {self._raw[0][:200]}"
        except BaseException:
            self._stack.close()
            raise
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()

    def _take(self, msg: str | bytes) -> None:
        text = msg if isinstance(msg, str) else msg.decode()
        try:
            ev: Event | None = parse_event(text)
        except ValueError as e:  # pydantic.ValidationError: a message outside the wire contract
            ev = None
            self.error = self.error or e
        with self._lock:
            self._raw.append(text)
            if ev is not None:
                self._events.append(ev)

    def _run(self) -> None:
        while True:
            try:
                msg = self._ws.recv()
            except (ConnectionClosed, OSError):
                return
            self._take(msg)

    # ---- what arrived ------------------------------------------------------------

    def received(self) -> list[Event]:
        """Every event so far, in order: the snapshot, the replayed ring, then live events."""
        with self._lock:
            return list(self._events)

    def raw(self) -> list[str]:
        """Every message so far as sent, parsed or not."""
        with self._lock:
            return list(self._raw)

    def types(self) -> set[str]:
        return {e.type for e in self.received()}

    def live(self, kind: type[E], **match: Any) -> list[E]:
        """The live (not replayed) events of this kind whose fields equal `match`."""
        return [e for e in self.received() if isinstance(e, kind) and not e.replay  # type: ignore[attr-defined]
                and all(getattr(e, k, None) == v for k, v in match.items())]

    def wait(self, pred: Callable[[Any], bool], what: str, timeout: float = WAIT_S) -> Any:
        """The first event (replayed or live) for which `pred` holds, once it has arrived."""
        return wait_for(lambda: next((e for e in self.received() if pred(e)), None), what, timeout)

    def wait_live(self, kind: type[E], what: str = "", timeout: float = WAIT_S, **match: Any) -> E:
        """The first live event of this kind whose fields equal `match`, once it has arrived."""
        return wait_for(lambda: next(iter(self.live(kind, **match)), None),
                        what or f"a live {kind.__name__} event {match}", timeout)

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self._thread.join(5)
