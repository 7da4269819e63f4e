"""What keeps a ``grpc.aio`` server up against what reaches its port before authentication.

Two pieces, shared by the coordinator's port, its plaintext health port and a rank's health port:

- :class:`GuardedServer` rebuilds the server on the same port when grpcio's accept loop dies.
  grpcio 1.84 and 1.85 end the aio server's loop on one HTTP/2 request whose ``:path`` is not
  UTF-8 (the process lives on, the port refuses connections, nothing is raised to the owner);
  no server option or interceptor sees that request first. A watchdog that polls the server's
  running state and binds a fresh server with the same handlers serves again within tens of
  milliseconds, with the ranks' waits intact (their state lives in the servicer, not the server).
- :class:`BoundedHealth` is the stock ``grpc.health.v1`` servicer with a cap on concurrent
  ``Watch`` streams: health needs no token (kubelet sends none), and each open Watch holds
  tens of KB of the server's memory, so without a cap anyone could grow it without bound.

And the options of those servers (:func:`control_server_options`, :func:`health_server_options`).
Connections are limited by idleness, not by a count a caller without the token can fill: gRPC
cannot tell which connections made an authenticated call, so a count cap that rank connections
need (``4 x world size + 1024``) was filled by ~1,030 idle sockets, and 256 on a health port
refused kubelet's probes. Instead:

- a connection with no call open is closed after :data:`CONTROL_IDLE_S` (30 s; health ports
  :data:`HEALTH_IDLE_S`, 3 s), one that has not sent its HTTP/2 settings (TLS included) after
  :data:`CONTROL_HANDSHAKE_S` (10 s; health ports :data:`HEALTH_HANDSHAKE_S`, 3 s). A rank's
  connection always has a call open (its Session stream or its heartbeat's long poll), so only
  connections that never made a call, and bare clients between calls, are closed; a client's next
  call connects again (gRPC does it within the call). gRPC adds +-10% jitter to the idle time
  and looks at idleness once per period, so a connection that never made a call goes 0.9-1.1
  periods after its accept, one that did 0.9-2.2 periods after its last call ended.
- what keeps an unauthenticated call open is bounded too: coordinator calls without the token are
  answered on their headers, a health request not sent within :data:`HEALTH_READ_S` (5 s) is
  refused, and a read past :data:`MAX_HEALTH_READS` evicts the oldest (see :class:`BoundedHealth`),
  so idle eviction cannot be dodged by holding a call open;
- unauthenticated connections are capped apart, below gRPC's own caps, and the oldest of the
  peer holding the most are dropped past it (:mod:`gridcomm._runtime.admission`), so a flood
  that reconnects as fast as it can never fills gRPC's caps;
- the count caps stay as a bound on file descriptors and memory (an idle HTTP/2 connection
  costs the server ~17 KB, ~48 KB with TLS): the coordinator takes ``4 x world size + 10,240`` and
  a health port :data:`HEALTH_MAX_CONNECTIONS` (9,216), each at most a share of the process's
  open-file limit (:func:`connection_cap`), which is raised from its soft to its hard value the
  first time (:func:`open_file_limit`).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from gridcomm._runtime import loop as _eventloop
from gridcomm._runtime.admission import HEALTH_MAX_CONNECTIONS, Admission
from gridcomm._runtime.loop import SERVER_STOP_TASK
from gridcomm._wire import CHUNK_BYTES, MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES

log = logging.getLogger(__name__)

#: How often the watchdog looks at the server's state when it cannot wait for grpcio's serving
#: task to end (a grpcio whose server keeps no such task), and the first retry of a rebind.
POLL_S = 0.02
#: How often it looks anyway while it waits for that task. Why not a short poll throughout:
#: every timer wake-up costs CPU, and 50 a second per server (a coordinator has two, every relay
#: and rank health port one) would cost a steady share of a core with nothing happening.
BACKSTOP_S = 2.0
#: Concurrent health Watch streams one server answers; kubelet uses Check, not Watch.
MAX_HEALTH_WATCHERS = 64
#: Health requests read at once. Why: they need no token, so each is read whole (up to the
#: server's message limit) before anything can refuse it; past this many they are refused unread.
MAX_HEALTH_READS = 32
#: Header block a caller may send (a token is at most 4 KiB). Why: grpcio keeps the memory of a
#: large header block after the connection closes, so an unbounded one grows the server per connection.
MAX_METADATA_BYTES = 16 * 1024
#: How long a health call may take to send its request after its headers. Why: a call waiting
#: for its request keeps its connection from being idle (and holds one of MAX_HEALTH_READS);
#: kubelet and ``gridcomm probe`` send the request with the headers.
HEALTH_READ_S = 5.0

#: A control-plane connection (coordinator, relay) with no call open this long is closed.
CONTROL_IDLE_S = 30.0
#: From a control-plane connection's accept to its client's HTTP/2 settings, TLS handshake
#: included. Why not shorter: thousands of ranks' TLS handshakes at once on a few cores.
CONTROL_HANDSHAKE_S = 10.0
#: A health-port connection with no call open this long is closed. Why this short: kubelet opens
#: a connection per probe and closes it after its one Check.
HEALTH_IDLE_S = 3.0
#: From a health-port connection's accept to its HTTP/2 settings (plaintext; kubelet's probe
#: times out after 1 s by default).
HEALTH_HANDSHAKE_S = 3.0
#: The share of the open-file limit one port's connections may take (the rest is for the other
#: ports and whatever else the process opens): a control port 1/2, a health port 1/4.
_FD_SHARE_CONTROL = 2
_FD_SHARE_HEALTH = 4
#: Soft limit to raise to where the hard limit is unlimited (Linux's default fs.nr_open).
_FD_UNLIMITED = 1 << 20

_fd_lock = threading.Lock()
_fd_limit: int | None = None


def open_file_limit() -> int:
    """This process's soft RLIMIT_NOFILE, raised to its hard limit the first time it is asked.

    Why raise it: every connection is a descriptor, and a soft limit of 1,024 under a much higher
    hard one is common (systemd's default is 1,024 under 524,288, and some container runtimes
    pass it on); past the soft limit grpc cannot accept (the port refuses everyone) and the
    process cannot open files. Raising the soft limit up to the hard one needs no privilege (Go's
    runtime does it at start too). Descriptors above 1,023 exist only while that many are open,
    and gridcomm waits on them with epoll, never select().
    Where it cannot be raised (no ``resource`` module, a refusal), the current soft limit is used.
    """
    global _fd_limit
    with _fd_lock:
        if _fd_limit is not None:
            return _fd_limit
        try:
            import resource
        except ImportError:  # not a Unix: grpc's own limits apply
            _fd_limit = _FD_UNLIMITED
            return _fd_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard
        if hard == resource.RLIM_INFINITY:
            try:
                with open("/proc/sys/fs/nr_open") as f:
                    target = int(f.read())
            except (OSError, ValueError):
                target = _FD_UNLIMITED
        if soft != resource.RLIM_INFINITY and soft < target:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                log.debug("raised this process's open-file limit from %d to %d (its hard limit)", soft, target)
                soft = target
            except (OSError, ValueError) as exc:
                log.debug("the open-file limit stays %d (raising it to %d failed: %s)", soft, target, exc)
        _fd_limit = _FD_UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)
        return _fd_limit


def connection_cap(wanted: int, share: int) -> int:
    """``wanted`` connections, but at most ``1/share`` of the open-file limit (at least 16)."""
    return max(16, min(wanted, open_file_limit() // share))


def token_problem(context: grpc.aio.ServicerContext, token: bytes | None) -> str | None:
    """Whether a call's headers carry ``Bearer <token>``: None when they do (or no token is
    asked for), else ``"missing"`` or ``"wrong"``. Compared in constant time; read from the call's
    headers, so before any request message is."""
    if token is None:
        return None
    supplied = b""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            supplied = value.encode() if isinstance(value, str) else bytes(value)
            break
    if hmac.compare_digest(supplied, b"Bearer " + token):
        return None
    return "wrong" if supplied else "missing"


#: Concurrent calls one connection may have open. A rank needs a few (its Session stream, a
#: long poll, a transfer).
MAX_STREAMS_PER_CONNECTION = 256


def server_credentials(tls: Any) -> grpc.ServerCredentials | None:
    """A gRPC server's credentials from the job's TLS files (a ``TlsFiles`` with its serving
    certificate and key; None: plaintext): the job's CA verifies client certificates, required
    where the job requires them. The coordinator and a relay serve alike."""
    if tls is None:
        return None
    assert tls.cert is not None and tls.key is not None
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                       require_client_auth=tls.require_client_cert)


def control_server_options(max_connections: int) -> list[tuple[str, Any]]:
    """The options of a server of the control plane (the coordinator, a relay): a long-poll server
    CANCELs calls past ~1,000 parked waiters with the defaults, a second server on the same port
    must fail, not share it, and what a caller without the token can make the server hold is
    bounded. Connections are evicted when idle (:data:`CONTROL_IDLE_S`); past ``max_connections``
    (at most half the open-file limit, see :func:`connection_cap`) new ones are closed at once."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.server.max_pending_requests", 1 << 20),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.max_allowed_incoming_connections", connection_cap(max_connections, _FD_SHARE_CONTROL)),
        # What frees the connections of callers that never make an (authenticated) call: see the
        # module's docstring. Why idle and not age: a rank's Session stream lives as long as the job.
        ("grpc.server_handshake_timeout_ms", int(CONTROL_HANDSHAKE_S * 1000)),
        ("grpc.max_connection_idle_ms", int(CONTROL_IDLE_S * 1000)),
        # Why no BDP probing, and a fixed 1 MiB window per stream (one chunk in flight): BDP
        # probing widens every stream's flow-control window, which is what a call refused before
        # its body was read can still make the server buffer (with it, unauthenticated large Sets
        # grow the server by tens of MB; without it, by the one window each).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", CHUNK_BYTES),
        # Why generous: liveness comes from heartbeats and connection loss, not keepalive; an
        # overloaded peer (thousands of ranks on few cores) must not be cut off for a slow ping ack.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]



