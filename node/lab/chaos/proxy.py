"""A TCP fault proxy in front of one kv_share listener: the one proxy for the drills and the tests.

The proxy forwards a sender's connection to its receiver, thread per direction, and reads just
enough of the kv_share frames (`wire.peek_offer`, `wire.peek_answer`: the layouts live in wire.py
only) to know which session a transfer carries and where each block's payload sits in the stream.
On that it can put an armed one-shot `Fault` at an exact byte of one block (flip a bit, cut the
connection with a FIN or a RST, or just signal that the transfer got there), throttle a
connection, or hold every sender's bytes (`pause`). It counts connections, so a test can assert
how many transfers a push made and whether they overlapped.

A small receive window (inherited by accepted sockets) keeps what a sender has not yet got
through in its own buffers, as on a real link: a sender killed mid-transfer takes those bytes with
it, instead of a big proxy buffer feeding them to the receiver for seconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.node.kvshare import wire

_TRACE = os.environ.get("KVMESH_CHAOS_TRACE") == "1"  # connection lifecycles on stderr
_RECV = 65536
_PACE = 16384  # a throttled connection is paced in slices this big, so it is steady


def _trace(msg: str) -> None:
    if _TRACE:
        print(f"{time.monotonic():.3f} proxy {msg}", file=sys.stderr, flush=True)


@dataclass
class Fault:
    """A one-shot fault for the next transfer through one proxy: of `session`, or of any when None.

    The point is byte `byte` of the payload of one block the transfer sends: the `block`-th block
    sent (0: the first one sent), or when `block` is None block `int(at * sent)` of the `sent`
    blocks the receiver asked for. cut: forward up to that byte, then close both sides (`how`
    "fin"), or reset the receiver's side ("rst"); flip: invert bit `bit` of that byte; watch:
    change nothing, just signal. `fired` is set once the point is reached; a transfer that ends
    before it leaves the fault to the next one. With `rate_bps` the whole matching connection is
    throttled (set it to None to lift it at any time)."""

    kind: Literal["cut", "flip", "watch"]
    session: str | None = None
    at: float = 0.5
    block: int | None = None
    byte: int = 1000
    bit: int = 3
    how: Literal["fin", "rst"] = "fin"
    rate_bps: float | None = None
    fired: threading.Event = field(default_factory=threading.Event)
    info: dict[str, Any] = field(default_factory=dict)
    claimed: bool = False


class _Conn:
    """One proxied connection: its sockets, what was read of its frames, and the fault it carries."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.session: str | None = None
        self.offer_len: int | None = None  # -1: not a kv_share stream, passed through untouched
        self.n_blocks = 0
        self.block_bytes = 0
        self.first_missing: int | None = None
        self.fault: Fault | None = None
        self.target: int | None = None  # offset in the sender's stream where the fault applies
        self.c2s = 0  # sender bytes forwarded
        self.offer_head = bytearray()
        self.answer_head: bytearray | None = bytearray()  # None: done reading the ANSWER
        self.threads: list[threading.Thread] = []
        self._ended = 0
        self._lock = threading.Lock()

    def cut(self, how: Literal["fin", "rst"] = "fin") -> None:
        """Drop both sides at once: with FINs, or resetting the receiver's side ("rst")."""
        if how == "rst":
            with contextlib.suppress(OSError):
                self.server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.server.shutdown(socket.SHUT_RD)  # wakes the other pump's recv without sending anything
                self.server.close()  # linger 0: the close sends a RST
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def half_ended(self) -> bool:
        """Count one direction as ended; True for the second one."""
        with self._lock:
            self._ended += 1
            return self._ended == 2


