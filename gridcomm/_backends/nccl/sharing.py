"""Several ranks of one communicator on one GPU: allowed only in NCCL's multi-rank mode.

NCCL before 2.30 refuses two ranks on one GPU ("Duplicate GPU detected", or a hang in init
with some versions); from 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1`` runs them (one process per
rank; NVLink SHARP off, ``NCCL_NVLS_ENABLE=0``; ``NCCL_MAX_CTAS`` caps each rank's channels).
Before NCCL init, each rank leaves a marker file for its GPU in a folder of the communicator
under ``/dev/shm`` (keyed by its unique ID, which only the communicator's ranks know) and looks
for other ranks' markers of the same GPU. Where it finds one without the mode (or with an NCCL
too old for it) it raises :class:`ConfigError` naming the fix, before NCCL's own error. The
rank that marks a GPU first sees nobody; the one after it raises, and the first one's init is
aborted when that rank fails (or times out, with CuPy's binding). Markers go at destroy/abort.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence

from gridcomm import _config
from gridcomm._errors import ConfigError

log = logging.getLogger(__name__)

#: The NCCL version (NCCL_VERSION_CODE) that runs several ranks on one GPU.
MULTI_RANK_MIN_NCCL = 23000

#: What turns NCCL's mode on, and the settings that go with it (``gridcomm launch`` sets any the
#: user did not): NVLink SHARP off (it needs a GPU per rank), two channels per rank.
MODE_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_MAX_CTAS": "2"}

#: Where the markers live (shared memory: gone at reboot; every rank of a host sees it).
MARKER_ROOT = "/dev/shm"

_FIX = ("run them with NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL_NVLS_ENABLE=0 (gridcomm launch sets both where ranks "
        "outnumber GPUs) on NCCL >= 2.30 (pip install 'gridcomm[cuda13]' or 'gridcomm[cuda12]' pulls it), or give "
        "each rank a GPU of its own (CUDA_VISIBLE_DEVICES)")


def version_text(code: int) -> str:
    """NCCL_VERSION_CODE as a version: 23206 -> '2.32.6' (codes before 2.9 had 1000s)."""
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def mode_on(environ: Mapping[str, str] | None = None) -> bool:
    """True when NCCL_MULTI_RANK_GPU_ENABLE asks for NCCL's several-ranks-per-GPU mode."""
    # The process's own environment: NCCL reads the variable there, whatever gridcomm resolved.
    env = _config.process_environ() if environ is None else environ
    return env.get("NCCL_MULTI_RANK_GPU_ENABLE", "").strip() == "1"


def problem(rank: int, size: int, gpu: str, sharers: Sequence[int], nccl_version: int,
            environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``rank`` cannot share ``gpu`` with ``sharers`` (other ranks of its communicator), or
    None where it can (no sharers, or the mode on with NCCL >= 2.30)."""
    if not sharers:
        return None
    have = version_text(nccl_version)
    where = f"rank {rank} of {size} shares GPU {gpu} with rank{'s' if len(sharers) > 1 else ''} " \
            f"{', '.join(map(str, sorted(sharers)))} of the same communicator"
    if nccl_version < MULTI_RANK_MIN_NCCL:
        return (f"{where}, and this process's NCCL ({have}) cannot run several ranks on one GPU: NCCL >= 2.30 "
                f"can, in its multi-rank mode; {_FIX}.")
    if not mode_on(environ):
        return (f"{where}, and NCCL ({have}) runs several ranks on one GPU only in its multi-rank mode, which "
                f"NCCL_MULTI_RANK_GPU_ENABLE=1 turns on (it is unset here); {_FIX}.")
    return None


class Marker:
    """This rank's mark on its GPU for one communicator (see the module docstring)."""

    def __init__(self, unique_id: bytes, gpu: str, rank: int, root: str | None = None) -> None:
        key = hashlib.sha256(unique_id).hexdigest()[:24]
        self.folder = os.path.join(MARKER_ROOT if root is None else root, f".gridcomm-gpus-{key}")
        self.gpu = gpu.replace("/", "_").replace(":", "_").replace(".", "_")
        self.path = os.path.join(self.folder, f"{self.gpu}-{rank}")
        self.rank = rank
        self.placed = False

    def place(self) -> list[int]:
        """Leaves the marker; returns the other ranks that marked the same GPU (empty where the
        folder cannot be written: then nothing is checked)."""
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            with open(self.path, "w", encoding="ascii") as out:
                out.write(str(os.getpid()))
            self.placed = True
            names = os.listdir(self.folder)
        except OSError as exc:
            log.debug("rank %d: no GPU marker in %s: %s", self.rank, self.folder, exc)
            return []
        prefix = f"{self.gpu}-"
        others = []
        for name in names:
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                other = int(name[len(prefix):])
                if other != self.rank:
                    others.append(other)
        return sorted(others)

    def remove(self) -> None:
        """Takes the marker away (the last one out takes the folder); idempotent."""
        if not self.placed:
            return
        self.placed = False
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            os.rmdir(self.folder)
        except OSError:  # other ranks' markers are still there, or it is gone already
            pass


def check(unique_id: bytes, gpu: str, rank: int, size: int, nccl_version: int,
          environ: Mapping[str, str] | None = None, root: str | None = None) -> Marker | None:
    """Marks ``gpu`` for ``rank``; raises ConfigError (the marker removed) where it is shared
    without NCCL's mode. Returns the marker to remove at destroy, or None for one rank alone."""
    if size < 2:
        return None
    marker = Marker(unique_id, gpu, rank, root)
    why = problem(rank, size, gpu, marker.place(), nccl_version, environ)
    if why is not None:
        marker.remove()
        raise ConfigError(why)
    return marker
