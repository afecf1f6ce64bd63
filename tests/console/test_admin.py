"""Admin client and token handling, against a tiny local HTTP server; and the full drain path through the app."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_node import FakeAdminServer
from kvm_helpers import Clock, make_app, make_view

from kvmesh.console.admin import AdminClient, TokenError, load_admin_token
from kvmesh.console.cli import main as cli_main
from kvmesh.console.screens.confirm import ConfirmScreen

pytestmark = pytest.mark.anyio
TOKEN = "s3cret-admin-token"


@pytest.fixture
def admin_server() -> Iterator[tuple[FakeAdminServer, str]]:
    srv = FakeAdminServer(TOKEN, hosts={"node-1", "node-2", "node-3"}, sessions={"s-000", "s-001"})
    url = srv.start()
    yield srv, url
    srv.stop()


async def test_admin_calls_paths_bodies_and_token(admin_server: tuple[FakeAdminServer, str]) -> None:
    """drain/undrain/migrate/replicate POST the documented paths with the bearer token and parse ActionResult."""
    srv, url = admin_server
    client = AdminClient(lambda: [url], TOKEN)
    try:
        assert (await client.drain("node-2")).ok
        assert (await client.undrain("node-2")).ok
        res = await client.migrate("s-001", "node-3")
        assert res.ok and res.message == "migrating s-001 to node-3"
        assert (await client.replicate("s-000")).ok
    finally:
        await client.aclose()
    assert [r["path"] for r in srv.requests] == [
        "/v1/admin/hosts/node-2/drain", "/v1/admin/hosts/node-2/undrain",
        "/v1/admin/sessions/s-001/migrate", "/v1/admin/sessions/s-000/replicate",
    ]
    assert srv.requests[2]["body"] == {"target": "node-3"}
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in srv.requests)
    assert TOKEN not in repr(client)


async def test_admin_errors_become_readable_failures(admin_server: tuple[FakeAdminServer, str]) -> None:
    """401 (no/wrong token), 404 (unknown host/session) and 409 (conflict) come back as ok=False with a reason."""
    srv, url = admin_server
    nobody = AdminClient(lambda: [url], None)
    client = AdminClient(lambda: [url], TOKEN)
    try:
        res = await nobody.drain("node-1")
        assert not res.ok and res.message.startswith("unauthorized")
        res = await client.drain("gpu-9")
        assert not res.ok and res.message.startswith("not found") and "gpu-9" in res.message
        res = await client.migrate("s-000", "gpu-9")
        assert not res.ok and res.message.startswith("conflict")
    finally:
        await nobody.aclose()
        await client.aclose()


async def test_unreachable_node_is_skipped_for_the_next(admin_server: tuple[FakeAdminServer, str]) -> None:
    """A node that cannot be reached is skipped; the next node in the list answers."""
    srv, url = admin_server
    client = AdminClient(lambda: ["http://127.0.0.1:9", url], TOKEN)
    try:
        assert (await client.drain("node-3")).ok
    finally:
        await client.aclose()
    assert len(srv.requests) == 1


def test_token_from_env_or_file_never_a_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The token comes from KVMESH_ADMIN_TOKEN or --admin-token-file; --admin-token is rejected."""
    assert load_admin_token(None, {"KVMESH_ADMIN_TOKEN": " abc \n"}).token == "abc"
    assert load_admin_token(None, {}).token is None
    f = tmp_path / "tok"
    f.write_text(TOKEN + "\n")
    os.chmod(f, 0o600)
    src = load_admin_token(str(f), {"KVMESH_ADMIN_TOKEN": "ignored"})
    assert src.token == TOKEN and not src.warning and TOKEN not in src.origin
    os.chmod(f, 0o644)
    assert "chmod 600" in load_admin_token(str(f), {}).warning
    (tmp_path / "empty").write_text("")
    with pytest.raises(TokenError):
        load_admin_token(str(tmp_path / "empty"), {})
    with pytest.raises(TokenError):
        load_admin_token(str(tmp_path / "missing"), {})
    assert cli_main(["--node", "http://127.0.0.1:1", "--admin-token", "x"]) == 2
    assert cli_main(["--node", "http://127.0.0.1:1", f"--admin-token={TOKEN}"]) == 2
    assert "ps" in capsys.readouterr().err


async def test_drain_through_the_app_reaches_the_admin_api(admin_server: tuple[FakeAdminServer, str]) -> None:
    """d, confirm: the app's real AdminClient POSTs the drain with the token; the result is in the event log."""
    srv, url = admin_server
    clock = Clock()
    app, state = make_app(clock, snapshot=make_view())
    app.admin = AdminClient(lambda: [url], TOKEN)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.2)
        await pilot.press("h", "down", "down", "d")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("right", "enter")
        for _ in range(50):
            if any("accepted" in e.text for e in state.log):
                break
            await pilot.pause(0.05)
    assert [r["path"] for r in srv.requests] == ["/v1/admin/hosts/node-3/drain"]
    assert any("drain node-3: accepted: drain node-3: started" in e.text for e in state.log)
