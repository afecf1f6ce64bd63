"""TLS on the API and kv_share, and the loopback-only rule for a mesh without a secret."""

from __future__ import annotations

import json
import random
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvmesh.node.lab.workload import grow_conversation
from kvmesh.node.config import load_config
from kvmesh.node.errors import ConfigError
from kvmesh.node.lab.launcher import NodeProcess, free_port, write_toml

SECRET = "tls-test-mesh-secret-000000"


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=kvmesh-test", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return crt, key


def test_non_loopback_bind_without_secret_is_refused_with_the_reason() -> None:
    """A node with no mesh secret refuses to listen beyond loopback, naming the field and the fix."""
    for override in ({"api.host": "0.0.0.0"}, {"kvshare.listen": "0.0.0.0:7000"}, {"kvshare.listen": ":7000"}):
        with pytest.raises(ConfigError, match="mesh.secret"):
            load_config(None, override)
    assert load_config(None, {"api.host": "0.0.0.0", "mesh.secret": SECRET}).api.host == "0.0.0.0"
    assert load_config(None, {"api.host": "::1"}).api.host == "::1"


def test_non_loopback_bind_refused_at_start_by_the_cli(tmp_path: Path) -> None:
    """`kvmesh node --host 0.0.0.0` without a secret exits non-zero and says why."""
    r = subprocess.run([sys.executable, "-m", "kvmesh.node.cli", "node", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "mesh.secret" in r.stderr and "loopback" in r.stderr


def test_tls_mesh_serves_https_and_replicates_over_tls(tmp_path: Path, cert: tuple[Path, Path]) -> None:
    """Two nodes with TLS on API and kv_share: an https turn runs and its replica lands over TLS."""
    crt, key = cert
    tls = {"cert_file": str(crt), "key_file": str(key), "ca_file": str(crt)}
    names = ["a", "b"]
    ports = {n: (free_port(), free_port()) for n in names}
    nodes = []
    for n in names:
        peers = [{"name": p, "api": f"https://127.0.0.1:{ports[p][0]}", "kvshare": f"127.0.0.1:{ports[p][1]}"}
                 for p in names if p != n]
        cfg = {"name": n, "api": {"host": "127.0.0.1", "port": ports[n][0], "tls": tls},
               "engine": {"kind": "sim", "slots": 1, "cache_bytes": 32 << 20, "block_size": 64,
                          "sim": {"kv_scale": 0.02, "prefill_tps": 1e6, "decode_tps": 1000.0}},
               "kvshare": {"listen": f"127.0.0.1:{ports[n][1]}", "replicate_min_tokens": 0, "fsync": "never",
                           "tls": tls, "store_dir": str(tmp_path / f"store-{n}")},
               "mesh": {"peers": peers, "secret": SECRET, "poll_interval_s": 0.2}}
        write_toml(tmp_path / f"{n}.toml", cfg)
        nodes.append(NodeProcess(n, tmp_path / f"{n}.toml", tmp_path).start())
    try:
        for node in nodes:
            node.wait_ready()
        a, b = nodes
        assert a.api.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(crt)), timeout=30) as c:
            deadline = time.monotonic() + 15
            while not all(h["reachable"] for h in c.get(f"{a.api}/v1/cluster").json()["hosts"]):
                assert time.monotonic() < deadline, "peers never saw each other over https"
                time.sleep(0.2)
            msgs = grow_conversation(random.Random(1), 1500)
            r = c.post(f"{a.api}/v1/chat/completions", headers={"X-Session-Id": "tls-1"},
                       json={"model": "kvmesh-sim", "messages": msgs, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200
            served_by = r.headers["x-kvmesh-host"]
            other = b if served_by == "a" else a
            deadline = time.monotonic() + 15
            while True:
                inn = c.get(f"{other.api}/v1/stats").json()["kvshare"]["in"]
                if inn.get(served_by, {}).get("transfers", 0) >= 1:
                    break
                assert time.monotonic() < deadline, f"no replica arrived over TLS: {json.dumps(inn)}"
                time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):  # plain TLS clients without the CA are refused
            httpx.get(f"{a.api}/health", timeout=5)
    finally:
        for node in nodes:
            node.stop()
