"""Settings resolved once: explicit arguments, then ``GRIDCOMM_*``, then the cupyx/torchrun/Kubernetes
conventions, then defaults (see :mod:`gridcomm._config.readers` for each and
:mod:`gridcomm._config.registry` for the list).

``init_process_group`` resolves one :class:`Settings`, a :class:`Coordinator` one
:class:`CoordinatorSettings`, a :class:`CoordinatorClient` one :class:`ClientSettings`; each is
frozen and handed down, so the client, the coordinator, the host data plane and NCCL read what was
resolved at construction and never the environment of a later moment. ``timeout_s`` everywhere is
the bound on a whole call (a join, a barrier, a rebuild with the backend's creation included).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from gridcomm._config import cluster, readers
from gridcomm._config.readers import TlsFiles
from gridcomm._errors import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    """What a coordinator client needs: where to dial, who it is, its secret and its bound."""

    host: str
    port: int
    rank: int
    world_size: int
    token: str | None
    tls: TlsFiles | None
    timeout_s: float
    job_id: str
    session: str
    #: The relay this rank's Session stream dials (GRIDCOMM_RELAY_ADDRESS), or None: the coordinator.
    relay: str | None = None
    #: The relay tree: GRIDCOMM_RELAY and GRIDCOMM_RELAY_FANIN.
    relay_mode: str = "auto"
    #: None: GRIDCOMM_RELAY_FANIN=auto (from the world size; see fanin).
    relay_fanin: int | None = None
    #: GRIDCOMM_RELAY_ADDRESSES (or what a Kubernetes detector derived): the tree's relay
    #: addresses as a template, so a rank can join through its group's relay; None: joins go to
    #: the coordinator.
    relay_addresses: str | None = None

    @classmethod
    def resolve(cls, host: str | None = None, port: int | None = None, rank: int | None = None,
                world_size: int | None = None, token: str | None = None, timeout_s: float | None = None, *,
                job_id: str | None = None, tls: TlsFiles | None = None, session: str | None = None,
                relay: str | None = None, relay_addresses: str | None = None,
                environ: Mapping[str, str] | None = None) -> ClientSettings:
        settings = cls._read(host, port, rank, world_size, token, timeout_s, job_id=job_id, tls=tls, session=session,
                             relay=relay, relay_addresses=relay_addresses, environ=environ)
        readers.withhold_token(environ)
        return settings

    @classmethod
    def _read(cls, host: str | None, port: int | None, rank: int | None, world_size: int | None, token: str | None,
              timeout_s: float | None, *, job_id: str | None, tls: TlsFiles | None, session: str | None,
              relay: str | None, relay_addresses: str | None, environ: Mapping[str, str] | None) -> ClientSettings:
        size = readers.world_size(world_size, environ)
        me = readers.rank(rank, size, environ)
        dial_host, dial_port = readers.coordinator_address(host, port, environ)
        return cls(host=dial_host, port=dial_port, rank=me, world_size=size, token=readers.token(token, environ),
                   tls=tls if tls is not None else readers.tls(environ), timeout_s=readers.timeout_s(timeout_s, environ),
                   job_id=readers.job_id(job_id, environ), session=readers.session_mode(session, environ),
                   relay=readers.relay_address(relay, environ), relay_mode=readers.relay_mode(environ),
                   relay_fanin=readers.relay_fanin(environ),
                   relay_addresses=readers.relay_addresses(None, environ) or relay_addresses)

    @property
    def target(self) -> str:
        return readers.format_target(self.host, self.port)

    def fanin(self, world_size: int) -> int:
        """Ranks per relay of the tree at this world size (a recovery's world may be smaller)."""
        return self.relay_fanin if self.relay_fanin is not None else readers.auto_relay_fanin(world_size)


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    """What a coordinator server needs. Only the job id, the liveness and stall bounds and the
    metrics linger come from the environment when not passed: a server's address, secret and TLS
    are its constructor's (the process that hosts it, ``init_process_group`` or ``gridcomm serve``,
    resolves them)."""

    world_size: int
    bind: str
    port: int
    token: str | None
    tls: TlsFiles | None
    job_id: str
    heartbeat_timeout_s: float
    health_port: int | None
    metrics_port: int | None
    #: GRIDCOMM_STALL_TIMEOUT_S (0: stalls are not named).
    stall_timeout_s: float = readers.DEFAULT_STALL_TIMEOUT_S
    #: GRIDCOMM_METRICS_LINGER_S: /metrics and status stay up this long in a stop with a grace.
    metrics_linger_s: float = readers.DEFAULT_METRICS_LINGER_S
    #: GRIDCOMM_RELAY_FANIN (None: auto): the groups the directed join assigns (see fanin).
    relay_fanin: int | None = None

    def fanin(self) -> int:
        """Ranks per relay group of this job's tree, by the same rule as ClientSettings.fanin."""
        return self.relay_fanin if self.relay_fanin is not None else readers.auto_relay_fanin(self.world_size)

    @classmethod
    def resolve(cls, world_size: int, bind: str = "0.0.0.0", port: int = 0, token: str | None = None, *,
                job_id: str | None = None, heartbeat_timeout_s: float | None = None, tls: TlsFiles | None = None,
                health_port: int | None = None, metrics_port: int | None = None,
                stall_timeout_s: float | None = None, call_timeout_s: float | None = None,
                call_timeout_name: str | None = None,
                environ: Mapping[str, str] | None = None) -> CoordinatorSettings:
        _, requested = readers.coordinator_address("localhost", port, environ)
        return cls(world_size=readers.world_size(world_size), bind=readers.validate_host("bind", bind), port=requested,
                   token=readers.validate_token("token", token) if token is not None else None, tls=tls,
                   job_id=readers.job_id(job_id, environ),
                   heartbeat_timeout_s=readers.heartbeat_timeout_s(heartbeat_timeout_s, environ),
                   health_port=health_port, metrics_port=metrics_port,
                   stall_timeout_s=readers.stall_timeout_s(stall_timeout_s, environ, call_timeout_s=call_timeout_s,
                                                           call_timeout_name=call_timeout_name),
                   metrics_linger_s=readers.metrics_linger_s(environ), relay_fanin=readers.relay_fanin(environ))

    @classmethod
    def serve(cls, world_size: int | None = None, bind: str | None = None, port: int | None = None,
              job_id: str | None = None, metrics_port: int | None = None,
              environ: Mapping[str, str] | None = None) -> CoordinatorSettings:
        """A standalone coordinator's (``gridcomm serve``): each setting from its command-line
        flag, else the environment (address, secret, TLS, health and metrics ports included)."""
        _, requested = readers.coordinator_address("localhost", port, environ)
        settings = cls.resolve(readers.world_size(world_size, environ), readers.bind_address(bind, environ), requested,
                               readers.token(None, environ), job_id=job_id, tls=readers.tls(environ),
                               health_port=readers.health_port(None, environ),
                               metrics_port=readers.metrics_port(metrics_port, environ), environ=environ)
        readers.withhold_token(environ)
        return settings


@dataclasses.dataclass(frozen=True)
class PlaneSettings:
    """The host backend's data plane: the address it publishes (None: found on the route to the
    coordinator) and whether ranks of one host use shared memory."""

    data_host: str | None
    shm: bool


@dataclasses.dataclass(frozen=True)
class NcclSettings:
    """The NCCL backend's engine setting (``auto``, ``nccl4py``, ``cupy``) and ranks per bootstrap root."""

    engine: str
    ranks_per_root: int

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None) -> NcclSettings:
        return cls(engine=readers.nccl_engine(environ), ranks_per_root=readers.ranks_per_root(environ))


