"""This process's grpc.health.v1 server, what kubelet probes (``GRIDCOMM_HEALTH_PORT``).

Two services, two questions:

- ``""`` is liveness: SERVING whenever the server answers. It runs on the process's background
  loop (:mod:`gridcomm._runtime.loop`), so an answer means the process and that loop are alive;
  nothing a peer does changes it. The one exception: once the job names this rank stalled (its
  peers waited for it in a collective it never entered), it turns NOT_SERVING for good, so
  kubelet restarts the pod. Why: a survivor that reports a peer's failure, writes a
  checkpoint or rebuilds its communicator must not be restarted by its liveness probe (a kill
  there turned the failure policy's exit code 3 into 137).
- ``gridcomm.v1.Coordinator`` is readiness: SERVING only while one of this process's
  communicators is up (after its rendezvous, until a failure, abort or stop), so rank 0 is not
  Ready before every rank has joined. It may turn SERVING again (a new communicator after a
  recovery).

One server per port and process, started by the first of :func:`start_health_server` (a script
that loads data or a model before ``init_process_group`` calls it first, so kubelet's startup
probe passes meanwhile) and ``init_process_group``; it lives until the process exits.

The port needs no token (kubelet sends none), so what others can hold there is bounded by
:func:`gridcomm._runtime.guard.health_server_options`: a connection with no call open is closed
after 3 s and one that has not sent its HTTP/2 settings after 3 s, so a few hundred idle sockets
never refuse a probe (kubelet opens a connection per probe); past 1,024 connections the oldest
of the peer holding the most are dropped (gridcomm._runtime.admission), so a flood that reconnects
cannot fill the cap of 9,216 (at most 1/4 of the open-file limit, which starting the server
raises to its hard limit).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from typing import Any

from grpc_health.v1 import health_pb2

from gridcomm import _config
from gridcomm._errors import CoordinatorUnavailable, GridcommError
from gridcomm._runtime.admission import HEALTH_UNAUTHENTICATED, Admission
from gridcomm._runtime.guard import BoundedHealth, GuardedServer, health_server_options
from gridcomm._runtime.loop import run_soon, submit
from gridcomm._wire import SERVICE_NAME

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: How long starting the health server waits for the background loop.
START_WAIT_S = 10.0

_lock = threading.Lock()
#: The running servers, by the port asked for.
_servers: dict[int, ProcessHealth] = {}


class ProcessHealth:
    """grpc.health.v1 on a plaintext port: ``""`` liveness, ``gridcomm.v1.Coordinator`` readiness."""

    def __init__(self, port: int, bind: str = "0.0.0.0") -> None:
        self._requested = port
        self._bind = bind
        self._server: GuardedServer | None = None
        self._health: Any = None
        #: What holds readiness up: each communicator that is up (readiness is SERVING while any
        #: is). Why not a flag: an old communicator stopped after a newer one came up must not
        #: take the newer one's readiness down.
        self._ready: set[int] = set()
        self._lock = threading.Lock()
        self.port = 0

    def start(self) -> ProcessHealth:
        async def begin() -> int:
            self._health = BoundedHealth()
            # Both answers are set before the port opens, so no probe sees NOT_FOUND.
            await self._health.set("", _SERVING)
            await self._health.set(SERVICE_NAME, _NOT_SERVING)
            target = _config.format_target(self._bind, self._requested)
            admission = Admission("rank health", HEALTH_UNAUTHENTICATED, authenticates=False)
            self._health.admissions.append(admission)
            server = GuardedServer("rank health", target, health_server_options(), self._health.register,
                                   admission=admission)
            port = await server.start()
            if port == 0:
                raise CoordinatorUnavailable(
                    f"the health port {target} cannot be bound ({server.bind_error or 'in use?'}); set "
                    "GRIDCOMM_HEALTH_PORT to a free port (the manifests' probes name the same port).")
            self._server = server
            return port

        try:
            self.port = submit(begin()).result(START_WAIT_S)
        except concurrent.futures.TimeoutError:
            raise GridcommError(f"the health server did not start within {START_WAIT_S:g} s (this process's "
                                "background loop is starved?)") from None
        return self

    @property
    def ready(self) -> bool:
        return bool(self._ready)

    def set_ready(self, owner: object, ready: bool) -> None:
        """Marks ``owner`` (a communicator) up or not; readiness is SERVING while any owner is up."""
        with self._lock:
            before = bool(self._ready)
            if ready:
                self._ready.add(id(owner))
            else:
                self._ready.discard(id(owner))
            after = bool(self._ready)
        if after != before and self._health is not None:
            run_soon(self._health.set(SERVICE_NAME, _SERVING if after else _NOT_SERVING), 5.0)

    def set_live(self, live: bool) -> None:
        """Liveness (``""``): NOT_SERVING only for a rank the job found stalled (kubelet restarts it)."""
        if self._health is not None:
            run_soon(self._health.set("", _SERVING if live else _NOT_SERVING), 5.0)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            run_soon(server.stop(0.2), 5.0)


def start_health_server(port: int | None = None, bind: str | None = None) -> int | None:
    """Starts this process's grpc.health.v1 server now, if a port is configured; returns its port.

    ``port``: the argument, else ``GRIDCOMM_HEALTH_PORT``; with neither, nothing starts and None
    is returned (``port=0`` picks a free port). Liveness (``""``) is SERVING from now on;
    readiness (``gridcomm.v1.Coordinator``) turns SERVING once ``init_process_group`` has built
    the communicator. Call it first in a script that loads data or a model before
    ``init_process_group``, so kubelet's startup probe passes meanwhile; later calls (and
    ``init_process_group``) reuse the same server::

        gridcomm.start_health_server()            # GRIDCOMM_HEALTH_PORT, e.g. 13334
        model = load_model()                      # minutes; the pod stays live
        comm = gridcomm.init_process_group()      # readiness SERVING once every rank has joined
    """
    server = process_health(port, bind)
    return None if server is None else server.port


def process_health(port: int | None = None, bind: str | None = None) -> ProcessHealth | None:
    """The process's health server on ``port`` (argument, else GRIDCOMM_HEALTH_PORT), started on
    first use; None when no port is configured."""
    wanted = _config.health_port(port)
    if wanted is None:
        return None
    with _lock:
        server = _servers.get(wanted)
        if server is None and wanted == 0 and _servers:
            # A free port was asked for and one server runs already: that one is this process's.
            server = next(iter(_servers.values()))
        if server is None:
            server = ProcessHealth(wanted, _config.bind_address(bind)).start()
            if not _servers:
                atexit.register(_stop_all)
            _servers[wanted] = server
        return server


def running() -> ProcessHealth | None:
    """A health server this process started already (for ``init_process_group`` without a port)."""
    with _lock:
        return next(iter(_servers.values()), None)


def _stop_all() -> None:
    """At exit, before the background loop winds down (atexit runs in reverse order)."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
