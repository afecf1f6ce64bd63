"""The kv_share listener: an accept thread, and one thread per inbound transfer that feeds its bytes to
`wire.Receiver`, reading each payload straight into where it lands (the engine's pool, or a store write)
and verifying it there. What to do with an offer, and each commit, is decided on the event loop
(`landing.Landing`); the bytes, digests, copies and fsyncs stay on the transfer's thread. A state snapshot
that comes with the blocks is checked here at END (its cells, against the model's layout) and kept: in the
engine's snapshots when the blocks went into the engine, in the store's write when they went there. One
that does not check refuses the whole replica ('snapshot'): the blocks alone resume nothing such a model."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, TypeVarTuple

import numpy as np

from kvmesh.node.config import KVShareConfig
from kvmesh.node.engine.boundary import ImportAPI
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.errors import KVMeshError
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.landing import Landing, _Plan
from kvmesh.node.kvshare.links import _linger_close
from kvmesh.node.kvshare.store import ReplicaStore, SegmentWriter, copy_block

R = TypeVar("R")
Ts = TypeVarTuple("Ts")

# Inbound transfers served at once; an offer must be complete within OFFER_DEADLINE_S (or two
# io_timeout_s) of connecting: each read is bounded by io_timeout_s, this bounds a trickling client.
MAX_INBOUND_CONNECTIONS = 64
OFFER_DEADLINE_S = 10.0


@dataclass
class _Conn:
    """One inbound connection's state, on its receiving thread."""

    rx: wire.Receiver
    offer: wire.Offer | None = None
    src: str = "?"
    plan: _Plan = field(default_factory=_Plan)
    txn: ImportAPI | None = None  # reserved in the engine, not committed yet
    writer: SegmentWriter | None = None  # a store write, not committed yet
    received: int = 0
    t_first: float = 0.0
    first_block_seen: bool = False
    tokens: np.ndarray | None = None  # the offer's
    snapshot: wire.SnapshotReceived | None = None