def health_server_options() -> list[tuple[str, Any]]:
    """A health-only port: a health request is a service name, so anything large is refused.
    Idle connections go after :data:`HEALTH_IDLE_S`, so a few hundred held sockets never refuse
    a probe (the cap, :data:`HEALTH_MAX_CONNECTIONS`, is only a bound on descriptors and memory)."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", 16 * 1024),
        ("grpc.max_concurrent_streams", 64),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.max_allowed_incoming_connections", connection_cap(HEALTH_MAX_CONNECTIONS, _FD_SHARE_HEALTH)),
        ("grpc.server_handshake_timeout_ms", int(HEALTH_HANDSHAKE_S * 1000)),
        ("grpc.max_connection_idle_ms", int(HEALTH_IDLE_S * 1000)),
    ]


def _running(server: grpc.aio.Server) -> bool:
    """Whether grpcio's accept loop still runs. Why a private attribute: the public API says
    nothing when the loop dies (wait_for_termination returns only after a stop() call)."""
    inner = getattr(server, "_server", None)
    is_running = getattr(inner, "is_running", None)
    return True if is_running is None else bool(is_running())


async def _start(server: grpc.aio.Server) -> asyncio.Future[Any] | None:
    """Starts ``server``; returns grpcio's task that runs its accept loop (it ends when the loop
    dies), or None when there is no such task to be found (the watchdog then polls). Why a
    private name: grpcio says nothing public when its loop dies."""
    before = asyncio.all_tasks()
    await server.start()
    found = [task for task in asyncio.all_tasks() - before
             if getattr(task.get_coro(), "__qualname__", "").endswith("_server_main_loop")]
    # Why not the first of several: another server started on this loop meanwhile, and which
    # task is whose cannot be told; polling is right for either.
    return found[0] if len(found) == 1 else None


def bind_problem(target: str) -> str | None:
    """Why ``target`` (HOST:PORT) cannot be listened on now, or None when it can (or when the
    port is 0). Why ask before grpc does: grpc's core prints its own error line
    (``add_port.cc ... Failed to add port``) to stderr when a bind fails, beside our message."""
    host, _, port_text = target.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        return None  # not a HOST:PORT this check understands: grpc decides
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"the address {host!r} does not resolve ({exc.strerror or exc})"
    family, kind, proto, _canon, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As grpc's listeners do: a port held only by connections in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is already in use on {host}"
            return f"{host}:{port} cannot be bound ({exc.strerror or exc})"
    return None


class GuardedServer:
    """A ``grpc.aio`` server that a watchdog rebuilds on the same port if its loop dies.

    ``register`` adds the handlers to a fresh server (called for the first one and for every
    rebuild); ``on_accepting(bool)`` is told when the server stops or starts accepting again,
    so health can say NOT_SERVING in between. Runs on the caller's event loop.
    """

    def __init__(self, name: str, target: str, options: list[tuple[str, Any]],
                 register: Callable[[grpc.aio.Server], None], *,
                 credentials: grpc.ServerCredentials | None = None,
                 on_accepting: Callable[[bool], None] | None = None,
                 admission: Admission | None = None) -> None:
        self.name = name
        #: Caps the port's unauthenticated connections (see gridcomm._runtime.admission).
        self.admission = admission
        self._target = target
        self._options = options
        self._register = register
        self._credentials = credentials
        self._on_accepting = on_accepting
        self._server: grpc.aio.Server | None = None
        #: grpcio's task that serves the current server (None: not found; the watchdog polls).
        self._serving: asyncio.Future[Any] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stopping = False
        #: The stop in progress of each server this guard stopped (see _stop_once).
        self._stops: dict[int, asyncio.Future[None]] = {}
        self.port = 0
        #: Times the server was found dead and bound again.
        self.restarts = 0
        self.accepting = False
        #: Why the first bind failed, when it did (see bind_problem).
        self.bind_error: str | None = None

    def _bind(self, target: str) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=self._options, maximum_concurrent_rpcs=None)
        self._register(server)
        try:
            if self._credentials is not None:
                port = server.add_secure_port(target, self._credentials)
            else:
                port = server.add_insecure_port(target)
        except RuntimeError:
            port = 0
        return server, port

    async def start(self) -> int:
        """Binds and starts; returns the port (0 when it cannot be bound: the caller says why,
        with :attr:`bind_error`)."""
        self.bind_error = bind_problem(self._target)
        if self.bind_error is not None:
            return 0
        server, port = self._bind(self._target)
        if not port:
            return 0
        self._serving = await _start(server)
        self._server, self.port, self.accepting = server, port, True
        self._watchdog = asyncio.ensure_future(self._watch())
        if self.admission is not None:
            self.admission.start(lambda: self.port)
        if asyncio.get_running_loop() is _eventloop.current():
            _eventloop.stops_at_exit(self)
        return port

    async def _watch(self) -> None:
        while not self._stopping:
            serving = self._serving
            if serving is not None and not serving.done():
                # Woken the moment grpcio's serving task ends, not by a timer.
                await asyncio.wait((serving,), timeout=BACKSTOP_S)
            else:
                await asyncio.sleep(POLL_S)
            server = self._server
            if self._stopping or server is None or _running(server):
                continue
            self.accepting = False
            if self._on_accepting is not None:
                self._on_accepting(False)
            log.error("%s: grpcio's server loop on port %d ended on its own (a malformed request?); "
                      "binding a new server on the same port", self.name, self.port)
            await self._rebind(server)

    def _stop_once(self, server: grpc.aio.Server, grace_s: float | None) -> asyncio.Future[None]:
        """Stops ``server``, or joins the stop of it already under way. Why: grpcio's shutdown of
        one server run twice at once (stop() while the watchdog disposes of a dead server) can
        crash the process in its core; a stop is shielded so that cancelling a waiter leaves it
        to finish."""
        stopping = self._stops.get(id(server))
        if stopping is None:
            stopping = asyncio.ensure_future(server.stop(grace_s))
            stopping.set_name(SERVER_STOP_TASK)
            self._stops[id(server)] = stopping
            stopping.add_done_callback(lambda _: self._stops.pop(id(server), None))
        return asyncio.shield(stopping)

    async def _rebind(self, dead: grpc.aio.Server) -> None:
        try:
            await self._stop_once(dead, 0)
        except Exception:  # noqa: BLE001 - the old server is gone either way
            pass
        target = self._target.rsplit(":", 1)[0] + f":{self.port}"
        backoff = POLL_S
        started = time.monotonic()
        while not self._stopping:
            # Asked first, so that gRPC's own error line is not printed for every try.
            server, port = self._bind(target) if bind_problem(target) is None else (None, 0)
            if server is not None and port:
                self._serving = await _start(server)
                self._server, self.accepting = server, True
                self.restarts += 1
                log.warning("%s: serving again on port %d after %.3f s", self.name, port, time.monotonic() - started)
                if self._on_accepting is not None:
                    self._on_accepting(True)
                return
            # Why retry: the port can be held for a moment by the dead server's sockets; health
            # says NOT_SERVING meanwhile, so kubelet sees the truth.
            log.error("%s: port %d cannot be bound again yet; retrying in %.2f s", self.name, self.port, backoff)
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

    async def stop(self, grace_s: float | None) -> None:
        self._stopping = True
        self.accepting = False
        if self.admission is not None:
            self.admission.stop()
        if self._watchdog is not None:
            self._watchdog.cancel()
        server, self._server = self._server, None
        if server is not None:
            await self._stop_once(server, grace_s)


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieves a cancelled read's outcome, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _health_request(data: bytes) -> Any:
    try:
        return health_pb2.HealthCheckRequest.FromString(data)
    except Exception:  # noqa: BLE001 - answered INVALID_ARGUMENT
        return None


class BoundedHealth(health.aio.HealthServicer):  # type: ignore[misc]
    """The stock aio health servicer behind a gate: at most ``max_watchers`` Watch streams (past
    them a Watch is refused) and :data:`MAX_HEALTH_READS` requests being read at once, each for at
    most :data:`HEALTH_READ_S`. Why a newcomer evicts the oldest read rather than being refused:
    32 calls that never send their request held every place, so every probe was refused
    (RESOURCE_EXHAUSTED) for as long as their connections lived; a probe's request comes with its
    headers, so it is read long before 32 newer calls can push it out."""

    def __init__(self, max_watchers: int = MAX_HEALTH_WATCHERS) -> None:
        super().__init__()
        self._max_watchers = max_watchers
        self.watchers = 0
        #: The reads in progress, oldest first; each one's future is set when it is evicted.
        self._readers: dict[asyncio.Future[None], None] = {}
        #: The health ports' admissions: a connection that sent a health call is not dropped as
        #: one that never made a call (see gridcomm._runtime.admission).
        self.admissions: list[Admission] = []

    def register(self, server: grpc.aio.Server) -> None:
        """Adds grpc.health.v1.Health to ``server``: the same wire format as the generated
        helper's, with requests read by the gate (see :meth:`_read`)."""
        handlers = {
            "Check": grpc.stream_unary_rpc_method_handler(
                self._check, request_deserializer=_health_request,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
            "Watch": grpc.stream_stream_rpc_method_handler(
                self._watch, request_deserializer=_health_request,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(health.SERVICE_NAME, handlers),))

    async def _read(self, context: grpc.aio.ServicerContext) -> Any:
        if self.admissions:
            peer = context.peer()
            for admission in self.admissions:
                admission.served(peer)
        evicted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._readers[evicted] = None
        if len(self._readers) > MAX_HEALTH_READS:
            oldest = next(iter(self._readers))
            del self._readers[oldest]
            oldest.set_result(None)
        remaining = context.time_remaining()
        wait_s = HEALTH_READ_S if remaining is None else max(0.0, min(HEALTH_READ_S, remaining))
        read = asyncio.ensure_future(context.read())
        try:
            await asyncio.wait((read, evicted), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._readers.pop(evicted, None)
        if not read.done():
            read.cancel()
            read.add_done_callback(_consume)
            if evicted.done():
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"more than {MAX_HEALTH_READS} health requests were being read at once and "
                                    "this one had waited longest for its request; try again.")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the health request did not come within {wait_s:g} s of the call's headers.")
        request = read.result()
        if request is None or request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a grpc.health.v1.HealthCheckRequest.")
        return request

    async def _check(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self.Check(await self._read(context), context)

    async def _watch(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        request = await self._read(context)
        if self.watchers >= self._max_watchers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this server answers at most {self._max_watchers} health Watch streams at once; "
                                "use Check (as kubelet does).")
        self.watchers += 1
        try:
            await self.Watch(request, context)
        finally:
            self.watchers -= 1
