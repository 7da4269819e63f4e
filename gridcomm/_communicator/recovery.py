"""Recovery in place: what :meth:`Communicator.rebuild` and :meth:`Communicator.shrink` do to
make the next generation's communicator after a rank failed.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING

from gridcomm._errors import CommAborted, ConfigError, CoordinatorLost, GridcommError, RankFailedError

if TYPE_CHECKING:
    from gridcomm._communicator.communicator import Communicator

# Why the communicator's logger: a recovery's lines read as they did when this was part of it.
log = logging.getLogger("gridcomm._communicator.communicator")


def recover(comm: Communicator, mode: str, timeout_s: float | None) -> Communicator:
    """Recovery in place (see :meth:`Communicator.rebuild` and :meth:`Communicator.shrink`)."""
    if comm._parent is not None:
        raise ConfigError(f"{mode}() recovers the whole job: call it on the communicator init_process_group "
                          "returned (this split child is closed with it; split the new one again).")
    if comm._successor is not None:
        raise ConfigError(f"this communicator was already recovered into generation {comm._successor.generation}; "
                          f"call {mode}() on the communicator that recovery returned.")
    assert comm._job is not None  # a root: made by init_process_group or a recovery
    if comm._finalized:
        raise CommAborted(f"rank {comm.rank}: {mode}() after stop() or abort(); this rank has left the job.")
    if comm._closed is None:
        failure = comm._client.failure or failure_now(comm)
        if failure is None:
            raise ConfigError(f"{mode}() follows a RankFailedError, but no rank of generation {comm.generation} "
                              "has failed.")
        comm._on_failure(failure)
    closed = comm._closed
    if not isinstance(closed, RankFailedError) or isinstance(closed, CoordinatorLost):
        # This rank aborted (the job counts it failed), or the coordinator is gone: nothing to join.
        raise copy.copy(closed)  # type: ignore[misc]
    comm._await_aborts()
    for backend in comm._all_backends():
        try:
            backend.destroy()  # already aborted at the failure; frees sockets and shared memory now
        except Exception as exc:  # noqa: BLE001 - best effort
            log.warning("rank %d: freeing a backend failed: %s", comm.rank, exc)
    successor: Communicator = comm._job.recover(mode, timeout_s)
    comm._successor = successor
    comm._finalized = True  # the job's client, coordinator and health now belong to the successor
    comm._close(CommAborted(f"communicator {comm.name!r} of generation {comm.generation} was recovered by "
                            f"{mode}() into generation {successor.generation}; use the communicator it returned"))
    return successor


def failure_now(comm: Communicator) -> GridcommError | None:
    """Asks the coordinator for a failure of this generation the watcher has not told of yet."""
    from gridcomm._client.watcher import failure_error

    try:
        failures = comm._client.heartbeat()
    except GridcommError as exc:
        return exc if isinstance(exc, RankFailedError) else None
    return failure_error(failures[0], comm.rank) if failures else None
