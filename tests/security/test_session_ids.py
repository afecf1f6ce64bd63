"""Session ids as clients send them: emails, base64 and path-like ids work; only non-ids are refused.

Any printable id up to 256 UTF-8 bytes is accepted (X-Session-Id, or `user`), shown verbatim in
/v1/cluster and events, and names nothing on disk: the replica store's directories go by
`protocol.session_key(id)`. Refused with a 400 naming the header or field: empty, over 256 bytes,
a control character. Session ids in admin and peer URL paths may hold '/', encoded or not.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest
from websockets.sync.client import connect

from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread
from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.protocol import session_key

from .helpers import MODEL, Mesh, chat, openai_error, sim_config, start_mesh, tree

# The prompt must fill KV blocks (64 tokens each) so that every served turn writes its session to the store.
LONG = "Please summarise the following text about replicas and caches. " * 4
# What agent frameworks send, as the issue reported them (each got 400 before).
CLIENT_IDS = ["user+tag@example.com", "b64:ab+/cd==", "proj/feature-x"]
# Ids that would escape or break a directory if they named one; as ids they are fine.
PATHY_IDS = ["../../../../etc/passwd", "..", ".", "/tmp/evil", "..\\..\\x", "%2e%2e%2f", "a b", "~x"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadedServer, Path]]:
    root = tmp_path_factory.mktemp("sid")
    store = root / "store"
    cfg = sim_config("sid", kvshare={"store_dir": str(store), "replicate_min_tokens": 0, "persist_own": True})
    srv = serve_in_thread(cfg)
    try:
        yield srv, store
    finally:
        srv.stop()


def _client(srv: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30.0)


def _turn(c: openai.OpenAI, messages: list[dict[str, str]], sid: str | None = None, user: str | None = None
          ) -> tuple[str, int, str]:
    """One turn through the official client: (X-Session-Id answered, cached prompt tokens, reply)."""
    kw: dict[str, Any] = {"user": user} if user is not None else {}
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0,  # type: ignore[arg-type]
        extra_headers={"X-Session-Id": sid} if sid is not None else None, **kw)
    done = raw.parse()
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    return raw.headers["x-session-id"], done.usage.prompt_tokens_details.cached_tokens or 0, \
        done.choices[0].message.content or ""


def _converse(c: openai.OpenAI, sid: str) -> int:
    """Two turns of one conversation sent with X-Session-Id: sid; the cached tokens of the second."""
    msgs = [{"role": "user", "content": LONG + sid}]
    answered, _, reply = _turn(c, msgs, sid=sid)
    assert answered == sid
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    answered, cached, _ = _turn(c, msgs, sid=sid)
    assert answered == sid
    return cached


def _events(url: str) -> list[dict[str, Any]]:
    """The node's replay ring as a fresh /v1/events subscriber gets it (after the snapshot)."""
    out: list[dict[str, Any]] = []
    with connect(url.replace("http://", "ws://") + "/v1/events", open_timeout=10, max_size=None) as ws:
        ws.recv(timeout=10)  # the snapshot
        try:
            while True:
                ev = json.loads(ws.recv(timeout=1.0))
                if not ev.get("replay"):
                    break
                out.append(ev)
        except TimeoutError:
            pass
    return out


def _manifest_sessions(store: Path) -> dict[str, str]:
    """Directory name -> the session its manifest names, for every committed replica."""
    return {d.name: json.loads((d / "manifest.json").read_text())["session"]
            for d in store.iterdir() if (d / "manifest.json").is_file()}


