"""A process's one listening socket for host data-plane links: it accepts, authenticates and hands
each new link to the communicator it names, refusing what cannot be admitted."""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from gridcomm import _config
from gridcomm._backends.host.frames import HANDSHAKE_S, MAGIC, MAX_HANDSHAKES, VERSION, _Expired, _Woken
from gridcomm._backends.host.handshake import (
    _ACCEPT_HEAD,
    _ADMITTED,
    _HELLO,
    _MAC_BYTES,
    _REFUSED,
    _UNKNOWN,
    HELLO_S,
    _Io,
    _mac,
    _negotiate_shm,
)
from gridcomm._backends.host.link import Link
from gridcomm._backends.host.tls import tls_contexts
from gridcomm._errors import (
    AuthenticationError,
    ConfigError,
    DataPlaneError,
    GridcommError,
)

if TYPE_CHECKING:
    from gridcomm._backends.host.plane import Plane

log = logging.getLogger(__name__)


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


class _Pending:
    """A connection accepted and not yet admitted (it has not proved the job's token). Until its
    HELLO is verified (``hello``) it is the accept thread's alone; then a thread of its own runs
    the rest of the handshake."""

    __slots__ = ("seq", "sock", "addr", "accepted", "buf", "got", "tls_done", "hello", "evicted")

    def __init__(self, seq: int, sock: socket.socket, addr: str) -> None:
        self.seq = seq
        self.sock = sock
        self.addr = addr
        self.accepted = time.monotonic()
        self.buf = bytearray(_HELLO.size)
        self.got = 0
        self.tls_done = False
        #: Its HELLO named a communicator of this process, with the right magic and version.
        self.hello = False
        #: Dropped for a newcomer (the thread that runs it then says nothing more).
        self.evicted = False


