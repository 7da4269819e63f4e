"""gridcomm against raw NCCL with several ranks (2 and 4 by default), side by side in the same
processes, on whatever GPUs there are: a GPU per rank where there are enough, else ranks share
GPUs in NCCL's multi-rank mode (NCCL >= 2.30, as ``gridcomm launch`` sets it up).

Per world size, each rank process measures, in this order:

- ``init``: raw NCCL init (CuPy's ncclCommInitRank, its unique ID through a file, as a
  hand-rolled launcher would) and the same + a first 4 B all_reduce, synchronised; then
  ``gridcomm.init_process_group`` (rendezvous on rank 0's embedded coordinator, the unique ID
  through it, the engine's bounded init) and the same + a first all_reduce;
- ``per call``: 4 B and 1 MiB float32 all_reduce, ``--calls`` back to back then one synchronise,
  in alternating rounds: gridcomm's ``comm.all_reduce``, CuPy's ``NcclCommunicator.allReduce``
  (raw) and, with the nccl4py engine, nccl4py's low-level call on gridcomm's own communicator.

The table shows, per world size, the slowest rank's median over ``--rounds`` and the ratios to
raw. Standing targets: per call <= 1.10x raw, init <= raw + 20 ms.

    PYTHONPATH=$PWD python3 benchmarks/nccl_ranks.py [--worlds 2 4] [--rounds 11] [--calls 200] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _raw_id(folder: str, rank: int) -> Any:
    from cupy.cuda import nccl

    path = os.path.join(folder, "nccl-id")
    if rank == 0:
        uid = bytes(int(c) & 0xFF for c in nccl.get_unique_id())
        with open(path + ".tmp", "wb") as out:
            out.write(uid)
        os.rename(path + ".tmp", path)
        return uid
    deadline = time.monotonic() + 120
    while not os.path.exists(path):  # a benchmark's stand-in for a launcher's key-value store
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 wrote no NCCL unique ID within 120 s")
        time.sleep(0.001)
    with open(path, "rb") as src:
        return src.read()


def worker(world: int, rank: int, folder: str, rounds: int, calls: int) -> dict[str, Any]:
    import cupy
    from cupy.cuda import nccl

    import gridcomm
    from gridcomm._backends.nccl import engines

    out: dict[str, Any] = {"rank": rank}
    x = cupy.ones(1, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream()
    # raw NCCL
    t0 = time.perf_counter()
    uid = _raw_id(folder, rank)
    try:
        raw = nccl.NcclCommunicator(world, uid, rank)
    except TypeError:  # older CuPy: a tuple of signed chars
        raw = nccl.NcclCommunicator(world, tuple(b - 256 if b > 127 else b for b in uid), rank)
    out["raw_init_ms"] = (time.perf_counter() - t0) * 1e3
    raw.allReduce(x.data.ptr, x.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    stream.synchronize()
    out["raw_first_ms"] = (time.perf_counter() - t0) * 1e3
    # gridcomm
    t0 = time.perf_counter()
    comm = gridcomm.init_process_group(world, rank, backend="nccl")
    out["gridcomm_init_ms"] = (time.perf_counter() - t0) * 1e3
    comm.all_reduce(x, x)
    stream.synchronize()
    out["gridcomm_first_ms"] = (time.perf_counter() - t0) * 1e3
    backend = comm._backend
    handle = backend.ready()
    out["engine"] = backend.engine
    out["nccl"] = engines.nccl_version(backend.engine)
    low = backend._engine if backend.engine == "nccl4py" else None
    for size, label in ((1, "4B"), (1 << 18, "1MiB")):
        a = cupy.ones(size, dtype=cupy.float32)
        b = cupy.empty_like(a)
        ways: dict[str, Any] = {
            "gridcomm": lambda a=a, b=b: comm.all_reduce(a, b),
            "raw": lambda a=a, b=b, n=size: raw.allReduce(a.data.ptr, b.data.ptr, n, nccl.NCCL_FLOAT32,
                                                          nccl.NCCL_SUM, stream.ptr),
        }
        if low is not None:
            f32, op = low.types["float32"], low.ops["sum"]
            ways["nccl4py"] = lambda a=a, b=b, n=size, t=f32, o=op: low.all_reduce(a.data.ptr, b.data.ptr, n, t, o, handle,
                                                                      stream.ptr)
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, call in ways.items():
                call()
                stream.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                stream.synchronize()
                samples[name].append((time.perf_counter() - start) / calls * 1e6)
        out[label] = {name: statistics.median(values) for name, values in samples.items()}
    comm.stop()
    raw.destroy()
    return out


def run(world: int, rounds: int, calls: int) -> list[dict[str, Any]]:
    from gridcomm._backends import nccl as _nccl
    from gridcomm._backends.nccl import sharing
    from gridcomm._cli.placement import visible_gpus

    gpus = visible_gpus(dict(os.environ))
    if not gpus:
        import cupy

        gpus = [str(i) for i in range(int(cupy.cuda.runtime.getDeviceCount()))]
    if len(gpus) < world and _nccl.nccl_version() < sharing.MULTI_RANK_MIN_NCCL:
        raise SystemExit(f"world size {world} on {len(gpus)} GPU(s) needs NCCL >= 2.30; this NCCL is "
                         f"{sharing.version_text(_nccl.nccl_version())}")
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for rank in range(world):
            env = dict(os.environ, GRIDCOMM_PORT=str(port), GRIDCOMM_BIND="127.0.0.1", GRIDCOMM_HOST="127.0.0.1",
                       CUDA_VISIBLE_DEVICES=gpus[rank % len(gpus)])
            if len(gpus) < world:
                env.update({k: v for k, v in sharing.MODE_ENV.items() if k not in os.environ})
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(world), str(rank), folder,
                                           str(rounds), str(calls)], env=env, stdout=subprocess.PIPE, text=True))
        results = []
        for proc in procs:
            stdout, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"a rank of world size {world} exited {proc.returncode}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def table(world: int, results: list[dict[str, Any]]) -> str:
    slow = {key: max(r[key] for r in results) for key in ("raw_init_ms", "raw_first_ms", "gridcomm_init_ms",
                                                            "gridcomm_first_ms")}
    lines = [f"### world size {world} (engine {results[0]['engine']}, NCCL {results[0]['nccl']})", "",
             "| measure | raw NCCL | gridcomm | gridcomm - raw |", "| --- | --- | --- | --- |",
             f"| init | {slow['raw_init_ms']:.1f} ms | {slow['gridcomm_init_ms']:.1f} ms | "
             f"{slow['gridcomm_init_ms'] - slow['raw_init_ms']:+.1f} ms |",
             f"| init + first all_reduce | {slow['raw_first_ms']:.1f} ms | {slow['gridcomm_first_ms']:.1f} ms | "
             f"{slow['gridcomm_first_ms'] - slow['raw_first_ms']:+.1f} ms |", "",
             "| all_reduce per call | raw (CuPy) | nccl4py's call | gridcomm | gridcomm / raw |",
             "| --- | --- | --- | --- | --- |"]
    for label in ("4B", "1MiB"):
        worst = {name: max(r[label].get(name, 0.0) for r in results) for name in ("raw", "nccl4py", "gridcomm")}
        n4 = f"{worst['nccl4py']:.2f} us" if worst["nccl4py"] else "-"
        lines.append(f"| {label} | {worst['raw']:.2f} us | {n4} | {worst['gridcomm']:.2f} us | "
                     f"{worst['gridcomm'] / worst['raw']:.3f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        world, rank, folder, rounds, calls = sys.argv[2:7]
        print(json.dumps(worker(int(world), int(rank), folder, int(rounds), int(calls))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    everything = {}
    for world in args.worlds:
        results = run(world, args.rounds, args.calls)
        everything[str(world)] = results
        print(table(world, results), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(everything, out, indent=1)


if __name__ == "__main__":
    main()
