"""Secrets never leak: not in logs (at DEBUG), events, views, metrics, responses or error text.

A run on the shared two-process mesh (mesh secret, previous secret, admin token) does turns,
replicas, drains, a migrate, a replicate and failed auth attempts on every listener (including
clients presenting the real secrets in the wrong place); then every log file, every view and a
capture of both nodes' /v1/events are searched for the three secret strings and both peer tokens.
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
from support.events import EventStream

from kvmesh.node.config import load_config
from kvmesh.node.errors import ConfigError
from kvmesh.node.kvshare import wire
from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

from .helpers import Mesh, chat
from .test_auth import undrained_after


def _kv_offer(addr: str, secret: bytes, session: str) -> None:
    """An offer to a kv_share listener signed with `secret` (for a model nobody serves); the reply is ignored."""
    toks = np.arange(64, dtype=np.int32)
    offer = wire.Offer(session=session, sender="intruder", fingerprint="not-a-model", block_size=64, block_bytes=1024,
                       n_blocks=1, generation=1, sent_at=1.0)
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(wire.Sender(secret).offer_bytes(offer, toks, [bytes(16)]))
        s.settimeout(10)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass


def _exercise(m: Mesh, seen: list[str]) -> None:
    """Turns, replicas, drains, a migrate, a replicate and failed auth attempts; every response kept in `seen`."""
    a, b = m.api("a"), m.api("b")
    admin = m.admin_headers()

    def keep(r) -> None:  # type: ignore[no-untyped-def]
        seen.append(f"{r.status_code} {dict(r.headers)} {r.text}")

    served: dict[str, str] = {}
    for i in range(4):
        sid = f"leak-{i}"
        msgs = [{"role": "system", "content": f"session {i} " + "context " * 200}, {"role": "user", "content": "go"}]
        for turn in range(2):
            r = m.http.post((a if i % 2 == 0 else b) + "/v1/chat/completions", headers={"X-Session-Id": sid},
                            json=chat(msgs, max_tokens=4))
            keep(r)
            assert r.status_code == 200, r.text
            served[sid] = r.headers["x-kvmesh-host"]
            msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"},
                     {"role": "user", "content": f"turn {turn}"}]
    with undrained_after(m):
        for host in ("a", "b"):
            for action in ("drain", "undrain"):
                r = m.http.post(a + f"/v1/admin/hosts/{host}/{action}", headers=admin)
                keep(r)
                assert r.status_code == 200, r.text
    sid = "leak-0"
    src = served[sid]
    dst = "b" if src == "a" else "a"
    r = m.http.post(a + f"/v1/admin/sessions/{sid}/migrate", headers=admin, json={"target": dst})
    keep(r)
    assert r.status_code == 200, r.text
    r = m.http.post(b + "/v1/admin/sessions/leak-1/replicate", headers=admin)
    keep(r)
    assert r.status_code == 200, r.text
    # Failed attempts, the real secrets presented in the wrong places.
    for headers in ({"Authorization": f"Bearer {m.secret}"}, {"Authorization": f"Bearer {m.previous_secret}"},
                    {"Authorization": m.admin_token}, {"Authorization": f"Bearer {m.peer_token}"}):
        r = m.http.post(a + "/v1/admin/hosts/a/drain", headers=headers)
        keep(r)
        assert r.status_code == 401
    for headers in ({PEER_HEADER: m.secret}, {PEER_HEADER: m.previous_secret}, {PEER_HEADER: m.admin_token},
                    {PEER_HEADER: peer_token(b"wrong-secret-wrong-secret")}):
        r = m.http.get(b + "/v1/peer/status", headers=headers)
        keep(r)
        assert r.status_code == 401
        r = m.http.post(a + "/v1/chat/completions", headers={"X-Kvmesh-Forwarded": "1", "X-Session-Id": "leak-fwd", **headers},
                        json=chat())
        keep(r)
        assert r.status_code == 200
    # kv_share: an offer signed with a wrong secret (unauthenticated) and one with the previous secret (authenticated,
    # then refused: no such model here).
    kv = {n: m.configs[n]["kvshare"]["listen"] for n in m.nodes}
    _kv_offer(kv["a"], b"wrong-secret-wrong-secret", "leak-kv-wrong")
    _kv_offer(kv["b"], m.previous_secret.encode(), "leak-kv-previous")
    _kv_offer(kv["b"], m.admin_token.encode(), "leak-kv-admin")


def test_secrets_never_appear_in_logs_events_views_or_responses(mesh: Mesh) -> None:
    """After a full run: no secret, previous secret, admin token or peer token in any log, event, view, metric or response."""
    m = mesh
    captures = {n: EventStream(m.api(n), open_timeout=15) for n in m.nodes}
    seen: list[str] = []
    try:
        _exercise(m, seen)
        # The event streams saw the run (replicas, drains, the migrate, the refusals).
        wait_for(lambda: all({"replica_refused", "drain_started", "turn_finished"} <= c.types() for c in captures.values())
                 and any("migrate_completed" in c.types() for c in captures.values()),
                 "the run's events on both streams", timeout=20)
    finally:
        for c in captures.values():
            c.close()
    corpus: dict[str, str] = {}
    for n in m.nodes:
        api = m.api(n)
        for path, headers in (("/v1/cluster", {}), ("/v1/stats", {}), ("/metrics", {}), ("/health", {}),
                              ("/v1/models", {}), ("/v1/peer/status", m.peer_headers()), ("/openapi.json", {})):
            r = m.http.get(api + path, headers=headers)
            assert r.status_code == 200, (n, path, r.status_code)
            corpus[f"{n} GET {path}"] = f"{dict(r.headers)}\n{r.text}"
        corpus[f"{n} /v1/events"] = "\n".join(captures[n].raw())
        proc = m.nodes[n].proc
        assert proc is not None
        corpus[f"{n} cmdline"] = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
    corpus["responses"] = "\n".join(seen)
    # Every file the run wrote (logs, ready files, the replica stores), except the config files that hold the secrets.
    files = [p for p in m.workdir.rglob("*") if p.is_file() and p.suffix != ".toml"]
    assert any(p.suffix == ".log" and p.stat().st_size > 0 for p in files), files
    for p in files:
        corpus[str(p.relative_to(m.workdir))] = p.read_bytes().decode("latin-1")
    logs = "".join(corpus[k] for k in corpus if k.endswith(".log"))
    assert "DEBUG" in logs and "refused a replica" in logs, "the nodes did not log at DEBUG what the run did"
    # The search would find them: the config files (not searched) hold them.
    assert all(s in (m.workdir / "a.toml").read_text() for s in (m.secret, m.previous_secret, m.admin_token))
    leaks = [f"{what} in {where}" for where, text in corpus.items() for what, s in m.secret_strings().items() if s in text]
    assert not leaks, leaks


def test_a_short_secret_is_refused_without_its_value_in_the_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config whose mesh secret, previous secret or admin token is too short: ConfigError naming the field, never the value."""
    cfg = tmp_path / "n.toml"
    cfg.write_text('admin_token = "Tk7zQ"\n[mesh]\nsecret = "Sec-R3t-9x"\nprevious_secret = "Pv-8q1"\n')
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    text = f"{e.value}\n{e.value!r}\n{e.value.args}"
    for field in ("admin_token", "mesh.secret", "mesh.previous_secret"):
        assert field in text, text
    for value in ("Tk7zQ", "Sec-R3t-9x", "Pv-8q1"):
        assert value not in text, text
    # The same via the environment, and a valid config's repr and dump hide its secrets.
    monkeypatch.setenv("KVMESH_MESH_SECRET", "EnvS3cr")
    with pytest.raises(ConfigError) as e:
        load_config(None)
    assert "mesh.secret" in str(e.value) and "EnvS3cr" not in f"{e.value}{e.value!r}"
    monkeypatch.setenv("KVMESH_MESH_SECRET", "a-valid-mesh-secret-value-123")
    ok = load_config(None, {"admin_token": "a-valid-admin-token-456"})
    for shown in (repr(ok), str(ok), ok.model_dump_json()):
        assert "a-valid-mesh-secret-value-123" not in shown and "a-valid-admin-token-456" not in shown
