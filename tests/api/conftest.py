"""Fixtures for the API tests: real uvicorn servers on loopback, in-process.

Each server runs `uvicorn.Server.serve()` on its own event loop in a background
thread, bound to 127.0.0.1 port 0; the fixtures yield the base URL
(`http://127.0.0.1:PORT`) and stop the server when their scope ends.

- `tiny` / `tiny_url`: the tiny torch engine on CPU (2 slots, queue 1, 4096-token context).
- `tiny_cold`: a second tiny node with an empty cache (function scope).
- `sim` / `sim_url`: the sim engine, fast (2000 decode tokens/s), 2 slots.
- `sim_busy`: the sim engine, 1 slot, no wait queue, slow decode: for 429s.
- `sim_queue`: the sim engine, 1 slot, a queue of 1 with a 0.5 s wait timeout.
- `sim_one_slot`: the sim engine, 1 slot, a patient queue: for hang-ups.
- `small_body`: the sim engine with `api.max_body_bytes` = 4 KiB.

Module-scope servers are built once per test module; the one-slot sim servers
are per test, so each starts idle. Test modules do not import this file (two
`conftest` modules can clash); helpers come as fixtures (`check_error`,
`make_client`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvmesh.node.config import ApiConfig, EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

# Sim engine rates for the "fast" server: fast enough that max_tokens=64 takes ~30 ms.
FAST_SIM = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6)
# Slow decode for holding a slot: 40 tokens/s, so a ~100-token turn holds it for seconds
# (tests check /health before relying on it; none asserts how long anything takes).
SLOW_SIM = SimConfig(kv_scale=0.01, decode_tps=40, prefill_tps=1e6)


def _serve(cfg: NodeConfig) -> Iterator[ThreadedServer]:
    srv = serve_in_thread(cfg)
    try:
        yield srv
    finally:
        srv.stop()


def tiny_config(**engine: Any) -> NodeConfig:
    base: dict[str, Any] = dict(kind="tiny", cache_bytes=64 << 20, max_context=4096, slots=2, queue_max=1,
                                queue_timeout_s=20.0, device="cpu")
    base.update(engine)
    return NodeConfig(name="api-tiny", engine=EngineConfig(**base))


def sim_config(*, sim: SimConfig = FAST_SIM, api: ApiConfig | None = None, name: str = "api-sim",
               **engine: Any) -> NodeConfig:
    base: dict[str, Any] = dict(kind="sim", cache_bytes=64 << 20, slots=2, queue_max=1, queue_timeout_s=20.0, sim=sim)
    base.update(engine)
    return NodeConfig(name=name, api=api or ApiConfig(), engine=EngineConfig(**base))


@pytest.fixture(scope="module")
def tiny() -> Iterator[ThreadedServer]:
    """The tiny torch engine behind a real server (2 slots, 4096-token context)."""
    yield from _serve(tiny_config())


@pytest.fixture()
def tiny_cold() -> Iterator[ThreadedServer]:
    """A second tiny node (same seeded weights, its own empty cache), for cold-vs-warm comparisons."""
    yield from _serve(tiny_config())


@pytest.fixture(scope="module")
def tiny_url(tiny: ThreadedServer) -> str:
    return tiny.url


@pytest.fixture(scope="module")
def sim() -> Iterator[ThreadedServer]:
    """The sim engine, fast decode, 2 slots."""
    yield from _serve(sim_config())


@pytest.fixture(scope="module")
def sim_url(sim: ThreadedServer) -> str:
    return sim.url


@pytest.fixture()
def sim_busy() -> Iterator[ThreadedServer]:
    """The sim engine, 1 slot, no wait queue, slow decode: a held slot means 429 for the next turn.

    Function scope: each overload test starts from an idle server.
    """
    yield from _serve(sim_config(sim=SLOW_SIM, name="api-sim-busy", slots=1, queue_max=0, queue_timeout_s=0.5))


@pytest.fixture()
def sim_queue() -> Iterator[ThreadedServer]:
    """The sim engine, 1 slot, a wait queue of 1 with a short timeout, slow decode."""
    yield from _serve(sim_config(sim=SLOW_SIM, name="api-sim-queue", slots=1, queue_max=1, queue_timeout_s=0.5))


@pytest.fixture()
def sim_one_slot() -> Iterator[ThreadedServer]:
    """The sim engine, 1 slot, slow decode, a patient queue: a leaked slot shows as a wait then 429."""
    yield from _serve(sim_config(sim=SLOW_SIM, name="api-sim-one", slots=1, queue_max=4, queue_timeout_s=10.0))


@pytest.fixture(scope="module")
def small_body() -> Iterator[ThreadedServer]:
    """The sim engine with a 4 KiB request-body limit."""
    yield from _serve(sim_config(name="api-sim-small", api=ApiConfig(max_body_bytes=4096)))


def client_for(srv: ThreadedServer, **kw: Any) -> openai.OpenAI:
    """The official OpenAI client pointed at a test server (no retries: a 429 must surface)."""
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 60.0)
    return openai.OpenAI(base_url=srv.v1, api_key="x", **kw)


@pytest.fixture(scope="module")
def tiny_client(tiny: ThreadedServer) -> Iterator[openai.OpenAI]:
    c = client_for(tiny)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sim_client(sim: ThreadedServer) -> Iterator[openai.OpenAI]:
    c = client_for(sim)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http_tiny(tiny: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny.url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def http_sim(sim: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, timeout=60.0) as c:
        yield c


def assert_openai_error(resp: httpx.Response, status: int, *, code: str | None = None,
                        param: str | None = None, says: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error: the status, a JSON body with error.message/type/code, no traceback."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    text = resp.text
    assert "Traceback" not in text and 'File "' not in text, text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], err
    assert isinstance(err.get("type"), str) and err["type"], err
    assert "code" in err and isinstance(err["code"], str) and err["code"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err.get("param") == param, err
    if says is not None:
        assert says.lower() in err["message"].lower(), err
    return err


@pytest.fixture()
def check_error():
    """`assert_openai_error` as a fixture (test modules do not import conftest)."""
    return assert_openai_error


@pytest.fixture()
def make_client() -> Iterator[Any]:
    """`client_for` as a fixture; the clients it made are closed afterwards."""
    made: list[openai.OpenAI] = []

    def make(srv: ThreadedServer, **kw: Any) -> openai.OpenAI:
        made.append(client_for(srv, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()
