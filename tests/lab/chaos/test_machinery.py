"""The drill's own instruments, checked without a mesh: the link proxy puts its fault exactly
where it says (and pauses, throttles and resets as told), the store verifier catches what it
must, the clock check finds wall-clock durations, the clock shim jumps a process's wall clock,
and a scenario that cannot inject its fault is reported "not run", never "passed"."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmesh.node.engine.hashing import block_hashes, chain_seed, payload_digest
from kvmesh.node.engine.simkv import block_bytes
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.lab.chaos import (
    Fault,
    LinkProxy,
    clockshim,
    verify_store,
    wall_clock_findings,
)
from kvmesh.node.lab.chaos.harness import Drill
from kvmesh.node.lab.chaos.invariants import Observed, judge
from kvmesh.node.lab.chaos.runner import EXIT_NOT_RUN, summarize
from kvmesh.node.protocol import session_key

SECRET = b"a-test-secret-of-some-length"
FP, BS, BB = "f" * 32, 16, 1024


def _offer(n_blocks: int = 8) -> tuple[bytes, bytes]:
    offer = wire.Offer(session="s1", sender="a", fingerprint=FP, block_size=BS, block_bytes=BB, n_blocks=n_blocks,
                       generation=1, sent_at=0.0)
    tokens = np.arange(n_blocks * BS, dtype=np.int32)
    return wire.encode_offer(offer, tokens, [bytes([i]) * 16 for i in range(n_blocks)], SECRET)


def test_peek_offer_and_answer_read_real_frames() -> None:
    """wire.peek_offer / peek_answer (what the proxy reads) parse real frames, ask for more bytes, refuse others."""
    frame, mac = _offer()
    assert wire.peek_offer(frame[:10]) is None  # not enough yet
    got = wire.peek_offer(frame)
    assert got is not None and got.length == len(frame)
    assert got.header["session"] == "s1" and got.header["n_blocks"] == 8 and got.header["block_bytes"] == BB
    with pytest.raises(wire.ProtocolError):
        wire.peek_offer(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = wire.encode_answer(SECRET, mac, first_missing=5)
    assert wire.peek_answer(answer[:6]) is None and wire.peek_answer(answer) == 5
    with pytest.raises(wire.ProtocolError):
        wire.peek_answer(frame)


def _through_proxy(fault: Fault, first_missing: int = 2) -> tuple[bytes, bytes, Exception | None]:
    """Send an offer, get an ANSWER, stream the blocks through a proxy; returns (what the sender
    sent after the offer, what the receiver got after the offer, the receiver's error)."""
    frame, mac = _offer()
    received = bytearray()
    rx_error: list[Exception] = []
    srv = socket.create_server(("127.0.0.1", 0))

    def receiver() -> None:
        conn, _ = srv.accept()
        with conn:
            got = b""
            while len(got) < len(frame):
                got += conn.recv(len(frame) - len(got))
            conn.sendall(wire.encode_answer(SECRET, mac, first_missing=first_missing))
            try:
                while data := conn.recv(65536):
                    received.extend(data)
            except OSError as e:
                rx_error.append(e)

    t = threading.Thread(target=receiver)
    t.start()
    px = LinkProxy("a", "b")
    px.target = ("127.0.0.1", srv.getsockname()[1])
    px.arm(fault)
    body = b"".join(wire.encode_block_header(i, bytes([i]) * 16, b"d" * 16) + bytes([i]) * BB
                    for i in range(first_missing, 8)) + wire.encode_end(8 - first_missing, b"m" * 32)
    try:
        host, port = px.address.split(":")
        with socket.create_connection((host, int(port))) as c:
            c.sendall(frame)
            c.recv(11)  # the ANSWER's fixed part
            c.sendall(body)
            c.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # a cut may reach the sender first
    t.join(10)
    px.close()
    srv.close()
    return body, bytes(received), (rx_error[0] if rx_error else None)


def test_proxy_flips_exactly_one_bit_of_the_chosen_block() -> None:
    """A flip lands on the one byte and bit it names, in the block at `at` of those sent."""
    f = Fault("flip", "s1", at=0.5, byte=100, bit=3)
    sent, got, _ = _through_proxy(f)
    assert f.fired.is_set() and f.info["blocks_sent"] == 6 and f.info["block"] == 2 + 3
    assert len(got) == len(sent)
    diff = [i for i in range(len(sent)) if sent[i] != got[i]]
    assert diff == [3 * (37 + BB) + 37 + 100], diff  # inside block 5's payload, byte 100
    assert sent[diff[0]] ^ got[diff[0]] == 1 << 3


def test_proxy_cuts_in_the_middle_of_the_chosen_block() -> None:
    """A cut delivers exactly the bytes before its point, then ends the stream with a FIN."""
    f = Fault("cut", "s1", at=0.5, byte=300)
    sent, got, _ = _through_proxy(f)
    assert f.fired.is_set()
    assert got == sent[: 3 * (37 + BB) + 37 + 300], (len(got), len(sent))


def test_proxy_leaves_other_sessions_alone() -> None:
    """A fault armed for another session neither fires nor stays claimed."""
    f = Fault("flip", "another-session")
    sent, got, _ = _through_proxy(f)
    assert got == sent and not f.fired.is_set() and not f.claimed


def test_proxy_block_index_and_any_session() -> None:
    """Fault(block=k) hits the k-th block sent (whatever first_missing is), for any session when none is named."""
    f = Fault("flip", None, block=1, byte=5, bit=0)
    sent, got, _ = _through_proxy(f, first_missing=3)
    assert f.fired.is_set() and f.info["block"] == 3 + 1 and f.info["sent_index"] == 1, f.info
    diff = [i for i in range(len(sent)) if sent[i] != got[i]]
    assert diff == [1 * (37 + BB) + 37 + 5] and sent[diff[0]] ^ got[diff[0]] == 1, diff


def test_proxy_cut_with_rst_resets_the_receiver() -> None:
    """how="rst": the receiver's side is reset (ECONNRESET), not closed with a FIN, after the bytes before the point."""
    f = Fault("cut", "s1", block=2, byte=10, how="rst")
    sent, got, err = _through_proxy(f)
    assert f.fired.is_set()
    assert isinstance(err, ConnectionResetError), err
    assert sent.startswith(got) and len(got) <= 2 * (37 + BB) + 37 + 10, (len(got), len(sent))


def test_proxy_fault_on_a_transfer_too_short_waits_for_the_next() -> None:
    """A fault whose block a transfer does not send stays armed (unclaimed) for the next transfer."""
    f = Fault("flip", "s1", block=7)
    sent, got, _ = _through_proxy(f)  # sends 6 blocks: indices 0..5 of those sent
    assert got == sent and not f.fired.is_set() and not f.claimed


class _Sink:
    """A TCP server that keeps every byte it receives, on one connection."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.got = bytearray()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            while data := conn.recv(65536):
                self.got.extend(data)

    def close(self) -> None:
        self.thread.join(10)
        self.srv.close()


def _connect(px: LinkProxy) -> socket.socket:
    host, port = px.address.split(":")
    return socket.create_connection((host, int(port)))


def test_proxy_pause_holds_bytes_and_counts_connections() -> None:
    """pause(): the connection opens and is counted, no byte passes until resume(), then every byte does."""
    sink = _Sink()
    px = LinkProxy(target=("127.0.0.1", sink.srv.getsockname()[1]))
    px.pause()
    data = b"x" * 50_000  # not kv_share: passed through untouched
    try:
        with _connect(px) as c:
            c.sendall(data)
            deadline = time.monotonic() + 5
            while px.connections < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            assert px.connections == 1 and px.max_active == 1 and px.active() == [None]
            assert len(sink.got) == 0, "bytes crossed a paused proxy"
            px.resume()
            c.shutdown(socket.SHUT_WR)
            sink.close()
        assert bytes(sink.got) == data
        px.reset_counts()
        assert px.connections == 0
    finally:
        px.close()


def test_proxy_rate_limit_paces_the_sender() -> None:
    """rate_bps: 100 KB at 250 kB/s takes at least 0.4 s to cross the proxy."""
    sink = _Sink()
    px = LinkProxy(target=("127.0.0.1", sink.srv.getsockname()[1]))
    px.rate_bps = 250_000
    data = b"y" * 100_000
    try:
        t0 = time.monotonic()
        with _connect(px) as c:
            c.sendall(data)
            c.shutdown(socket.SHUT_WR)
            sink.close()
        elapsed = time.monotonic() - t0
        assert bytes(sink.got) == data and elapsed >= 0.4, elapsed
    finally:
        px.close()


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
    bad = [f for f in wall_clock_findings(Path(__file__).resolve().parents[3] / "node") if not f["allowed"]]
    assert not bad, "\n".join(f"{f['file']}:{f['line']} {f['function']}: {f['expr']}" for f in bad)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, check=False).returncode:
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
        except Exception:  # noqa: BLE001, S110 - refusing the write is right; leaving files is not
            pass
        if temps := sorted(str(p.relative_to(root)) for p in root.rglob("~*")):
            left[pages_short] = temps
        filler.unlink()
        shutil.rmtree(root)
    assert not left, f"temp files left behind (by pages short of room): {left}"


# A child that prints, per stdin line: time.time(), a `from time import time` binding made after
# start-up, time.time_ns() in seconds, and time.monotonic().
_SHIM_CHILD = ("import sys, time\nfrom time import time as bound\n"
               "for _ in sys.stdin:\n    print(time.time(), bound(), time.time_ns() / 1e9, time.monotonic(), flush=True)\n")


def test_clock_shim_jumps_a_process_wall_clock_both_ways_not_its_monotonic(tmp_path: Path) -> None:
    """A process with the shim as its site hook: its wall clock follows the offset file (+1 h, then -1 h) at once; monotonic does not jump."""
    shim = tmp_path / "shim"
    shim.mkdir()
    shutil.copyfile(clockshim.__file__, shim / "sitecustomize.py")
    clock = tmp_path / "offset.txt"
    clock.write_text("+3600\n")
    env = {**os.environ, "PYTHONPATH": str(shim), clockshim.ENV: str(clock)}
    proc = subprocess.Popen([sys.executable, "-c", _SHIM_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None

    def ask() -> list[float]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        return [float(x) for x in proc.stdout.readline().split()]

    try:
        fwd, now = ask(), time.time()
        assert all(abs(v - now - 3600) < 5 for v in fwd[:3]), (fwd, now)
        (tmp_path / "new.txt").write_text("-3600\n")
        os.replace(tmp_path / "new.txt", clock)  # as the drill does; the very next call must see it
        back, now = ask(), time.time()
        assert all(abs(v - now + 3600) < 5 for v in back[:3]), (back, now)
        assert 0 <= back[3] - fwd[3] < 5, "the monotonic clock jumped too"
    finally:
        proc.stdin.close()
        proc.wait(10)


def _summary_row(status: str) -> dict[str, Any]:
    return {"status": status, "failed_turns": 0, "corrupt_imports": 0}


def test_summary_and_exit_status_say_not_run() -> None:
    """Scenarios not run are counted as such and exit with 3, never 0; any failure exits 1; all passed exits 0."""
    result, rc = summarize([_summary_row("passed"), _summary_row("not_run")])
    assert rc == EXIT_NOT_RUN == 3 and (result["passed"], result["failed"], result["not_run"]) == (1, 0, 1)
    assert summarize([_summary_row("passed"), _summary_row("not_run"), _summary_row("failed")])[1] == 1
    assert summarize([_summary_row("passed")])[1] == 0
    assert summarize([])[1] == 1


def test_a_fault_that_cannot_be_injected_is_not_run_never_passed(tmp_path: Path) -> None:
    """cannot_inject() with nothing else broken is judged "not_run"; with a breach "failed"; a fault never hit "failed"."""
    serving = {n: {"pinned": True, "as_entry": True} for n in ("node-a", "node-b", "node-c")}
    drills = [Drill(tmp_path / "a", "a", 1), Drill(tmp_path / "b", "b", 2)]
    try:
        d, never_hit = drills
        d.cannot_inject("no clock to jump here")
        det = judge(d, "a", "about", Observed(serving=dict(serving)))
        assert det["status"] == "not_run" and det["passed"] is False and det["failures"] == [], det
        assert det["not_run"] == "no clock to jump here" and det["fault"]["hit"] is False
        d.checks["what_the_fault_is_about"] = False
        assert judge(d, "a", "about", Observed(serving=dict(serving)))["status"] == "failed"
        det = judge(never_hit, "b", "about", Observed(serving=dict(serving)))
        assert det["status"] == "failed" and any("not injected" in f for f in det["failures"]), det["failures"]
    finally:
        for x in drills:
            asyncio.run(x.http.aclose())