def _shutdown_fd(fd: int) -> None:
    """Shuts a socket down by its descriptor, without closing it: the thread polling it wakes (its
    reads end), and closes it itself, so the descriptor is never closed under another thread."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


class Endpoint:
    """The process's listening socket for one address (and TLS setting), shared by the planes
    (communicators) of the process, with its accept thread.

    Admission is bounded against sockets that never authenticate: at most
    :data:`~gridcomm._backends.host.frames.MAX_HANDSHAKES` connections are pending (accepted, not
    yet admitted) at once; each must deliver its HELLO within :data:`HELLO_S` of its accept and
    finish within :data:`~gridcomm._backends.host.frames.HANDSHAKE_S`; and a newcomer is never
    refused for want of a place: the oldest pending connection whose HELLO is not verified yet is
    evicted for it (the oldest of all when every one has a verified HELLO), as OpenSSH's
    MaxStartups drops unauthenticated connections rather than stopping accepting. A dialer's HELLO
    comes a round trip after its connect, so idle and trickling sockets are always the ones
    evicted first, and a dialer dropped anyway connects again (see ``Plane._dial``).

    Until its HELLO, a connection costs no thread: the accept thread polls the listening socket
    and every such connection (non-blocking, the TLS handshake included) and reads HELLOs itself.
    A verified HELLO gets a thread for the rest (the token's MACs, then shared memory)."""

    #: Connections taken from the listening socket per turn of the accept loop, fewer than
    #: MAX_HANDSHAKES, so a connection accepted in one turn is read in the next before a flood of
    #: newer ones can evict it.
    ACCEPT_BATCH = 16

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
        #: Pending connections in the order they were accepted (oldest first), under _pending_lock.
        self._pending: dict[int, _Pending] = {}
        #: The accept thread's connections before their HELLO, by descriptor.
        self._early: dict[int, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._seq = 0
        #: Handshake threads still running (close() waits for them before closing the stop pipe).
        self._threads = 0
        self._threads_done = threading.Condition(self._pending_lock)
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
        # Why wait for the threads: the pipe may be closed only once no handshake thread polls it
        # any more; woken by the stop byte, each ends at once.
        deadline = time.monotonic() + HANDSHAKE_S
        with self._threads_done:
            while self._threads and self._threads_done.wait(max(0.0, deadline - time.monotonic())):
                pass
            idle = self._threads == 0
        os.close(self._stop_w)
        if idle and not self._thread.is_alive():
            os.close(self._stop_r)

    def pending(self) -> tuple[int, int]:
        """(connections pending admission, of which with a verified HELLO): for tests and logs."""
        with self._pending_lock:
            return len(self._pending), sum(entry.hello for entry in self._pending.values())

    # ------------------------------------------------------------------ the accept thread
    def _accept_loop(self) -> None:
        try:
            while not self._closed:
                # Why a bound on each wait: none without a timeout, even one the stop pipe ends;
                # the earliest HELLO deadline ends it sooner.
                timeout = 5.0
                with self._pending_lock:
                    for pending in self._pending.values():
                        if not pending.hello:
                            timeout = min(timeout, max(0.0, pending.accepted + HELLO_S - time.monotonic()))
                            break
                ready = self._poller.poll(timeout * 1000 + 1)
                for fd, _ in ready:
                    if fd == self._stop_r:
                        return
                    if fd == self._sock.fileno():
                        self._accept_some()
                    else:
                        early = self._early.get(fd)
                        if early is not None:
                            self._progress(early)
                self._expire()
        finally:
            for early in list(self._early.values()):
                self._drop(early, None)

    def _accept_some(self) -> None:
        for _ in range(self.ACCEPT_BATCH):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("data-plane endpoint %s:%d: accept failed: %s", self.host, self.port, exc)
                return
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock: socket.socket = conn
                if self._server_ctx is not None:
                    sock = self._server_ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            except OSError as exc:
                self._refusals.report("data-plane endpoint %s:%d: dropped a connection from %s: %s", self.host,
                                      self.port, addr, exc)
                conn.close()
                continue
            self._make_room()
            self._seq += 1
            entry = _Pending(self._seq, sock, _config.format_target(str(addr[0]), int(addr[1])))
            with self._pending_lock:
                self._pending[entry.seq] = entry
            self._early[sock.fileno()] = entry
            self._poller.register(sock.fileno(), select.POLLIN)
            self._progress(entry)  # its HELLO may be there already

    def _make_room(self) -> None:
        """Evicts the oldest pending connection whose HELLO is not verified (else the oldest of all)
        when MAX_HANDSHAKES are pending, so the newcomer is taken rather than refused."""
        with self._pending_lock:
            if len(self._pending) < MAX_HANDSHAKES:
                return
            victim = next((e for e in self._pending.values() if not e.hello), None) or \
                next(iter(self._pending.values()))
            age = time.monotonic() - victim.accepted
            victim.evicted = True
            if victim.hello:
                # Its thread owns the socket: woken by the shutdown, it closes it and ends.
                del self._pending[victim.seq]
                _shutdown_fd(victim.sock.fileno())
        self._refusals.report("data-plane endpoint %s:%d: dropped the oldest unauthenticated connection (from %s, "
                              "%.2f s old%s) for a new one: %d connections were waiting for admission", self.host,
                              self.port, victim.addr, age, ", hello verified" if victim.hello else "", MAX_HANDSHAKES)
        if not victim.hello:
            self._drop(victim, None)

    def _expire(self) -> None:
        """Drops the connections whose HELLO has not come within HELLO_S of their accept."""
        now = time.monotonic()
        late = []
        with self._pending_lock:
            for entry in self._pending.values():
                if entry.hello:
                    continue
                if entry.accepted + HELLO_S > now:
                    break  # accepted in order: the rest are younger
                late.append(entry)
        for entry in late:
            self._drop(entry, f"it sent no data-plane hello within {HELLO_S:g} s")

    def _drop(self, entry: _Pending, reason: str | None) -> None:
        """Closes a connection of the accept thread's (before its HELLO), logging ``reason``."""
        with self._pending_lock:
            self._pending.pop(entry.seq, None)
        fd = entry.sock.fileno()
        if self._early.pop(fd, None) is not None:
            self._poller.unregister(fd)
        if reason is not None:
            self._refusals.report("data-plane endpoint %s:%d: dropped a connection from %s: %s", self.host, self.port,
                                  entry.addr, reason)
        entry.sock.close()

    def _progress(self, entry: _Pending) -> None:
        """Moves a connection's TLS handshake and HELLO as far as they go without blocking; hands it
        to a thread of its own once its HELLO is verified."""
        sock = entry.sock
        try:
            if self._server_ctx is not None and not entry.tls_done:
                assert isinstance(sock, ssl.SSLSocket)
                sock.do_handshake()
                entry.tls_done = True
            view = memoryview(entry.buf)
            while entry.got < _HELLO.size:
                n = sock.recv_into(view[entry.got:], _HELLO.size - entry.got)
                if n == 0:
                    raise ConnectionResetError(errno.ECONNRESET, "the peer closed the connection during the handshake")
                entry.got += n
            plane = self._verify_hello(entry)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            self._poller.modify(sock.fileno(), select.POLLIN)
            return
        except ssl.SSLWantWriteError:
            self._poller.modify(sock.fileno(), select.POLLOUT)
            return
        except (OSError, GridcommError, ValueError, struct.error) as exc:
            self._drop(entry, str(exc))
            return
        except Exception:  # noqa: BLE001 - a bug here must cost one connection, not the endpoint
            log.exception("data-plane endpoint %s:%d: reading a hello from %s failed", self.host, self.port, entry.addr)
            self._drop(entry, None)
            return
        fd = sock.fileno()
        del self._early[fd]
        self._poller.unregister(fd)
        with self._pending_lock:
            entry.hello = True
            self._threads += 1
        try:
            threading.Thread(target=self._admit, args=(entry, plane), name="gridcomm-p2p-admit", daemon=True).start()
        except BaseException:
            with self._pending_lock:
                self._threads -= 1
                self._pending.pop(entry.seq, None)
            sock.close()
            raise

    def _verify_hello(self, entry: _Pending) -> Plane:
        magic, version, _, target, *_rest = _HELLO.unpack(bytes(entry.buf))
        if magic != MAGIC or version != VERSION:
            raise DataPlaneError(f"it is not a gridcomm data-plane client of version {VERSION} (magic {magic!r}, "
                                 f"version {version})")
        with self._lock:
            plane = self._planes.get(target)
        if plane is None or plane.closed:
            try:  # a few bytes into an empty send buffer: sent at once, or not at all (it is dropped anyway)
                entry.sock.send(_ACCEPT_HEAD.pack(MAGIC, _UNKNOWN, b"", b"") + bytes(_MAC_BYTES))
            except (OSError, ssl.SSLError):
                pass
            raise DataPlaneError(f"it named communicator {target.hex()}, which does not live in this process (a stale "
                                 "address, or a rank of another job)")
        return plane

    # ------------------------------------------------------------------ a handshake's thread
    def _admit(self, entry: _Pending, plane: Plane) -> None:
        sock = entry.sock
        try:
            io = _Io(sock, entry.accepted + HANDSHAKE_S, self._stop_r)
            link = self._authenticate(io, entry, plane)
            if link is not None:
                sock = link.sock
        except (_Woken, _Expired, OSError, GridcommError, ValueError, struct.error) as exc:
            reason = "it did not finish its handshake in time" if isinstance(exc, _Expired) else str(exc)
            with self._pending_lock:
                self._pending.pop(entry.seq, None)  # from now on nobody else touches its socket
            if not isinstance(exc, _Woken) and not entry.evicted:
                self._refusals.report("data-plane endpoint %s:%d: dropped a connection from %s: %s", self.host,
                                      self.port, entry.addr, reason)
            sock.close()
        except Exception:  # noqa: BLE001 - a bug here must cost one connection, not the endpoint
            log.exception("data-plane endpoint %s:%d: admitting a connection from %s failed", self.host, self.port,
                          entry.addr)
            with self._pending_lock:
                self._pending.pop(entry.seq, None)
            sock.close()
        finally:
            with self._threads_done:
                self._threads -= 1
                self._threads_done.notify_all()

    def _authenticate(self, io: _Io, entry: _Pending, plane: Plane) -> Link | None:
        hello = bytes(entry.buf)
        _, _, _, _, _, rank, dialed, peer_host, _ = _HELLO.unpack(hello)
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
        with self._pending_lock:
            if entry.evicted:  # evicted while it proved the token: its socket is shut down
                raise ConnectionResetError(errno.ECONNRESET, "evicted for a newer connection")
            # Admitted: it no longer holds a pending place, and nothing evicts it any more.
            self._pending.pop(entry.seq, None)
        io.send(bytes([_ADMITTED]))
        what = f"{plane.label}: link from rank {rank} ({entry.addr})"
        shm_out, shm_in = _negotiate_shm(io, plane.same_host(peer_host), what)
        link = Link(plane.label, rank, entry.addr, io.sock, shm_out, shm_in)
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

