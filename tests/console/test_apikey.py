"""The console's client API key: where it comes from (KVMESH_API_KEY, --api-key-file, `api_key_file`; never a flag
value or a raw config value), and its event streams to a keyed node, which follow it with the key and say clearly,
once, that the node wants one without it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmesh.console.apikey import ApiKey, ApiKeyError, load_api_key
from kvmesh.console.app import KvmeshConsole
from kvmesh.console.cli import _run_parser, build_config
from kvmesh.console.cli import main as cli_main
from kvmesh.console.config import ConsoleConfig, load_config_file
from kvmesh.console.ingest import Backoff, stream_node
from kvmesh.console.state import ConsoleState
from kvmesh.node.config import ApiConfig, EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

KEY = "sk-kvmesh-console-0123456789"
WAIT_S = 20.0  # a deadline for a loopback node to answer, never a speed goal


@pytest.fixture(scope="module")
def keyed() -> Iterator[ThreadedServer]:
    """A sim node with one client key."""
    srv = serve_in_thread(NodeConfig(name="console-keyed", api=ApiConfig(keys=[KEY]),
                                     engine=EngineConfig(kind="sim", cache_bytes=64 << 20, slots=2,
                                                         sim=SimConfig(kv_scale=0.01))))
    try:
        yield srv
    finally:
        srv.stop()


async def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _follow(url: str, state: ConsoleState, key: ApiKey, until: Callable[[], bool], what: str) -> None:
    task = asyncio.create_task(stream_node(url, state, headers=key.headers(), backoff=Backoff(0.05, 0.1),
                                           refused_retry_s=0.05))
    try:
        await _until(until, what)
        await asyncio.sleep(0.3)  # several more tries, had the loop gone on retrying
        assert not task.done(), "a refusal never ends the loop"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.anyio
async def test_ingest_follows_a_keyed_node_with_the_key(keyed: ThreadedServer) -> None:
    """With the key, the ingest loop connects to a keyed node and takes its cluster view."""
    state = ConsoleState()
    await _follow(keyed.url, state, ApiKey(KEY), lambda: "console-keyed" in state.hosts, "the keyed node's view")
    assert state.nodes[keyed.url].ever_connected and not any(e.level == "error" for e in state.log)


@pytest.mark.anyio
async def test_ingest_without_the_key_says_so_once(keyed: ThreadedServer) -> None:
    """Without a key the node's refusal is one clear error naming KVMESH_API_KEY and --api-key-file, not a retry per line."""
    state = ConsoleState()
    await _follow(keyed.url, state, ApiKey(), lambda: any(e.level == "error" for e in state.log), "the refusal in the log")
    said = [e.text for e in state.log if keyed.url in e.text]
    assert len(said) == 1, said
    assert "wants an API key" in said[0] and "KVMESH_API_KEY" in said[0] and "--api-key-file" in said[0], said
    assert not state.nodes[keyed.url].ever_connected


@pytest.mark.anyio
async def test_ingest_with_a_wrong_key_says_it_was_refused(keyed: ThreadedServer) -> None:
    """A wrong key is reported as refused (check the key), without the key in the message."""
    state = ConsoleState()
    await _follow(keyed.url, state, ApiKey("sk-not-the-key-0000"), lambda: any(e.level == "error" for e in state.log),
                  "the refusal in the log")
    said = [e.text for e in state.log if e.level == "error"]
    assert len(said) == 1 and "refused the console's API key" in said[0] and "sk-not-the-key" not in said[0], said


@pytest.mark.anyio
async def test_the_app_presents_its_key_to_the_nodes(keyed: ThreadedServer) -> None:
    """KvmeshConsole given an API key follows a keyed node; given none, its log tells the operator what to set."""
    for key, ok in ((ApiKey(KEY, "env KVMESH_API_KEY"), True), (ApiKey(), False)):
        state = ConsoleState()
        app = KvmeshConsole(ConsoleConfig(nodes=[keyed.url], refresh_interval=0.2, readonly=True), state=state,
                            api_key=key)
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + WAIT_S
            while not ("console-keyed" in state.hosts if ok else any("wants an API key" in e.text for e in state.log)):
                assert time.monotonic() < deadline, (ok, [e.text for e in state.log])
                await pilot.pause(0.1)


def test_the_key_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    """KVMESH_API_KEY's first key, or --api-key-file's contents (which win); a loose file warns, a bad one is refused."""
    assert load_api_key(None, {"KVMESH_API_KEY": " , sk-first-key-0001 ,sk-second-0002"}).key == "sk-first-key-0001"
    assert load_api_key(None, {}).key is None and ApiKey().headers() == {}
    f = tmp_path / "api-key"
    f.write_text(KEY + "\n")
    os.chmod(f, 0o600)
    src = load_api_key(str(f), {"KVMESH_API_KEY": "sk-ignored-0000"})
    assert (src.key, src.warning) == (KEY, "") and src.headers() == {"Authorization": f"Bearer {KEY}"}
    assert KEY not in repr(src), "the key never reaches a log through repr"
    os.chmod(f, 0o644)
    assert "chmod 600" in load_api_key(str(f), {}).warning
    (tmp_path / "empty").write_text("\n")
    for bad in ("empty", "missing"):
        with pytest.raises(ApiKeyError):
            load_api_key(str(tmp_path / bad), {})


def test_the_key_is_never_a_flag_value_or_a_config_value(tmp_path: Path) -> None:
    """--api-key is refused (it would show in ps), as is api_key in a config; api_key_file and --api-key-file are taken."""
    assert cli_main(["--node", "http://127.0.0.1:1", "--api-key", KEY]) == 2
    assert cli_main(["--node", "http://127.0.0.1:1", f"--api-key={KEY}"]) == 2
    raw = tmp_path / "raw.toml"
    raw.write_text(f'[console]\napi_key = "{KEY}"\n')
    with pytest.raises(ValueError, match="api_key_file") as ei:
        load_config_file(str(raw))
    assert KEY not in str(ei.value)
    good = tmp_path / "console.toml"
    good.write_text('[console]\nnodes = ["http://127.0.0.1:1"]\napi_key_file = "/etc/kvmesh/api-key"\n')
    args = _run_parser().parse_args(["--config", str(good)])
    assert build_config(args).api_key_file == "/etc/kvmesh/api-key"
    args = _run_parser().parse_args(["--config", str(good), "--api-key-file", "/tmp/other"])
    assert build_config(args).api_key_file == "/tmp/other", "the flag wins over the config"
