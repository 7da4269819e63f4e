"""Admission of a host data-plane link: the fixed-size handshake messages, their MAC over the job's
token, the byte I/O a handshake runs on, and the shared-memory offer both sides make."""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import select
import socket
import ssl
import struct
import time

from gridcomm._backends.host import shm as _shm
from gridcomm._backends.host.frames import (
    _TLS_PIECE,
    MAX_SHM_SLOT_BYTES,
    MAX_SHM_SLOTS,
    SHM_SLOT_BYTES,
    SHM_SLOTS,
    _Expired,
    _Woken,
)
from gridcomm._errors import (
    DataPlaneError,
)

log = logging.getLogger(__name__)


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


#: How long a connection has, counted from its accept, to deliver a whole HELLO (after its TLS
#: handshake, with TLS). A dialer sends its HELLO as soon as it is connected, so a healthy one
#: needs a round trip or two; what has sent no HELLO by then (an idle or trickling socket) is
#: dropped, so it holds one of the endpoint's pending-handshake places for 1 s at most, not for the
#: whole handshake bound. Why 1 s: a hundred times a loaded loopback TLS handshake, and a dialer
#: dropped by a stall longer than that connects again (see :data:`RETRIED_BEFORE_ADMISSION`).
HELLO_S = 1.0


#: What a dialer reads as "dropped before admission, connect again" rather than as its peer's death:
#: the acceptor closes (or resets) a connection that has not proved the job's token when it runs
#: out of time (:data:`HELLO_S`) or of places (the oldest unauthenticated connection is evicted for
#: a newcomer), and an unauthenticated socket can cause either. A dead peer's port refuses the next
#: connection, which the dialer judges on its own.
RETRIED_BEFORE_ADMISSION: tuple[type[BaseException], ...] = (
    ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError, ssl.SSLZeroReturnError)


def closed_before_admission(exc: BaseException) -> bool:
    """Whether ``exc`` (raised before this dialer's link was admitted) is the connection being
    closed or reset under it, never a certificate or protocol failure (those are
    :class:`ssl.SSLError` with a reason, and stay errors at once)."""
    if isinstance(exc, RETRIED_BEFORE_ADMISSION):
        return True
    # Why errno too: OpenSSL reports a reset inside a TLS read as SSLSyscallError / OSError(ECONNRESET).
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED) and \
        not isinstance(exc, ssl.SSLCertVerificationError)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


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

