"""Early drop of unauthenticated connections, so a flood of them cannot lock anyone out.

gRPC closes new connections at once past ``grpc.max_allowed_incoming_connections`` and closes
idle ones after a while, but it cannot tell a connection that made an authenticated call from one
that never did. One process holding every slot idle eviction frees (8,258 idle HTTP/2 sockets
opened in 1.3 s) kept a token holder, a new rank and kubelet's probes out for tens of seconds at
a time, again and again. OpenSSH meets the same attack with ``MaxStartups``: connections that have
not authenticated yet are capped, and past the cap some are dropped early.

:class:`Admission` does that beside a ``grpc.aio`` server, on its event loop. Every
:data:`SWEEP_S` it lists the port's established connections (netlink's sock_diag, as ``ss`` does);
those whose peer address and port made no admitted
call (see :meth:`Admission.admitted`; on a health port no call counts) are unauthenticated. Past
``cap`` of them it drops those older than :data:`GRACE_S`, oldest first, of the peer address
holding the most (a client's first call goes out with its connection: a newcomer is never
dropped, and is admitted at its first call; a flood loses its idle sockets) by
shutting the socket down under gRPC (it finds the descriptor through ``/proc/self/fd`` and checks
the inode on a duplicate before touching it, so a reused descriptor number is never shut).
gRPC's own cap is raised well above ``cap``, so what a flood opens between two sweeps still
leaves room for everyone else.

Cost: a sweep reads the kernel's table only when this process holds more descriptors than half
the cap (counting ``/proc/self/fd`` is cheap); otherwise it does nothing. A sweep that does read
it runs on a thread of its own, not on the server's event loop: under a flood a sweep lists
thousands of connections and descriptors and shuts thousands down (system calls that release the
GIL), and a coordinator's ports sweep in turn; on the loop, that would hold a health probe or a
call for the sweeps' whole length. Linux only: elsewhere (no ``/proc``) it never starts and
gRPC's limits alone apply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import logging
import os
import socket
import struct
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: How often the connections are counted. Why this often: one process opened ~6,400 connections a
#: second; between two sweeps a flood adds at most rate x SWEEP_S to what the cap allows, and
#: gRPC's own cap leaves that much room above it.
SWEEP_S = 0.25
#: Unauthenticated connections kept: on a coordinator's port (plus its world size), on a relay's,
#: and on a health port (where no call authenticates, so every connection counts; kubelet's probe
#: is one short connection).
CONTROL_UNAUTHENTICATED = 2048
HEALTH_UNAUTHENTICATED = 1024
#: On a relay's port: its node's ranks authenticate at their first call (the relay checks the
#: token itself, at once), so fewer are kept than on the coordinator's.
RELAY_UNAUTHENTICATED = 1024
#: A connection is dropped only once a sweep has seen it this long without an admitted call: a
#: client's first call goes out with its connection, so only connections that make none get this
#: old unauthenticated. A flood that reconnects at R connections a second then holds about
#: R x GRACE_S of them (one process on 2 cores: ~6,400 a second), inside the room below.
GRACE_S = 1.0
#: Room above the cap for what a flood opens between two sweeps (gRPC's own cap, past which it
#: closes new connections at once): a coordinator takes 4 x world size + this, a health port this.
CONTROL_HEADROOM = 10_240
HEALTH_MAX_CONNECTIONS = 9_216

#: Netlink's sock_diag (``ss``'s source): the kernel lists only the sockets of one local port,
#: where ``/proc/net/tcp`` is read whole (200-600 ms with 24,000 sockets on 2 cores).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_INET_DIAG_REQ_BYTECODE = 1
_BC_S_GE, _BC_S_LE = 2, 3
_TCP_ESTABLISHED = 1


def _diag_request(family: int, port: int) -> bytes:
    """A dump request for ``family``'s established TCP sockets whose local port is ``port``."""
    # Bytecode: local port >= port (else reject), then local port <= port (else reject).
    code = struct.pack("=BBH", _BC_S_GE, 8, 20) + struct.pack("=BBH", 0, 0, port) + \
        struct.pack("=BBH", _BC_S_LE, 8, 12) + struct.pack("=BBH", 0, 0, port)
    attribute = struct.pack("=HH", 4 + len(code), _INET_DIAG_REQ_BYTECODE) + code
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_ESTABLISHED) + bytes(48) + attribute
    return struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0) + body


def connections(port: int) -> list[tuple[tuple[str, int], int]]:
    """The established connections to local ``port``: (peer (host, port), socket inode)."""
    out = []
    for family in (socket.AF_INET, socket.AF_INET6):
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
            nl.send(_diag_request(family, port))
            done = False
            while not done:
                data = nl.recv(1 << 20)
                if not data:
                    break
                offset = 0
                while offset + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, offset)
                    if kind in (_NLMSG_DONE, _NLMSG_ERROR) or length < 16:
                        done = True
                        break
                    msg = offset + 16
                    dport = struct.unpack_from("!H", data, msg + 6)[0]
                    raw = data[msg + 24:msg + 40]
                    inode = struct.unpack_from("=I", data, msg + 68)[0]
                    if family == socket.AF_INET:
                        host = socket.inet_ntop(socket.AF_INET, raw[:4])
                    elif raw[:12] == b"\0" * 10 + b"\xff\xff":
                        host = socket.inet_ntop(socket.AF_INET, raw[12:])  # an IPv4-mapped peer
                    else:
                        host = socket.inet_ntop(socket.AF_INET6, raw)
                    out.append(((host, dport), inode))
                    offset += (length + 3) & ~3
    return out


def peer_of(text: str) -> tuple[str, int] | None:
    """gRPC's ``context.peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``) -> (host, port)."""
    kind, _, rest = text.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


