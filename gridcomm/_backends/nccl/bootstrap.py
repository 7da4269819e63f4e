"""Making a rank's NCCL communicator: the unique-id exchange through the coordinator's key-value
store (one root, or one per partition of ranks), then a bounded, abortable init."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gridcomm._backends.base import NO_HOOKS, ControlPlane, Hooks
from gridcomm._backends.nccl.backend import NcclBackend
from gridcomm._backends.nccl.engines import new_unique_id
from gridcomm._backends.nccl.loader import engine
from gridcomm._config.settings import NcclSettings
from gridcomm._errors import ConfigError


# ---------------------------------------------------------------------- unique IDs
def root_ranks(size: int, per_root: int) -> list[int]:
    """The ranks that create a unique ID, root i first: ``ceil(size / per_root)`` roots, root i at
    the first rank of the i-th partition NCCL itself assigns to root i (ncclCommInitRankScalable
    gives the first ``size % n`` roots one rank more), so each bootstrap root lives in a process
    it serves. One root (rank 0) when ``size <= per_root``."""
    if size < 1 or per_root < 1:
        raise ConfigError(f"root_ranks: size={size} and per_root={per_root} must be >= 1.")
    n = -(-size // per_root)
    return [i * (size // n) + min(i, size % n) for i in range(n)]


def id_key(name: str, index: int) -> str:
    """The coordinator key of communicator ``name``'s unique ID ``index``; ID 0 keeps the key a
    single-ID communicator has always used."""
    return f"{name}/nccl-unique-id" if index == 0 else f"{name}/nccl-unique-id/{index}"


def exchange_ids(client: ControlPlane, name: str, rank: int, roots: Sequence[int],
                 make_id: Callable[[], bytes], timeout_s: float) -> list[bytes]:
    """Every unique ID of communicator ``name``, root order. A root rank makes its own ID (the
    bootstrap root lives in the creating process) and ``set``s it; every rank ``get``s the others."""
    deadline = time.monotonic() + timeout_s
    mine = roots.index(rank) if rank in roots else -1
    ids: list[bytes] = []
    own = b""
    if mine >= 0:
        own = make_id()
        client.set(id_key(name, mine), own)
    for index in range(len(roots)):
        if index == mine:
            ids.append(own)
        else:
            ids.append(client.get(id_key(name, index), timeout_s=max(deadline - time.monotonic(), 0.001)))
    return ids


def connect(client: ControlPlane, name: str, rank: int, size: int, *, hooks: Hooks = NO_HOOKS,
            failed: Callable[[], BaseException | None] = lambda: None,
            timeout_s: float | None = None, settings: NcclSettings | None = None) -> NcclBackend:
    """This rank's NCCL communicator ``name`` of ``size`` ranks. The unique IDs travel through
    ``client`` (the control plane: ``set``/``get``): one, made by rank 0, for worlds of up to
    GRIDCOMM_RANKS_PER_ROOT ranks; else one per root (see :func:`root_ranks`; nccl4py only). The
    whole exchange and NCCL init are bounded by ``timeout_s`` (default ``client.timeout_s``);
    ``failed()`` returns a peer's failure seen by this rank's watcher, or None: with nccl4py, init
    is aborted as soon as it is set and that error is raised. ``settings`` are the engine setting
    and ranks per root the job resolved (default: read now); ``hooks`` the communicator's."""
    if settings is None:
        settings = NcclSettings.resolve()
    timeout = float(client.timeout_s if timeout_s is None else timeout_s)
    deadline = time.monotonic() + timeout
    chosen = engine(setting=settings.engine)
    roots = root_ranks(size, settings.ranks_per_root) if chosen == "nccl4py" else [0]
    ids = exchange_ids(client, name, rank, roots, lambda: new_unique_id(chosen), timeout)
    return NcclBackend(size, rank, ids, engine_name=chosen, deadline=deadline, failed=failed, label=name, hooks=hooks,
                       settings=settings)