def test_client_style_ids_work_end_to_end_through_the_openai_client(node: tuple[ThreadedServer, Path]) -> None:
    """Email, base64 and path-like X-Session-Id values: 200, the same id answered, the second turn reuses the cache,
    the id shown verbatim in /v1/cluster and in events, and its replica stored under session_key (no '/' in names)."""
    srv, store = node
    c = _client(srv)
    for sid in CLIENT_IDS:
        assert _converse(c, sid) >= 64, sid
    # The same ids sent as `user` (no header) name the same sessions.
    assert _turn(c, [{"role": "user", "content": LONG + "user+tag@example.com"}], user="user+tag@example.com")[0] \
        == "user+tag@example.com"
    cluster = httpx.get(srv.url + "/v1/cluster", timeout=10).json()
    shown = {s["session"] for s in cluster["sessions"]}
    assert set(CLIENT_IDS) <= shown, shown
    started = {e["session"] for e in _events(srv.url) if e["type"] in ("turn_started", "turn_finished")}
    assert set(CLIENT_IDS) <= started, started
    wait_for(lambda: set(CLIENT_IDS) <= set(_manifest_sessions(store).values()), "every session's write-behind")
    on_disk = _manifest_sessions(store)
    for sid in CLIENT_IDS:
        assert on_disk[session_key(sid)] == sid
    assert all(re.fullmatch(r"[0-9a-f]{32}", d.name) for d in store.iterdir())
    assert all("/" not in p.name and p.resolve().is_relative_to(store.resolve()) for p in store.rglob("*"))


def test_path_like_and_non_ascii_ids_name_only_digest_directories(node: tuple[ThreadedServer, Path]) -> None:
    """Traversal-looking ids (header), UTF-8 ids (raw header bytes and `user`) run as themselves; the store's only
    new entries are their session_key directories; nothing appears beside the store."""
    srv, store = node
    parent_before = {k for k in tree(store.parent) if not k.startswith(store.name)}
    c = _client(srv)
    for sid in PATHY_IDS:
        assert _turn(c, [{"role": "user", "content": LONG + sid}], sid=sid)[0] == sid
    utf8 = "s\u00e9ssion-\u00fc\u4e2d"
    with httpx.Client(timeout=30) as h:
        r = h.post(srv.url + "/v1/chat/completions", headers=[(b"X-Session-Id", utf8.encode())],
                   json=chat([{"role": "user", "content": LONG + "utf8"}]))
        assert r.status_code == 200, r.text
        assert dict(r.headers.raw)[b"x-session-id"] == utf8.encode()  # the same bytes back
        emoji = "\U0001f600 team/alice"
        r = h.post(srv.url + "/v1/chat/completions", json=chat([{"role": "user", "content": LONG + "emoji"}], user=emoji))
        assert r.status_code == 200 and dict(r.headers.raw)[b"x-session-id"] == emoji.encode()
    ids = [*PATHY_IDS, utf8, emoji]
    shown = {s["session"] for s in httpx.get(srv.url + "/v1/cluster", timeout=10).json()["sessions"]}
    assert set(ids) <= shown, shown
    wait_for(lambda: set(ids) <= set(_manifest_sessions(store).values()), "every session's write-behind")
    assert {session_key(s) for s in ids} <= {d.name for d in store.iterdir()}
    assert all(re.fullmatch(r"[0-9a-f]{32}", d.name) for d in store.iterdir())
    assert {k for k in tree(store.parent) if not k.startswith(store.name)} == parent_before


def test_a_stored_replica_of_a_client_style_id_is_restored_after_a_restart(tmp_path: Path) -> None:
    """Each client-style id's replica, stored under session_key, is imported by a fresh node on the same store:
    the next turn of each conversation reuses its cache."""
    cfg = sim_config("sid-restart", kvshare={"store_dir": str(tmp_path / "store"), "replicate_min_tokens": 0,
                                             "persist_own": True})
    convs: dict[str, list[dict[str, str]]] = {}
    srv = serve_in_thread(cfg)
    try:
        for sid in CLIENT_IDS:
            msgs = [{"role": "user", "content": LONG + sid}]
            _, _, reply = _turn(_client(srv), msgs, sid=sid)
            convs[sid] = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
        wait_for(lambda: set(CLIENT_IDS) <= set(_manifest_sessions(tmp_path / "store").values()), "the write-behinds")
    finally:
        srv.stop()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted(session_key(s) for s in CLIENT_IDS)
    srv = serve_in_thread(cfg)
    try:
        for sid, msgs in convs.items():
            answered, cached, _ = _turn(_client(srv), msgs, sid=sid)
            assert answered == sid and cached >= 64, (sid, cached)
    finally:
        srv.stop()


