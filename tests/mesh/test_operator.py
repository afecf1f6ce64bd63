"""Operator actions on a live mesh: drain (warm, with progress and completion), undrain, migrate (warm),
and the admin token (401 without it, never in a log)."""

from __future__ import annotations

import json
import secrets

import pytest
from support.conversation import Conversation

from kvmesh.node.lab.workload import text
from kvmesh.node.lab.launcher import NodeProcess, mesh_configs, wait_for

from .helpers import Mesh, whole_blocks


def test_drain_keeps_the_drained_hosts_sessions_warm(make_mesh, events) -> None:  # type: ignore[no-untyped-def]
    """Draining a host pushes its sessions to their next hosts first: their next turns elsewhere are warm."""
    m: Mesh = make_mesh(slots=2)
    x = "a"
    others = m.others(x)
    # While the other hosts drain (they hold nothing: their drains complete at once), new sessions can only
    # land on x, and no replica can be made anywhere: whatever is warm later, the drain itself pushed.
    for h in others:
        m.set_draining(x, h, True)
    for h in others:
        m.wait_draining(h, True)
    convs = [Conversation(f"drain-{i}", seed=600 + i) for i in range(3)]
    running = Conversation("drain-running", seed=610)
    for i, conv in enumerate([*convs, running]):
        t = m.turn(conv, m.names[i % 3])
        assert t.host == x, f"{conv.session} ran on {t.host} while every other host drained"
    for conv in [*convs, running]:
        m.settle(conv)
        info = m.session_info(x, conv.session)
        assert info is not None and info["replica_host"] is None, info
    for h in others:
        m.set_draining(others[0], h, False)
    for h in others:
        m.wait_draining(h, False)

    ws = events(m.api(x))
    # A turn that runs for ~2 s (40k tokens of tool output to prefill) while x starts draining.
    running.messages[-1]["content"] += text(running.rng, 40_000)
    with m.client(x).chat.completions.with_streaming_response.create(
            model="kvmesh-sim", messages=running.messages, max_tokens=8, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_headers={"X-Session-Id": running.session}) as resp:
        assert resp.headers["x-kvmesh-host"] == x
        # Drain x through another node's admin API while a turn runs on x.
        body = m.set_draining(others[1], x, True)
        assert x in body["message"]
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", "the running turn did not finish normally"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish in (["length"], ["stop"]), f"the running turn did not finish: {finish}"
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    assert usage["completion_tokens"] >= 1 and usage["prompt_tokens"] > 40_000
    running.grow("".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]))
    m.wait_draining(x, True)
    assert m.http.get(m.api(x) + "/health").json()["status"] == "draining"

    done = ws.wait(lambda e: e.type == "drain_completed" and e.host == x, f"drain_completed from {x}")
    seen = ws.received()
    started = [e for e in seen if e.type == "drain_started" and e.host == x]
    progress = [e for e in seen if e.type == "drain_progress" and e.host == x]
    assert len(started) == 1 and started[0].sessions == 4, started
    assert [p.done for p in progress] == [1, 2, 3, 4] and all(p.total == 4 for p in progress), progress
    assert seen.index(started[0]) < seen.index(progress[0]) and seen.index(progress[-1]) < seen.index(done)
    assert (done.moved, done.failed) == (4, 0), done

    # Every session has its latest cache on another host: the drain pushed the idle ones; the running
    # one was pushed again after its turn ended (its replica covers the streamed turn's prompt).
    for conv in convs:
        m.wait_replica(conv.session, x, whole_blocks(conv.turns[-1].prompt_tokens))
    m.wait_replica(running.session, x, whole_blocks(usage["prompt_tokens"]))
    for i, conv in enumerate([*convs, running]):
        entry = [x, *others][i % 3]  # the draining host itself is an entry too
        t = m.turn(conv, entry)
        assert t.host != x, f"{conv.session} ran on the draining host"
        assert t.handoff == "warm" and t.reused >= 0.9, t

    # Undrain: x takes turns again. Drain the two others, so their sessions come back to x (warm again).
    m.set_draining(others[0], x, False)
    m.wait_draining(x, False)
    assert m.http.get(m.api(x) + "/health").json()["status"] == "ok"
    evs = {h: events(m.api(h)) for h in others}
    for h in others:
        m.set_draining(x, h, True)
    for h in others:
        evs[h].wait(lambda e, h=h: e.type == "drain_completed" and e.host == h, f"drain_completed from {h}")
        m.wait_draining(h, True)
    for conv in convs:
        m.settle(conv)
        t = m.turn(conv, others[0])
        assert t.host == x and t.handoff == "warm" and t.reused >= 0.9, t
    c = wait_for(lambda: (c := m.cluster(x)["counters"])["warm"] >= 2 * len(convs) + 1 and c,
                 "the cluster to count every warm handoff")
    assert c["partial"] == 0 and c["cold"] == 0 and c["stale_state_cold"] == 0, c


