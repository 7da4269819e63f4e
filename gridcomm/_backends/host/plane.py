"""The host backend's data plane: direct, authenticated links between ranks.

The coordinator only introduces ranks, as NCCL's bootstrap does: each rank of a communicator
publishes a card (address, random communicator id, host key) through the key-value store, and
from then on bytes move between the two ranks alone.

- **Endpoint.** One listening TCP socket per process (shared by all of its communicators), bound
  to the address this host uses to reach the coordinator, with a thread that accepts and
  authenticates connections and hands each one to the communicator it names. Connections that
  have not authenticated are bounded in time (HELLO_S to say hello) and number (the oldest is
  evicted for a newcomer), and a dialer connects again after a close before admission, so
  sockets held against the port delay a link but never fail a rank.
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

import dataclasses
import errno
import hmac
import json
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from gridcomm import _config
from gridcomm._backends.host import shm as _shm
from gridcomm._backends.host.endpoint import _acquire_endpoint, _release_endpoint
from gridcomm._backends.host.frames import HANDSHAKE_S, MAGIC, VERSION, _Expired, _Lost, _Woken
from gridcomm._backends.host.handshake import (
    _ACCEPT_HEAD,
    _ADMITTED,
    _HELLO,
    _MAC_BYTES,
    _UNKNOWN,
    _Io,
    _mac,
    _negotiate_shm,
    closed_before_admission,
)
from gridcomm._backends.host.link import Incoming, Link, Outgoing
from gridcomm._backends.host.tls import tls_contexts
from gridcomm._errors import (
    AuthenticationError,
    CommAborted,
    DataPlaneError,
    RankFailedError,
    RendezvousTimeout,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlaneConfig:
    """What every communicator of one job needs to build its data plane."""

    token: str | None
    tls: _config.TlsFiles | None
    #: The address this rank listens on and publishes (see :func:`gridcomm._runtime.address.local_address`).
    host: str
    #: Bound on one call (``GRIDCOMM_TIMEOUT_S``).
    timeout_s: float
    #: How long a rank whose peer's connection broke waits for the coordinator's verdict before
    #: it names that peer itself (the liveness bound, plus slack).
    verdict_s: float
    #: Whether ranks of one host may exchange through /dev/shm (GRIDCOMM_SHM).
    shm: bool = True


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
                 lookup: Callable[[int], bytes], on_broken: Callable[[BaseException], None] | None = None) -> None:
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
        self.on_broken = on_broken
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
        """Connects and authenticates the link to ``peer``, bounded by this dial's deadline.

        A connection closed or reset before the link is admitted (before the peer has checked this
        rank's proof of the token and said so) is connected again, with backoff, until the
        deadline: the peer's endpoint drops unauthenticated connections when they are late or when
        it needs their place for a newer one (see ``Endpoint``), and anyone who can reach its port
        can make that happen, so it says nothing about the peer's health. A dead peer's port
        refuses the next connection (judged below), and the coordinator's verdict wakes this wait.
        A certificate the other side rejects, a wrong proof or a refusal stay errors at once;
        a connection broken after admission is the peer's loss (:meth:`_lost`)."""
        card = self._card(peer)
        addr = _config.format_target(card.host, card.port)
        what = f"{self.label}: link to rank {peer} ({addr})"
        started = time.monotonic()
        deadline = min(self._deadline, started + HANDSHAKE_S + self.config.verdict_s)
        refused_since: float | None = None
        backoff = 0.01
        dropped = 0
        last_drop = ""

        def timeout(during: str, hint: str = "") -> BaseException:
            why = (f"; {dropped} connections were closed before admission (the last: {last_drop}): is something "
                   "else crowding its data-plane port with unauthenticated connections, or does it run another "
                   f"gridcomm version (data-plane version {VERSION})?") if dropped else hint
            return self._break(RendezvousTimeout(f"{what}: {during} within {time.monotonic() - started:.1f} s{why}",
                                                 [peer]), report=True)

        while True:
            try:
                sock = self._connect(card, deadline)
            except _Expired:
                raise timeout("no connection", f"; is rank {peer} running, and is {addr} reachable from here?") from None
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
                continue
            refused_since = None  # its port accepts: it is listening
            io = _Io(sock, deadline, self._wake_r)
            try:
                if self._client_ctx is not None:
                    io.sock = self._client_ctx.wrap_socket(sock, do_handshake_on_connect=False)
                    io.tls_handshake()
                peer_host = self._prove(io, peer, card, what)
            except _Expired:
                io.sock.close()
                raise timeout("the handshake did not finish") from None
            except (OSError, struct.error) as exc:
                io.sock.close()
                if isinstance(exc, OSError) and closed_before_admission(exc):
                    dropped += 1
                    last_drop = str(exc) or type(exc).__name__
                    now = time.monotonic()
                    if now >= deadline:
                        raise timeout("the link was not admitted") from exc
                    log.debug("%s: the connection was closed before admission (%s); connecting again", what, exc)
                    self._pause(min(backoff, max(0.0, deadline - now)))
                    backoff = min(0.5, backoff * 2)
                    continue
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
            break
        # Admitted: from here on a broken connection is the peer's loss, as on an established link.
        try:
            shm_out, shm_in = _negotiate_shm(io, self.same_host(peer_host), what)
        except _Expired:
            io.sock.close()
            raise timeout("the handshake did not finish") from None
        except (OSError, struct.error) as exc:
            io.sock.close()
            raise self._lost(peer, addr, f"the handshake failed ({exc})") from exc
        except DataPlaneError as exc:
            io.sock.close()
            raise self._break(exc, report=True) from None
        except BaseException:
            io.sock.close()
            raise
        return Link(self.label, peer, addr, io.sock, shm_out, shm_in)

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

    def _prove(self, io: _Io, peer: int, card: Card, what: str) -> bytes:
        """The challenge-response, up to admission; returns the peer's host key."""
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
        return bytes(peer_host)

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

