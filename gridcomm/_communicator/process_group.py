"""``init_process_group``: the drop-in for ``cupyx.distributed.init_process_group``."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from gridcomm import _config
from gridcomm._backends.base import Hooks
from gridcomm._backends.host.plane import PlaneConfig
from gridcomm._client.client import CoordinatorClient
from gridcomm._communicator.communicator import Communicator, build_backend
from gridcomm._config.settings import ClientSettings, Settings
from gridcomm._coordinator.server import Coordinator
from gridcomm._errors import ConfigError, CoordinatorUnavailable, GridcommError, coordinator_lost
from gridcomm._runtime import health as _health
from gridcomm._runtime.address import local_address
from gridcomm._runtime.health import ProcessHealth
from gridcomm._wire import SERVICE_NAME, shown_generation

log = logging.getLogger(__name__)


def resolve_backend(choice: str, nccl_engine: str | None = None) -> str:
    """'auto' picks nccl where CuPy sees a GPU and NCCL is available, else host (``choice`` is a
    validated setting: auto, nccl or host; ``nccl_engine`` the GRIDCOMM_NCCL_ENGINE setting)."""
    if choice == "auto":
        from gridcomm._backends import nccl as _nccl

        choice = "nccl" if _nccl.available(nccl_engine) else "host"
    elif choice == "nccl":
        from gridcomm._backends import nccl as _nccl

        _nccl.require_gpu(nccl_engine)  # say so (and suggest host/auto) before the rendezvous, not from inside NCCL
    return choice


def init_process_group(
    n_devices: int | None = None,
    rank: int | None = None,
    *,
    backend: str | None = None,
    host: str | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    token: str | None = None,
    use_mpi: bool = False,
) -> Communicator:
    """Joins the job and returns this rank's :class:`Communicator`.

    Same first arguments as ``cupyx.distributed.init_process_group(n_devices, rank, *, backend,
    host, port, use_mpi)``, so a cupyx program switches by changing its import. Anything not
    passed comes from the environment (``GRIDCOMM_*``, cupyx, torchrun, Indexed Job). ``backend``
    is ``nccl`` (default; CuPy arrays, current device), ``host`` (NumPy arrays) or ``auto``.
    Rank 0 hosts the coordinator unless ``GRIDCOMM_COORDINATOR=external``. Two ranks::

        comm = gridcomm.init_process_group(2, rank)      # every rank, each with its GPU
        comm.all_reduce(x, y, op="sum")
        comm.stop()
    """
    if use_mpi:
        # As cupyx accepts it: MPI there only exchanges the NCCL unique ID, which gridcomm's
        # rendezvous does; the collectives are the same NCCL calls either way.
        log.warning("use_mpi=True: gridcomm's rendezvous exchanges the NCCL unique ID instead of MPI "
                    "(the collectives are unchanged); the argument can be dropped.")
    job = Job.configure(n_devices, rank, backend=backend, host=host, port=port, timeout_s=timeout_s, token=token)
    return job.start()


@dataclasses.dataclass
class Job:
    """One rank's part in a job, across its generations: the settings resolved once at
    ``init_process_group``, the client that joined, and what the rank hosts (the embedded
    coordinator, the health port). :meth:`start` makes generation 1's communicator; a
    communicator's ``rebuild``/``shrink`` come back here for the next generation's."""

    settings: Settings
    #: ``nccl`` or ``host`` (``auto`` decided).
    kind: str
    health: ProcessHealth | None = None
    coordinator: Coordinator | None = None
    client: CoordinatorClient | None = None

    @classmethod
    def configure(cls, n_devices: int | None, rank: int | None, *, backend: str | None, host: str | None,
                  port: int | None, timeout_s: float | None, token: str | None,
                  environ: Mapping[str, str] | None = None) -> Job:
        """Resolves arguments and environment (``environ``, default the process's; an explicit
        argument wins); starts nothing. Nothing of the job reads the environment afterwards."""
        settings = Settings.resolve(n_devices, rank, backend=backend, host=host, port=port, timeout_s=timeout_s,
                                    token=token, environ=environ)
        kind = resolve_backend(settings.backend, settings.nccl.engine)
        if settings.source != "arguments":
            log.info("rank %d of %d (from %s); coordinator %s:%d", settings.rank, settings.world_size,
                     settings.source, settings.client.host, settings.client.port)
        return cls(settings=settings, kind=kind)

    @property
    def rank(self) -> int:
        return self.settings.rank

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    @property
    def timeout_s(self) -> float:
        """The bound on a whole call of this job's (init, barrier, rebuild), unless it passes its own."""
        return self.settings.timeout_s

    def start(self) -> Communicator:
        """Joins (rank 0 first starts the embedded coordinator) and builds this rank's communicator."""
        started = time.monotonic()
        settings = self.settings
        # Up before the rendezvous (or earlier: start_health_server), so kubelet's liveness probe
        # passes while ranks gather; readiness waits for the communicator. On rank 0 too: the health
        # port answers for this rank, not for the coordinator it hosts (kubelet restarts a rank, not a coordinator).
        wanted = settings.health_port
        self.health = (_health.process_health(wanted, settings.bind) if wanted is not None else None) or _health.running()
        dial = self.host_coordinator()
        try:
            self.client = CoordinatorClient(settings=dial, coordinator_rank=0 if settings.embedded else None)
            self.client.join()
            comm = self._communicator()
            if self.coordinator is not None:
                # Registered after the coordinator's own exit handler, so it runs first (atexit
                # is last in, first out): the server then waits only for the other ranks.
                atexit.register(_end_at_exit, comm)
        except BaseException as exc:
            self._give_up(exc)
            raise
        log.info("rank %d of %d: %s communicator ready in %.3f s (generation %d)", self.rank, self.world_size,
                 self.kind, time.monotonic() - started, shown_generation(self.client.generation))
        return comm

    def host_coordinator(self) -> ClientSettings:
        """Starts the embedded coordinator where this rank hosts it (rank 0, unless
        GRIDCOMM_COORDINATOR=external); returns the settings this rank's client dials with. Also
        for a torch program whose rank 0 hosts the coordinator (``gridcomm.TorchStore``)."""
        settings = self.settings
        dial = settings.client
        if settings.coordinator is not None and self.coordinator is None:
            try:
                self.coordinator = Coordinator(settings=settings.coordinator).start()
            except CoordinatorUnavailable:
                duplicate = _duplicate_rank_0(settings.bind, dial.port, self.world_size)
                if duplicate is None:
                    raise
                raise duplicate from None
        if self.coordinator is not None:
            # Why: rank 0 dials its own server directly, not through a DNS name that may lag (with
            # TLS it keeps the configured name, which the certificate is issued for, unless
            # GRIDCOMM_TLS_SERVER_NAME says what to verify).
            host = dial.host
            if dial.tls is None or dial.tls.server_name:
                host = "127.0.0.1" if settings.bind in ("0.0.0.0", "::") else settings.bind
            dial = dataclasses.replace(dial, host=host, port=self.coordinator.port)
        return dial

    def _communicator(self, timeout_s: float | None = None) -> Communicator:
        """The communicator of the client's current generation (its members, this rank's place);
        ``timeout_s`` bounds the backend's creation (default: the job's timeout)."""
        client = self.client
        assert client is not None
        members = client.members
        rank = members.index(self.rank)
        plane = None
        if self.kind == "host":
            dial = self.settings.client
            # The address the data plane publishes is found on the route to the coordinator as
            # configured (not rank 0's loopback shortcut to its own server).
            plane = PlaneConfig(token=dial.token, tls=dial.tls,
                                host=local_address(dial.host, self.settings.plane.data_host),
                                timeout_s=self.timeout_s, verdict_s=client.heartbeat_timeout_s + 1.0,
                                shm=self.settings.plane.shm)
        everyone = len(members) == self.world_size

        def make(hooks: Hooks) -> Any:
            return build_backend(self.kind, client, "world", rank, len(members), hooks, plane=plane,
                                 participants=() if everyone else members, failed=lambda: client.failure,
                                 timeout_s=timeout_s, nccl=self.settings.nccl)

        return Communicator(make, client, members=members, job=self,
                            fingerprints="collectives" in self.settings.debug,
                            record=self.settings.flight_record, trace_dir=self.settings.trace_dir)

    @property
    def grace_s(self) -> float:
        """How long the embedded coordinator waits, at the end, for every rank to leave or fail."""
        return min(60.0, self.timeout_s)

    def recover(self, mode: str, timeout_s: float | None) -> Communicator:
        """The next generation's communicator, after a failure: joins it as a survivor (see
        CoordinatorClient.recover) and builds the backend anew. Raises what ended the attempt
        (RankFailedError when another rank failed meanwhile: the caller may try again)."""
        client = self.client
        assert client is not None
        started = time.monotonic()
        budget = self.timeout_s if timeout_s is None else _config.parse_duration("timeout_s", timeout_s)
        try:
            client.recover(mode, budget)
        except CoordinatorUnavailable as exc:
            # The coordinator rank 0 hosts went while the survivors waited: rank 0 failed.
            raise coordinator_lost(exc, client.coordinator_rank) from exc
        # Why what is left: the caller's bound covers the whole recovery, NCCL's creation included.
        comm = self._communicator(max(1.0, budget - (time.monotonic() - started)))
        log.warning("rank %d: %s() done in %.3f s: generation %d, %d ranks (job ranks %s)", self.rank, mode,
                    time.monotonic() - started, shown_generation(client.generation), comm.world_size, list(comm.members)[:16])
        return comm

    def _give_up(self, exc: BaseException) -> None:
        """Undoes a start that failed: tells the coordinator (a rank that joined), closes the
        client, and stops the embedded coordinator after a grace."""
        client = self.client
        if client is not None:
            if isinstance(exc, GridcommError) and client.generation:
                try:
                    client.report_failure(f"init_process_group failed: {exc}")
                except GridcommError:
                    pass
            client.close()
        if self.coordinator is not None:
            # Why a grace: the other joiners should get their answer (who is missing) before the
            # server goes; stop() returns as soon as none of them has a call in flight.
            self.coordinator.stop(grace_s=min(5.0, self.timeout_s))


