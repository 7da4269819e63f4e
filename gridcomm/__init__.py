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
    "__version__",
    "init_process_group",
    "start_health_server",
]
