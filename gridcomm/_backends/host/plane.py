"""The host backend's data plane: direct, authenticated links between ranks.

The coordinator only introduces ranks, as NCCL's bootstrap does: each rank of a communicator
publishes a card (address, random communicator id, host key) through the key-value store, and
from then on bytes move between the two ranks alone.

- **Endpoint.** One listening TCP socket per process (shared by all of its communicators), bound
  to the address this host uses to reach the coordinator, with a thread that accepts and
  authenticates connections and hands each one to the communicator it names.
- **Link.** One connection per pair of ranks and communicator, made on first use: the lower rank
  dials, the higher one accepts (so two ranks never dial each other at once). Its first bytes are
  an HMAC challenge-response over the job's token in both directions (the token itself never
  crosses the wire), inside TLS when the job uses TLS. Ranks on one host (see :mod:`gridcomm._backends.host.shm`)
  then agree on two shared-memory segments, one per direction, and move payloads through them;
  the socket carries only small frame headers ("slot 3 holds 512 KiB of message 17") and credits
  ("slot 3 is free again"), so the buffers are bounded by the slots on both sides.
- **Progress.** All sockets are non-blocking. A call posts its sends and receives on its links and
  runs :meth:`Plane.wait`, which makes every link progress, and sleeps in ``poll`` on the links'
  sockets plus a wake-up pipe only when none can. The pipe is written by :meth:`Plane.abort`
  (the communicator's failure latch, from the liveness thread), so every wait ends at a reported
  failure; every wait also has the call's deadline. A peer whose connection breaks mid-call is
  named after a bounded wait for the coordinator's verdict, which names the rank that really
  failed when the broken connection was only a consequence.

Frames on a link are FIFO and carry a per-link message number and the call's kind, so a frame
that does not belong to the message this rank expects is a :class:`DataPlaneError` saying so,
never a wrong result or a hang.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from gridcomm import _config
from gridcomm._backends.host import shm as _shm
from gridcomm._errors import (
    AuthenticationError,
    CommAborted,
    ConfigError,
    DataPlaneError,
    GridcommError,
    RankFailedError,
    RendezvousTimeout,
)

log = logging.getLogger(__name__)

VERSION = 1
MAGIC = b"GCP1"
#: Bound on connecting and authenticating one link (dial or accept).
HANDSHAKE_S = 10.0
#: At most this many connections are being authenticated at once per process; more are closed.
MAX_HANDSHAKES = 64
#: Payload bytes per frame on a socket; also the size of a link's receive scratch for reductions.
SOCKET_FRAME = 256 * 1024
#: Shared-memory slots per direction of a same-host link, and their size: 2 MiB per direction.
SHM_SLOTS = 4
SHM_SLOT_BYTES = 512 * 1024
#: Largest slot geometry accepted from a peer (what this process will map).
MAX_SHM_SLOTS = 64
MAX_SHM_SLOT_BYTES = 16 * 1024 * 1024
#: Messages up to this size travel inline on the socket even between ranks of one host: one
#: send beats a copy into a slot plus a doorbell plus a credit.
INLINE_BYTES = 32 * 1024
#: Frames whose payload is at most this are copied into one buffer with their header (one iovec).
_COALESCE_BYTES = 4096
#: Size of a link's staging buffer for headers and small payloads read from the socket.
_RBUF_BYTES = 64 * 1024
#: A frame payload at least this large is read straight into its destination.
_DIRECT_BYTES = 16 * 1024
#: Bytes of frames prepared ahead of the socket per link (several small frames go out in one call).
_BATCH_BYTES = 1024 * 1024
#: TLS sockets are written in record-sized pieces (a retried SSL write must repeat the same piece).
_TLS_PIECE = 16 * 1024
_IOV_MAX = 64

# Frame header: kind, call kind, flags, pad, slot, message number, payload bytes.
_FRAME = struct.Struct("<BBBxIIQ")
_DATA, _SHM, _CREDIT, _BYE = 1, 2, 3, 4
_LAST = 1
_FRAME_KINDS = {_DATA: "data", _SHM: "shared-memory", _CREDIT: "credit", _BYE: "goodbye"}

# Handshake messages (fixed sizes, so nothing a peer sends before it is admitted can grow memory).
# HELLO, dialer -> acceptor: magic, version, reserved, target communicator id, dialer's id,
# dialer's rank, the rank it dials, dialer's host key, challenge.
_HELLO = struct.Struct("<4sHH16s16sII32s32s")
# ACCEPT, acceptor -> dialer: magic, status, acceptor's host key, challenge; then its 32-byte MAC.
_ACCEPT_HEAD = struct.Struct("<4sB3x32s32s")
_MAC_BYTES = 32
# SHM offer, both ways: offered (0/1), slots, slot bytes, segment name, cookie.
_OFFER = struct.Struct("<B3xII48s32s")
_ADMITTED, _UNKNOWN, _REFUSED = 0, 1, 2

#: Call kinds carried in frame headers (send, recv and send_recv pair with each other).
OPS = {"all_reduce": 1, "reduce": 2, "broadcast": 3, "reduce_scatter": 4, "all_gather": 5, "p2p": 6,
       "scatter": 7, "gather": 8, "all_to_all": 9}
_OP_NAMES = {v: k for k, v in OPS.items()}


class _Woken(Exception):
    """The wake-up pipe was written: the communicator failed or the endpoint is closing."""


class _Expired(Exception):
    """A deadline passed."""


class _Lost(Exception):
    """A link's connection broke (``clean``: the peer said goodbye first)."""

    def __init__(self, link: Link, why: str, clean: bool = False) -> None:
        super().__init__(why)
        self.link = link
        self.why = why
        self.clean = clean