#: How often, while connections are being dropped, freed memory is handed back to the system.
TRIM_S = 2.0


def _trim() -> None:
    """glibc's malloc_trim: gRPC frees what a dropped connection held, but glibc keeps the pages in
    its arenas; under a flood that reconnects, the coordinator grew by ~550 MB without this."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _descriptors() -> dict[int, int]:
    """socket inode -> this process's descriptor for it."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _shut(fd: int, inode: int) -> bool:
    """Shuts the socket ``inode`` down through descriptor ``fd`` if it still is that socket (gRPC
    then sees it end and closes it); a duplicate holds it meanwhile, so the number cannot be reused."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:
            return False
        sock = socket.socket(fileno=dup)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            sock.detach()
        return True
    finally:
        os.close(dup)


class Admission:
    """Caps the unauthenticated connections of one port (see the module's docstring)."""

    def __init__(self, name: str, cap: int, *, authenticates: bool, grace_s: float = GRACE_S) -> None:
        self.name = name
        self.cap = cap
        #: A connection this young is never dropped (its first call may be on its way).
        self.grace_s = grace_s
        #: socket inode -> descriptor, as last listed (checked again before any use).
        self._fds: dict[int, int] = {}
        #: False on a health port: no call authenticates, every connection counts.
        self._authenticates = authenticates
        #: Peers (host, port) that made an admitted call (-> when, by time.monotonic()), pruned to
        #: the connections that exist. Written on the server's loop, pruned by a sweep's thread.
        self._admitted: dict[tuple[str, int], float] = {}
        #: inode -> when a sweep first saw that connection (its age, for "oldest first").
        self._seen: dict[int, float] = {}
        self.dropped = 0
        self._quiet_until = 0.0
        self._trim_at = 0.0
        self._task: asyncio.Task[None] | None = None
        #: The thread sweeps run on (made at the first sweep that has connections to count).
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._port: Callable[[], int] = lambda: 0

    def admitted(self, peer: str) -> None:
        """A call from ``peer`` (``context.peer()``) passed the token check: its connection is
        authenticated from now on."""
        if self._authenticates:
            address = peer_of(peer)
            if address is not None:
                self._admitted[address] = time.monotonic()

    def served(self, peer: str) -> None:
        """A health call came from ``peer``: on a health port (where no call authenticates) its
        connection is not one that never made a call. On any other port: nothing."""
        if not self._authenticates:
            address = peer_of(peer)
            if address is not None:
                self._admitted[address] = time.monotonic()

    def start(self, port: Callable[[], int]) -> None:
        """Sweeps the port ``port()`` names (the server's current one) on the running loop."""
        if not os.path.isdir("/proc/self/fd") or self._task is not None:
            return
        self._port = port
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False)

    def _crowded(self) -> bool:
        """Whether this process holds more descriptors than half the cap (else no sweep is due)."""
        try:
            return len(os.listdir("/proc/self/fd")) > self.cap // 2
        except OSError:
            return False

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                if not self._crowded():
                    self._seen = {}
                    continue
                if self._thread is None:
                    self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"gridcomm-{self.name}")
                await loop.run_in_executor(self._thread, self.sweep)
            except Exception:  # noqa: BLE001 - a sweep that fails leaves gRPC's own limits
                log.exception("%s: counting its unauthenticated connections failed", self.name)

    def sweep(self) -> int:
        """One count, and the drops it calls for; returns how many were dropped."""
        port = self._port()
        if not port:
            return 0
        try:
            if len(os.listdir("/proc/self/fd")) <= self.cap // 2:
                if self._seen:
                    self._seen.clear()
                return 0
        except OSError:
            return 0
        now = time.monotonic()
        present = connections(port)
        seen = self._seen
        self._seen = {inode: seen.get(inode, now) for _, inode in present}
        peers = {peer for peer, _ in present}
        admitted = self._admitted
        # Only what was admitted before the listing: a connection accepted since may be admitted
        # meanwhile (on the loop) and is not in ``present`` yet.
        for peer, at in list(admitted.items()):
            if at < now and peer not in peers:
                admitted.pop(peer, None)
        waiting = [(peer, inode) for peer, inode in present if peer not in admitted]
        excess = len(waiting) - self.cap
        if excess <= 0:
            return 0
        by_host: dict[str, list[tuple[float, int]]] = {}
        cutoff = now - self.grace_s
        for (host, _), inode in waiting:
            first = self._seen[inode]
            if first <= cutoff:  # younger ones may still be on their way to their first call
                by_host.setdefault(host, []).append((first, inode))
        excess = min(excess, sum(len(held) for held in by_host.values()))
        if excess <= 0:
            return 0
        for held in by_host.values():
            held.sort(reverse=True)  # oldest last: popped first
        hosts = sorted(by_host, key=lambda h: -len(by_host[h]))[:3]
        heap = [(-len(held), host) for host, held in by_host.items()]
        heapq.heapify(heap)
        victims = []
        for _ in range(excess):
            _, host = heapq.heappop(heap)
            held = by_host[host]
            victims.append(held.pop()[1])
            if held:
                heapq.heappush(heap, (-len(held), host))
        fds = self._fds
        if any(inode not in fds for inode in victims):
            fds = self._fds = _descriptors()
        dropped = sum(1 for inode in victims if inode in fds and _shut(fds[inode], inode))
        self.dropped += dropped
        if dropped and now >= self._trim_at:
            self._trim_at = now + TRIM_S
            _trim()
        if dropped and now >= self._quiet_until:
            self._quiet_until = now + 10.0
            log.warning("%s: %d unauthenticated connections past its cap of %d; dropped the %d oldest of the peers "
                        "holding the most (%s; %d dropped so far)", self.name, len(waiting), self.cap, dropped,
                        ", ".join(hosts), self.dropped)
        return dropped
