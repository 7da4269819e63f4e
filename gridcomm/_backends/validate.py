"""Argument checks shared by the NCCL and host backends, so both refuse the same calls with the
same words. Duck-typed over NumPy and CuPy arrays (``shape``, ``size``, ``dtype``, ``flags``);
imports neither. Each error names the method, the argument, the value and the rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from gridcomm._errors import ArgumentError

_F = TypeVar("_F", bound=Callable[..., Any])


def reports_invalid(method: _F) -> _F:
    """Backend method decorator: an ArgumentError is passed to the backend's ``on_invalid`` hook
    before it propagates, since peers may already wait inside the collective (the communicator
    reports the rank failed, so they get RankFailedError instead of hanging)."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except ArgumentError as exc:
            hook = self.on_invalid
            if hook is not None:
                hook(exc)
            raise

    return wrapped  # type: ignore[return-value]

OPS = ("sum", "prod", "min", "max", "avg")

#: (kind, itemsize) of the dtypes both backends carry; complex travels as pairs of its real type.
_SUPPORTED = {
    ("i", 1), ("u", 1), ("i", 4), ("u", 4), ("i", 8), ("u", 8),
    ("f", 2), ("f", 4), ("f", 8), ("c", 8), ("c", 16),
}


def dtype_supported(dtype: Any) -> bool:
    return (dtype.kind, dtype.itemsize) in _SUPPORTED or dtype.name == "bfloat16"


def check_dtype(method: str, name: str, array: Any) -> None:
    dtype = array.dtype
    if not dtype_supported(dtype):
        raise ArgumentError(
            f"{method}: {name} has dtype {dtype.name}, which NCCL cannot carry; use one of int8, uint8, int32, "
            "uint32, int64, uint64, float16, bfloat16, float32, float64, complex64, complex128."
        )


def check_op(method: str, op: Any, dtype: Any) -> None:
    if op not in OPS:
        raise ArgumentError(f"{method}: op={op!r} is not a reduction; use one of {', '.join(OPS)}.")
    if dtype.kind == "c" and op != "sum":
        raise ArgumentError(f"{method}: op={op!r} is not defined for complex arrays ({dtype.name}); only 'sum' is.")
    if op == "avg" and dtype.kind != "f" and dtype.name != "bfloat16":
        raise ArgumentError(f"{method}: op='avg' needs a floating dtype, not {dtype.name}; use 'sum' and divide.")


def check_contiguous(method: str, name: str, array: Any) -> None:
    for attr in ("shape", "dtype", "flags", "size"):
        if not hasattr(array, attr):
            raise ArgumentError(f"{method}: {name} must be an array (NumPy or CuPy), not {type(array).__name__}.")
    flags = array.flags
    if not (flags.c_contiguous or flags.f_contiguous):
        raise ArgumentError(f"{method}: {name} with shape {tuple(array.shape)} is not contiguous; pass "
                            "array.copy() or cupy.ascontiguousarray(array).")


def check_array(method: str, name: str, array: Any) -> None:
    check_contiguous(method, name, array)
    check_dtype(method, name, array)


