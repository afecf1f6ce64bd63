"""Fixtures for the bad-input and security tests (helpers in helpers.py).

- `fuzz_server` (module scope): an in-process sim node with an admin token and no mesh secret (loopback
  only, so the peer routes are open to it), with a 64 KiB body limit.
- `mesh` (session scope): two real `kvmesh node` processes, `a` and `b`, with a mesh secret, a previous
  secret and an admin token, kv_share io_timeout_s = 2, every log at DEBUG. Tests on it use their own
  session ids and leave both hosts undrained.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

from .helpers import Mesh, sim_config, start_mesh

FUZZ_ADMIN_TOKEN = "fuzz-admin-token-0123456789"
KV_IO_TIMEOUT_S = 2.0


@pytest.fixture(autouse=True)
def _no_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_config reads KVMESH_ADMIN_TOKEN / KVMESH_MESH_SECRET: none may leak in from the test runner."""
    for var in ("KVMESH_ADMIN_TOKEN", "KVMESH_MESH_SECRET"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    store = tmp_path_factory.mktemp("fuzz-store")
    cfg = sim_config("fuzz", admin_token=FUZZ_ADMIN_TOKEN, api={"max_body_bytes": 64 << 10},
                     kvshare={"store_dir": str(store), "replicate_min_tokens": 0})
    srv = serve_in_thread(cfg)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("sec-mesh"), kvshare={"io_timeout_s": KV_IO_TIMEOUT_S},
                   api={"max_body_bytes": 64 << 10})
    try:
        yield m
    finally:
        m.stop()