def _duplicate_rank_0(bind: str, port: int, world_size: int) -> ConfigError | None:
    """The error for a rank 0 whose coordinator port is taken by another rank 0's coordinator (a
    gridcomm coordinator answers its health service there), or None (something else holds it,
    and the caller's 'port in use' stands). Why ask: "choose another port" would start a second
    job beside the first, where the fault is the rank started twice."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host = "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind
    target = _config.format_target(host, port)
    try:
        with grpc.insecure_channel(target) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                      timeout=2.0)
    except grpc.RpcError:
        return None  # not a coordinator's health service (or none answered)
    return ConfigError(
        f"rank 0 is already running: a gridcomm coordinator answers on {target}, the port this rank 0 would host "
        f"it on, so another process was started as rank 0 of this {world_size}-rank job. Each rank must be "
        "started exactly once: check this process's rank (GRIDCOMM_RANK, RANK or JOB_COMPLETION_INDEX).")


def _end_at_exit(comm: Communicator) -> None:
    """The coordinator's rank at interpreter exit without ``stop()``: it leaves (or, when the
    script ended on an uncaught exception, fails naming it), as any rank's ``stop()`` would.
    Why: otherwise the coordinator waited for its own rank's client, up to its exit grace, and
    then blamed it for a lost connection. Nothing happens after a ``stop()`` (it is idempotent)."""
    error = getattr(sys, "last_value", None)
    try:
        if isinstance(error, BaseException) and not isinstance(error, (SystemExit, KeyboardInterrupt)):
            comm.abort(f"the script ended on an uncaught {type(error).__name__}: {error}"[:500])
        else:
            comm.stop()
    except Exception as exc:  # noqa: BLE001 - at exit, say it and let the coordinator's own handler go on
        log.warning("rank %d: leaving at exit failed: %s", comm.rank, exc)
