"""``init_process_group``: the drop-in for ``cupyx.distributed.init_process_group``."""

from __future__ import annotations

import logging
import time

from gridcomm import _cluster, _config, _health
from gridcomm._client import CoordinatorClient
from gridcomm._comm import Communicator, FailureLatch, build_backend
from gridcomm._errors import ConfigError, GridcommError
from gridcomm._liveness import Watcher
from gridcomm._p2p import PlaneConfig, local_address
from gridcomm._server import Coordinator

log = logging.getLogger(__name__)


def resolve_backend(name: str | None) -> str:
    """'auto' picks nccl where CuPy sees a GPU and NCCL is available, else host."""
    choice = _config.backend(name)
    if choice == "auto":
        from gridcomm import _nccl

        choice = "nccl" if _nccl.available() else "host"
    elif choice == "nccl":
        from gridcomm import _nccl

        _nccl.require_gpu()  # issue 18: say so (and suggest host/auto) before the rendezvous
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
        raise ConfigError("use_mpi=True is not supported: gridcomm's rendezvous replaces MPI; drop the argument.")
    info = None
    if n_devices is None or rank is None or host is None:
        # Why: what the caller did not pass comes from the environment's detector (gridcomm
        # launch, torchrun, Kubeflow, JobSet, Indexed Job), which also derives rank 0's name.
        try:
            info = _cluster.detect()
        except ConfigError:
            if n_devices is None or rank is None:
                raise
    world_size = _config.world_size(n_devices if n_devices is not None or info is None else info.world_size)
    my_rank = _config.rank(rank if rank is not None or info is None else info.rank, world_size)
    kind = resolve_backend(backend)
    if info is not None and host is None:
        host = info.host
        port = info.port if port is None else port
    dial_host, dial_port = _config.coordinator_address(host, port)
    if info is not None:
        log.info("rank %d of %d (from %s); coordinator %s:%d", my_rank, world_size, info.source, dial_host, dial_port)
    secret = _config.token(token)
    tls = _config.tls()
    wait_s = _config.timeout_s(timeout_s)
    started = time.monotonic()
    coordinator = None
    watcher = None
    latch = FailureLatch()
    # Up before the rendezvous (or earlier: start_health_server), so kubelet's liveness probe
    # passes while ranks gather; readiness waits for the communicator. On rank 0 too: the health
    # port answers for this rank, not for the coordinator it hosts (issue 18).
    health = _health.process_health() or _health.running()
    # The data plane's address is found on the route to the coordinator's configured name (rank 0
    # dials its own server on loopback below, which says nothing about what its peers can reach).
    route_host = dial_host
    if my_rank == 0 and _config.coordinator_mode() == "embedded":
        bind = _config.bind_address()
        coordinator = Coordinator(world_size, bind=bind, port=dial_port, token=secret, tls=tls,
                                  metrics_port=_config.metrics_port()).start()
        # Why: rank 0 dials its own server directly, not through a DNS name that may lag (with
        # TLS it keeps the configured name, which the certificate is issued for, unless
        # GRIDCOMM_TLS_SERVER_NAME says what to verify).
        if tls is None or tls.server_name:
            dial_host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
        dial_port = coordinator.port
    client = None
    try:
        client = CoordinatorClient(dial_host, dial_port, my_rank, world_size, token=secret, timeout_s=wait_s, tls=tls)
        client.join()
        watcher = Watcher(client.target, client.tls, client.metadata, client.caller, client.heartbeat_timeout_s,
                          latch.fire, coordinator_rank=0 if _config.coordinator_mode() == "embedded" else None)
        watcher.start()
        plane = None
        if kind == "host":
            plane = PlaneConfig(token=secret, tls=tls, host=local_address(route_host, _config.data_host()),
                                timeout_s=wait_s, verdict_s=client.heartbeat_timeout_s + 1.0,
                                shm=_config.shared_memory())
        impl = build_backend(kind, client, "world", my_rank, world_size, plane=plane)
    except BaseException as exc:
        if watcher is not None:
            watcher.stop()
        if client is not None:
            if isinstance(exc, GridcommError) and client.generation:
                try:
                    client.report_failure(f"init_process_group failed: {exc}")
                except GridcommError:
                    pass
            client.close()
        if coordinator is not None:
            # Why a grace: the other joiners should get their answer (who is missing) before the
            # server goes; stop() returns as soon as none of them has a call in flight.
            coordinator.stop(grace_s=min(5.0, wait_s))
        raise
    log.info("rank %d of %d: %s communicator ready in %.3f s", my_rank, world_size, kind, time.monotonic() - started)
    comm = Communicator(impl, client, coordinator=coordinator, grace_s=min(60.0, wait_s), watcher=watcher,
                        health=health, latch=latch)
    if _config.coordinator_mode() == "embedded":
        comm.coordinator_rank = impl.coordinator_rank = 0
    return comm
