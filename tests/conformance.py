# ruff: noqa: B023 - each @case body runs at once, inside its loop iteration
"""The communicator conformance worker: one OS process per rank, any backend.

Runs every method x every dtype x every valid op on fresh random data and checks the result
against a NumPy reference computed locally (every rank can regenerate every other rank's input
from the shared seed). Also checks that invalid arguments raise the shared validation errors
on every backend, and that split and barrier work. Prints "CASE name ok|FAIL ..." lines and a
final "SUMMARY passed=N failed=M" line; exits non-zero on any failure.

Environment: GRIDCOMM_RANK, GRIDCOMM_WORLD_SIZE, GRIDCOMM_PORT (and GRIDCOMM_BIND), BACKEND,
SEED, SIZE (elements per rank in each case; 7 by default, larger to reach the host backend's
bandwidth algorithms and its shared memory). The host backend also prints a "TRANSPORTS" line:
how each of this rank's links moved its payloads.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
import zlib

import numpy as np

import gridcomm

BACKEND = os.environ.get("BACKEND", "host")
SEED = int(os.environ.get("SEED", "1234"))
SIZE = int(os.environ.get("SIZE", "7"))
RANK = int(os.environ["GRIDCOMM_RANK"])
WORLD = int(os.environ["GRIDCOMM_WORLD_SIZE"])

if BACKEND == "nccl":
    import cupy as xp

    def to_numpy(a):
        return xp.asnumpy(a)

    def sync():
        xp.cuda.get_current_stream().synchronize()
else:
    xp = np

    def to_numpy(a):
        return np.asarray(a)

    def sync():
        pass

DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "complex64",
          "complex128"]
if BACKEND == "nccl":
    try:
        xp.dtype("bfloat16")  # CuPy 14 with ml_dtypes
        DTYPES.append("bfloat16")
    except TypeError:
        pass
OPS = ["sum", "prod", "min", "max", "avg"]
NP_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def valid_op(dtype: str, op: str) -> bool:
    kind = np.dtype("float32").kind if dtype == "bfloat16" else np.dtype(dtype).kind
    if kind == "c":
        return op == "sum"
    if op == "avg":
        return kind == "f"
    return True


def data(rank: int, tag: str, shape, dtype: str) -> np.ndarray:
    """Rank ``rank``'s input for case ``tag``: reproducible on every rank, small values so prod
    over a few ranks stays exact in every integer type."""
    rng = np.random.default_rng([SEED, rank, zlib.crc32(tag.encode())])
    if dtype == "bfloat16":
        return rng.integers(-4, 5, size=shape).astype(np.float32)
    dt = np.dtype(dtype)
    if dt.kind == "c":
        return (rng.integers(-8, 9, size=shape) + 1j * rng.integers(-8, 9, size=shape)).astype(dt)
    if dt.kind == "u":
        return rng.integers(1, 4, size=shape).astype(dt)
    if dt.kind == "i":
        return rng.integers(-3, 4, size=shape).astype(dt)
    return (rng.standard_normal(size=shape) * 2).astype(dt)


def device(a: np.ndarray, dtype: str):
    if dtype == "bfloat16":
        return xp.asarray(a).astype("bfloat16")
    return xp.asarray(a)


def host(a, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return to_numpy(a.astype(xp.float32))
    return to_numpy(a)


def reference(op: str, arrays: list[np.ndarray], dtype: str) -> np.ndarray:
    if op == "avg":
        return (functools.reduce(np.add, [a.astype(np.float64) for a in arrays]) / len(arrays))
    return functools.reduce(NP_OPS[op], arrays)


def check(got: np.ndarray, want: np.ndarray, dtype: str, ranks: int) -> None:
    kind = "f" if dtype == "bfloat16" else np.dtype(dtype).kind
    if kind in "iub":
        np.testing.assert_array_equal(got, want)
        return
    tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "complex64": 1e-5}.get(dtype, 1e-12)
    np.testing.assert_allclose(got.astype(np.complex128 if kind == "c" else np.float64),
                               want.astype(np.complex128 if kind == "c" else np.float64),
                               rtol=tol, atol=tol * ranks * 4)


RESULTS = {"passed": 0, "failed": 0}


def case(name: str):
    def wrap(fn):
        try:
            fn()
            sync()
            RESULTS["passed"] += 1
            print(f"CASE {name} ok", flush=True)
        except Exception:  # noqa: BLE001 - report and continue with the next case
            RESULTS["failed"] += 1
            print(f"CASE {name} FAIL\n{traceback.format_exc()}", flush=True)
        return fn
    return wrap


def run(comm: gridcomm.Communicator) -> None:
    W, R = comm.world_size, comm.rank
    n = SIZE  # odd sizes catch off-by-one chunking
    for dtype in DTYPES:
        for op in OPS:
            if not valid_op(dtype, op):
                continue

            @case(f"all_reduce/{dtype}/{op}")
            def _():
                tag = f"ar{dtype}{op}"
                ins = [data(r, tag, (n, 3), dtype) for r in range(W)]
                x = device(ins[R], dtype)
                y = xp.zeros_like(x)
                comm.all_reduce(x, y, op=op)
                sync()
                check(host(y, dtype), reference(op, ins, dtype), dtype, W)

            @case(f"reduce/{dtype}/{op}")
            def _():
                tag = f"rd{dtype}{op}"
                root = W - 1
                ins = [data(r, tag, (n,), dtype) for r in range(W)]
                x = device(ins[R], dtype)
                y = xp.zeros_like(x)
                comm.reduce(x, y, root=root, op=op)
                sync()
                if R == root:
                    check(host(y, dtype), reference(op, ins, dtype), dtype, W)

            @case(f"reduce_scatter/{dtype}/{op}")
            def _():
                tag = f"rs{dtype}{op}"
                ins = [data(r, tag, (W * n,), dtype) for r in range(W)]
                x = device(ins[R], dtype)
                y = device(np.zeros(n, dtype=np.float32 if dtype == "bfloat16" else dtype), dtype)
                comm.reduce_scatter(x, y, n, op=op)
                sync()
                check(host(y, dtype), reference(op, ins, dtype)[R * n:(R + 1) * n], dtype, W)

        @case(f"broadcast/{dtype}")
        def _():
            root = 1 % W
            want = data(root, f"bc{dtype}", (n, 2), dtype)
            x = device(want if R == root else np.zeros_like(want), dtype)
            comm.broadcast(x, root=root)
            sync()
            check(host(x, dtype), want, dtype, 1)

        @case(f"all_gather/{dtype}")
        def _():
            ins = [data(r, f"ag{dtype}", (n,), dtype) for r in range(W)]
            x = device(ins[R], dtype)
            y = device(np.zeros(W * n, dtype=ins[R].dtype), dtype)
            comm.all_gather(x, y, n)
            sync()
            check(host(y, dtype), np.concatenate(ins), dtype, 1)

        @case(f"send_recv/{dtype}")
        def _():
            # Pairs (0,1), (2,3), ...; an odd rank out exchanges with itself.
            partner = R ^ 1 if (R ^ 1) < W else R
            mine = data(R, f"sr{dtype}", (n,), dtype)
            x = device(mine, dtype)
            y = device(np.zeros_like(mine), dtype)
            comm.send_recv(x, y, partner)
            sync()
            check(host(y, dtype), data(partner, f"sr{dtype}", (n,), dtype), dtype, 1)

        @case(f"send+recv/{dtype}")
        def _():
            if W == 1:
                return
            # Even ranks send first, odd ranks receive first: no deadlock on any backend.
            mine = data(R, f"p2p{dtype}", (n,), dtype)
            x = device(mine, dtype)
            y = device(np.zeros_like(mine), dtype)
            partner = R ^ 1
            if partner >= W:
                return
            if R % 2 == 0:
                comm.send(x, partner)
                comm.recv(y, partner)
            else:
                comm.recv(y, partner)
                comm.send(x, partner)
            sync()
            check(host(y, dtype), data(partner, f"p2p{dtype}", (n,), dtype), dtype, 1)

        @case(f"scatter/{dtype}")
        def _():
            root = 0
            full = data(root, f"sc{dtype}", (W, n), dtype)
            x = device(full if R == root else np.zeros_like(full), dtype)
            y = device(np.zeros(n, dtype=full.dtype), dtype)
            comm.scatter(x, y, root=root)
            sync()
            check(host(y, dtype), full[R], dtype, 1)

        @case(f"gather/{dtype}")
        def _():
            root = W - 1
            ins = [data(r, f"ga{dtype}", (n,), dtype) for r in range(W)]
            x = device(ins[R], dtype)
            y = device(np.zeros((W, n), dtype=ins[R].dtype), dtype)
            comm.gather(x, y, root=root)
            sync()
            if R == root:
                check(host(y, dtype), np.stack(ins), dtype, 1)

        @case(f"all_to_all/{dtype}")
        def _():
            ins = [data(r, f"aa{dtype}", (W, n), dtype) for r in range(W)]
            x = device(ins[R], dtype)
            y = device(np.zeros((W, n), dtype=ins[R].dtype), dtype)
            comm.all_to_all(x, y)
            sync()
            check(host(y, dtype), np.stack([ins[s][R] for s in range(W)]), dtype, 1)

    @case("large all_reduce (crosses the gRPC message limit on host)")
    def _():
        size = (24 * 1024 * 1024 if BACKEND == "host" else 64 * 1024 * 1024) // 4
        x = xp.full(size, R + 1, dtype=xp.float32)
        y = xp.empty_like(x)
        comm.all_reduce(x, y)
        sync()
        got = host(y, "float32")
        assert got[0] == got[-1] == W * (W + 1) / 2, (got[0], got[-1])

    if BACKEND == "host":
        @case("results are bit-identical on every rank")
        def _():
            # Random floats, so every rounding shows: each rank's result, hashed, must be the
            # same everywhere (small sizes take recursive doubling, large ones the ring).
            for shape in [(5,), (W * 50_000 + 3,)]:
                for op in ("sum", "prod", "min", "max", "avg"):
                    x = np.random.default_rng([SEED, R, shape[0]]).standard_normal(shape).astype(np.float32)
                    y = np.empty_like(x)
                    comm.all_reduce(x, y, op=op)
                    mine = np.array([zlib.crc32(y.tobytes())], dtype=np.int64)
                    every = np.empty(W, dtype=np.int64)
                    comm.all_gather(mine, every, 1)
                    assert len(set(every.tolist())) == 1, (shape, op, every)

    def check_invalid() -> None:
        x = xp.zeros(4, dtype=xp.float32)
        bad = [
            (lambda: comm.all_reduce(x, x, op="bogus"), "op='bogus' is not a reduction"),
            (lambda: comm.all_reduce(xp.zeros(4, dtype=xp.int16), xp.zeros(4, dtype=xp.int16)), "int16"),
            (lambda: comm.all_reduce(x, xp.zeros(5, dtype=xp.float32)), "out_array has 5 elements"),
            (lambda: comm.all_reduce(x, xp.zeros(4, dtype=xp.float64)), "dtype float64 but in_array has float32"),
            (lambda: comm.all_reduce(xp.zeros((4, 4), dtype=xp.float32)[:, 1], xp.zeros(4, dtype=xp.float32)),
             "not contiguous"),
            (lambda: comm.all_reduce(xp.zeros(4, dtype=xp.complex64), xp.zeros(4, dtype=xp.complex64), op="max"),
             "complex"),
            (lambda: comm.all_reduce(xp.zeros(4, dtype=xp.int32), xp.zeros(4, dtype=xp.int32), op="avg"),
             "floating dtype"),
            (lambda: comm.broadcast(x, root=W), f"root={W} is out of range for world size {W}"),
            (lambda: comm.reduce(x, x, root=-1), "root=-1 is out of range"),
            (lambda: comm.send(x, R), "is this rank itself"),
            (lambda: comm.recv(x, W + 3), "out of range"),
            (lambda: comm.scatter(xp.zeros((W + 1, 4), dtype=xp.float32), x, root=R), "first dimension must equal"),
            (lambda: comm.all_to_all(xp.zeros((W + 1, 4), dtype=xp.float32), xp.zeros((W + 1, 4), dtype=xp.float32)),
             "first dimension must equal"),
            (lambda: comm.reduce_scatter(xp.zeros(W * 4 + 1, dtype=xp.float32), x, 4), "count x world size"),
            (lambda: comm.all_gather(x, xp.zeros(W * 4 - 1, dtype=xp.float32), 4), "count x world size"),
            (lambda: comm.all_reduce([1, 2], [1, 2]), "must be an array"),
        ]
        for call, words in bad:
            try:
                call()
            except gridcomm.ArgumentError as exc:
                assert words in str(exc), f"{words!r} not in {exc}"
            else:
                raise AssertionError(f"no ArgumentError for the case expecting {words!r}")
        y = xp.full(4, 1.0, dtype=xp.float32)
        comm.all_reduce(y, y)
        sync()
        assert float(host(y, "float32")[0]) == W

    @case("invalid arguments raise the shared errors (backend level)")
    def _():
        # White-box: with the communicator's hook detached, an invalid call only raises, so
        # every rule can be checked in one job. Through the communicator, the first invalid
        # call fails the rank (tests/test_failures.py checks that peers are told).
        hook, comm._backend.on_invalid = comm._backend.on_invalid, None
        try:
            check_invalid()
        finally:
            comm._backend.on_invalid = hook

    @case("split by parity, all_reduce and barrier inside")
    def _():
        sub = comm.split(R % 2, key=-R)  # key reverses the order inside each group
        mates = [r for r in range(W) if r % 2 == R % 2]
        assert sub.world_size == len(mates)
        assert sub.rank == sorted(mates, reverse=True).index(R), (sub.rank, mates)
        x = xp.full(3, R, dtype=xp.int64)
        sub.all_reduce(x, x)
        sync()
        assert int(host(x, "int64")[0]) == sum(mates)
        sub.barrier("inside")
        none = comm.split(None)
        assert none is None

    @case("barrier, twice back to back")
    def _():
        comm.barrier()
        comm.barrier("named")


def main() -> int:
    comm = gridcomm.init_process_group(WORLD, RANK, backend=BACKEND)
    try:
        run(comm)
        if BACKEND == "host":
            print("TRANSPORTS " + json.dumps(comm._backend.transports()), flush=True)
    finally:
        comm.stop()
    print(f"SUMMARY passed={RESULTS['passed']} failed={RESULTS['failed']}", flush=True)
    return 1 if RESULTS["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
