"""How a communicator's backend is made (:func:`build_backend`), and what a root communicator
reads of its rank's job (:class:`Job`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from gridcomm._backends.base import Backend, Hooks
from gridcomm._backends.host.plane import PlaneConfig
from gridcomm._client.client import CoordinatorClient
from gridcomm._config.settings import NcclSettings
from gridcomm._errors import ConfigError
from gridcomm._runtime.health import ProcessHealth

if TYPE_CHECKING:
    from gridcomm._communicator.communicator import Communicator


def build_backend(kind: str, client: CoordinatorClient, name: str, rank: int, size: int, hooks: Hooks, *,
                  plane: PlaneConfig | None = None, participants: Sequence[int] = (),
                  failed: Callable[[], BaseException | None] = lambda: None, timeout_s: float | None = None,
                  nccl: NcclSettings | None = None) -> Backend:
    """Creates this rank's backend for communicator ``name``; for NCCL, its rank 0 makes the unique
    ID (the NCCL bootstrap root lives in the creating process) and the others fetch it. The host
    backend publishes its data-plane address (``plane``) and waits, with the ``participants``
    (job ranks; empty: all), until every member has. ``failed()`` returns the failure this rank's
    watcher has seen (or None): a backend that waits for its peers gives up when it is set.
    ``hooks`` are what the backend calls back (its communicator's). ``timeout_s`` bounds the
    creation, for either backend (default: the client's timeout); ``nccl`` is the NCCL engine's
    settings as the job resolved them."""
    if kind == "host":
        from gridcomm._backends.host.backend import HostBackend

        if plane is None:
            raise ConfigError("the host backend needs its data-plane settings (PlaneConfig); build it through "
                              "init_process_group.")
        return HostBackend(client, name, rank, size, config=plane, participants=participants, hooks=hooks,
                           timeout_s=timeout_s)
    from gridcomm._backends import nccl as _nccl

    return _nccl.connect(client, name, rank, size, hooks=hooks, failed=failed, timeout_s=timeout_s, settings=nccl)


class EmbeddedServer(Protocol):
    """The embedded coordinator, as a communicator sees it: something to stop at the end."""

    def stop(self, grace_s: float = ...) -> None: ...


class Job(Protocol):
    """What a root communicator reads of its rank's job (gridcomm._communicator.process_group.Job)."""

    health: ProcessHealth | None

    @property
    def coordinator(self) -> EmbeddedServer | None: ...

    @property
    def grace_s(self) -> float: ...

    def recover(self, mode: str, timeout_s: float | None) -> Communicator: ...