def check_rank(method: str, name: str, value: Any, world_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise ArgumentError(f"{method}: {name}={value!r} must be an integer rank.")
    value = int(value)
    if not 0 <= value < world_size:
        raise ArgumentError(f"{method}: {name}={value} is out of range for world size {world_size}; "
                            f"ranks are 0..{world_size - 1}.")
    return value


def check_same_dtype(method: str, a: Any, b: Any) -> None:
    if a.dtype != b.dtype:
        raise ArgumentError(f"{method}: out_array has dtype {b.dtype.name} but in_array has {a.dtype.name}; "
                            "they must match.")


def check_count(method: str, count: Any) -> int:
    if isinstance(count, bool) or not hasattr(count, "__index__") or int(count) < 0:
        raise ArgumentError(f"{method}: count={count!r} must be a non-negative integer.")
    return int(count)


def _size(method: str, name: str, array: Any, expected: int, rule: str) -> None:
    if array.size != expected:
        raise ArgumentError(f"{method}: {name} has {array.size} elements, but {rule} ({expected}).")


def _leading(method: str, name: str, array: Any, world_size: int) -> None:
    if not array.flags.c_contiguous:
        raise ArgumentError(f"{method}: {name} must be C-contiguous, since it is cut into one slice per rank along "
                            "its first dimension; pass cupy.ascontiguousarray(array).")
    if len(array.shape) == 0 or array.shape[0] != world_size:
        raise ArgumentError(f"{method}: {name} has shape {tuple(array.shape)}; its first dimension must equal the "
                            f"world size ({world_size}), one slice per rank.")


def all_reduce(in_array: Any, out_array: Any, op: Any) -> None:
    check_array("all_reduce", "in_array", in_array)
    check_contiguous("all_reduce", "out_array", out_array)
    check_same_dtype("all_reduce", in_array, out_array)
    check_op("all_reduce", op, in_array.dtype)
    _size("all_reduce", "out_array", out_array, in_array.size, "it must hold as many as in_array")


def reduce(in_array: Any, out_array: Any, root: Any, op: Any, rank: int, world_size: int) -> int:
    check_array("reduce", "in_array", in_array)
    root = check_rank("reduce", "root", root, world_size)
    check_op("reduce", op, in_array.dtype)
    if rank == root:
        check_contiguous("reduce", "out_array", out_array)
        check_same_dtype("reduce", in_array, out_array)
        _size("reduce", "out_array", out_array, in_array.size, "on the root it must hold as many as in_array")
    return root


def broadcast(array: Any, root: Any, world_size: int) -> int:
    check_array("broadcast", "in_out_array", array)
    return check_rank("broadcast", "root", root, world_size)


def reduce_scatter(in_array: Any, out_array: Any, count: Any, op: Any, world_size: int) -> int:
    check_array("reduce_scatter", "in_array", in_array)
    check_contiguous("reduce_scatter", "out_array", out_array)
    check_same_dtype("reduce_scatter", in_array, out_array)
    check_op("reduce_scatter", op, in_array.dtype)
    count = check_count("reduce_scatter", count)
    _size("reduce_scatter", "in_array", in_array, count * world_size, "it must hold count x world size")
    _size("reduce_scatter", "out_array", out_array, count, "it must hold count")
    return count


def all_gather(in_array: Any, out_array: Any, count: Any, world_size: int) -> int:
    check_array("all_gather", "in_array", in_array)
    check_contiguous("all_gather", "out_array", out_array)
    check_same_dtype("all_gather", in_array, out_array)
    count = check_count("all_gather", count)
    _size("all_gather", "in_array", in_array, count, "it must hold count")
    _size("all_gather", "out_array", out_array, count * world_size, "it must hold count x world size")
    return count


def peer(method: str, value: Any, rank: int, world_size: int, *, allow_self: bool = False) -> int:
    value = check_rank(method, "peer", value, world_size)
    if value == rank and not allow_self:
        raise ArgumentError(f"{method}: peer={value} is this rank itself; a {method} to oneself never completes.")
    return value


def send_recv(in_array: Any, out_array: Any, peer_rank: Any, rank: int, world_size: int) -> int:
    check_array("send_recv", "in_array", in_array)
    check_array("send_recv", "out_array", out_array)
    return peer("send_recv", peer_rank, rank, world_size, allow_self=True)


def scatter(in_array: Any, out_array: Any, root: Any, rank: int, world_size: int) -> int:
    root = check_rank("scatter", "root", root, world_size)
    check_array("scatter", "out_array", out_array)
    if rank == root:
        check_array("scatter", "in_array", in_array)
        check_same_dtype("scatter", in_array, out_array)
        _leading("scatter", "in_array", in_array, world_size)
        _size("scatter", "out_array", out_array, in_array.size // world_size, "it must hold one slice of in_array")
    return root


def gather(in_array: Any, out_array: Any, root: Any, rank: int, world_size: int) -> int:
    root = check_rank("gather", "root", root, world_size)
    check_array("gather", "in_array", in_array)
    if rank == root:
        check_contiguous("gather", "out_array", out_array)
        check_same_dtype("gather", in_array, out_array)
        _leading("gather", "out_array", out_array, world_size)
        _size("gather", "in_array", in_array, out_array.size // world_size, "it must hold one slice of out_array")
    return root


def all_to_all(in_array: Any, out_array: Any, world_size: int) -> None:
    check_array("all_to_all", "in_array", in_array)
    check_contiguous("all_to_all", "out_array", out_array)
    check_same_dtype("all_to_all", in_array, out_array)
    _leading("all_to_all", "in_array", in_array, world_size)
    _leading("all_to_all", "out_array", out_array, world_size)
    _size("all_to_all", "out_array", out_array, in_array.size, "it must hold as many as in_array")
