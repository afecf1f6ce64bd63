"""Discovered peers (`mesh.discovery = "dns"` or `"kubernetes"`): the hosts a source lists, admitted by a signed hello.

Every `discovery_interval_s` the source is read. DNS (dnspython, the system's resolvers or
`dns_server`): SRV records (a name starting with "_", e.g. `_api._tcp.kvmesh.ns.svc`) give each
host and port; A/AAAA records (a Kubernetes headless Service) give addresses at `dns_port`.
Kubernetes (node.mesh.kubesource): the Service's EndpointSlices, ready and not terminating, listed
afresh every round. A new address is sent
`POST /v1/peer/hello` with a fresh nonce; only an answer whose MAC (HMAC-SHA256 with the mesh
secret over the nonce and the answer's fields) checks out becomes a peer, under the name it gave,
at the address resolved, with the ports it gave. An address absent from two resolutions in a row
is removed (one lost answer is not a departure); a failed resolution changes nothing (a DNS outage
must not empty the mesh). Static `mesh.peers` stay as they are.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import secrets
from collections.abc import Callable
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.resolver
import httpx
from pydantic import ValidationError

from kvmesh.node.config import MeshConfig, PeerConfig
from kvmesh.node.protocol import PeerHello

log = logging.getLogger("kvmesh.mesh.discovery")

Address = tuple[str, int]  # (host or IP, API port) as resolved


def hello_mac(secret: bytes, nonce: str, name: str, api_port: int, kvshare_port: int, scheme: str) -> str:
    msg = f"kvmesh/hello/v1|{nonce}|{name}|{api_port}|{kvshare_port}|{scheme}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def hello(name: str, api_port: int, kvshare_port: int, scheme: str, secret: bytes, nonce: str) -> PeerHello:
    """This host's answer to a hello (the route's side)."""
    return PeerHello(name=name, api_port=api_port, kvshare_port=kvshare_port, scheme=scheme,
                     mac=hello_mac(secret, nonce, name, api_port, kvshare_port, scheme))


def _url_host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


class DnsSource:
    """The addresses a DNS name lists (SRV for a name starting with "_", else A and AAAA at `dns_port`)."""

    def __init__(self, cfg: MeshConfig, own_api_port: Callable[[], int]) -> None:
        self.cfg, self.own_api_port = cfg, own_api_port
        self.resolver = dns.asyncresolver.Resolver(configure=not cfg.dns_server)
        if cfg.dns_server:
            host, port = cfg.dns_server.rsplit(":", 1)
            self.resolver.nameservers, self.resolver.port = [host], int(port)
        self.resolver.lifetime = 2.0

    @property
    def what(self) -> str:
        return self.cfg.dns_name

    async def resolve(self) -> set[Address] | None:
        """The addresses the name lists now; None when the lookup failed (not the same as none)."""
        name = self.cfg.dns_name
        try:
            if name.startswith("_"):
                ans = await self.resolver.resolve(name, "SRV")
                return {(str(r.target).rstrip("."), int(r.port)) for r in ans}
            port = self.cfg.dns_port or self.own_api_port()
            out: set[Address] = set()
            for rdtype in ("A", "AAAA"):
                try:
                    out |= {(r.to_text(), port) for r in await self.resolver.resolve(name, rdtype)}
                except dns.resolver.NoAnswer:
                    pass
            return out
        except dns.resolver.NXDOMAIN:
            return set()
        except dns.exception.DNSException as e:
            log.warning("discovery: resolving %s failed (%s); keeping the peers as they are", name, e)
            return None


class Source(Protocol):
    """Where discovered addresses come from: DNS (above) or Kubernetes (node.mesh.kubesource)."""

    @property
    def what(self) -> str: ...

    async def resolve(self) -> set[Address] | None: ...


class Discovery:
    """Keeps the discovered part of the peer set in step with its source (see the module docstring)."""

    def __init__(self, me: str, source: Source, *, interval_s: float, secrets_: list[bytes],
                 client: Callable[[], httpx.AsyncClient], admit: Callable[[PeerConfig], None],
                 remove: Callable[[str], None], scheme: str = "http") -> None:
        self.me, self.source, self.interval_s, self.secrets = me, source, interval_s, secrets_
        self.client, self.admit, self.remove, self.scheme = client, admit, remove, scheme
        self.found: dict[Address, str] = {}  # address -> admitted peer name
        self.missing: dict[Address, int] = {}  # address -> rounds in a row it was absent from
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:  # noqa: BLE001 - discovery must keep running; the next round retries
                log.exception("discovery round failed")
            await asyncio.sleep(self.interval_s)

    async def round(self) -> None:
        """One resolution: admit what is new (after its hello), remove what has been gone twice."""
        now = await self.source.resolve()
        if now is None:
            return
        for addr in now - self.found.keys():
            await self._greet(addr)
        for addr in list(self.found):
            if addr in now:
                self.missing.pop(addr, None)
                continue
            self.missing[addr] = self.missing.get(addr, 0) + 1
            if self.missing[addr] >= 2:
                name = self.found.pop(addr)
                self.missing.pop(addr, None)
                if name != self.me:
                    log.warning("discovery: %s (%s:%d) left %s", name, *addr, self.source.what)
                    self.remove(name)

    async def _greet(self, addr: Address) -> None:
        host, port = addr
        nonce = secrets.token_hex(16)
        url = f"{self.scheme}://{_url_host(host)}:{port}/v1/peer/hello"
        try:
            r = await self.client().post(url, json={"nonce": nonce}, timeout=2.0)
            r.raise_for_status()
            h = PeerHello.model_validate_json(r.content)
        except (httpx.HTTPError, ValidationError) as e:
            log.info("discovery: %s:%d did not answer a hello (%s)", host, port, type(e).__name__)
            return
        if not any(hmac.compare_digest(h.mac, hello_mac(s, nonce, h.name, h.api_port, h.kvshare_port, h.scheme))
                   for s in self.secrets):
            log.warning("discovery: %s:%d answered a hello without the mesh secret; not admitted", host, port)
            return
        if h.name == self.me:
            self.found[addr] = h.name  # this node's own record: known, never a peer
            return
        try:
            peer = PeerConfig(name=h.name, api=f"{h.scheme}://{_url_host(host)}:{h.api_port}",
                              kvshare=f"{host}:{h.kvshare_port}")
        except ValidationError as e:
            log.warning("discovery: %s:%d gave an unusable hello: %s", host, port, e.errors()[0]["msg"])
            return
        self.found[addr] = h.name
        log.info("discovery: admitted %s at %s", h.name, peer.api)
        self.admit(peer)

