"""Hostile session ids: refused before anything touches the disk; `user` values hashed into safe ids.

Session ids name directories of the replica store, so an id that tries path traversal, NUL bytes,
huge lengths or non-ASCII must be refused (400 naming X-Session-Id) with the store directory (and
its parent, the traversal target) byte-for-byte unchanged. A `user` value (free text in the OpenAI
API) is used as the session id only when it is already safe; otherwise it is hashed.
"""

from __future__ import annotations

import hashlib
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.node.launcher import wait_for
from kvmesh.node.protocol import is_valid_session_id
from kvmesh.node.server import ThreadedServer, serve_in_thread

from .helpers import MODEL, SAFE_ID, chat, openai_error, sim_config, tree

# The prompt must fill a KV block (64 tokens) so that every served turn writes its session to the store.
LONG = "Please summarise the following text about replicas and caches. " * 4

HOSTILE: dict[str, bytes] = {
    "dotdot-slash": b"../../../../etc/passwd",
    "dotdot": b"..",
    "dot": b".",
    "slash": b"a/b",
    "backslash": b"..\\..\\x",
    "encoded-traversal": b"%2e%2e%2f%2e%2e",
    "absolute": b"/tmp/evil",
    "space": b"a b",
    "empty": b"",
    "too-long-129": b"x" * 129,
    "huge-8k": b"y" * 8000,
    "utf8-accents": "s\u00e9ssion".encode(),
    "utf8-rtl-override": "abc\u202edef".encode(),
    "utf8-fullwidth-dots": "\uff0e\uff0e\uff0fx".encode(),
    "latin1-byte": b"caf\xe9",
    "tab-inside": b"a\tb",
}


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


def _snapshot(store: Path) -> tuple[dict[str, int], dict[str, int]]:
    return tree(store), tree(store.parent)


def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send a raw HTTP/1.1 request; the status code and the whole response."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
            if b"\r\n\r\n" in got and b"content-length" in got.lower():
                head, _, body = got.partition(b"\r\n\r\n")
                n = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
                if len(body) >= n:
                    break
    return int(got.split(b" ", 2)[1]), got


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_session_header_is_refused_naming_the_header_before_touching_disk(node: tuple[ThreadedServer, Path], name: str) -> None:
    """X-Session-Id with traversal, huge, empty or non-ASCII values: 400 naming X-Session-Id; store and its parent unchanged."""
    srv, store = node
    value = HOSTILE[name]
    before = _snapshot(store)
    with httpx.Client(timeout=30) as c:
        r = c.post(srv.url + "/v1/chat/completions", headers=[(b"X-Session-Id", value)], json=chat([{"role": "user", "content": LONG}]))
    err = openai_error(r, 400)
    assert err.get("param") == "X-Session-Id", err
    assert "X-Session-Id" in err["message"], err
    assert _snapshot(store) == before
    assert all(is_valid_session_id(s) for s in srv.node.engine.sessions)


def test_nul_byte_in_session_header_is_refused_before_the_app(node: tuple[ThreadedServer, Path]) -> None:
    """A NUL byte in X-Session-Id (sent raw: clients refuse to) is refused with 400 at the HTTP layer; nothing on disk."""
    srv, store = node
    before = _snapshot(store)
    body = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":1}' % MODEL.encode()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Session-Id: a\x00../b\r\n"
           b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
    status, _ = _raw(srv.url, req)
    assert status == 400
    assert _snapshot(store) == before


PATH_IDS = {
    "dotdot": "%2e%2e",
    "nul": "a%00b",
    "utf8": "s%C3%A9ssion",
    "huge": "z" * 4000,
    "backslash": "..%5c..%5cx",
    "slash-encoded": "a%2Fb",
}


@pytest.mark.parametrize("route", ["/v1/peer/sessions/{s}/adopt", "/v1/peer/sessions/{s}/replicate",
                                   "/v1/peer/sessions/{s}/migrate?target=sid", "/v1/admin/sessions/{s}/replicate"])
def test_hostile_session_ids_in_paths_are_refused_before_touching_disk(node: tuple[ThreadedServer, Path], route: str) -> None:
    """Session ids in peer and admin paths (NUL, traversal, huge, UTF-8): a 4xx error, the store untouched, no such session recorded."""
    srv, store = node
    before = _snapshot(store)
    with httpx.Client(timeout=30) as c:
        for name, sid in PATH_IDS.items():
            r = c.post(srv.url + route.format(s=sid), headers={"Authorization": "Bearer none"})
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
            openai_error(r)
        cluster = c.get(srv.url + "/v1/cluster").json()
    assert _snapshot(store) == before
    assert all(is_valid_session_id(s["session"]) for s in cluster["sessions"]), cluster["sessions"]


USERS = {
    "traversal": "../../../../etc/passwd",
    "nul": "a\x00b",
    "unicode": "\u00fcser-\u4e2d\u6587-\U0001f600",
    "max-length": "m" * 512,
    "slash": "team/alice",
    "dotdot": "..",
    "newline": "a\r\nX-Injected: 1",
    "controls": "\x01\x02\x7f",
}


def test_user_values_become_safe_session_ids_and_name_only_safe_directories(node: tuple[ThreadedServer, Path]) -> None:
    """`user` with traversal, NUL, unicode, 512 chars: the turn runs under a hashed safe id (response header), the only directories created are those ids."""
    srv, store = node
    seen: dict[str, str] = {}
    parent_before = {k for k in tree(store.parent) if not k.startswith(store.name)}
    names_before = {p.name for p in store.iterdir()} if store.exists() else set()
    with httpx.Client(timeout=30) as c:
        for name, user in USERS.items():
            r = c.post(srv.url + "/v1/chat/completions", json=chat([{"role": "user", "content": LONG + name}], user=user))
            assert r.status_code == 200, (name, r.text[:300])
            sid = r.headers["x-session-id"]
            assert re.fullmatch(SAFE_ID, sid), (name, sid)
            assert sid == "user-" + hashlib.sha256(user.encode()).hexdigest()[:20], (name, sid)
            seen[name] = sid
        # A safe `user` is the id itself; one past the 512-character limit is refused naming `user`.
        r = c.post(srv.url + "/v1/chat/completions", json=chat([{"role": "user", "content": LONG}], user="alice@example.com"))
        assert r.status_code == 200 and r.headers["x-session-id"] == "alice@example.com"
        seen["safe"] = "alice@example.com"
        r = c.post(srv.url + "/v1/chat/completions", json=chat([{"role": "user", "content": LONG}], user="u" * 513))
        assert openai_error(r, 400).get("param") == "user"
    assert len(set(seen.values())) == len(seen), seen  # distinct users, distinct sessions
    # Every served turn wrote its session to the store (persist_own) under exactly its id, and nothing else.
    ids = set(seen.values())

    def landed() -> bool:
        return {p.name for p in store.iterdir() if (p / "manifest.json").exists()} >= ids

    wait_for(landed, "every session's write-behind to the store")
    assert {p.name for p in store.iterdir()} - names_before == ids, sorted(p.name for p in store.iterdir())
    assert all(p.resolve().is_relative_to(store.resolve()) for p in store.rglob("*"))
    assert {k for k in tree(store.parent) if not k.startswith(store.name)} == parent_before