@dataclasses.dataclass(frozen=True)
class PlaneConfig:
    """What every communicator of one job needs to build its data plane."""

    token: str | None
    tls: _config.TlsFiles | None
    #: The address this rank listens on and publishes (see :func:`local_address`).
    host: str
    #: Bound on one call (``GRIDCOMM_TIMEOUT_S``).
    timeout_s: float
    #: How long a rank whose peer's connection broke waits for the coordinator's verdict before
    #: it names that peer itself (the liveness bound, plus slack).
    verdict_s: float
    #: Whether ranks of one host may exchange through /dev/shm (GRIDCOMM_SHM).
    shm: bool = True


def local_address(route_host: str, explicit: str | None = None) -> str:
    """The address of this host on the route to ``route_host`` (the coordinator): what the peers
    can reach. Found by connecting a UDP socket (no packet is sent); if the name does not resolve
    (a headless Service's own record can lag behind its pod), this host's own name is tried, then
    loopback. ``explicit`` (``GRIDCOMM_DATA_HOST``) wins."""
    if explicit:
        return explicit
    for name in (route_host, socket.gethostname()):
        try:
            infos = socket.getaddrinfo(name, 9, type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, _, _, _, sockaddr in infos:
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as probe:
                    probe.connect(sockaddr)
                    return str(probe.getsockname()[0])
            except OSError:
                continue
    return "127.0.0.1"


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


# ---------------------------------------------------------------------------------------------- TLS
def _load_pair(context: ssl.SSLContext, cert: bytes, key: bytes | None) -> None:
    """ssl loads certificate chains from files only: the PEMs are written to a private folder for
    the call and removed at once."""
    folder = tempfile.mkdtemp(prefix="gridcomm-tls-")
    try:
        cert_path = os.path.join(folder, "cert.pem")
        key_path = os.path.join(folder, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key or b"")):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        context.load_cert_chain(cert_path, key_path if key else None)
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def tls_contexts(tls: _config.TlsFiles) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for links of a job that uses TLS. Every rank serves its links, so
    each needs a certificate: GRIDCOMM_TLS_CERT/_KEY, else its client certificate. Peers are
    dialled by address, so host names are not checked; the job's CA, and the token's HMAC
    inside the TLS session, say who the peer is."""
    cert, key = (tls.cert, tls.key) if tls.cert is not None else (tls.client_cert, tls.client_key)
    if cert is None:
        raise ConfigError("the host backend's data plane uses TLS like the coordinator, and every rank accepts "
                          "connections from its peers, so every rank needs a certificate: set GRIDCOMM_TLS_CERT and "
                          "GRIDCOMM_TLS_KEY (or GRIDCOMM_TLS_CLIENT_CERT and _KEY) on every rank.")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_pair(server, cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    if tls.ca is not None:
        client.load_verify_locations(cadata=tls.ca.decode("ascii", errors="replace"))
    else:
        client.load_default_certs()
    if tls.require_client_cert:
        if tls.ca is None:
            raise ConfigError("GRIDCOMM_TLS_REQUIRE_CLIENT_CERT needs GRIDCOMM_TLS_CA to verify peers' certificates.")
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cadata=tls.ca.decode("ascii", errors="replace"))
    client_cert, client_key = tls.client_pair()
    if client_cert is not None:
        _load_pair(client, client_cert, client_key)
    elif tls.require_client_cert:
        _load_pair(client, cert, key)
    return server, client


# ---------------------------------------------------------------------------------------------- handshake I/O
class _Io:
    """Bounded, wakeable I/O on a non-blocking (maybe TLS) socket, for the handshake."""

    def __init__(self, sock: socket.socket, deadline: float, wake_fd: int | None) -> None:
        self.sock = sock
        self.deadline = deadline
        self.wake_fd = wake_fd

    def wait(self, events: int) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _Expired()
        poller = select.poll()
        poller.register(self.sock.fileno(), events | select.POLLERR | select.POLLHUP)
        if self.wake_fd is not None:
            poller.register(self.wake_fd, select.POLLIN)
        for fd, _ in poller.poll(remaining * 1000):
            if fd == self.wake_fd:
                raise _Woken()

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view[:_TLS_PIECE]):]
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                self.wait(select.POLLOUT)
            except ssl.SSLWantReadError:
                self.wait(select.POLLIN)

    def recv(self, size: int) -> bytes:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            try:
                n = self.sock.recv_into(view[got:], size - got)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                self.wait(select.POLLIN)
                continue
            except ssl.SSLWantWriteError:
                self.wait(select.POLLOUT)
                continue
            if n == 0:
                raise ConnectionResetError(errno.ECONNRESET, "the peer closed the connection during the handshake")
            got += n
        return bytes(buf)

    def tls_handshake(self) -> None:
        assert isinstance(self.sock, ssl.SSLSocket)
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                self.wait(select.POLLIN)
            except ssl.SSLWantWriteError:
                self.wait(select.POLLOUT)


def _negotiate_shm(io: _Io, want: bool, what: str) -> tuple[_shm.Segment | None, _shm.Segment | None]:
    """Both ends of a new link run this at once. Each offers a segment for its sending direction
    when it believes the peer shares its host; shared memory is used only when both offered and
    both could map the other's (the probe). Each end unlinks its own name before returning, so
    nothing is left in /dev/shm whatever happens to either process later."""
    mine: _shm.Segment | None = None
    theirs: _shm.Segment | None = None
    try:
        if want:
            try:
                mine = _shm.Segment.create(SHM_SLOTS, SHM_SLOT_BYTES)
            except _shm.ShmUnavailable as exc:
                log.info("%s: no shared memory for this link (%s); it uses its socket", what, exc)
        if mine is not None:
            offer = _OFFER.pack(1, mine.slots, mine.slot_bytes, mine.name.encode(), mine.cookie)
        else:
            offer = _OFFER.pack(0, 0, 0, b"", b"")
        io.send(offer)
        offered, slots, slot_bytes, raw_name, cookie = _OFFER.unpack(io.recv(_OFFER.size))
        if offered not in (0, 1):
            raise DataPlaneError(f"{what}: the peer's shared-memory offer is malformed (flag {offered}).")
        if offered and mine is not None:
            if not (1 <= slots <= MAX_SHM_SLOTS and 64 <= slot_bytes <= MAX_SHM_SLOT_BYTES and slot_bytes % 64 == 0):
                raise DataPlaneError(f"{what}: the peer offered {slots} shared-memory slots of {slot_bytes} bytes, "
                                     f"outside 1..{MAX_SHM_SLOTS} slots of 64..{MAX_SHM_SLOT_BYTES} bytes.")
            name = raw_name.rstrip(b"\0").decode("ascii", errors="replace")
            try:
                theirs = _shm.Segment.open(name, cookie, slots, slot_bytes)
            except _shm.ShmUnavailable as exc:
                log.info("%s: cannot map the peer's segment (%s); the link uses its socket", what, exc)
        io.send(b"\x01" if theirs is not None else b"\x00")
        peer_mapped = io.recv(1) == b"\x01"
        if theirs is not None:
            _shm.unlink(theirs.name)
        if mine is not None:
            _shm.unlink(mine.name)
        if theirs is None or not peer_mapped:
            for segment in (mine, theirs):
                if segment is not None:
                    segment.close()
            return None, None
        return mine, theirs
    except BaseException:
        for segment in (mine, theirs):
            if segment is not None:
                _shm.unlink(segment.name)
                segment.close()
        raise


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

    def _write(self) -> bool:
        moved = False
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
                raise _Lost(self, f"sending failed ({exc.strerror or exc})") from exc
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


# ---------------------------------------------------------------------------------------------- endpoint
class _Refusals:
    """Logs refused connections as the first of each 10 s and a count of the rest (a flood of
    bad connections must not flood the log)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0.0
        self._quiet = 0

    def report(self, message: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < 10.0:
                self._quiet += 1
                return
            quiet, self._quiet, self._last = self._quiet, 0, now
        log.warning(message + (f" ({quiet} more refused since the last report)" if quiet else ""), *args)


class Endpoint:
    """The process's listening socket for one address (and TLS setting), shared by the planes
    (communicators) of the process, with its accept thread."""

    def __init__(self, host: str, tls: _config.TlsFiles | None) -> None:
        self.host = host
        self.key = (host, tls)
        self._server_ctx = tls_contexts(tls)[0] if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"the host backend cannot listen on {host}: {exc.strerror}; set GRIDCOMM_DATA_HOST to an "
                              "address of this host that its peers can reach.") from exc
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._planes: dict[bytes, Plane] = {}
        self._lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe()
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._poller.register(self._stop_r, select.POLLIN)
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._refusals = _Refusals()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"gridcomm-p2p-accept-{self.port}", daemon=True)
        self._thread.start()

    def register(self, plane: Plane) -> None:
        with self._lock:
            self._planes[plane.id] = plane

    def unregister(self, plane: Plane) -> bool:
        """Forgets ``plane``; True when no plane is left (the caller then closes the endpoint)."""
        with self._lock:
            self._planes.pop(plane.id, None)
            return not self._planes

    def close(self) -> None:
        """Stops accepting and ends the handshakes in progress (they poll the stop pipe)."""
        if self._closed:
            return
        self._closed = True
        os.write(self._stop_w, b"x")
        self._thread.join(HANDSHAKE_S + 1.0)
        self._sock.close()
        # Why the slots: the pipe may be closed only once no handshake thread polls it any more;
        # woken by the stop byte, each ends at once and gives its slot back.
        deadline = time.monotonic() + HANDSHAKE_S
        taken = 0
        while taken < MAX_HANDSHAKES and self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            taken += 1
        os.close(self._stop_w)
        if taken == MAX_HANDSHAKES:
            os.close(self._stop_r)

    def _accept_loop(self) -> None:
        while not self._closed:
            # Why a bound on each wait: none without a timeout, even one the stop pipe ends.
            ready = [fd for fd, _ in self._poller.poll(5000)]
            if self._stop_r in ready:
                return
            if not ready:
                continue
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                log.warning("data-plane endpoint %s:%d: accept failed: %s", self.host, self.port, exc)
                continue
            if not self._slots.acquire(blocking=False):
                self._refusals.report("data-plane endpoint %s:%d: refused a connection from %s: %d handshakes are "
                                      "already in progress", self.host, self.port, addr, MAX_HANDSHAKES)
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(conn, addr), name="gridcomm-p2p-admit", daemon=True).start()

    def _admit(self, conn: socket.socket, addr: Any) -> None:
        peer_addr = _config.format_target(str(addr[0]), int(addr[1]))
        sock: socket.socket = conn
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            io = _Io(conn, time.monotonic() + HANDSHAKE_S, self._stop_r)
            if self._server_ctx is not None:
                sock = self._server_ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                io.sock = sock
                io.tls_handshake()
            link = self._authenticate(io, peer_addr)
            if link is not None:
                sock = link.sock
        except (_Woken, _Expired, OSError, GridcommError, ValueError, struct.error) as exc:
            reason = "it did not finish its handshake in time" if isinstance(exc, _Expired) else str(exc)
            if not isinstance(exc, _Woken):
                self._refusals.report("data-plane endpoint %s:%d: dropped a connection from %s: %s", self.host,
                                      self.port, peer_addr, reason)
            sock.close()
        except Exception:  # noqa: BLE001 - a bug here must cost one connection, not the endpoint
            log.exception("data-plane endpoint %s:%d: admitting a connection from %s failed", self.host, self.port,
                          peer_addr)
            sock.close()
        finally:
            self._slots.release()

    def _authenticate(self, io: _Io, peer_addr: str) -> Link | None:
        hello = io.recv(_HELLO.size)
        magic, version, _, target, source, rank, dialed, peer_host, challenge = _HELLO.unpack(hello)
        if magic != MAGIC or version != VERSION:
            raise DataPlaneError(f"it is not a gridcomm data-plane client of version {VERSION} (magic {magic!r}, "
                                 f"version {version})")
        with self._lock:
            plane = self._planes.get(target)
        if plane is None or plane.closed:
            io.send(_ACCEPT_HEAD.pack(MAGIC, _UNKNOWN, b"", b"") + bytes(_MAC_BYTES))
            raise DataPlaneError(f"it named communicator {target.hex()}, which does not live in this process (a stale "
                                 "address, or a rank of another job)")
        head = _ACCEPT_HEAD.pack(MAGIC, _ADMITTED, plane.host_key, secrets.token_bytes(32))
        mac = _mac(plane.key, b"gridcomm p2p accept\0", hello, head)
        io.send(head + mac)
        proof = io.recv(_MAC_BYTES)
        if not hmac.compare_digest(proof, _mac(plane.key, b"gridcomm p2p dial\0", hello, head, mac)):
            io.send(bytes([_REFUSED]))
            raise AuthenticationError(f"it claims rank {rank} of communicator {plane.name!r} but did not prove the "
                                      "job's token")
        if not (0 <= rank < plane.world_size) or rank == plane.rank or dialed != plane.rank or rank > plane.rank:
            io.send(bytes([_REFUSED]))
            raise DataPlaneError(f"it claims rank {rank} dialling rank {dialed} of communicator {plane.name!r} (world size "
                                 f"{plane.world_size}); only lower ranks dial this rank {plane.rank}")
        io.send(bytes([_ADMITTED]))
        what = f"{plane.label}: link from rank {rank} ({peer_addr})"
        shm_out, shm_in = _negotiate_shm(io, plane.same_host(peer_host), what)
        link = Link(plane.label, rank, peer_addr, io.sock, shm_out, shm_in)
        if not plane.adopt(link):
            link.close(goodbye=False)
        return link