REFUSED: dict[str, bytes] = {
    "empty": b"",
    "257-bytes": b"x" * 257,
    "257-bytes-utf8": "\u00e9".encode() * 128 + b"x",
    "tab": b"a\tb",
    "rtl-override": "abc\u202edef".encode(),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_non_ids_in_the_header_are_refused_naming_it(node: tuple[ThreadedServer, Path], name: str) -> None:
    """Empty, 257-byte and control-character X-Session-Id values: 400 naming X-Session-Id, the store unchanged."""
    srv, store = node
    before = tree(store)
    with httpx.Client(timeout=30) as c:
        r = c.post(srv.url + "/v1/chat/completions", headers=[(b"X-Session-Id", REFUSED[name])],
                   json=chat([{"role": "user", "content": LONG}]))
    err = openai_error(r, 400)
    assert err.get("param") == "X-Session-Id" and "X-Session-Id" in err["message"], err
    assert tree(store) == before


def test_the_limits_are_256_bytes_and_refusals_of_user_name_user(node: tuple[ThreadedServer, Path]) -> None:
    """A 256-byte id is accepted (header and `user`); a 257-byte or control-character `user` is 400 naming `user`."""
    srv, _ = node
    c = _client(srv)
    assert _turn(c, [{"role": "user", "content": "hi h"}], sid="h" * 256)[0] == "h" * 256
    for user in ("u" * 256, "\u00e9" * 128):  # the client sends headers as ASCII only: UTF-8 goes in `user`
        with httpx.Client(timeout=30) as h:
            r = h.post(srv.url + "/v1/chat/completions", json=chat([{"role": "user", "content": "hi " + user[:2]}], user=user))
        assert r.status_code == 200 and dict(r.headers.raw)[b"x-session-id"] == user.encode(), r.text
    for user in ("u" * 257, "a\x00b", "a\r\nX-Injected: 1"):
        with pytest.raises(openai.BadRequestError) as ei:
            _turn(c, [{"role": "user", "content": "hi"}], user=user)
        assert ei.value.param == "user", (user, ei.value)


def _raw(url: str, request: bytes) -> int:
    """Send a raw HTTP/1.1 request; the status code."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        got = s.recv(65536)
    return int(got.split(b" ", 2)[1])


def test_nul_byte_in_session_header_is_refused_before_the_app(node: tuple[ThreadedServer, Path]) -> None:
    """A NUL byte in X-Session-Id (sent raw: clients refuse to) is refused with 400 at the HTTP layer; nothing on disk."""
    srv, store = node
    before = tree(store)
    body = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":1}' % MODEL.encode()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Session-Id: a\x00../b\r\n"
           b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
    assert _raw(srv.url, req) == 400
    assert tree(store) == before


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("sid-mesh"), kvshare={"persist_own": True})
    try:
        yield m
    finally:
        m.stop()


def _home(m: Mesh, entry: str, sid: str) -> str | None:
    s = next((s for s in m.http.get(m.api(entry) + "/v1/cluster").json()["sessions"] if s["session"] == sid), None)
    return s["home"] if s else None


def test_a_path_like_session_migrates_through_admin_and_peer_routes(mesh: Mesh) -> None:
    """`proj/feature-x` in admin paths (percent-encoded and not): migrate relays to the home over the peer routes,
    the replica crosses kv_share under the id itself and lands in the target's store under session_key; a turn then
    runs warm on the new home."""
    m, sid = mesh, "proj/feature-x"
    c = openai.OpenAI(base_url=m.api("a") + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    msgs = [{"role": "user", "content": LONG * 3}]
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,  # type: ignore[arg-type]
                                                      extra_headers={"X-Session-Id": sid})
    home = raw.headers["x-kvmesh-host"]
    other = "b" if home == "a" else "a"
    for n in ("a", "b"):
        wait_for(lambda n=n: _home(m, n, sid) == home, f"{n} to see {home} as the home of {sid}")  # type: ignore[misc]
    # Asked of the other node: it relays to the home over /v1/peer/sessions/<encoded id>/migrate and /adopt.
    r = m.http.post(m.api(other) + f"/v1/admin/sessions/{quote(sid, safe='')}/migrate", json={"target": other},
                    headers=m.admin_headers())
    assert r.status_code == 200 and r.json()["ok"], r.text
    for n in ("a", "b"):
        wait_for(lambda n=n: _home(m, n, sid) == other, f"{n} to see {other} as the home of {sid}")  # type: ignore[misc]
    wait_for(lambda: (m.store_dir(other) / session_key(sid) / "manifest.json").is_file(), f"{other}'s stored replica")
    assert json.loads((m.store_dir(other) / session_key(sid) / "manifest.json").read_text())["session"] == sid
    assert not any("/" in p.name or p.name in (".", "..") for p in m.store_dir(other).rglob("*"))
    msgs += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
             {"role": "user", "content": "next"}]
    raw2 = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,  # type: ignore[arg-type]
                                                       extra_headers={"X-Session-Id": sid})
    assert raw2.headers["x-kvmesh-host"] == other and raw2.headers["x-session-id"] == sid
    assert int(raw2.headers["x-kvmesh-cached-tokens"]) >= 64
    # The unencoded path form reaches the same session (the old `{session}` form keeps working for plain ids).
    r = m.http.post(m.api(other) + f"/v1/admin/sessions/{sid}/replicate", headers=m.admin_headers())
    assert r.status_code == 200 and sid in r.json()["message"], r.text
    r = m.http.post(m.api(other) + "/v1/admin/sessions/plain-id/replicate", headers=m.admin_headers())
    assert r.status_code == 200, r.text


def test_a_utf8_id_is_forwarded_between_nodes_byte_for_byte(mesh: Mesh) -> None:
    """A UTF-8 X-Session-Id sent to the node that is not the session's home is forwarded there as the same id:
    both turns run on the home, and both answers carry the id's exact bytes."""
    m, sid = mesh, "\u00e9quipe/\u4e2d\u6587 \U0001f600"
    msgs = [{"role": "user", "content": LONG + "forwarded"}]
    r1 = m.http.post(m.api("a") + "/v1/chat/completions", headers=[(b"X-Session-Id", sid.encode())], json=chat(msgs))
    assert r1.status_code == 200 and dict(r1.headers.raw)[b"x-session-id"] == sid.encode(), r1.text
    home = r1.headers["x-kvmesh-host"]
    other = "b" if home == "a" else "a"
    wait_for(lambda: _home(m, other, sid) == home, f"{other} to see {home} as the home of the session")
    msgs += [{"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "next"}]
    r2 = m.http.post(m.api(other) + "/v1/chat/completions", headers=[(b"X-Session-Id", sid.encode())], json=chat(msgs))
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-kvmesh-host"] == home and dict(r2.headers.raw)[b"x-session-id"] == sid.encode()
    assert int(r2.headers["x-kvmesh-cached-tokens"]) >= 64


@pytest.mark.parametrize("path", ["a%00b", "%09tab", "x" * 257])
def test_non_ids_in_admin_paths_are_refused_naming_session(mesh: Mesh, path: str) -> None:
    """A NUL, a control character or 257 bytes as the session in an admin path: 400 naming `session`."""
    r = mesh.http.post(mesh.api("a") + f"/v1/admin/sessions/{path}/replicate", headers=mesh.admin_headers())
    assert openai_error(r, 400).get("param") == "session", r.text
