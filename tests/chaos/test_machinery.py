"""The drill's own instruments, checked without a mesh: the link proxy puts its fault exactly
where it says, the store verifier catches what it must, the clock check finds wall-clock
durations. Plus two bugs the drills found, reproduced small (xfail strict until fixed)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from kvmesh.node.chaos import Fault, LinkProxy, parse_offer, verify_store, wall_clock_findings
from kvmesh.node.engine.hashing import block_hashes, chain_seed, payload_digest
from kvmesh.node.engine.simkv import block_bytes
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.protocol import session_key

SECRET = b"a-test-secret-of-some-length"
FP, BS, BB = "f" * 32, 16, 1024


def _offer(n_blocks: int = 8) -> tuple[bytes, bytes]:
    offer = wire.Offer(session="s1", sender="a", fingerprint=FP, block_size=BS, block_bytes=BB, n_blocks=n_blocks,
                       generation=1, sent_at=0.0)
    tokens = np.arange(n_blocks * BS, dtype=np.int32)
    return wire.encode_offer(offer, tokens, [bytes([i]) * 16 for i in range(n_blocks)], SECRET)


def test_parse_offer_reads_a_real_offer_frame() -> None:
    frame, _ = _offer()
    assert parse_offer(frame[:10]) is None  # not enough yet
    length, header = parse_offer(frame)  # type: ignore[misc]
    assert length == len(frame)
    assert header["session"] == "s1" and header["n_blocks"] == 8 and header["block_bytes"] == BB
    with pytest.raises(ValueError):
        parse_offer(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def _through_proxy(fault: Fault, first_missing: int = 2) -> tuple[bytes, bytes, Exception | None]:
    """Send an offer, get an ANSWER, stream the blocks through a proxy; returns (what the sender
    sent after the offer, what the receiver got after the offer, the sender's error)."""
    frame, mac = _offer()
    received = bytearray()
    srv = socket.create_server(("127.0.0.1", 0))

    def receiver() -> None:
        conn, _ = srv.accept()
        with conn:
            got = b""
            while len(got) < len(frame):
                got += conn.recv(len(frame) - len(got))
            conn.sendall(wire.encode_answer(SECRET, mac, first_missing=first_missing))
            while data := conn.recv(65536):
                received.extend(data)

    t = threading.Thread(target=receiver)
    t.start()
    px = LinkProxy("a", "b")
    px.target = ("127.0.0.1", srv.getsockname()[1])
    px.arm(fault)
    body = b"".join(wire.encode_block_header(i, bytes([i]) * 16, b"d" * 16) + bytes([i]) * BB
                    for i in range(first_missing, 8)) + wire.encode_end(8 - first_missing, b"m" * 32)
    err = None
    try:
        host, port = px.address.split(":")
        with socket.create_connection((host, int(port))) as c:
            c.sendall(frame)
            c.recv(11)  # the ANSWER's fixed part
            c.sendall(body)
            c.shutdown(socket.SHUT_WR)
    except OSError as e:
        err = e
    t.join(10)
    px.close()
    srv.close()
    return body, bytes(received), err


def test_proxy_flips_exactly_one_bit_of_the_chosen_block() -> None:
    f = Fault("flip", "s1", at=0.5, byte=100, bit=3)
    sent, got, _ = _through_proxy(f)
    assert f.fired.is_set() and f.info["blocks_sent"] == 6 and f.info["block"] == 2 + 3
    assert len(got) == len(sent)
    diff = [i for i in range(len(sent)) if sent[i] != got[i]]
    assert diff == [3 * (37 + BB) + 37 + 100], diff  # inside block 5's payload, byte 100
    assert sent[diff[0]] ^ got[diff[0]] == 1 << 3


def test_proxy_cuts_in_the_middle_of_the_chosen_block() -> None:
    f = Fault("cut", "s1", at=0.5, byte=300)
    sent, got, _ = _through_proxy(f)
    assert f.fired.is_set()
    assert got == sent[: 3 * (37 + BB) + 37 + 300], (len(got), len(sent))


def test_proxy_leaves_other_sessions_alone() -> None:
    f = Fault("flip", "another-session")
    sent, got, _ = _through_proxy(f)
    assert got == sent and not f.fired.is_set() and not f.claimed


def _store_with_replica(root: Path) -> Path:
    store = ReplicaStore(root, budget_bytes=1 << 30, fsync="never")
    tokens = np.arange(4 * BS, dtype=np.int32)
    hashes = block_hashes(chain_seed(FP), tokens, BS)
    w = store.begin_write("s1", fingerprint=FP, block_size=BS, block_bytes=BB, tokens=tokens, hashes=hashes,
                          first_block=0, generation=1)
    with w:
        for i in range(len(hashes)):
            data = block_bytes(hashes[i - 1] if i else chain_seed(FP), tokens[i * BS : (i + 1) * BS], BB // BS, BS)
            w.write_block(i, data, payload_digest(data))
        w.commit()
    store.close()
    return root / session_key("s1")


def test_verify_store_passes_a_good_replica_and_catches_bad_ones(tmp_path: Path) -> None:
    d = _store_with_replica(tmp_path / "good")
    rep = verify_store(tmp_path / "good", "x")
    assert (rep.replicas, rep.blocks, rep.corrupt, rep.leaked) == (1, 4, [], [])

    seg = next(d.glob("seg-*.kv"))
    flipped = tmp_path / "flipped"
    shutil.copytree(tmp_path / "good", flipped)
    data = bytearray((flipped / d.name / seg.name).read_bytes())
    data[BB + 7] ^= 0x10
    (flipped / d.name / seg.name).write_bytes(bytes(data))
    assert any("block 1" in c for c in verify_store(flipped, "x").corrupt)

    torn = tmp_path / "torn"
    shutil.copytree(tmp_path / "good", torn)
    with open(torn / d.name / seg.name, "r+b") as fh:
        fh.truncate(2 * BB + 5)
    assert any("partial" in c for c in verify_store(torn, "x").corrupt)

    leaky = tmp_path / "leaky"
    shutil.copytree(tmp_path / "good", leaky)
    (leaky / d.name / "~seg.0123.tmp").write_bytes(b"x")
    (leaky / "half").mkdir()
    rep = verify_store(leaky, "x")
    assert rep.corrupt == [] and len(rep.leaked) == 2, rep.leaked


def test_wall_clock_check_finds_wall_durations_only(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import time\n"
        "class T:\n"
        "    def __init__(self):\n"
        "        self.born = time.time()\n"
        "        self.t0 = time.monotonic()\n"
        "    def age(self):\n"
        "        return time.time() - self.born\n"  # a duration on the wall clock
        "    def ok(self):\n"
        "        return time.monotonic() - self.t0\n"
        "    def stamp(self):\n"
        "        return {'ts': time.time()}\n"
        "def newest(xs):\n"
        "    return max(xs, key=lambda x: x.born)\n"  # an order by wall stamps
    )
    found = {(f["function"], f["kind"]) for f in wall_clock_findings(pkg) if not f["allowed"]}
    assert found == {("age", "duration"), ("newest", "ordering")}, found


def test_node_uses_monotonic_clocks_for_durations_and_order() -> None:
    bad = [f for f in wall_clock_findings(Path(__file__).resolve().parents[2] / "node") if not f["allowed"]]
    assert not bad, "\n".join(f"{f['file']}:{f['line']} {f['function']}: {f['expr']}" for f in bad)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("tmpfs mount refused here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_leaves_no_temp_segment(tiny_tmpfs: Path) -> None:
    """Writes that hit ENOSPC at every point of one 100 KiB block: no temp segment may stay."""
    bb = 102400
    tokens = np.arange(256, dtype=np.int32)
    hashes = block_hashes(chain_seed(FP), tokens, 256)
    data = hashes[0] * (bb // 16)
    left: dict[int, list[str]] = {}
    for pages_short in range(6):
        root = tiny_tmpfs / f"store{pages_short}"
        store = ReplicaStore(root, budget_bytes=1 << 30, fsync="never")
        st = os.statvfs(tiny_tmpfs)
        # Room for all but a few pages of the block: when write(2) comes up short by <= 8 KiB,
        # Python's BufferedWriter keeps the tail and reports success; commit's flush then fails.
        filler = tiny_tmpfs / "filler"
        filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - bb + (pages_short - 2) * 4096))
        try:
            w = store.begin_write("s1", fingerprint=FP, block_size=256, block_bytes=bb, tokens=tokens, hashes=hashes,
                                  first_block=0, generation=1)
            with w:
                w.write_block(0, data, payload_digest(data))
                w.commit()
        except Exception:  # noqa: BLE001 - refusing the write is right; leaving files is not
            pass
        if temps := sorted(str(p.relative_to(root)) for p in root.rglob("~*")):
            left[pages_short] = temps
        filler.unlink()
        shutil.rmtree(root)
    assert not left, f"temp files left behind (by pages short of room): {left}"