_endpoints: dict[tuple[str, Any], Endpoint] = {}
_endpoints_lock = threading.Lock()


def _acquire_endpoint(host: str, tls: _config.TlsFiles | None, plane: Plane) -> Endpoint:
    with _endpoints_lock:
        endpoint = _endpoints.get((host, tls))
        if endpoint is None:
            endpoint = Endpoint(host, tls)
            _endpoints[(host, tls)] = endpoint
        endpoint.register(plane)
        return endpoint


def _release_endpoint(endpoint: Endpoint, plane: Plane) -> None:
    with _endpoints_lock:
        if not endpoint.unregister(plane):
            return
        _endpoints.pop(endpoint.key, None)
    endpoint.close()


# ---------------------------------------------------------------------------------------------- plane
@dataclasses.dataclass(frozen=True)
class Card:
    """What a rank publishes for its peers: where its endpoint is, which communicator, which host."""

    host: str
    port: int
    id: bytes
    host_key: bytes

    def encode(self) -> bytes:
        return json.dumps({"v": VERSION, "host": self.host, "port": self.port, "id": self.id.hex(),
                           "host_key": self.host_key.hex()}).encode()

    @classmethod
    def decode(cls, data: bytes, what: str) -> Card:
        try:
            raw = json.loads(data.decode())
            card = cls(str(raw["host"]), int(raw["port"]), bytes.fromhex(raw["id"]), bytes.fromhex(raw["host_key"]))
            if raw["v"] != VERSION or len(card.id) != 16 or len(card.host_key) not in (0, 32) or \
                    not 0 < card.port < 65536:
                raise ValueError(f"version {raw['v']}, id of {len(card.id)} bytes, port {card.port}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise DataPlaneError(f"{what}: its published data-plane address is not valid ({exc}); do all ranks run "
                                 f"the same gridcomm version (data-plane version {VERSION})?") from exc
        return card


