"""Websocket ingest: one long-lived loop per node, feeding frames into the state.

`stream_node` connects to `{node}/v1/events`, hands every text frame to the sink
(normally the `ConsoleState`), and on any failure marks the node disconnected and
reconnects with exponential backoff plus jitter. Each (re)connect begins with a
cluster view, so the state rebuilds itself; nothing here interprets events. The loop
only ends when its task is cancelled: a node going away must never end the console.

The handshake presents the console's API key (`headers`, console.apikey). A node that refuses it (401,
or 403 from a server that can refuse a websocket no other way) is reported to the sink once, as a
refusal the operator can act on, and asked again only every `REFUSED_RETRY_S`: retrying sooner
cannot help until the key or the node's configuration changes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from kvmesh.console.apikey import refusal

# Cluster views of big meshes are large single frames (2,000 sessions is ~0.5 MB).
MAX_FRAME_BYTES = 64 * 1024 * 1024
# How often a node that refused the console's credentials is asked again.
REFUSED_RETRY_S = 30.0


class IngestSink(Protocol):
    def node_connected(self, url: str) -> None: ...
    def node_disconnected(self, url: str, reason: str = "") -> None: ...
    def node_refused(self, url: str, message: str) -> None: ...
    def feed_frame(self, url: str, data: str | bytes) -> bool: ...


class Backoff:
    """Exponential backoff with jitter, so a restarted mesh is not hit by every console at once."""

    def __init__(
        self, initial: float = 0.5, maximum: float = 10.0, factor: float = 2.0, jitter: float = 0.25,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.initial, self.maximum, self.factor, self.jitter = initial, maximum, factor, jitter
        self._rng = rng
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * self.factor)
        return delay * (1 - self.jitter + 2 * self.jitter * self._rng())

    def reset(self) -> None:
        self._next = self.initial


def events_url(node_url: str) -> str:
    """http://host:port -> ws://host:port/v1/events (https -> wss)."""
    parts = urlsplit(node_url if "://" in node_url else "http://" + node_url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme, "ws")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/events"):
        path += "/v1/events"
    return f"{scheme}://{parts.netloc}{path}"


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


async def stream_node(
    url: str,
    sink: IngestSink,
    *,
    headers: Mapping[str, str] | None = None,
    backoff: Backoff | None = None,
    connect: Callable[..., Any] = ws_connect,
    open_timeout: float = 5.0,
    refused_retry_s: float = REFUSED_RETRY_S,
) -> None:
    """Follow one node's event stream forever (until cancelled); `headers` go with every handshake."""
    backoff = backoff or Backoff()
    target = events_url(url)
    kwargs: dict[str, Any] = {"max_size": MAX_FRAME_BYTES, "open_timeout": open_timeout}
    if headers:
        kwargs["additional_headers"] = dict(headers)
    if _is_loopback(target):
        kwargs["proxy"] = None  # an HTTP(S)_PROXY in the environment must not capture loopback
    while True:
        reason = ""
        try:
            async with connect(target, **kwargs) as ws:
                first = True
                async for frame in ws:
                    if first:
                        # Only a stream that delivers (its cluster view first) counts as
                        # connected: a server that accepts and drops at once keeps the
                        # node stale since its first loss, and keeps backing off.
                        sink.node_connected(url)
                        backoff.reset()
                        first = False
                    sink.feed_frame(url, frame)
                reason = "closed by node"
        except asyncio.CancelledError:
            sink.node_disconnected(url, "console stopping")
            raise
        except InvalidStatus as exc:
            said = refusal(url, exc.response.status_code, keyed=bool(headers))
            if said is not None:
                sink.node_refused(url, said)
                await asyncio.sleep(refused_retry_s)
                continue
            reason = f"HTTP {exc.response.status_code} on the event stream's handshake"
        except Exception as exc:  # noqa: BLE001 - any failure means: mark stale, retry
            reason = f"{type(exc).__name__}: {exc}"[:200]
        sink.node_disconnected(url, reason)
        await asyncio.sleep(backoff.next())
