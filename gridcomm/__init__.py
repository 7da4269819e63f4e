"""gridcomm: find N processes on N hosts and build one NCCL communicator over CuPy arrays.

The public API is what this module exports; everything in ``gridcomm._*`` is private.
"""

from __future__ import annotations

from gridcomm._api import init_process_group
from gridcomm._client import CoordinatorClient
from gridcomm._comm import Communicator
from gridcomm._errors import (
    ArgumentError,
    AuthenticationError,
    CommAborted,
    ConfigError,
    CoordinatorLost,
    CoordinatorUnavailable,
    DataPlaneError,
    GridcommError,
    RankFailedError,
    RendezvousTimeout,
)
from gridcomm._health import start_health_server
from gridcomm._server import Coordinator

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "AuthenticationError",
    "CommAborted",
    "Communicator",
    "ConfigError",
    "Coordinator",
    "CoordinatorClient",
    "CoordinatorLost",
    "CoordinatorUnavailable",
    "DataPlaneError",
    "GridcommError",
    "RankFailedError",
    "RendezvousTimeout",
    "__version__",
    "init_process_group",
    "start_health_server",
]
