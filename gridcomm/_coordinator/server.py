"""The coordinator's lifecycle: a ``grpc.aio`` server on a thread of its own, its health, its
metrics port, and its stop. The RPCs' handlers and reflection are :mod:`gridcomm._coordinator.service`'s;
the operations are :mod:`gridcomm._coordinator.servicer`'s."""

from __future__ import annotations

import asyncio
import atexit
import logging
import signal
import sys
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from gridcomm import _config
from gridcomm._config.settings import CoordinatorSettings
from gridcomm._coordinator import metrics as _metrics
from gridcomm._coordinator.service import ADMISSIONS, register_service
from gridcomm._coordinator.servicer import Servicer
from gridcomm._coordinator.state import JobState, Limits
from gridcomm._errors import ConfigError, CoordinatorUnavailable
from gridcomm._runtime.admission import (
    CONTROL_HEADROOM,
    CONTROL_UNAUTHENTICATED,
    HEALTH_UNAUTHENTICATED,
    Admission,
)
from gridcomm._runtime.guard import (
    BoundedHealth,
    GuardedServer,
    connection_cap,
    control_server_options,
    health_server_options,
    open_file_limit,
    server_credentials,
)
from gridcomm._runtime.loop import drop_late_grpc_events
from gridcomm._wire import SERVICE_NAME

log = logging.getLogger(__name__)

#: Connections the coordinator holds beyond 4 per rank: room for what a flood of unauthenticated
#: connections opens between two sweeps of its admission (which keeps at most
#: CONTROL_UNAUTHENTICATED of them, see gridcomm._runtime.admission), so a token holder or a new
#: rank always finds a slot. An idle connection costs the server ~17 KB, ~48 KB with TLS.
SPARE_CONNECTIONS = CONTROL_HEADROOM


def max_connections(world_size: int) -> int:
    """Connections the coordinator accepts at once: a few per rank (its calls, its watcher, a
    probe) and :data:`SPARE_CONNECTIONS`, at most half the process's open-file limit (raised to
    its hard limit first); past it new connections are closed at once. Says so in the log when
    that limit leaves less than the ranks need."""
    cap = connection_cap(4 * world_size + SPARE_CONNECTIONS, 2)
    if cap < 4 * world_size + 1024:
        log.warning("coordinator: the open-file limit (%d, ulimit -n) lets it hold %d connections, fewer than "
                    "a job of %d ranks may need; raise the hard limit (ulimit -Hn, the container runtime's nofile)",
                    open_file_limit(), cap, world_size)
    return cap


def server_options(world_size: int) -> list[tuple[str, Any]]:
    """gRPC server options, set explicitly (see control_server_options)."""
    return control_server_options(max_connections(world_size))

