"""TLS contexts for the API, peer calls and kv_share, from a `TLSConfig`.

The mesh verifies certificates against its own CA (`ca_file`); peers are
addressed by IP, so the chain is checked but not the host name.
"""

from __future__ import annotations

import ssl

from kvmesh.node.config import TLSConfig


def server_context(tls: TLSConfig) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


def client_context(tls: TLSConfig | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=(tls.ca_file or None) if tls else None)
    ctx.check_hostname = False  # peers are configured by address; the CA chain is what is trusted
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
