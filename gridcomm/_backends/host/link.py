"""One authenticated link between two ranks: framed messages on a socket (and shared-memory slots
between ranks of one host), with its send and receive state."""

from __future__ import annotations

import collections
import select
import socket
import ssl
from collections.abc import Callable

from gridcomm._backends.host import shm as _shm
from gridcomm._backends.host.frames import (
    _BATCH_BYTES,
    _BYE,
    _COALESCE_BYTES,
    _CREDIT,
    _DATA,
    _DIRECT_BYTES,
    _FRAME,
    _IOV_MAX,
    _LAST,
    _OP_NAMES,
    _RBUF_BYTES,
    _SHM,
    _TLS_PIECE,
    INLINE_BYTES,
    SOCKET_FRAME,
    _Lost,
)
from gridcomm._errors import (
    DataPlaneError,
)


# ---------------------------------------------------------------------------------------------- links
class Outgoing:
    """One message being sent: ``view`` (bytes), of which ``ready`` may be sent (a forwarded
    message grows as it arrives) and ``sent`` are framed."""

    __slots__ = ("view", "op", "seq", "sent", "ready", "total")

    def __init__(self, view: memoryview, op: int, seq: int, ready: int | None) -> None:
        self.view = view
        self.op = op
        self.seq = seq
        self.total = len(view)
        self.ready = self.total if ready is None else ready
        self.sent = 0

    def advance(self, ready: int) -> None:
        self.ready = ready


class Incoming:
    """One message being received, into ``dest`` or through ``reduce(offset, view)``; ``after(got)``
    is called after each frame (forwarding)."""

    __slots__ = ("op", "seq", "total", "got", "dest", "reduce", "after", "itemsize")

    def __init__(self, op: int, seq: int, total: int, dest: memoryview | None,
                 reduce: Callable[[int, memoryview], None] | None, after: Callable[[int], None] | None,
                 itemsize: int) -> None:
        self.op = op
        self.seq = seq
        self.total = total
        self.got = 0
        self.dest = dest
        self.reduce = reduce
        self.after = after
        self.itemsize = itemsize


