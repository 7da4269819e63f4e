"""A process's one listening socket for host data-plane links: it accepts, authenticates and hands
each new link to the communicator it names, refusing what cannot be admitted."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import select
import socket
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

