"""Stored Responses across a mesh (node.responses.service): a previous_response_id chain entered at alternating
nodes of three runs each follow-up where its conversation's cache is, warm; any node reads, lists and deletes a
response another node made; and once the conversation's home is stopped, the chain goes on from its replica
holder, warm, the record having travelled with the replica.

Three sim nodes served in-process (node.lab.inprocess), a full mesh with a mesh secret, replicating from one
block (256 tokens); the instructions make every prompt 16 blocks long.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvmesh.node.config import EngineConfig, KVShareConfig, MeshConfig, NodeConfig, PeerConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread
from kvmesh.node.lab.launcher import free_port, wait_for

NAMES = ("a", "b", "c")
MODEL = "gpt-5"
# ~4000 tokens: a replica's partial last block (up to 255 tokens) and a turn's new input stay under 10% of a prompt
INSTRUCTIONS = "You are a careful coding agent. Read before you write; test what you change. " * 54
SIM = SimConfig(kv_scale=0.02, decode_tps=2000.0, prefill_tps=50000.0)


@dataclass
class Seen:
    """One turn as the client saw it."""

    id: str
    host: str
    handoff: str
    prompt: int
    cached: int


class InProcessMesh:
    """Three sim nodes in this process, each listing the others as peers."""

    def __init__(self, root: Path) -> None:
        ports = {n: (free_port(), free_port()) for n in NAMES}
        secret = "msk-" + secrets.token_hex(16)
        self.servers: dict[str, ThreadedServer] = {}
        for n in NAMES:
            peers = [PeerConfig(name=p, api=f"http://127.0.0.1:{ports[p][0]}", kvshare=f"127.0.0.1:{ports[p][1]}")
                     for p in NAMES if p != n]
            cfg = NodeConfig(
                name=n, engine=EngineConfig(kind="sim", slots=2, cache_bytes=64 << 20, sim=SIM, served_names=["gpt-*"]),
                mesh=MeshConfig.model_validate({"peers": peers, "secret": secret, "poll_interval_s": 0.2,
                                                "stale_after_s": 1.5}),
                kvshare=KVShareConfig(listen=f"127.0.0.1:{ports[n][1]}", replicate_min_tokens=256, fsync="never",
                                      store_dir=str(root / f"store-{n}")))
            self.servers[n] = serve_in_thread(cfg, port=ports[n][0])
        self.clients = {n: openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=60.0)
                        for n, s in self.servers.items()}
        for n, s in self.servers.items():
            wait_for(lambda s=s: all(p.reachable for p in s.node.mesh.peers.peers.values()), f"{n} to see every peer")

    def turn(self, entry: str, text: str, previous: str | None = None, *, instructions: str | None = INSTRUCTIONS) -> Seen:
        raw = self.clients[entry].responses.with_raw_response.create(
            model=MODEL, instructions=instructions, input=text, previous_response_id=previous, max_output_tokens=8,
            temperature=0)
        r = raw.parse()
        assert r.usage is not None and r.previous_response_id == previous
        return Seen(r.id, raw.headers["x-kvmesh-host"], raw.headers["x-kvmesh-handoff"], r.usage.input_tokens,
                    r.usage.input_tokens_details.cached_tokens)

    def stats(self, host: str) -> dict[str, Any]:
        return httpx.get(self.servers[host].url + "/v1/stats", timeout=30).json()

    def stop(self, *names: str) -> None:
        for n in names or tuple(self.servers):
            if n in self.servers:
                self.clients.pop(n).close()
                self.servers.pop(n).stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessMesh]:
    m = InProcessMesh(tmp_path_factory.mktemp("responses-mesh"))
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture()
def doomed(tmp_path: Path) -> Iterator[InProcessMesh]:
    """A mesh of its own, for a test that stops a node."""
    m = InProcessMesh(tmp_path)
    try:
        yield m
    finally:
        m.stop()


def _warm(t: Seen) -> bool:
    return t.cached >= 0.9 * t.prompt


def _chain(m: InProcessMesh, entries: str, tag: str) -> list[Seen]:
    """A chain of turns, turn i entered at entries[i], each continuing the one before."""
    turns: list[Seen] = []
    for i, entry in enumerate(entries):
        turns.append(m.turn(entry, f"{tag}: step {i + 1}, go on.", turns[-1].id if turns else None))
    return turns


def test_a_chain_entered_at_alternating_nodes_is_warm_on_every_follow_up(mesh: InProcessMesh) -> None:
    """Five chained turns entered at a, b, c, a, b: each follow-up runs where the conversation's cache is, >= 90% reused."""
    turns = _chain(mesh, "abcab", "alternating")
    for t in turns:
        print(f"{t.host} handoff={t.handoff} prompt={t.prompt} cached={t.cached}")
    for prev, t in zip(turns, turns[1:], strict=False):
        assert t.prompt > prev.prompt and t.handoff in ("none", "warm"), t
        assert _warm(t), t


