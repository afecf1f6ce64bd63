"""kvshare.enabled = false is a real switch: no listener, no push after a turn, a migrate says why it cannot ship the cache."""

from __future__ import annotations

from support.conversation import Conversation

from .helpers import start_mesh, whole_blocks


def test_kvshare_off_pushes_and_accepts_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Three nodes with kv_share off: turns are served, the session stays long enough to replicate, yet no host listens,
    no replica lands anywhere, and a migrate fails naming the switch (while the same call moves a replica when on)."""
    m = start_mesh(tmp_path / "off", kvshare={"enabled": False})
    try:
        conv = Conversation("kv-off", seed=901)
        t1 = m.turn(conv, "a")
        assert t1.status == 200 and t1.prompt_tokens > whole_blocks(1024) > 0  # past replicate_min_tokens (1024)
        m.turn(conv, t1.host)
        assert all(m.stats(n)["kvshare"]["address"] == "" for n in m.names)  # no listener anywhere
        target = next(n for n in m.names if n != t1.host)
        r = m.admin(t1.host, f"/v1/admin/sessions/{conv.session}/migrate", {"target": target})
        assert r.status_code == 200 and r.json()["ok"] is False, r.text
        assert "kvshare.enabled = false" in r.json()["message"]
        assert all(m.transfers_in(n, src) == 0 for n in m.names for src in m.names if src != n)
        assert all(m.holding(n, conv.session)["resident_tokens"] == 0 for n in m.names if n != t1.host)
    finally:
        m.stop()