class LinkProxy:
    """A fault proxy in front of one node's kv_share listener (`target`), for the link src -> dst.

    `target` may be set after construction: the drill binds every proxy before it picks the nodes'
    ports, so no node port can be one of the proxies'."""

    def __init__(self, src: str = "", dst: str = "", target: tuple[str, int] | None = None) -> None:
        self.src, self.dst = src, dst
        self.target = target
        self.rate_bps: float | None = None  # every connection's sender -> receiver rate (None: as fast as it goes)
        self.connections = 0
        self.max_active = 0
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # before listen: the window is sized by it
        ls.bind(("127.0.0.1", 0))
        ls.listen(64)
        self._listener = ls
        self.address = f"127.0.0.1:{ls.getsockname()[1]}"
        self._faults: list[Fault] = []
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._gate = threading.Event()
        self._gate.set()
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{src}-{dst}", daemon=True)
        self._thread.start()

    # ---- control -------------------------------------------------------------------

    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def pause(self) -> None:
        """Hold every sender's bytes in the proxy (the connections stay open) until resume()."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def active(self) -> list[str | None]:
        """The session of each open connection (None until its offer was read)."""
        with self._lock:
            return [c.session for c in self._conns]

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = 0
            self.max_active = len(self._conns)

    def close(self) -> None:
        self._closed.set()
        self._gate.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.cut()
        for c in conns:
            for t in c.threads:
                t.join(2)
        self._thread.join(2)

    # ---- connections -----------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                if self.target is None:
                    raise ConnectionRefusedError("no target yet")
                server = socket.create_connection(self.target, timeout=2.0)
                server.settimeout(None)
            except OSError:
                client.close()  # the receiver is down: the sender sees its connection closed
                continue
            conn = _Conn(client, server)
            with self._lock:
                self._conns.add(conn)
                self.connections += 1
                self.max_active = max(self.max_active, len(self._conns))
            conn.threads = [threading.Thread(target=self._c2s, args=(conn,), daemon=True, name=f"proxy-{self.src}>"),
                            threading.Thread(target=self._s2c, args=(conn,), daemon=True, name=f"proxy-{self.dst}<")]
            for t in conn.threads:
                t.start()

    def _claim(self, session: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.session in (None, session) and not f.claimed and not f.fired.is_set():
                    f.claimed = True
                    return f
        return None

    def _end(self, conn: _Conn, half: socket.socket) -> None:
        with contextlib.suppress(OSError):
            half.shutdown(socket.SHUT_WR)  # pass the FIN on
        if not conn.half_ended():
            return
        conn.client.close()
        conn.server.close()
        f = conn.fault
        if f is not None and not f.fired.is_set():
            f.claimed = False  # the point was not reached (too few blocks): the next transfer gets it
        with self._lock:
            self._conns.discard(conn)

    # ---- receiver -> sender ------------------------------------------------------------

    def _s2c(self, conn: _Conn) -> None:
        try:
            while data := conn.server.recv(_RECV):
                if conn.answer_head is not None:
                    self._read_answer(conn, data)
                conn.client.sendall(data)  # parsed before forwarded: blocks follow only after this
        except Exception as e:  # noqa: BLE001 - whatever breaks, both sides must see the link go
            _trace(f"{self.src}->{self.dst} {conn.session} s2c error {e!r}")
            conn.cut()  # the receiver died: the sender must see it at once
        _trace(f"{self.src}->{self.dst} {conn.session} s2c end")
        self._end(conn, conn.client)

    @staticmethod
    def _read_answer(conn: _Conn, data: bytes) -> None:
        assert conn.answer_head is not None
        conn.answer_head += data
        try:
            conn.first_missing = wire.peek_answer(conn.answer_head)
        except wire.ProtocolError:
            conn.answer_head = None  # not kv_share: nothing to aim at
            return
        if conn.first_missing is not None:
            conn.answer_head = None

    # ---- sender -> receiver: where faults apply ------------------------------------------

    def _c2s(self, conn: _Conn) -> None:
        try:
            while data := conn.client.recv(_RECV):
                self._gate.wait()
                if conn.offer_len is None:
                    self._read_offer(conn, data)
                out = self._apply(conn, data)
                if out is None:
                    break  # cut
                self._send(conn, out)
        except Exception as e:  # noqa: BLE001 - whatever breaks, both sides must see the link go
            _trace(f"{self.src}->{self.dst} {conn.session} c2s error {e!r} at {conn.c2s}")
            conn.cut()
        _trace(f"{self.src}->{self.dst} {conn.session} c2s end at {conn.c2s}")
        self._end(conn, conn.server)

    def _read_offer(self, conn: _Conn, data: bytes) -> None:
        conn.offer_head += data
        try:
            frame = wire.peek_offer(conn.offer_head)
        except wire.ProtocolError:
            conn.offer_len, conn.offer_head = -1, bytearray()  # not kv_share: pass through untouched
            return
        if frame is None:
            return
        conn.offer_len, conn.offer_head = frame.length, bytearray()
        conn.session = str(frame.header.get("session"))
        conn.n_blocks = int(frame.header.get("n_blocks", 0))
        conn.block_bytes = int(frame.header.get("block_bytes", 0))
        conn.fault = self._claim(conn.session)

    def _aim(self, conn: _Conn, f: Fault) -> int | None:
        """The stream offset of the fault's byte, once the offer and the ANSWER were read."""
        if conn.offer_len is None or conn.offer_len < 0 or conn.first_missing is None or conn.block_bytes < 1:
            return None
        sent = conn.n_blocks - conn.first_missing
        k = f.block if f.block is not None else min(sent - 1, int(sent * f.at))
        if not 0 <= k < sent:
            return None  # this transfer does not send that block
        bb = conn.block_bytes
        target = conn.offer_len + k * (wire.BLOCK_HEADER_BYTES + bb) + wire.BLOCK_HEADER_BYTES + min(f.byte, bb - 1)
        f.info.update(blocks_sent=sent, block=conn.first_missing + k, sent_index=k, offset=target,
                      link=f"{self.src}->{self.dst}")
        return target

    def _apply(self, conn: _Conn, data: bytes) -> bytes | None:
        """`data` with the fault applied if its point falls in it; None once the connection is cut."""
        f = conn.fault
        if f is None or f.fired.is_set():
            return data
        if conn.target is None:
            conn.target = self._aim(conn, f)
        pos = conn.c2s
        if conn.target is None or not pos <= conn.target < pos + len(data):
            return data
        i = conn.target - pos
        if f.kind == "cut":
            self._send(conn, data[:i])
            f.info["bytes_delivered"] = pos + i
            f.fired.set()
            conn.cut(f.how)
            return None
        if f.kind == "flip":
            flipped = bytearray(data)
            flipped[i] ^= 1 << f.bit
            data = bytes(flipped)
            f.info["flipped"] = f"bit {f.bit} of stream byte {conn.target}"
        f.fired.set()
        return data

    def _send(self, conn: _Conn, data: bytes) -> None:
        f = conn.fault
        for i in range(0, len(data), _PACE):
            piece = data[i : i + _PACE]
            conn.server.sendall(piece)
            conn.c2s += len(piece)
            rate = (f.rate_bps if f is not None else None) or self.rate_bps  # read each time: it may be lifted
            if rate:
                time.sleep(len(piece) / rate)
