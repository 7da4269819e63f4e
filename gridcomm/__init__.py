"""gridcomm: find N processes on N hosts and build one NCCL communicator over CuPy arrays.

The public API is what this module exports; everything in ``gridcomm._*`` is private.
"""

from __future__ import annotations

from gridcomm._client.client import CoordinatorClient
from gridcomm._communicator.communicator import Communicator
from gridcomm._communicator.process_group import init_process_group
from gridcomm._coordinator.server import Coordinator
from gridcomm._errors import (
    ArgumentError,
    AuthenticationError,
    CollectiveMismatch,
    CommAborted,
    ConfigError,
    CoordinatorLost,
    CoordinatorRestarted,
    CoordinatorUnavailable,
    DataPlaneError,
    GridcommError,
    RankFailedError,
    RankStalled,
    RendezvousTimeout,
)
from gridcomm._runtime.health import start_health_server

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``TorchStore`` is loaded on first use: torch is optional (``pip install 'gridcomm[torch]'``)."""
    if name == "TorchStore":
        try:
            from gridcomm._communicator.torch_store import TorchStore
        except ImportError as exc:
            return _torch_missing(exc)
        globals()[name] = TorchStore
        return TorchStore
    raise AttributeError(f"module 'gridcomm' has no attribute {name!r}")


def _torch_missing(exc: ImportError) -> type:
    """A stand-in whose use says what is missing (so ``from gridcomm import *`` works without torch)."""
    reason = f"gridcomm.TorchStore needs torch ({exc}); install it, e.g. pip install 'gridcomm[torch]'."

    class TorchStore:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise ConfigError(reason)

    return TorchStore

__all__ = [
    "ArgumentError",
    "AuthenticationError",
    "CollectiveMismatch",
    "CommAborted",
    "Communicator",
    "ConfigError",
    "Coordinator",
    "CoordinatorClient",
    "CoordinatorLost",
    "CoordinatorRestarted",
    "CoordinatorUnavailable",
    "DataPlaneError",
    "GridcommError",
    "RankFailedError",
    "RankStalled",
    "RendezvousTimeout",
    "TorchStore",
    "__version__",
    "init_process_group",
    "start_health_server",
]