def test_any_node_reads_lists_and_deletes_what_another_made(mesh: InProcessMesh) -> None:
    """A response made through a is read and listed through b and c; deleted through c, it is gone everywhere."""
    first = mesh.turn("a", "cross-node: made on a.")
    second = mesh.turn("b", "cross-node: continued on b.", first.id)
    for n in NAMES:
        got = mesh.clients[n].responses.retrieve(second.id)
        assert got.id == second.id and got.previous_response_id == first.id
        items = mesh.clients[n].responses.input_items.list(second.id, order="asc")
        assert [i.content[0].text for i in items.data if i.type == "message" and i.role == "user"] == [  # type: ignore[union-attr]
            "cross-node: made on a.", "cross-node: continued on b."]
    mesh.clients["c"].responses.delete(second.id)
    for n in NAMES:
        with pytest.raises(openai.NotFoundError):
            mesh.clients[n].responses.retrieve(second.id)
    assert mesh.clients["b"].responses.retrieve(first.id).id == first.id  # only the one deleted


def test_a_chain_goes_on_warm_at_the_replica_holder_after_its_home_stops(doomed: InProcessMesh) -> None:
    """After the home stops, the chain continues from the survivors on the replica holder, warm (its record survived)."""
    m = doomed
    turns = _chain(m, "abc", "failover")
    home = turns[-1].host
    wait_for(lambda: _replicated(m, home), f"a whole replica of the chain off {home}")
    survivors = [n for n in NAMES if n != home]
    m.stop(home)
    after: list[Seen] = []
    for entry in (*survivors, *survivors):
        t = m.turn(entry, f"failover: after {home} stopped, via {entry}.", (after or turns)[-1].id)
        print(f"{t.host} handoff={t.handoff} prompt={t.prompt} cached={t.cached}")
        # (right after the stop an entry's view may lag the new home's first turn: any survivor holding a copy is warm)
        assert t.host in survivors and _warm(t), t
        after.append(t)
    assert after[0].handoff == "warm", after[0]  # the first turn after the stop moved, warm


def test_a_chain_too_short_to_replicate_survives_its_home_too(doomed: InProcessMesh) -> None:
    """A chain below replicate_min_tokens has no replica, yet its record went to a peer: it continues after the home stops."""
    m = doomed
    first = m.turn("a", "short: hi", instructions=None)
    second = m.turn("b", "short: and?", first.id, instructions=None)
    assert second.prompt < 256  # below kvshare.replicate_min_tokens: no replica of it anywhere
    home = second.host
    m.stop(home)
    survivor = next(n for n in NAMES if n != home)
    third = m.turn(survivor, "short: still there?", second.id, instructions=None)
    assert third.prompt > second.prompt and third.host != home
    items = m.clients[survivor].responses.input_items.list(third.id, order="asc")
    assert [i.content[0].text for i in items.data if i.type == "message" and i.role == "user"] == [  # type: ignore[union-attr]
        "short: hi", "short: and?", "short: still there?"]


def _replicated(m: InProcessMesh, home: str) -> bool:
    """Whether a host other than the home holds every whole block of the home's conversation, stored responses too."""
    node = m.servers[home].node
    try:  # read from this thread while the nodes' loops run: a dict that changes size is read again
        session = next(iter(node.responses.store.records), None)
        if session is None:
            return False
        whole = node.engine.resident_tokens(session) // node.engine.block_size * node.engine.block_size
        return any(h != home and max(x.resident, x.stored) >= whole > 0
                   and m.servers[h].node.responses.store.records.get(session) is not None
                   for h, x in node.mesh.holdings(session).items())
    except RuntimeError:
        return False