class Coordinator:
    """The gridcomm control-plane server (rendezvous, key-value, barriers, liveness, health).

    Runs a ``grpc.aio`` server on a thread of its own, so it can live inside the rank-0 process
    (the default) or standalone (``gridcomm serve``)::

        server = gridcomm.Coordinator(world_size=2, port=0).start()
        print(server.port)          # the bound port
        ...
        server.stop()

    ``bind`` is the listen address; ``port=0`` picks a free port. With ``token`` set, every
    coordinator RPC must carry it (health checks need none, as kubelet sends none).
    """

    def __init__(
        self,
        world_size: int | None = None,
        bind: str = "0.0.0.0",
        port: int = 0,
        token: str | None = None,
        *,
        job_id: str | None = None,
        heartbeat_timeout_s: float | None = None,
        stall_timeout_s: float | None = None,
        limits: Limits | None = None,
        tls: _config.TlsFiles | None = None,
        health_port: int | None = None,
        metrics_port: int | None = None,
        settings: CoordinatorSettings | None = None,
    ) -> None:
        if settings is None:
            if world_size is None:
                raise ConfigError("Coordinator needs world_size (or settings=).")
            settings = CoordinatorSettings.resolve(world_size, bind, port, token, job_id=job_id,
                                                   heartbeat_timeout_s=heartbeat_timeout_s, tls=tls,
                                                   stall_timeout_s=stall_timeout_s,
                                                   health_port=health_port, metrics_port=metrics_port)
        self.settings = settings
        self.world_size = settings.world_size
        self.bind = settings.bind
        self._requested_port = settings.port
        self._token = settings.token
        self.job_id = settings.job_id
        self.heartbeat_timeout_s = settings.heartbeat_timeout_s
        self.relay_fanin = settings.fanin()
        self.relay_fanin_configured = settings.relay_fanin is not None
        #: A live rank the others wait for in a collective this long is failed as stalled (0: off).
        self.stall_timeout_s = settings.stall_timeout_s
        #: At interpreter exit without stop(), how long to keep serving for ranks still joined.
        self.exit_grace_s = min(30.0, 2 * self.heartbeat_timeout_s)
        #: No single long-poll is held longer than this, whatever wait_s a request asks for.
        self.max_wait_s = 3600.0
        #: After a heartbeat call drops without an answer, how long the rank has to heartbeat again.
        self.connection_grace_s = min(2.0, self.heartbeat_timeout_s / 2)
        self.state = JobState(self.world_size, self.job_id, now=time.monotonic(), limits=limits)
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stop_requested: asyncio.Event | None = None
        self._all_left = threading.Event()
        self._closing = False
        self._servicer: Servicer | None = None
        self._health: Any = None
        self._main: GuardedServer | None = None
        self._health_server: GuardedServer | None = None
        #: False once a rank failed (or the coordinator stops): health says NOT_SERVING.
        self._job_ok = False
        self._stopped = threading.Event()
        self.tls = tls = settings.tls
        if tls is not None and (tls.cert is None or tls.key is None):
            raise ConfigError("a TLS coordinator needs GRIDCOMM_TLS_CERT and GRIDCOMM_TLS_KEY (its certificate and key).")
        self._health_port_requested = settings.health_port
        #: The plaintext grpc.health.v1 port (health only; kubelet's probes cannot speak TLS).
        self.health_port: int | None = None
        #: Counters for operators, served at /metrics when a port is given.
        self.metrics = _metrics.CoordinatorMetrics()
        self._metrics_port_requested = settings.metrics_port
        self._metrics_server: _metrics.MetricsServer | None = None
        #: The Prometheus /metrics port (after start(), when one was asked for).
        self.metrics_port: int | None = None
        #: In a stop with a grace, how long /metrics and status stay up (GRIDCOMM_METRICS_LINGER_S; see stop()).
        self.metrics_linger_s = settings.metrics_linger_s

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        """The port the server listens on (after start())."""
        if self._port is None:
            raise ConfigError("the coordinator has not been started; call start() first.")
        return self._port

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::", "") else self.bind
        return _config.format_target(host, self.port)

    def start(self, timeout_s: float = 30.0) -> Coordinator:
        """Binds and starts serving; returns self once the port is bound (raises if it cannot be)."""
        if self._thread is not None:
            raise ConfigError("this Coordinator was already started; create a new one.")
        if self._token is None and self.bind in ("0.0.0.0", "::"):
            log.warning(
                "coordinator: listening on all interfaces (%s) without a token; set GRIDCOMM_TOKEN to "
                "refuse callers that do not know it", self.bind,
            )
        self._thread = threading.Thread(target=self._run, name="gridcomm-coordinator", daemon=True)
        self._thread.start()
        # Why: a process that exits without stop() would otherwise freeze this daemon thread
        # mid-serve at interpreter shutdown, leaving ranks connected to a server that never
        # answers; at exit we stop properly, after a bounded wait for the ranks to leave or fail.
        atexit.register(self._stop_at_exit)
        if not self._ready.wait(timeout_s):
            raise CoordinatorUnavailable(f"the coordinator did not start within {timeout_s:.1f} s.")
        if self._start_error is not None:
            raise self._start_error
        if self._metrics_port_requested is not None:
            try:
                self._metrics_server = _metrics.serve_metrics(self, self._metrics_port_requested, self.bind)
            except BaseException:
                self.stop()
                raise
            self.metrics_port = self._metrics_server.port
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        drop_late_grpc_events(loop)  # no traceback for another loop's late events (nothing went wrong)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._ready.is_set():
                self._start_error = exc
                self._ready.set()
            else:
                log.exception("coordinator: the server loop ended on an error")
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self._stopped.set()

    async def _serve(self) -> None:
        self._stop_requested = asyncio.Event()
        self._servicer = Servicer(self)
        self._health = BoundedHealth()
        servicer, health_servicer = self._servicer, self._health

        def register(server: grpc.aio.Server) -> None:
            register_service(servicer, server)
            health_servicer.register(server)

        target = _config.format_target(self.bind, self._requested_port)
        credentials = server_credentials(self.tls)
        # Why + world size: at a large job's start every rank's connection waits for its join to be
        # admitted, seconds on a busy coordinator; those are never what is dropped.
        admission = Admission("coordinator", CONTROL_UNAUTHENTICATED + self.world_size, authenticates=True)
        ADMISSIONS[servicer] = admission
        self._main = GuardedServer("coordinator", target, server_options(self.world_size), register,
                                   credentials=credentials, on_accepting=self._accepting_changed, admission=admission)
        port = await self._main.start()
        if port == 0:
            raise CoordinatorUnavailable(
                f"the coordinator cannot listen on {target}: {self._main.bind_error or 'is the port in use?'}; "
                "choose another with GRIDCOMM_PORT or port=0."
            )
        self._port = port
        health_server = None
        if self._health_port_requested is not None:
            health_target = _config.format_target(self.bind, self._health_port_requested)
            health_admission = Admission("coordinator health", HEALTH_UNAUTHENTICATED, authenticates=False)
            health_servicer.admissions.append(health_admission)
            health_server = GuardedServer("coordinator health", health_target, health_server_options(),
                                          health_servicer.register, admission=health_admission)
            self.health_port = await health_server.start()
            if not self.health_port:
                await self._main.stop(0)
                raise CoordinatorUnavailable(f"the health port {health_target} cannot be bound: "
                                             f"{health_server.bind_error or 'is it in use?'}")
        self._health_server = health_server
        self._job_ok = True
        await self._publish_health()
        liveness = asyncio.ensure_future(self._servicer.watch_liveness())
        log.info("coordinator: serving job %r for %d ranks on %s", self.job_id, self.world_size, target)
        self._ready.set()
        try:
            await self._stop_requested.wait()
        finally:
            self._closing = True
            liveness.cancel()
            self._job_ok = False
            await self._publish_health()
            self._servicer.wake_all()
            await self._main.stop(0.5)
            if health_server is not None:
                await health_server.stop(0.2)

    @property
    def serving(self) -> bool:
        """True while the coordinator accepts calls and no rank has failed: what health says."""
        main = self._main
        return self._job_ok and main is not None and main.accepting

    async def _publish_health(self) -> None:
        # "" is liveness (the port accepts calls), whatever happened to the ranks; SERVICE_NAME is
        # readiness (serving, and no rank has failed).
        main = self._main
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        live = not self._closing and main is not None and main.accepting
        await self._health.set("", serving if live else not_serving)
        await self._health.set(SERVICE_NAME, serving if self.serving else not_serving)

    def _accepting_changed(self, accepting: bool) -> None:
        """The watchdog found the main server dead (or bound it again): the plaintext health port
        must not say SERVING for a port that refuses connections."""
        asyncio.ensure_future(self._publish_health())

    @property
    def token(self) -> str | None:
        """The job's token every call must carry (None: none is asked for)."""
        return self._token

    @property
    def closing(self) -> bool:
        """Whether stop() has begun: waits end with UNAVAILABLE, open streams go unanswered."""
        return self._closing

    def note_all_left(self) -> None:
        """Every rank has left or failed: a stop() that waits for that goes on."""
        self._all_left.set()

    def set_serving(self, serving: bool) -> None:
        """Called on the loop thread (after a failure, and when a recovery forms a generation)."""
        self._job_ok = serving
        asyncio.ensure_future(self._publish_health())

    def wait_all_left(self, timeout_s: float) -> bool:
        """Waits until every rank has left (or failed); returns False at the timeout."""
        return self._all_left.wait(timeout_s)

    def _wait_idle(self, timeout_s: float, cut: threading.Event | None = None) -> None:
        """Waits (bounded) until nobody needs this server any more: every rank left or failed, or,
        before the rendezvous completed, no rank has a call in flight (the joiners got their answer);
        or until ``cut`` is set (a SIGTERM held while lingering: the pod is being terminated)."""
        deadline = time.monotonic() + timeout_s
        state = self.state
        said = False
        while not self._all_left.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if cut is not None and cut.is_set():
                return
            if not said and time.monotonic() > deadline - timeout_s + 1.0:
                # Why say it: the process of rank 0 outlives its script by up to the grace, and a
                # silent linger reads as a hang (kubectl logs showed nothing for ~14 s).
                said = True
                joined = [m.rank for m in list(state.members.values()) if m.state.name == "JOINED"]
                log.warning("coordinator: waiting up to %.0f s more for %d rank(s) still joined to leave or be "
                            "found gone (%s), then it stops", max(0.0, deadline - time.monotonic()), len(joined),
                            ", ".join(map(str, sorted(joined)[:8])) + (" ..." if len(joined) > 8 else ""))
            if time.monotonic() >= deadline:
                return
            if not state.complete and not any(m.active_calls for m in list(state.members.values())):
                return

    def _stop_at_exit(self) -> None:
        self.stop(grace_s=self.exit_grace_s)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stops serving, first waiting up to ``grace_s`` for every rank to leave. Idempotent.

        With a grace and a metrics port (rank 0's stop at the end of the job or after a failure,
        and its exit without stop()), ``/metrics`` and the coordinator's port (status, health)
        also stay up until ``metrics_linger_s`` (GRIDCOMM_METRICS_LINGER_S, 30 s) have passed since
        the call, or since the job's latest rank failure where that came first (a failure scraped
        for that long already needs no more), saying so on stderr, so the last scrapes see how the
        job ended. The linger runs alongside the wait for the ranks: the call takes the longer of
        the two, never their sum. Why: rank 0 hears of a failure ~2 s after it and stops at once;
        the metrics port went with it, and no scrape saw the failure. A SIGTERM meanwhile
        (Kubernetes terminates rank 0's pod as soon as another rank's exit fails the Job) ends the
        wait for the ranks and is held until the linger ends, then delivered; Ctrl-C ends it at
        once. The metrics port closes last, just before the coordinator's loop stops, so it is up
        for as long as the coordinator is."""
        atexit.unregister(self._stop_at_exit)
        started = time.monotonic()
        running = self._thread is not None and self._loop is not None and not self._stopped.is_set()
        linger = self.metrics_linger_s if grace_s > 0 and running and self._metrics_server is not None else 0.0
        held = _HeldSigterm() if linger > 0 else None
        try:
            if running and grace_s > 0:
                self._wait_idle(grace_s, cut=held.received if held is not None else None)
            if linger > 0:
                failures = list(self.state.failures) if self.state.failed else []
                self._linger(min([started, *(f.at for f in failures[-1:])]) + linger)
        finally:
            metrics, self._metrics_server = self._metrics_server, None
            if metrics is not None:
                metrics.stop()
            if running:
                assert self._thread is not None and self._loop is not None
                loop, stop = self._loop, self._stop_requested
                if stop is not None:
                    try:
                        loop.call_soon_threadsafe(stop.set)
                    except RuntimeError:
                        pass  # loop already closed
                self._thread.join(10.0)
            if held is not None:
                held.release()  # last: a held SIGTERM ends the process

    def _linger(self, deadline: float) -> None:
        """Keeps serving (metrics, status) until ``deadline``, or until the loop ends on its own."""
        left = deadline - time.monotonic()
        if left <= 0.05:
            return
        failed = sorted(m.rank for m in list(self.state.members.values()) if m.state.name == "FAILED")
        what = (f"the failure of rank(s) {', '.join(map(str, failed[:8]))}{' ...' if len(failed) > 8 else ''}"
                if failed else "the end of the job")
        # Why say it: the process outlives its script by the linger, and a silent linger reads as a hang.
        log.warning("coordinator: serving /metrics (port %s) and status %.0f s more so the last scrapes see %s "
                    "(GRIDCOMM_METRICS_LINGER_S=%g), then it stops", self.metrics_port, left, what,
                    self.metrics_linger_s)
        self._stopped.wait(left)

    def __enter__(self) -> Coordinator:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _HeldSigterm:
    """Holds a SIGTERM that comes while the coordinator lingers, and delivers it at :meth:`release`.

    Installed only from the main thread and only where SIGTERM has its default action (a
    program's own handler is left alone); the linger is bounded (GRIDCOMM_METRICS_LINGER_S, at most
    600 s) and Kubernetes' termination grace (30 s by default) still ends it with SIGKILL."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self._installed = False
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            try:
                signal.signal(signal.SIGTERM, self._hold)
                self._installed = True
            except (ValueError, OSError):
                pass  # not settable here (an embedding interpreter): SIGTERM keeps its default

    def _hold(self, signum: int, frame: object) -> None:
        if not self.received.is_set():
            self.received.set()
            log.warning("coordinator: SIGTERM received; it takes effect once the metrics linger ends")

    def release(self) -> None:
        if not self._installed:
            return
        self._installed = False
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.received.is_set():
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()  # what the program printed is not lost with the process
                except (OSError, ValueError, AttributeError):
                    pass
            signal.raise_signal(signal.SIGTERM)