@dataclasses.dataclass(frozen=True)
class Settings:
    """One rank's settings for ``init_process_group``, resolved once (:meth:`resolve`)."""

    client: ClientSettings
    #: As asked for: ``auto``, ``nccl`` or ``host`` (``auto`` is decided where the GPU is probed).
    backend: str
    #: True: rank 0 hosts the coordinator (GRIDCOMM_COORDINATOR=embedded).
    embedded: bool
    #: The embedded coordinator's liveness bound (GRIDCOMM_HEARTBEAT_TIMEOUT_S).
    heartbeat_timeout_s: float
    bind: str
    metrics_port: int | None
    plane: PlaneSettings
    nccl: NcclSettings
    #: Which detector named the rank ("gridcomm", "torchrun", ...), or "arguments".
    source: str
    #: The embedded coordinator's settings where this rank hosts it (rank 0, embedded), from the
    #: same environment as the rest; else None.
    coordinator: CoordinatorSettings | None = None
    #: GRIDCOMM_DEBUG's checks (``collectives``: every communicator of the job fingerprints its calls).
    debug: frozenset[str] = frozenset()
    #: GRIDCOMM_HEALTH_PORT: this rank's health port (None: none, unless one was started already).
    health_port: int | None = None
    #: GRIDCOMM_FLIGHT_RECORD: collectives each communicator's flight record keeps (0: none).
    flight_record: int = readers.DEFAULT_FLIGHT_RECORD
    #: GRIDCOMM_TRACE_DIR: where this rank writes its flight record at a failure (None: nowhere).
    trace_dir: str | None = None

    @property
    def rank(self) -> int:
        return self.client.rank

    @property
    def world_size(self) -> int:
        return self.client.world_size

    @property
    def timeout_s(self) -> float:
        return self.client.timeout_s

    @classmethod
    def resolve(cls, n_devices: int | None = None, rank: int | None = None, *, backend: str | None = None,
                host: str | None = None, port: int | None = None, timeout_s: float | None = None,
                token: str | None = None, environ: Mapping[str, str] | None = None,
                hostname: str | None = None, fqdn: str | None = None) -> Settings:
        env = readers.process_environ() if environ is None else environ
        info = None
        if n_devices is None or rank is None or host is None:
            # Why: what the caller did not pass comes from the environment's detector (gridcomm
            # launch, torchrun, Kubeflow, JobSet, Indexed Job), which also derives rank 0's name.
            try:
                info = cluster.detect(env, hostname=hostname, fqdn=fqdn)
            except ConfigError:
                if n_devices is None or rank is None:
                    raise
        if info is not None:
            n_devices = info.world_size if n_devices is None else n_devices
            rank = info.rank if rank is None else rank
            if host is None:
                host = info.host
                port = info.port if port is None else port
        client = ClientSettings._read(host, port, rank, n_devices, token, timeout_s, job_id=None, tls=None,
                                      session=None, relay=None, environ=env,
                                      relay_addresses=info.relay_addresses if info is not None else None)
        embedded = readers.coordinator_mode(env) == "embedded"
        heartbeat_s = readers.heartbeat_timeout_s(None, env)
        bind = readers.bind_address(None, env)
        metrics = readers.metrics_port(None, env)
        coordinator = None
        if embedded and client.rank == 0:
            coordinator = CoordinatorSettings.resolve(
                client.world_size, bind=bind, port=client.port, token=client.token, job_id=client.job_id,
                heartbeat_timeout_s=heartbeat_s, tls=client.tls, metrics_port=metrics,
                call_timeout_s=client.timeout_s, call_timeout_name=readers.timeout_source(timeout_s, env), environ=env)
        settings = cls(client=client, backend=readers.backend(backend, env), embedded=embedded,
                       heartbeat_timeout_s=heartbeat_s, bind=bind, metrics_port=metrics,
                       plane=PlaneSettings(data_host=readers.data_host(env), shm=readers.shared_memory(env)),
                       nccl=NcclSettings.resolve(env), source="arguments" if info is None else info.source,
                       coordinator=coordinator, debug=readers.debug_flags(env),
                       health_port=readers.health_port(None, env), flight_record=readers.flight_record(env),
                       trace_dir=readers.trace_dir(env))
        # Last, once every setting is read: a resolve that fails leaves the environment as it was.
        readers.withhold_token(env)
        return settings