class Listener:
    """The receiving threads. It is given what it uses: its config section (listen address, timeouts,
    buffers), the store (where replicas without room in the pool go, and the blocks it already held),
    the loop's decisions (`Landing`), the mesh secrets that sign offers, the server TLS (None: plain TCP), and
    the engine's snapshots (None: its model keeps none)."""

    def __init__(self, cfg: KVShareConfig, store: ReplicaStore, landing: Landing, *, secret: bytes,
                 previous_secret: bytes | None, server_tls: ssl.SSLContext | None, snapshots: Snapshots | None = None):
        self.cfg = cfg
        self.snapshots = snapshots
        self.store = store
        self._landing = landing
        self.secret = secret
        self.previous_secret = previous_secret
        self._server_tls = server_tls
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._conn_slots = threading.BoundedSemaphore(MAX_INBOUND_CONNECTIONS)

    def start(self, loop: asyncio.AbstractEventLoop) -> str:
        """Listen, and accept on a thread; returns the address it listens on."""
        self._loop = loop
        host, port = self.cfg.listen.rsplit(":", 1)
        sock = socket.create_server((host, int(port)), backlog=64, reuse_port=False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.cfg.socket_buffer_bytes)
        self._listener = sock
        h, p = sock.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvshare-listen", daemon=True)
        self._accept_thread.start()
        return f"{h}:{p}"

    def stop(self) -> None:
        self._closing.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            if not self._conn_slots.acquire(blocking=False):
                conn.close()  # at the connection cap: the sender retries on its next turn
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), name="kvshare-recv", daemon=True).start()

    def _wrap(self, conn: socket.socket) -> socket.socket:
        if self._server_tls is None:
            return conn
        conn.settimeout(self.cfg.io_timeout_s)  # the handshake too is bounded
        return self._server_tls.wrap_socket(conn, server_side=True)

    def _call(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """Run fn on the event loop thread and wait for it (engine bookkeeping has one writer)."""
        assert self._loop is not None

        async def run() -> R:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def _serve_conn(self, conn: socket.socket) -> None:
        """One inbound transfer, on its own thread: the bytes (payloads, digests, the store's
        copies and fsyncs) stay on this thread; the loop only decides and commits."""
        st = _Conn(wire.Receiver(self.secret, self.previous_secret))
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.cfg.socket_buffer_bytes)
            conn = self._wrap(conn)
            conn.settimeout(self.cfg.io_timeout_s)
            offer_deadline = time.monotonic() + min(OFFER_DEADLINE_S, 2 * self.cfg.io_timeout_s)
            while not st.rx.done:
                if st.offer is None and time.monotonic() > offer_deadline:
                    raise wire.ProtocolError(wire.Reason.TRUNCATED, "the offer did not arrive in time")
                for ev in self._recv_events(conn, st):
                    if not self._on_event(conn, st, ev):
                        return
        except (OSError, KVMeshError, concurrent.futures.CancelledError, concurrent.futures.TimeoutError) as err:
            reason = getattr(err, "reason", None) or ("connection" if isinstance(err, OSError) else type(err).__name__)
            if reason == wire.Reason.VERSION:  # a peer of another version reads why, not a closed connection
                with contextlib.suppress(OSError):
                    conn.sendall(st.rx.refuse(reason, str(err)))
            if st.offer is not None and not self._closing.is_set():
                self._call(self._landing.refused, st.offer, st.src, reason, str(err))
        finally:
            if st.txn is not None and not self._closing.is_set():
                self._call(self._landing.abort, st.offer, st.txn)
            if st.writer is not None:
                st.writer.abort()
            conn.close()
            self._conn_slots.release()

    @staticmethod
    def _recv_events(conn: socket.socket, st: _Conn) -> list[wire.ReceiverEvent]:
        """Read what the socket has: payloads straight into their target (the engine's pool)."""
        view = st.rx.payload_view()
        if view is not None:
            n = conn.recv_into(view)
            st.received += n
            return st.rx.payload_filled(n) if n else st.rx.eof()
        data = conn.recv(max(1, st.rx.want()))
        st.received += len(data)
        return st.rx.feed(data) if data else st.rx.eof()

    def _on_event(self, conn: socket.socket, st: _Conn, ev: wire.ReceiverEvent) -> bool:
        """Act on one receiver event; False once the connection is done (refused)."""
        if isinstance(ev, wire.Refused):
            return self._refuse(conn, st, ev.reason, ev.message, ev.reply)
        if isinstance(ev, wire.OfferReceived):
            return self._accept_offer(conn, st, ev)
        if isinstance(ev, wire.BlockHeader) and not st.first_block_seen:
            # Transfer time counts from the first block's first byte, as raw TCP's does.
            st.first_block_seen, st.t_first = True, time.monotonic()
        elif isinstance(ev, wire.BlockReceived):
            if st.writer is not None:
                st.writer.write_block(ev.index, ev.data, ev.digest)
            ib = st.plan.inbound
            if ib is not None and st.offer is not None:  # progress for a turn that waits on it: plain stores
                if not ib.t_first:
                    ib.t_first = st.t_first
                ib.landed = (ev.index + 1) * st.offer.block_size
        elif isinstance(ev, wire.SnapshotReceived):
            st.snapshot = ev
            if st.writer is not None:
                st.writer.set_snapshot(ev.pos, ev.data, ev.digest)
        elif isinstance(ev, wire.EndReceived):
            last_byte = time.monotonic()
            assert st.offer is not None
            if (why := self._keep_snapshot(st)) is not None:
                return self._refuse(conn, st, wire.Reason.SNAPSHOT, why, st.rx.refuse(wire.Reason.SNAPSHOT, why))
            committed = self._land(st)
            tokens = self._call(self._landing.on_complete, st.offer, st.plan, st.received, last_byte, st.t_first,
                                committed, st.offer.snapshot_bytes)
            st.txn = st.writer = None  # committed
            conn.sendall(st.rx.result_ok(tokens))
        return True

    def _refuse(self, conn: socket.socket, st: _Conn, reason: str, message: str, reply: bytes) -> bool:
        """Refuse the transfer: undo what it reserved and count the refusal, then tell the sender, so a sender that
        reads the refusal finds this host's state already without it. Returns False: the connection is done."""
        if st.txn is not None:
            self._call(self._landing.abort, st.offer, st.txn)
            st.txn = None
        if st.writer is not None:
            st.writer.abort()
            st.writer = None
        self._call(self._landing.refused, st.offer, st.src, reason, message)
        conn.sendall(reply)
        _linger_close(conn)
        return False

    def _accept_offer(self, conn: socket.socket, st: _Conn, ev: wire.OfferReceived) -> bool:
        """Let the loop decide on the offer, open the store write here if it goes to the store,
        and answer: refuse (False) or accept from the first block this host lacks."""
        st.offer, st.src, st.tokens = ev.offer, ev.offer.sender, ev.tokens
        st.plan = plan = self._call(self._landing.on_offer, ev)
        refuse = plan.refuse
        if refuse is None and plan.store_only:
            try:  # blocks carried over from the held replica are verified and copied here, not on the loop
                st.writer = self.store.begin_write(ev.offer.session, fingerprint=ev.offer.fingerprint,
                                                   block_size=ev.offer.block_size, block_bytes=ev.offer.block_bytes,
                                                   tokens=ev.tokens, hashes=ev.hashes, first_block=plan.store_held,
                                                   generation=ev.offer.generation)
            except KVMeshError as err:
                refuse = (getattr(err, "reason", "store"), str(err))
        if refuse is not None:
            reason, message = refuse
            return self._refuse(conn, st, reason, message, st.rx.refuse(reason, message))
        st.txn = txn = plan.txn
        target = (lambda h, t=txn: t.buffer(h.index)) if txn is not None else None
        conn.sendall(st.rx.accept(plan.first_missing, payload_target=target))
        st.t_first = time.monotonic()
        return True

    def _keep_snapshot(self, st: _Conn) -> str | None:
        """The snapshot that came with the blocks, checked against the model's layout and, when the blocks go into
        the engine, kept in its snapshots (the store's write holds it already); why it cannot be, or None."""
        w = st.snapshot
        if w is None:
            return None
        if self.snapshots is None:
            return "this host's model keeps no snapshots"
        blob = np.frombuffer(w.data, dtype=np.uint8)
        if st.txn is None or st.tokens is None:
            return self.snapshots.check(w.pos, blob)
        return self.snapshots.put(st.tokens[: w.pos], blob, received=True)

    def _land(self, st: _Conn) -> int | None:
        """END verified; on this thread, the bytes still to move: the blocks the store held but the
        engine lacked go into the import (each digest checked), or the store's write commits (fsync).
        Returns the tokens the store committed (store-only), else None."""
        assert st.offer is not None
        if st.txn is not None:
            for i in range(st.plan.engine_held, st.plan.store_held):
                copy_block(st.txn, i, self.store.block_view(st.offer.session, i, verify=True))
            return None
        assert st.writer is not None
        tokens = st.writer.commit().num_tokens
        self.store.mark_own(st.offer.session, False)
        return tokens
