"""How an :class:`~gridcomm._backends.nccl.backend.NcclBackend` is put together, away from its
per-call paths: the per-call tables, the GPU sharing check, the count and timer it starts with,
the stand-ins while its split is under way, and a child made by ncclCommSplit. Nothing here runs
per collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gridcomm._backends.base import Hooks
from gridcomm._backends.nccl import sharing
from gridcomm._backends.nccl.engines import _TYPE_NAMES
from gridcomm._backends.nccl.sampler import GpuSampler
from gridcomm._backends.nccl.timing import GpuTimer
from gridcomm._errors import GridcommError

if TYPE_CHECKING:
    from gridcomm._backends.nccl.backend import NcclBackend

# Why the backend's logger: these lines read as they did when this was part of it.
log = logging.getLogger("gridcomm._backends.nccl.backend")


def _check_sharing(cupy: Any, eng: Any, unique_id: bytes, rank: int, size: int) -> sharing.Marker | None:
    """sharing.check for the current device (named by its PCI bus id: CUDA_VISIBLE_DEVICES
    renumbers devices per process). Skipped, with a debug line, where CUDA cannot name it."""
    try:
        gpu = str(cupy.cuda.Device().pci_bus_id)
    except Exception as exc:  # noqa: BLE001 - CUDA errors: NCCL's own init reports them
        log.debug("rank %d: GPU sharing not checked: %s", rank, exc)
        return None
    try:
        version = int(eng.version())
    except Exception as exc:  # noqa: BLE001 - an unknown version is checked as new enough
        log.debug("rank %d: NCCL version unknown: %s", rank, exc)
        version = sharing.MULTI_RANK_MIN_NCCL
    return sharing.check(unique_id, gpu, rank, size, version)


class _Count:
    """A count nobody reads (until the communicator hands the backend its tracker)."""

    __slots__ = ("entered", "kind", "stream", "record")

    def __init__(self) -> None:
        self.entered = 0
        self.kind = ""
        self.stream: Any = None
        #: No flight record (with GRIDCOMM_DEBUG=collectives the communicator's wrappers keep it).
        self.record: Any = None


def _timer(cupy: Any) -> GpuTimer | None:
    """Timing events for this device's collectives (see timing), None where CUDA refuses them."""
    try:
        return GpuTimer(lambda: cupy.cuda.Event(disable_timing=False), cupy.cuda.runtime.streamIsCapturing)
    except Exception as exc:  # noqa: BLE001 - no straggler figure, but the communicator works
        log.debug("NCCL collectives are not timed: %s", exc)
        return None


def call_tables(cupy: Any, eng: Any) -> tuple[dict[Any, tuple[int, int]], dict[str, int], dict[int, tuple[int, int]],
                                          dict[str, dict[int, tuple[int, int, int]]]]:
    """The backend's per-call tables for this engine: ``(_dtypes, _ops, _by_id, _reduce_by_id)``."""
    # Precomputed tables: dtype -> (NCCL type, elements per array element), op -> NCCL op.
    dtypes: dict[Any, tuple[int, int]] = {}
    for name in _TYPE_NAMES:
        dtypes[cupy.dtype(name)] = (eng.types[name], 1)
    dtypes[cupy.dtype("complex64")] = (eng.types["float32"], 2)
    dtypes[cupy.dtype("complex128")] = (eng.types["float64"], 2)
    if "bfloat16" in eng.types:
        try:  # CuPy 14 knows "bfloat16" through ml_dtypes
            dtypes[cupy.dtype("bfloat16")] = (eng.types["bfloat16"], 1)
        except TypeError:
            pass
    ops = dict(eng.ops)
    # The per-call tables are keyed by id(dtype): hashing a NumPy dtype costs more than the rest
    # of a fast path. The dtype objects are held by the backend's _dtypes, so an id found here is that
    # very dtype; any other object (an equal dtype included) misses and takes the checked path.
    #   id(dtype) -> (NCCL type, elements per array element)
    #   op -> id(dtype) -> (NCCL type, elements per array element, NCCL op), valid pairs only
    #   (complex: sum only; avg: floating types only).
    by_id: dict[int, tuple[int, int]] = {id(dt): entry for dt, entry in dtypes.items()}
    reduce_by_id: dict[str, dict[int, tuple[int, int, int]]] = {op: {} for op in ops}
    for dt, (nccl_type, mult) in dtypes.items():
        for op, code in ops.items():
            if (mult == 2 and op != "sum") or (op == "avg" and dt.kind != "f" and dt.name != "bfloat16"):
                continue
            reduce_by_id[op][id(dt)] = (nccl_type, mult, code)
    return dtypes, ops, by_id, reduce_by_id


def defer_to_first_call(backend: NcclBackend) -> None:
    """nccl4py: the blocking child the calls run on is still being split off (see
    engines._Split). Until it is up, each per-call function and group_start is a stand-in
    that waits for it, puts the real functions back and makes the call with the child's
    handle (every function takes the communicator second to last). After that the fast
    paths are exactly what they were: not one check per call is added. Code that reads the
    per-call functions or the handle itself (the benchmarks) calls :meth:`NcclBackend.ready` first."""
    backend._c = backend._engine.null
    real = {name: getattr(backend, name) for name in backend._PER_CALL}
    group_start = backend._group_start
    backend._pending = (real, group_start)

    def deferred(fn: Callable[..., Any]) -> Callable[..., Any]:
        def first(*args: Any) -> Any:
            return fn(*args[:-2], backend.ready(), args[-1])
        return first

    def first_group_start() -> None:
        backend.ready()
        group_start()

    for name, fn in real.items():
        setattr(backend, name, deferred(fn))
    backend._group_start = first_group_start


def split_child(parent: NcclBackend, color: int, key: int, new_rank: int, new_size: int,
                hooks: Hooks) -> NcclBackend | None:
    """:meth:`NcclBackend.split` (see there)."""
    split = getattr(parent._owner, "commSplit", None) if parent.engine == "cupy" else None
    if split is None:
        return None
    try:
        comm = split(color, key)
    except Exception as exc:  # noqa: BLE001 - NcclError
        raise GridcommError(f"rank {parent.rank}: ncclCommSplit(color={color}, key={key}) failed: {exc}") from exc
    if color < 0:
        return None
    from gridcomm._backends.nccl.backend import NcclBackend

    child = object.__new__(NcclBackend)
    child.__dict__.update(parent.__dict__)
    child.rank, child.world_size, child._owner, child._c = new_rank, new_size, comm, comm
    child._marker = None  # the parent's mark is the parent's to remove
    child.progress = _Count()  # the communicator hands the child its own tracker
    child._timer = _timer(parent._cupy)  # its own collectives, its own samples
    child._sampler = GpuSampler(parent._device_id, timer=child._timer)
    child.on_invalid = hooks.on_invalid
    return child


def exchange_ints(backend: NcclBackend, values: list[int]) -> list[list[int]]:
    """:meth:`NcclBackend.exchange_ints` (see there)."""
    cupy = backend._cupy
    mine = cupy.asarray(values, dtype=cupy.int64)
    out = cupy.empty(len(values) * backend.world_size, dtype=cupy.int64)
    backend.all_gather(mine, out, len(values))
    return out.get().reshape(backend.world_size, len(values)).tolist()


def unmark(backend: NcclBackend) -> None:
    """What goes with the communicator: the sampler's thread, this rank's GPU marker."""
    sampler = getattr(backend, "_sampler", None)
    if sampler is not None:
        sampler.stop()
    marker, backend._marker = getattr(backend, "_marker", None), None
    if marker is not None:
        marker.remove()
