"""The console's own connections to nodes' event streams, and the peers found in cluster views.

A connection is keyed by the node's normalized base URL. A node whose socket is
lost stays, marked with the time it went stale; the host table reads that to show
the host DISCONNECTED. Peers named in a cluster view that the console has no stream
for yet wait here until the app takes them (`take_discovered`) and connects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.console.state.changes import Changes
from kvmesh.node.protocol import HostInfo


def normalize_url(url: str) -> str:
    """A node's base URL as a key: scheme and host lower-cased, no trailing slash."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    host, sep, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{sep}{path}"


@dataclass(slots=True)
class NodeConn:
    """The console's own connection to one node's event stream."""

    url: str
    name: str | None = None  # learned from the node's cluster view
    connected: bool = False
    ever_connected: bool = False
    connected_since: float | None = None
    stale_since: float | None = None  # when the stream was lost (None while connected)
    error: str = ""
    reconnects: int = 0
    view_node: str | None = None
    view_seq: int = 0  # watermark: events from view_node with seq <= this are in the cluster view
    discovered: bool = False


class Nodes:
    """Every node the console follows (or means to), by normalized URL."""

    def __init__(self, changes: Changes, clock: Callable[[], float]) -> None:
        self.conns: dict[str, NodeConn] = {}
        self._changes = changes
        self._clock = clock
        self._discovered: dict[str, str] = {}  # host name -> url, not yet connected
        self._by_name: dict[str, NodeConn] = {}  # host name -> connection, as last found

    def add(self, url: str, *, discovered: bool = False) -> NodeConn:
        key = normalize_url(url)
        conn = self.conns.get(key)
        if conn is None:
            conn = self.conns[key] = NodeConn(url=key, discovered=discovered)
            self._changes.nodes = True
        return conn

    def connected(self, url: str) -> tuple[NodeConn, float | None]:
        """Mark the stream up; returns the connection and when it had gone stale (None: it had not)."""
        conn = self.add(url)
        now = self._clock()
        if conn.ever_connected:
            conn.reconnects += 1
        conn.connected = True
        conn.ever_connected = True
        conn.connected_since = now
        conn.error = ""
        was_stale = conn.stale_since
        conn.stale_since = None
        self._changes.nodes = True
        return conn, was_stale

    def disconnected(self, url: str, reason: str) -> tuple[NodeConn, bool]:
        """Mark the stream lost; returns the connection and whether it had been up."""
        conn = self.add(url)
        conn.error = reason
        if conn.connected or conn.stale_since is None:
            conn.stale_since = self._clock() if conn.ever_connected else conn.stale_since
        was_connected = conn.connected
        conn.connected = False
        self._changes.nodes = True
        return conn, was_connected

    def for_host(self, name: str) -> NodeConn | None:
        """The connection whose node is `name` (by an index: the hosts table asks for each of 256 hosts)."""
        conn = self._by_name.get(name)
        if conn is not None and conn.name == name:
            return conn
        for conn in self.conns.values():
            if conn.name == name:
                self._by_name[name] = conn
                return conn
        return None

    def connected_count(self) -> tuple[int, int]:
        return sum(1 for c in self.conns.values() if c.connected), len(self.conns)

    def maybe_discover(self, info: HostInfo) -> None:
        if info.name in self._discovered:
            return  # every cluster view names every host: 256 x 256 of these at a big mesh's start
        api = normalize_url(info.api)
        if api in self.conns or self.for_host(info.name) is not None:
            return
        self._discovered[info.name] = api

    def take_discovered(self) -> dict[str, str]:
        """Peers seen in cluster views (host name -> API URL) that the console has no stream for yet."""
        found, self._discovered = self._discovered, {}
        return found
