"""The NCCL backend: one NCCL communicator per rank, with cupyx's argument conventions.

What the rest of gridcomm uses of it is re-exported here; ``loader`` decides what NCCL this process
can use, ``engines`` drives it, ``bootstrap`` makes a communicator, ``backend`` runs collectives
(``build`` puts a backend together).
"""

from gridcomm._backends.nccl.backend import NcclBackend
from gridcomm._backends.nccl.bootstrap import connect, exchange_ids, id_key, root_ranks
from gridcomm._backends.nccl.engines import id_forms, id_to_bytes, nccl_version, new_unique_id
from gridcomm._backends.nccl.loader import (
    DEFAULT_RANKS_PER_ROOT,
    ENGINES,
    available,
    engine,
    engine_setting,
    nccl4py_why,
    ranks_per_root,
    require_gpu,
)
from gridcomm._backends.nccl.loader import _load_nccl4py as load_nccl4py

__all__ = [
    "DEFAULT_RANKS_PER_ROOT",
    "ENGINES",
    "NcclBackend",
    "available",
    "connect",
    "engine",
    "engine_setting",
    "exchange_ids",
    "id_forms",
    "id_key",
    "id_to_bytes",
    "load_nccl4py",
    "nccl_version",
    "nccl4py_why",
    "new_unique_id",
    "ranks_per_root",
    "require_gpu",
    "root_ranks",
]