class Plane:
    """The links of one communicator's rank and the progress engine that moves its messages."""

    def __init__(self, config: PlaneConfig, name: str, rank: int, world_size: int,
                 lookup: Callable[[int], bytes]) -> None:
        self.config = config
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.label = f"rank {rank} of communicator {name!r}"
        self.id = secrets.token_bytes(16)
        self.key = config.token.encode() if config.token else b""
        self.host_key = _shm.host_key() if config.shm and _shm.usable() else b""
        self._lookup = lookup
        self._cards: dict[int, Card] = {}
        self._links: dict[int, Link] = {}
        self._adopted: dict[int, Link] = {}
        self._lock = threading.Lock()
        self._client_ctx = tls_contexts(config.tls)[1] if config.tls is not None else None
        self._wake_r, self._wake_w = os.pipe()
        self._note_r, self._note_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, self._note_r, self._note_w):
            os.set_blocking(fd, False)
        self._failure: BaseException | None = None
        self._broken: BaseException | None = None
        self.closed = False
        self._deadline = 0.0
        #: Called with the error when this plane breaks on its own (bad bytes, a deadline): the
        #: communicator then reports this rank failed, so its peers are told instead of waiting.
        self.on_broken: Callable[[BaseException], None] | None = None
        try:
            self._endpoint = _acquire_endpoint(config.host, config.tls, self)
        except BaseException:
            for fd in (self._wake_r, self._wake_w, self._note_r, self._note_w):
                os.close(fd)
            raise
        self.card = Card(config.host, self._endpoint.port, self.id, self.host_key)

    def same_host(self, peer_host_key: bytes) -> bool:
        """Whether a peer with ``peer_host_key`` may share this host (the segment probe decides)."""
        return bool(self.host_key) and hmac.compare_digest(self.host_key, peer_host_key)

    def transports(self) -> dict[int, str]:
        """Each connected peer and how its link moves payloads: shm or tcp, +tls on TLS sockets."""
        return {peer: link.transport for peer, link in sorted(self._links.items())}

    # ------------------------------------------------------------------ failure
    def abort(self, error: BaseException) -> None:
        """The communicator failed (called from any thread): the wait in progress, and every later
        call, raises ``error``."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            if self.closed:
                return  # its pipe is closed (and the descriptor may belong to another file now)
            try:
                os.write(self._wake_w, b"!")
            except OSError:
                pass  # full: already woken

    def check(self) -> None:
        """Raises the failure or the breakage that ended this plane, if any; starts a call's deadline."""
        if self._failure is not None:
            raise self._failure
        if self._broken is not None:
            raise self._broken
        self._deadline = time.monotonic() + self.config.timeout_s

    def _break(self, error: BaseException, report: bool) -> BaseException:
        """This plane can no longer be trusted (messages half sent or received): every link is
        closed, so peers waiting on this rank are released, and later calls raise ``error``."""
        if self._broken is None:
            self._broken = error
        for link in self._links.values():
            link.close(goodbye=False)
        if report and self.on_broken is not None:
            try:
                self.on_broken(error)
            except Exception:  # noqa: BLE001 - the original error is what the caller must see
                log.exception("%s: reporting the broken data plane failed", self.label)
        return error

    # ------------------------------------------------------------------ links
    def adopt(self, link: Link) -> bool:
        """Takes a link the endpoint accepted (from its thread); False when it is not wanted."""
        with self._lock:
            if self.closed or self._broken is not None or link.peer in self._adopted or link.peer in self._links:
                log.warning("%s: dropped a second connection from rank %d (%s)", self.label, link.peer, link.addr)
                return False
            self._adopted[link.peer] = link
            try:
                os.write(self._note_w, b".")
            except OSError:
                pass  # full: already noted
        return True

    def link(self, peer: int) -> Link:
        """The link to ``peer``, made now if needed: dialled when this rank is the lower, else
        waited for (the lower rank dials it in the same call)."""
        link = self._links.get(peer)
        if link is not None:
            return link
        try:
            link = self._dial(peer) if self.rank < peer else self._await(peer)
        except _Woken:
            assert self._failure is not None
            raise self._break(self._failure, report=False) from None
        except DataPlaneError as exc:  # e.g. a card in the store that does not parse
            raise self._break(exc, report=True) from None
        log.debug("%s: link to rank %d (%s) over %s", self.label, peer, link.addr, link.transport)
        self._links[peer] = link
        return link

    def _card(self, peer: int) -> Card:
        card = self._cards.get(peer)
        if card is None:
            card = Card.decode(self._lookup(peer), f"{self.label}: rank {peer}")
            self._cards[peer] = card
        return card

    def _await(self, peer: int) -> Link:
        while True:
            with self._lock:
                link = self._adopted.pop(peer, None)
            if link is not None:
                return link
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise self._break(RendezvousTimeout(
                    f"{self.label}: rank {peer} did not connect to this rank's data-plane port "
                    f"{_config.format_target(self.card.host, self.card.port)} within {self.config.timeout_s:g} s; is "
                    f"rank {peer} inside the same call, and can it reach that address (GRIDCOMM_DATA_HOST)?",
                    [peer]), report=True)
            poller = select.poll()
            poller.register(self._note_r, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            for fd, _ in poller.poll(remaining * 1000):
                if fd == self._wake_r:
                    raise _Woken()
                try:
                    os.read(self._note_r, 4096)
                except BlockingIOError:
                    pass

    def _dial(self, peer: int) -> Link:
        card = self._card(peer)
        addr = _config.format_target(card.host, card.port)
        what = f"{self.label}: link to rank {peer} ({addr})"
        deadline = min(self._deadline, time.monotonic() + HANDSHAKE_S + self.config.verdict_s)
        refused_since: float | None = None
        backoff = 0.01
        while True:
            try:
                sock = self._connect(card, deadline)
                break
            except _Expired:
                raise self._break(RendezvousTimeout(f"{what}: no connection within {HANDSHAKE_S:g} s; is rank "
                                                    f"{peer} running, and is {addr} reachable from here?", [peer]),
                                  report=True) from None
            except OSError as exc:
                # Refused or unreachable: the peer may be gone (the coordinator will say so, which
                # wakes this wait) or its network not ready yet; retried with backoff, bounded.
                now = time.monotonic()
                refused_since = refused_since or now
                if now - refused_since > self.config.verdict_s:
                    raise self._break(RankFailedError(
                        f"rank {peer} failed: {what} refused for {now - refused_since:.1f} s ({exc.strerror or exc}), "
                        f"and the coordinator reported no failure (seen by rank {self.rank})", rank=peer,
                        reason=f"its data-plane port refused connections: {exc.strerror or exc}"), report=False) from exc
                self._pause(min(backoff, max(0.0, deadline - now)))
                backoff = min(0.5, backoff * 2)
        io = _Io(sock, deadline, self._wake_r)
        try:
            if self._client_ctx is not None:
                io.sock = self._client_ctx.wrap_socket(sock, do_handshake_on_connect=False)
                io.tls_handshake()
            link = self._handshake(io, peer, card, addr, what)
        except _Expired:
            io.sock.close()
            raise self._break(RendezvousTimeout(f"{what}: the handshake did not finish within {HANDSHAKE_S:g} s",
                                                [peer]), report=True) from None
        except (OSError, struct.error) as exc:
            io.sock.close()
            if isinstance(exc, ssl.SSLError):
                raise self._break(AuthenticationError(
                    f"{what}: TLS failed ({exc}); do all ranks use certificates of the job's CA (GRIDCOMM_TLS_CA)?"),
                    report=True) from exc
            raise self._lost(peer, addr, f"the handshake failed ({exc})") from exc
        except DataPlaneError as exc:
            io.sock.close()
            raise self._break(exc, report=True) from None
        except BaseException:
            io.sock.close()
            raise
        return link

    def _connect(self, card: Card, deadline: float) -> socket.socket:
        family = socket.AF_INET6 if ":" in card.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex((card.host, card.port))
            if code not in (0, errno.EINPROGRESS):
                raise OSError(code, os.strerror(code))
            _Io(sock, deadline, self._wake_r).wait(select.POLLOUT)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
            return sock
        except BaseException:
            sock.close()
            raise

    def _pause(self, seconds: float) -> None:
        """Sleeps ``seconds``, ended early (raising) by a failure."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if poller.poll(seconds * 1000):
            raise _Woken()

    def _handshake(self, io: _Io, peer: int, card: Card, addr: str, what: str) -> Link:
        hello = _HELLO.pack(MAGIC, VERSION, 0, card.id, self.id, self.rank, peer, self.host_key,
                            secrets.token_bytes(32))
        io.send(hello)
        head = io.recv(_ACCEPT_HEAD.size)
        mac = io.recv(_MAC_BYTES)
        magic, status, peer_host, _ = _ACCEPT_HEAD.unpack(head)
        if magic != MAGIC:
            raise self._break(DataPlaneError(f"{what}: the peer is not a gridcomm data-plane endpoint (it answered "
                                             f"{head[:8]!r})."), report=True)
        if status == _UNKNOWN:
            raise self._break(DataPlaneError(f"{what}: the process there does not know communicator {self.name!r} "
                                             "(it stopped it, or the address is stale)."), report=True)
        if status != _ADMITTED or not hmac.compare_digest(mac, _mac(self.key, b"gridcomm p2p accept\0", hello, head)):
            raise self._break(AuthenticationError(
                f"{what}: the peer did not prove the job's token; do all ranks use the same GRIDCOMM_TOKEN?"),
                report=True)
        io.send(_mac(self.key, b"gridcomm p2p dial\0", hello, head, mac))
        if io.recv(1) != bytes([_ADMITTED]):
            raise self._break(AuthenticationError(f"{what}: the peer refused this rank's proof of the job's token."),
                              report=True)
        shm_out, shm_in = _negotiate_shm(io, self.same_host(peer_host), what)
        return Link(self.label, peer, addr, io.sock, shm_out, shm_in)

    # ------------------------------------------------------------------ messages
    def send(self, peer: int, view: memoryview, op: int, ready: int | None = None) -> Outgoing:
        """Queues ``view`` (bytes) for ``peer``; :meth:`wait` moves it."""
        return self.link(peer).post_send(view, op, ready)

    def recv(self, peer: int, total: int, op: int, *, dest: memoryview | None = None,
             reduce: Callable[[int, memoryview], None] | None = None, after: Callable[[int], None] | None = None,
             itemsize: int = 1) -> Incoming:
        """Queues the receipt of ``total`` bytes from ``peer``, written to ``dest`` or passed to
        ``reduce(offset, view)`` frame by frame (whole elements of ``itemsize`` bytes)."""
        return self.link(peer).post_recv(total, op, dest, reduce, after, itemsize)

    def wait(self) -> None:
        """Moves every queued message until all are done, the call's deadline passes, or the
        communicator fails."""
        links = [link for link in self._links.values() if link.busy()]
        try:
            while links:
                moved = False
                for link in links:
                    moved = link.pump() or moved
                links = [link for link in links if link.busy()]
                if not links or moved:
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    waiting = ", ".join(f"rank {link.peer} ({link.pending()})" for link in links)
                    raise self._break(RendezvousTimeout(
                        f"{self.label}: a call did not complete within {self.config.timeout_s:g} s, still {waiting}; "
                        "did every rank make the same call?", [link.peer for link in links]), report=True)
                poller = select.poll()
                poller.register(self._wake_r, select.POLLIN)
                for link in links:
                    events = link.events()
                    if events:
                        poller.register(link.fd, events)
                for fd, _ in poller.poll(remaining * 1000):
                    if fd == self._wake_r:
                        raise _Woken()
        except _Woken:
            assert self._failure is not None
            raise self._break(self._failure, report=False) from None
        except _Lost as lost:
            raise self._lost(lost.link.peer, lost.link.addr, lost.why, clean=lost.clean) from None
        except DataPlaneError as exc:
            raise self._break(exc, report=True) from None

    def _lost(self, peer: int, addr: str, why: str, clean: bool = False) -> BaseException:
        """A connection to ``peer`` broke mid-call. The coordinator's verdict (which names the rank
        that really failed: ``peer`` may only have aborted because another rank died) is awaited
        up to the liveness bound; without one, ``peer`` is named."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if not clean and poller.poll(self.config.verdict_s * 1000):
            assert self._failure is not None
            return self._break(self._failure, report=False)
        if clean:
            return self._break(CommAborted(f"{self.label}: rank {peer} ({addr}) {why}; did every rank make the same "
                                           "calls before stop()?"), report=True)
        return self._break(RankFailedError(
            f"rank {peer} failed: its data-plane connection ({addr}) {why} during a call, and the coordinator reported "
            f"no failure within {self.config.verdict_s:g} s (seen by rank {self.rank})", rank=peer,
            reason=f"its data-plane connection {why}"), report=False)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Says goodbye on every link, closes them and the pipes, and leaves the endpoint.
        Idempotent; never waits on a peer."""
        if self.closed:
            return
        with self._lock:
            self.closed = True
            adopted, self._adopted = list(self._adopted.values()), {}
        for link in [*self._links.values(), *adopted]:
            link.close(goodbye=self._broken is None and self._failure is None)
        self._links.clear()
        _release_endpoint(self._endpoint, self)
        for fd in (self._wake_r, self._wake_w, self._note_r, self._note_w):
            try:
                os.close(fd)
            except OSError:
                pass
