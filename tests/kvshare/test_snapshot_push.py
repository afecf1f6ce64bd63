"""A replica push carries the session's newest state snapshot as a frame after its blocks: counted on the link (stats
and events), landed in the receiver's snapshots and written behind into its store, restored from that store by a
restarted host before the next turn; a corrupt snapshot frame, or one whose cells do not check, refuses the replica.

Two `KVShare`s in this process over loopback, sim engines; the snapshots are a `Snapshots` with a stand-in check (a
blob is "sound" at position P when its first byte is P's block count), what a window-mode or hybrid model's would be."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvmesh.node.config import KVShareConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.service import KVShare
from kvmesh.node.protocol import Event, ReplicaReady, ReplicaRefused, ReplicaSent

from .helpers import prompt_tokens, sim_engine
from .service_helpers import EngineFacts, HandOffer, hand_offer, read_reply

SECRET = b"snapshot-push-secret"
BS = 64
SNAP = 300  # bytes of a stand-in snapshot


def _snapshots() -> Snapshots:
    return Snapshots(1 << 20, lambda blob, pos: None if blob[0] == pos // BS % 256 else
                     f"window snapshot: cells of position {blob[0] * BS}, not {pos}", block_size=BS)


def _blob(pos: int) -> np.ndarray:
    b = np.random.default_rng(pos).integers(0, 256, SNAP, dtype=np.uint8)
    b[0] = pos // BS % 256
    return b


class _Host:
    def __init__(self, name: str, root: Path, peer: Callable[[str], str | None]):
        self.engine: Engine = sim_engine()
        self.snapshots = _snapshots()
        self.events: list[Event] = []
        cfg = KVShareConfig(store_dir=str(root), fsync="never", replicate_min_tokens=0)
        self.kv = KVShare(name, self.engine, cfg, secrets=[SECRET], publish=self.events.append, peer_address=peer,
                          snapshots=self.snapshots)

    async def stop(self) -> None:
        await self.kv.stop()
        self.kv.store.close()
        self.engine.close()


async def _until(what: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_push_carries_the_snapshot_and_a_restarted_host_restores_it_from_its_store(tmp_path: Path) -> None:
    """a's push lands blocks and snapshot in b (snapshot bytes in both ends' link stats, ReplicaSent and ReplicaReady);
    b's write-behind stores the snapshot beside the blocks; a new b on the same store, before the next turn, restores
    the blocks and the snapshot, so the turn resumes at its position."""

    async def main() -> None:
        b = _Host("b", tmp_path / "b", lambda n: None)
        await b.kv.start()
        a = _Host("a", tmp_path / "a", lambda n: b.kv.address if n == "b" else None)
        await a.kv.start()
        try:
            async for _ in a.engine.generate(GenerateRequest("s", prompt_tokens(700), max_tokens=2)):
                pass
            held = a.engine.session_tokens("s")
            assert held is not None
            pos = len(held) // BS * BS
            assert a.snapshots.put(held[:pos], _blob(pos)) is None
            res = await a.kv.push("s", "b")
            assert res.ok and res.snapshot_bytes == SNAP, res
            got = b.snapshots.newest(held)
            assert got is not None and got.pos == pos and np.array_equal(got.blob, _blob(pos))
            out, inn = a.kv.stats()["out"]["b"], b.kv.stats()["in"]["a"]  # type: ignore[index]
            assert (out["snapshots"], out["snapshot_bytes"], inn["snapshots"], inn["snapshot_bytes"]) == (1, SNAP, 1, SNAP)
            assert out["bytes"] > SNAP
            assert [e.snapshot_bytes for e in a.events if isinstance(e, ReplicaSent)] == [SNAP]
            assert [e.snapshot_bytes for e in b.events if isinstance(e, ReplicaReady)] == [SNAP]
            sent = a.kv.snapshot_stats()
            assert sent is not None and sent["sent"] == 1 and sent["sent_bytes"] == SNAP and sent["send_failed"] == 0
            await _until(lambda: (m := b.kv.store.manifest("s")) is not None and m.snapshot is not None)
        finally:
            await a.stop()
            await b.stop()
        again = _Host("b", tmp_path / "b", lambda n: None)
        await again.kv.start()
        try:
            nxt = np.concatenate([held, prompt_tokens(100, seed=3)])
            assert again.snapshots.newest(nxt) is None and again.engine.cached_prefix("s", nxt) == 0
            assert await again.kv.ensure_imported("s", nxt) >= pos
            w = again.snapshots.newest(nxt)
            assert w is not None and w.pos == pos and again.engine.cached_prefix("s", nxt) >= pos
        finally:
            await again.stop()

    asyncio.run(main())


def _send(addr: str, ho: HandOffer, blob: np.ndarray, *, flip: bool) -> wire.SenderEvent | str:
    """A hand-driven push of `ho`'s blocks and the snapshot `blob` (one payload bit flipped with `flip`)."""
    tx = wire.Sender(SECRET)
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(tx.offer_bytes(ho.offer, ho.tokens, ho.hashes))
        ev = read_reply(sock, tx)
        if not isinstance(ev, wire.Accepted):
            return ev
        for i in range(ev.first_missing, ho.offer.n_blocks):
            p = ho.payload(i)
            sock.sendall(tx.block_header(i, memoryview(p)) + p)
        data = bytearray(blob.tobytes())
        hdr = tx.snapshot_header(blob)
        if flip:
            data[len(data) // 2] ^= 0x20
        sock.sendall(hdr + bytes(data) + tx.end())
        return read_reply(sock, tx)


def test_a_corrupt_or_unsound_snapshot_frame_refuses_the_replica_and_nothing_resumes_from_it(tmp_path: Path) -> None:
    """A snapshot frame with a flipped bit is refused ('digest'), one whose cells do not check is refused ('snapshot',
    saying why): b keeps neither the snapshot nor the blocks, so the next turn recomputes; the sound one then lands."""

    async def main() -> None:
        b = _Host("b", tmp_path / "b", lambda n: None)
        await b.kv.start()
        try:
            facts = EngineFacts(b.engine.fingerprint, b.engine.block_bytes)
            tokens = prompt_tokens(4 * BS, seed=8)
            ho = hand_offer(facts, "hand-s", tokens, snapshot_pos=4 * BS, snapshot_bytes=SNAP)
            flipped = await asyncio.to_thread(_send, b.kv.address, ho, _blob(4 * BS), flip=True)
            assert isinstance(flipped, wire.PeerRefused) and flipped.reason == "digest", flipped
            unsound = await asyncio.to_thread(_send, b.kv.address, ho, _blob(3 * BS), flip=False)
            assert isinstance(unsound, wire.PeerRefused) and unsound.reason == "snapshot", unsound
            assert "window snapshot" in unsound.message
            assert b.snapshots.newest(tokens) is None and b.engine.cached_prefix("hand-s", tokens) == 0
            assert b.kv.store.manifest("hand-s") is None
            refused = b.kv.stats()["in"]["hand"]["refused"]  # type: ignore[index]
            assert refused == {"digest": 1, "snapshot": 1}
            assert [e.reason for e in b.events if isinstance(e, ReplicaRefused)] == ["digest", "snapshot"]
            sound = await asyncio.to_thread(_send, b.kv.address, ho, _blob(4 * BS), flip=False)
            assert isinstance(sound, wire.Completed), sound
            w = b.snapshots.newest(tokens)
            assert w is not None and w.pos == 4 * BS and b.engine.cached_prefix("hand-s", tokens) == 4 * BS
        finally:
            await b.stop()

    asyncio.run(main())
