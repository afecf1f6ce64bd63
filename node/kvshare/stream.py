"""One replica push on the wire, on its sender thread: connect, offer the block hashes, stream the
blocks the receiver lacks straight from the pinned pool, then the session's newest state snapshot
they reach (window-mode and recurrent models: `node.engine.snapshots`), then read its verdict
(`wire.Sender` frames it all). `_Job` is the push as the queue on the event loop and this thread
share it; `PushResult` is what it came to.

The snapshot is found here, on the thread (its lookup digests the tokens, its frame the blob), and
announced in the signed offer: the blocks and the snapshot are one replica, landed or refused whole."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvmesh.node.config import KVShareConfig
from kvmesh.node.engine.engine import PinnedBlocks
from kvmesh.node.engine.snapshots import Snapshot
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.links import _Progress, tcp_acked, tcp_bytes


@dataclass
class PushResult:
    ok: bool
    tokens: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    reason: str = ""
    message: str = ""
    wire_sent: int = 0  # payload bytes the kernel put on the link (TCP_INFO bytes_sent, with resends)
    wire_received: int = 0
    backlogged_bytes: int = 0  # bytes acknowledged while another push to the target was queued (_Progress)
    snapshot_bytes: int = 0  # the state snapshot's payload, when the push carried one (in bytes_sent once it landed)


@dataclass
class _Job:
    session: str
    target: str
    done: asyncio.Future[PushResult]
    cancel: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    preempted: bool = False  # stopped to free the pool blocks it pinned for a turn here
    offer_tip: tuple[int, bytes] | None = None  # (blocks offered, hash of the last one) once exported
    progress_at: float = 0.0  # monotonic time the socket last took bytes (sender thread writes it)
    sock: socket.socket | None = None  # while sending: closing it unblocks a stalled send
    link_free: Callable[[], None] | None = None  # gives the push's gate permit back (once); see _stream

    def supersede(self) -> None:
        self.cancel.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def preempt(self) -> None:
        """Stop it to free the pool blocks it pins (it ends refused: "preempted")."""
        self.preempted = True
        self.supersede()


class _Superseded(Exception):
    pass


class PushStream:
    """Runs pushes on the calling (sender) thread. It is given the mesh secret its offers are signed
    with, the config section (timeouts, socket buffers) and the data plane's client TLS (None: plain TCP)."""

    def __init__(self, secret: bytes, cfg: KVShareConfig, client_tls: ssl.SSLContext | None):
        self.secret = secret
        self.cfg = cfg
        self._client_tls = client_tls

    def send(self, addr: str, offer: wire.Offer, pinned: PinnedBlocks, job: _Job,
             backlog_s: Callable[[], float], snapshot: Callable[[np.ndarray], Snapshot | None] | None = None) -> PushResult:
        """The whole push to `addr`; `backlog_s` is the link's time backlogged so far (see `_Progress`);
        `snapshot(tokens)` the newest snapshot the pinned blocks reach (None: the model keeps none)."""
        snap = snapshot(pinned.tokens) if snapshot is not None else None
        if snap is not None:
            offer = offer.model_copy(update={"snapshot_pos": snap.pos, "snapshot_bytes": snap.nbytes})
        host, port = addr.rsplit(":", 1)
        tx = wire.Sender(self.secret)
        try:
            raw = socket.create_connection((host, int(port)), timeout=self.cfg.connect_timeout_s)
        except OSError as err:
            return PushResult(False, reason="superseded" if job.cancel.is_set() else "unreachable", message=str(err))
        sock = self._client_tls.wrap_socket(raw) if self._client_tls else raw
        job.sock = sock
        result = PushResult(False, reason="error")
        try:
            result = self._stream(sock, tx, offer, pinned, job, backlog_s, snap)
            if snap is not None:
                result.snapshot_bytes = snap.nbytes  # it went with this push, whether it landed or not
        finally:
            result.wire_sent, result.wire_received = tcp_bytes(sock)
            if not result.ok:
                # Drop what is still queued in the socket: a cut transfer must not keep the link busy.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        return result

    def _stream(self, sock: socket.socket, tx: wire.Sender, offer: wire.Offer, pinned: PinnedBlocks,
                job: _Job, backlog_s: Callable[[], float], snap: Snapshot | None) -> PushResult:
        """Offer, then send the blocks the receiver lacks and the snapshot, then wait for its verdict."""
        prog = _Progress(backlog_s)
        try:
            sock.settimeout(self.cfg.io_timeout_s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.cfg.socket_buffer_bytes)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frame = tx.offer_bytes(offer, pinned.tokens, pinned.hashes)
            sock.sendall(frame)
            prog.sent += len(frame)
            ev = self._read_reply(sock, tx)
            if isinstance(ev, wire.PeerRefused):
                return PushResult(False, reason=ev.reason, message=ev.message)
            assert isinstance(ev, wire.Accepted)
            t0 = time.monotonic()  # transfer time counts from the first block
            refused = self._send_blocks(sock, tx, pinned, job, ev.first_missing, prog, snap)
            if refused is not None:
                return refused
            if job.link_free is not None:
                job.link_free()  # the link is free for the next push while the receiver lands this one
            done = self._read_reply(sock, tx)
            prog.acked_to(tcp_acked(sock))
            secs = time.monotonic() - t0
            if isinstance(done, wire.PeerRefused):
                return PushResult(False, reason=done.reason, message=done.message, bytes_sent=prog.sent, seconds=secs)
            assert isinstance(done, wire.Completed)
            return PushResult(True, tokens=done.tokens, blocks_sent=len(pinned.ids) - ev.first_missing,
                              bytes_sent=prog.sent, seconds=secs, backlogged_bytes=prog.backlogged)
        except _Superseded:
            return PushResult(False, reason="superseded", bytes_sent=prog.sent)
        except (OSError, wire.ProtocolError) as err:
            if job.cancel.is_set():
                return PushResult(False, reason="superseded", bytes_sent=prog.sent)
            reason = err.reason if isinstance(err, wire.ProtocolError) else "unreachable"
            return PushResult(False, reason=reason, message=str(err), bytes_sent=prog.sent)

    def _send_blocks(self, sock: socket.socket, tx: wire.Sender, pinned: PinnedBlocks, job: _Job, first: int,
                     prog: _Progress, snap: Snapshot | None = None) -> PushResult | None:
        """Send blocks first.., the snapshot, and END; a refusal the receiver sent mid-stream, or None once END is sent."""
        prog.acked_to(tcp_acked(sock))
        # Each frame made only when its turn comes: a block read off an accelerator is a copy.
        frames: list[Callable[[], tuple[bytes, memoryview]]] = [
            functools.partial(self._block_frame, tx, pinned, i) for i in range(first, len(pinned.ids))]
        if snap is not None:
            frames.append(lambda: (tx.snapshot_header(snap.blob), snap.blob.data))
        for frame in frames:
            if job.cancel.is_set():
                raise _Superseded()
            if select.select([sock], [], [], 0)[0]:
                return None  # the receiver spoke mid-stream: a refusal, read as its verdict
            hdr, data = frame()
            try:
                sock.sendall(hdr)
                sock.sendall(data)
                job.progress_at = time.monotonic()
            except OSError:
                if job.cancel.is_set():
                    raise _Superseded() from None
                refusal = self._late_refusal(sock, tx)
                if refusal is not None:
                    return PushResult(False, reason=refusal.reason, message=refusal.message, bytes_sent=prog.sent)
                raise
            prog.sent += len(hdr) + data.nbytes
            prog.acked_to(tcp_acked(sock))
        end = tx.end()
        sock.sendall(end)
        prog.sent += len(end)
        return None

    @staticmethod
    def _block_frame(tx: wire.Sender, pinned: PinnedBlocks, i: int) -> tuple[bytes, memoryview]:
        data = pinned.read(pinned.ids[i])  # here, not on the loop: off an accelerator it is a copy
        return tx.block_header(i, data), data

    def _late_refusal(self, sock: socket.socket, tx: wire.Sender) -> wire.PeerRefused | None:
        """After a failed send, the receiver's refusal may still be readable: find it."""
        try:
            sock.settimeout(1.0)
            ev = self._read_reply(sock, tx)
        except (OSError, wire.ProtocolError):
            return None
        return ev if isinstance(ev, wire.PeerRefused) else None

    @staticmethod
    def _read_reply(sock: socket.socket, tx: wire.Sender) -> wire.SenderEvent:
        while True:
            data = sock.recv(max(1, tx.want()))
            events = tx.feed(data) if data else tx.eof()
            if events:
                return events[0]