class Link:
    """A connection to one peer of one communicator, and the messages queued on it."""

    def __init__(self, owner: str, peer: int, addr: str, sock: socket.socket, shm_out: _shm.Segment | None,
                 shm_in: _shm.Segment | None) -> None:
        self.owner = owner
        self.peer = peer
        self.addr = addr
        self.sock = sock
        sock.setblocking(False)
        self.fd = sock.fileno()
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.shm_out = shm_out
        self.shm_in = shm_in
        #: How payloads move: "shm" or "tcp", "+tls" when the socket (frames, or doorbells and
        #: credits next to shared memory) is TLS.
        self.transport = ("shm" if shm_out is not None else "tcp") + ("+tls" if self.tls else "")
        self._free = list(range(shm_out.slots)) if shm_out is not None else []
        self._used: set[int] = set()
        self._out: collections.deque[Outgoing] = collections.deque()
        self._in: collections.deque[Incoming] = collections.deque()
        self._wq: collections.deque[memoryview] = collections.deque()
        self._wq_bytes = 0
        self._rbuf = bytearray(_RBUF_BYTES)
        self._rview = memoryview(self._rbuf)
        self._rlo = 0
        self._rhi = 0
        # The data frame whose payload is being read: message, frame size, bytes still to read,
        # bytes read, where they go.
        self._cur: Incoming | None = None
        self._cur_n = 0
        self._cur_left = 0
        self._cur_done = 0
        self._cur_target: memoryview | None = None
        self._cur_flags = 0
        self._scratch: memoryview | None = None
        self._want_write = False
        self._want_credit = False
        self._held = False
        #: The peer said goodbye: nothing more will come from it.
        self._gone = False
        #: Why sending to the peer failed, when only credits were owed (see _write).
        self._unwritable: str | None = None
        self._out_seq = 0
        self._in_seq = 0
        self.closed = False

    # ------------------------------------------------------------------ posting
    def post_send(self, view: memoryview, op: int, ready: int | None = None) -> Outgoing:
        self._out_seq = (self._out_seq + 1) & 0xFFFFFFFF
        msg = Outgoing(view, op, self._out_seq, ready)
        self._out.append(msg)
        return msg

    def post_recv(self, total: int, op: int, dest: memoryview | None, reduce: Callable[[int, memoryview], None] | None,
                  after: Callable[[int], None] | None, itemsize: int) -> Incoming:
        self._in_seq = (self._in_seq + 1) & 0xFFFFFFFF
        msg = Incoming(op, self._in_seq, total, dest, reduce, after, itemsize)
        self._in.append(msg)
        self._held = self._gone
        return msg

    def busy(self) -> bool:
        return bool(self._out or self._in or self._wq)

    def events(self) -> int:
        """What this link waits for when it can make no progress by itself."""
        events = 0
        if (self._in or self._want_credit) and not self._held:
            events |= select.POLLIN
        if self._want_write:
            events |= select.POLLOUT
        return events

    def pending(self) -> str:
        """What is still queued (for timeout messages)."""
        parts = []
        if self._out:
            parts.append(f"sending {sum(m.total - m.sent for m in self._out)} bytes")
        if self._in:
            parts.append(f"receiving {sum(m.total - m.got for m in self._in)} bytes")
        return " and ".join(parts) or "flushing"

    # ------------------------------------------------------------------ progress
    def _check_gone(self) -> None:
        """After the peer's goodbye: an error if this rank still has a message for it or from it;
        else what is left to write (credits) is dropped, since nobody will read it."""
        if not self._gone:
            return
        if self._out or self._in or self._cur is not None:
            raise _Lost(self, "stopped its communicator (a clean stop) while this rank still exchanged with it",
                        clean=True)
        self._wq.clear()
        self._wq_bytes = 0

    def pump(self) -> bool:
        """Moves whatever can move without blocking; True if anything did."""
        self._check_gone()
        moved = self._write()
        moved = self._read() or moved
        if self._wq or self._out:
            moved = self._write() or moved
        return moved

    def _frame(self) -> bool:
        """Prepares the next frame of the first queued message; False if none can be made now."""
        if not self._out:
            return False
        msg = self._out[0]
        left = msg.ready - msg.sent
        if left <= 0 and msg.total > 0:
            return False
        use_shm = self.shm_out is not None and msg.total > INLINE_BYTES
        if use_shm:
            assert self.shm_out is not None
            if not self._free:
                self._want_credit = True
                return False
            size = min(left, self.shm_out.slot_bytes)
            slot = self._free.pop()
            self._used.add(slot)
            self.shm_out.slot(slot)[:size] = msg.view[msg.sent : msg.sent + size]
            flags = _LAST if msg.sent + size == msg.total else 0
            self._queue(memoryview(_FRAME.pack(_SHM, msg.op, flags, slot, msg.seq, size)))
        else:
            size = min(left, SOCKET_FRAME)
            flags = _LAST if msg.sent + size == msg.total else 0
            header = _FRAME.pack(_DATA, msg.op, flags, 0, msg.seq, size)
            if size <= _COALESCE_BYTES:
                self._queue(memoryview(header + bytes(msg.view[msg.sent : msg.sent + size])))
            else:
                self._queue(memoryview(header))
                self._queue(msg.view[msg.sent : msg.sent + size])
        msg.sent += size
        if msg.sent == msg.total:
            self._out.popleft()
        return True

    def _queue(self, buf: memoryview) -> None:
        self._wq.append(buf)
        self._wq_bytes += len(buf)

    def _only_credits_queued(self) -> bool:
        return not self._out and all(len(buf) == _FRAME.size and buf[0] == _CREDIT for buf in self._wq)

    def _write(self) -> bool:
        moved = False
        if self._unwritable is not None:
            if self._out:
                raise _Lost(self, self._unwritable)
            self._wq.clear()
            self._wq_bytes = 0
            return False
        while True:
            while self._wq_bytes < _BATCH_BYTES and self._frame():
                moved = True
            if not self._wq:
                return moved
            try:
                if self.tls:
                    sent = self.sock.send(self._wq[0][:_TLS_PIECE])
                else:
                    sent = self.sock.sendmsg(list(self._wq)[:_IOV_MAX]) if len(self._wq) > 1 else \
                        self.sock.send(self._wq[0])
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                self._want_write = True
                return moved
            except OSError as exc:
                if not self._only_credits_queued():
                    raise _Lost(self, f"sending failed ({exc.strerror or exc})") from exc
                # Why not an error yet: a peer that got all it needed from this rank stops (goodbye,
                # then close) while this rank still owes it credits for slots it has read. Whether
                # this rank is harmed is decided by what it still reads: the peer's last frames and
                # its goodbye, sent before the close, or a broken connection.
                self._unwritable = f"sending failed ({exc.strerror or exc})"
                self._want_write = False
                self._wq.clear()
                self._wq_bytes = 0
                return moved
            self._want_write = False
            moved = True
            self._wq_bytes -= sent
            while sent:
                head = self._wq[0]
                if sent >= len(head):
                    sent -= len(head)
                    self._wq.popleft()
                else:
                    self._wq[0] = head[sent:]
                    sent = 0

    def _read(self) -> bool:
        moved = False
        while True:
            moved = self._parse() or moved
            if self._held or not (self._in or self._want_credit or self._cur is not None):
                return moved
            direct = self._cur is not None and self._cur_left >= _DIRECT_BYTES and self._rlo == self._rhi
            if direct:
                assert self._cur_target is not None
                target = self._cur_target[self._cur_done :]
            else:
                if self._rlo == self._rhi:
                    self._rlo = self._rhi = 0
                elif self._rhi == len(self._rbuf):
                    # Why: a header split at the end of the buffer; move the rest to the front.
                    rest = self._rhi - self._rlo
                    self._rbuf[:rest] = self._rbuf[self._rlo : self._rhi]
                    self._rlo, self._rhi = 0, rest
                target = self._rview[self._rhi :]
            try:
                got = self.sock.recv_into(target, len(target))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return moved
            except ssl.SSLWantWriteError:
                self._want_write = True
                return moved
            except OSError as exc:
                raise _Lost(self, f"receiving failed ({exc.strerror or exc})") from exc
            if got == 0:
                raise _Lost(self, "closed the connection")
            moved = True
            if direct:
                self._payload_read(got)
            else:
                self._rhi += got

    def _payload_read(self, got: int) -> None:
        self._cur_done += got
        self._cur_left -= got
        if self._cur_left == 0:
            self._data_frame_done()

    def _parse(self) -> bool:
        """Consumes the frames (and payload bytes) in the staging buffer."""
        moved = False
        while True:
            avail = self._rhi - self._rlo
            if self._cur is not None:
                if not avail:
                    return moved
                take = min(avail, self._cur_left)
                assert self._cur_target is not None
                self._cur_target[self._cur_done : self._cur_done + take] = self._rview[self._rlo : self._rlo + take]
                self._rlo += take
                moved = True
                self._payload_read(take)
                continue
            if avail < _FRAME.size:
                return moved
            kind, op, flags, slot, seq, size = _FRAME.unpack_from(self._rbuf, self._rlo)
            if kind == _CREDIT:
                if slot not in self._used:
                    raise self._bad(f"a credit for shared-memory slot {slot}, which it does not hold")
                self._used.discard(slot)
                self._free.append(slot)
                self._want_credit = False
                self._rlo += _FRAME.size
                moved = True
                continue
            if kind == _BYE:
                # Why not an error at once: a peer that got all it needed from this rank may stop
                # while this rank still reads the peer's last frames (they came first).
                self._rlo += _FRAME.size
                self._gone = True
                self._check_gone()
                self._held = True
                return True
            if kind not in (_DATA, _SHM):
                raise self._bad(f"a frame of unknown kind {kind}")
            if not self._in:
                # Why: a message for a later call (the peer is ahead); it stays unread until that
                # call posts its receive. Credits this rank needs never queue behind it, since the
                # peer sent them before it could finish this call.
                self._held = True
                return moved
            msg = self._in[0]
            self._check(msg, kind, op, flags, slot, seq, size)
            self._rlo += _FRAME.size
            moved = True
            if kind == _SHM:
                assert self.shm_in is not None
                self._deliver(msg, self.shm_in.slot(slot)[:size])
                self._queue(memoryview(_FRAME.pack(_CREDIT, 0, 0, slot, 0, 0)))
                self._message_progress(msg, size, flags)
                continue
            self._cur = msg
            self._cur_n = size
            self._cur_left = size
            self._cur_done = 0
            if msg.reduce is not None:
                if self._scratch is None:
                    self._scratch = memoryview(bytearray(SOCKET_FRAME))
                self._cur_target = self._scratch[:size]
            else:
                assert msg.dest is not None
                self._cur_target = msg.dest[msg.got : msg.got + size]
            self._cur_flags = flags
            if size == 0:
                self._data_frame_done()

    def _check(self, msg: Incoming, kind: int, op: int, flags: int, slot: int, seq: int, size: int) -> None:
        if seq != msg.seq or op != msg.op:
            raise self._bad(f"message #{seq} of a {_OP_NAMES.get(op, f'kind-{op}')} call while it expected message "
                            f"#{msg.seq} of a {_OP_NAMES.get(msg.op, '?')} call: the two ranks called collectives or "
                            "send/recv in different orders")
        left = msg.total - msg.got
        last = bool(flags & _LAST)
        if size > left or (last and size != left) or (not last and size == left):
            sent = "more" if size > left or not last else "fewer"
            raise self._bad(f"{sent} bytes than the {msg.total} this rank's {_OP_NAMES.get(msg.op, '?')} expects "
                            f"(a frame of {size} bytes at offset {msg.got}{', the last' if last else ''}): the arrays "
                            "passed on the two ranks differ in size")
        if kind == _DATA and size > SOCKET_FRAME:
            raise self._bad(f"a data frame of {size} bytes, over the protocol's {SOCKET_FRAME}")
        if msg.reduce is not None and size % msg.itemsize:
            raise self._bad(f"a frame of {size} bytes, not a whole number of {msg.itemsize}-byte elements")
        if kind == _SHM and (self.shm_in is None or slot >= self.shm_in.slots or size > self.shm_in.slot_bytes):
            raise self._bad(f"a shared-memory frame for slot {slot} of {size} bytes, which this link does not have")

    def _deliver(self, msg: Incoming, view: memoryview) -> None:
        if msg.reduce is not None:
            msg.reduce(msg.got, view)
        else:
            assert msg.dest is not None
            msg.dest[msg.got : msg.got + len(view)] = view

    def _data_frame_done(self) -> None:
        msg = self._cur
        assert msg is not None and self._cur_target is not None
        if msg.reduce is not None:
            msg.reduce(msg.got, self._cur_target)
        self._cur = None
        self._cur_target = None
        self._message_progress(msg, self._cur_n, self._cur_flags)

    def _message_progress(self, msg: Incoming, size: int, flags: int) -> None:
        msg.got += size
        if msg.after is not None:
            msg.after(msg.got)
        if flags & _LAST:
            self._in.popleft()

    def _bad(self, what: str) -> DataPlaneError:
        return DataPlaneError(f"{self.owner} received from rank {self.peer} ({self.addr}) {what}.")

    def close(self, goodbye: bool) -> None:
        """Closes the connection (after a best-effort goodbye frame) and unmaps its segments."""
        if self.closed:
            return
        self.closed = True
        if goodbye and not self._wq:
            try:
                self.sock.send(_FRAME.pack(_BYE, 0, 0, 0, 0, 0))
            except (OSError, ssl.SSLError):
                pass
        try:
            self.sock.close()
        except OSError:
            pass
        for segment in (self.shm_out, self.shm_in):
            if segment is not None:
                segment.close()
        self._wq.clear()
        self._out.clear()
        self._in.clear()
        self._cur_target = None
        self._scratch = None