def test_migrate_is_warm(shared_mesh: Mesh) -> None:
    """Migrating a session to a host that held none of it makes that host its home, and the next turn is warm."""
    m = shared_mesh
    conv = Conversation("migrate-1", seed=701)
    t1 = m.turn(conv, "a")
    home = t1.host
    m.settle(conv)
    holder = m.wait_replica(conv.session, home, whole_blocks(t1.prompt_tokens))
    target = next(n for n in m.names if n not in (home, holder))
    assert m.holding(target, conv.session)["resident_tokens"] == 0
    before = m.transfers_in(target, home)
    # Asked of the replica holder: neither the home nor the target; the call is relayed to the home.
    r = m.admin(holder, f"/v1/admin/sessions/{conv.session}/migrate", {"target": target})
    assert r.status_code == 200, r.text
    assert r.json()["ok"] is True and target in r.json()["message"], r.json()
    assert m.transfers_in(target, home) == before + 1  # the replica was pushed before the answer
    assert m.holding(target, conv.session)["resident_tokens"] >= whole_blocks(t1.prompt_tokens)
    m.wait_home(conv.session, target)
    t2 = m.turn(conv, home)  # through the old home's entry
    assert t2.host == target, f"migrated to {target}, the next turn ran on {t2.host}"
    assert t2.handoff == "warm" and t2.reused >= 0.9, t2
    assert t2.cached >= whole_blocks(t1.prompt_tokens)
    # Unknown target: an OpenAI-shaped 404, nothing moves.
    r = m.admin("a", f"/v1/admin/sessions/{conv.session}/migrate", {"target": "nohost"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text


BAD_AUTH = ["none", "wrong", "basic", "bare", "truncated", "empty"]


def test_admin_calls_need_the_admin_token(shared_mesh: Mesh) -> None:
    """Drain, undrain, migrate and replicate answer 401 (OpenAI-shaped) without the right token, 200 with it;
    peer endpoints need the mesh secret; neither secret appears in any node's log."""
    m = shared_mesh
    conv = Conversation("auth-1", seed=801)
    t1 = m.turn(conv, "a")
    home = t1.host
    m.settle(conv)
    holder = m.wait_replica(conv.session, home, whole_blocks(t1.prompt_tokens))
    target = next(n for n in m.names if n not in (home, holder))
    victim = next(n for n in m.names if n != home)
    wrong = "adm-" + secrets.token_hex(12)
    calls = [
        ("a", f"/v1/admin/hosts/{victim}/drain", None),
        ("b", f"/v1/admin/hosts/{victim}/undrain", None),
        ("c", f"/v1/admin/sessions/{conv.session}/migrate", {"target": target}),
        ("a", f"/v1/admin/sessions/{conv.session}/replicate", None),
    ]
    variants = {"none": None, "wrong": f"Bearer {wrong}", "basic": f"Basic {m.admin_token}", "bare": m.admin_token,
                "truncated": f"Bearer {m.admin_token[:-1]}", "empty": "Bearer"}
    for entry, path, body in calls:
        for name, header in variants.items():
            if header is None:
                r = m.admin(entry, path, body, token=None)
            else:
                r = m.admin(entry, path, body, authorization=header)
            assert r.status_code == 401, f"{path} with {name} auth: {r.status_code} {r.text}"
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "code"} and err["message"], err
            assert err["type"] == "authentication_error" and err["code"] == "unauthorized", err
            assert m.admin_token not in r.text and wrong not in r.text
    # Nothing happened: no host drains, the session stays home.
    for e in m.names:
        assert not any(h["draining"] for h in m.cluster(e)["hosts"])
    assert (m.session_info("a", conv.session) or {}).get("home") == home

    # Peer endpoints want the mesh secret, not the admin token.
    for method, path in (("GET", "/v1/peer/status"), ("POST", "/v1/peer/drain"),
                         ("POST", f"/v1/peer/sessions/{conv.session}/adopt")):
        for headers in ({}, {"Authorization": f"Bearer {m.admin_token}"}, {"X-Kvmesh-Peer-Auth": wrong}):
            r = m.http.request(method, m.api(victim) + path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)
    assert not m.host_info(victim, victim)["draining"]

    # The right token: 200 and the action happens.
    r = m.admin("a", f"/v1/admin/hosts/{victim}/drain")
    try:
        assert r.status_code == 200 and r.json()["ok"], r.text
        m.wait_draining(victim, True)
    finally:
        r = m.admin("b", f"/v1/admin/hosts/{victim}/undrain")
        m.wait_draining(victim, False)
    assert r.status_code == 200 and r.json()["ok"], r.text
    r = m.admin("a", f"/v1/admin/sessions/{conv.session}/replicate")
    assert r.status_code == 200 and r.json()["ok"], r.text
    r = m.admin("c", f"/v1/admin/sessions/{conv.session}/migrate", {"target": target})
    assert r.status_code == 200 and r.json()["ok"], r.text
    m.wait_home(conv.session, target)

    # Neither secret is in any log, nor in anything the node serves.
    for name, proc in m.nodes.items():
        log = proc.log_file.read_text(errors="replace")
        for secret in (m.admin_token, wrong, m.secret):
            assert secret and secret not in log, f"a secret appears in {proc.log_file}"
        for path in ("/v1/cluster", "/v1/stats", "/metrics", "/health"):
            body = m.http.get(m.api(name) + path).text
            assert m.admin_token not in body and (m.secret or "") not in body, f"a secret in {name} {path}"


def test_a_node_without_mesh_secret_refuses_a_non_loopback_address(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Without a mesh secret, a node refuses to listen beyond loopback (its peer endpoints are unauthenticated)."""
    cfgs = mesh_configs(tmp_path, ["solo"], host="0.0.0.0",
                        engine={"kind": "sim", "slots": 1, "cache_bytes": 8 << 20, "sim": {"kv_scale": 0.02}},
                        extra={"admin_token": "adm-" + secrets.token_hex(12)})
    proc = NodeProcess("solo", cfgs["solo"], tmp_path).start()
    try:
        with pytest.raises(RuntimeError, match="exited"):
            proc.wait_ready(timeout=60)
    finally:
        proc.stop()
    log = proc.log_file.read_text(errors="replace")
    assert "api.host" in log and "mesh.secret" in log, log[-2000:]
