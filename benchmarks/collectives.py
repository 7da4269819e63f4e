"""GPU collectives: per-call time and bandwidth, gridcomm vs raw NcclCommunicator vs cupyx vs torch.

Two parts, printed as markdown tables (``--json PATH`` also writes every sample):

* Small collectives (4 B, 1 KiB, 64 KiB; float32): all_reduce, broadcast, all_gather, send_recv
  (one ncclGroup of send + recv; with one rank it exchanges with itself, which gridcomm's
  send_recv allows), and from 2 ranks a one-way send/recv pair (even ranks send, odd receive).
  Peers: gridcomm, raw ``cupy.cuda.nccl.NcclCommunicator`` (the same calls written by hand,
  pointers and the current stream read per call), ``cupyx.distributed`` NCCLBackend, and
  ``torch.distributed`` (NCCL) where torch imports with CUDA; absent peers are reported, not run.
  Each peer runs ``--calls`` back-to-back calls per block; blocks are interleaved over ``--rounds``
  rounds (the order rotates each round, so drift hits every peer alike). A row gives the median of
  the round times and the spread (min..max of the rounds); ratios are medians over raw's median,
  and in brackets the median of the per-round ratios (each peer's block over raw's block of the
  same round, which cancels slow drifts of the machine).
* A sweep of sizes (4 B to ``--sweep-max``, x``--sweep-step``) for all_reduce, all_gather and
  broadcast, gridcomm vs raw: time, algbw = bytes / time and busbw by the nccl-tests formulas
  (all_reduce algbw*2(n-1)/n, all_gather algbw*(n-1)/n, broadcast algbw). all_gather's size is
  its output (count x world size), as in nccl-tests. Calls per block target ~30 ms.

World size 1 runs in this process. ``--world-size N`` (N > 1) starts N processes of this script,
one GPU each (``CUDA_VISIBLE_DEVICES``); rank 0 hosts gridcomm's coordinator through
``gridcomm.init_process_group`` and the raw communicator's unique ID travels by a gridcomm
broadcast. Every timed block starts after a device barrier; times are rank 0's. Run it on the GPU
machine (``scripts/gpu_check.sh`` does, at world size 1 and, with 2+ GPUs, 2):

    python benchmarks/collectives.py [--world-size 2] [--rounds 7] [--calls 2000] [--json out.json]
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
from collections.abc import Callable
from typing import Any

# NVLink multicast stays off: on shared multi-GPU hosts it can take the GPUs out of service.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import cupy  # noqa: E402
import numpy  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

import gridcomm  # noqa: E402
from gridcomm._backends import nccl as gridcomm_nccl  # noqa: E402

SMALL_SIZES = (4, 1024, 64 * 1024)
PEERS = ("raw", "gridcomm", "cupyx", "torch", "rawgc")
BUSBW_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
F32 = nccl.NCCL_FLOAT32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sync() -> None:
    cupy.cuda.runtime.deviceSynchronize()  # every stream: torch runs NCCL on its own


class Bench:
    """One rank: the communicators of every peer, and the timing loops."""

    def __init__(self, args: argparse.Namespace, rank: int, ports: dict[str, int]) -> None:
        self.args, self.rank, self.ws = args, rank, args.world_size
        self.notes: dict[str, str] = {}
        cupy.cuda.Device(0).use()
        cupy.zeros(1).sum()  # CUDA context up before any init is timed
        t0 = time.perf_counter()
        self.comm = gridcomm.init_process_group(self.ws, rank, backend="nccl", host="127.0.0.1",
                                                port=ports["gridcomm"], timeout_s=120)
        self.grid_init_s = time.perf_counter() - t0
        uid = cupy.zeros(128, dtype=cupy.uint8)
        if rank == 0:
            uid.set(numpy.frombuffer(gridcomm_nccl.new_unique_id(), dtype=numpy.uint8))
        self.comm.broadcast(uid, root=0)
        as_bytes, as_tuple = gridcomm_nccl.id_forms(uid.get().tobytes())
        try:
            self.raw = nccl.NcclCommunicator(self.ws, as_bytes, rank)
        except TypeError:  # older CuPy takes a tuple of signed chars
            self.raw = nccl.NcclCommunicator(self.ws, as_tuple, rank)
        self._one = cupy.zeros(1, dtype=cupy.float32)
        self.ports = ports
        self.cx: Any = None
        self.torch: Any = None

    def init_peers(self) -> None:
        """cupyx and torch start only after the gridcomm-vs-raw parts: their threads and streams
        (torch's watchdog, cupyx's store process) then cannot disturb the headline ratios."""
        args = self.args
        self.cx = self._cupyx(self.ports["cupyx"]) if "cupyx" in args.peers else None
        self.torch = self._torch(self.ports["torch"]) if "torch" in args.peers else None
        for name in ("cupyx", "torch"):
            if name not in args.peers:
                self.notes.setdefault(name, "not run: left out with --peers")

    # ------------------------------------------------------------------ peers
    def agree(self, ok: bool) -> bool:
        """True only where every rank says True (so no rank waits for a peer another lacks)."""
        flag = cupy.array([1 if ok else 0], dtype=cupy.int32)
        self.comm.all_reduce(flag, flag, op="min")
        return bool(int(flag.get()[0]))

    def _cupyx(self, port: int) -> Any:
        why = ""
        try:
            import cupyx.distributed

        except Exception as exc:  # noqa: BLE001 - report and go on without the peer
            why = f"not run: importing cupyx.distributed failed: {exc!r}"
        if not self.agree(not why):
            self.notes["cupyx"] = why or "not run: unavailable on another rank"
            return None
        t0 = time.perf_counter()
        cx = cupyx.distributed.init_process_group(self.ws, self.rank, host="127.0.0.1", port=port)
        self.cupyx_init_s = time.perf_counter() - t0
        return cx

    def _torch(self, port: int) -> Any:
        why = ""
        try:
            import torch
            import torch.distributed as dist

            if not torch.cuda.is_available():
                why = "not run: torch imports but sees no CUDA device"
        except Exception as exc:  # noqa: BLE001 - ImportError where torch is absent
            why = f"not run: torch not installed on this machine ({exc!r})"
        if not self.agree(not why):
            self.notes["torch"] = why or "not run: unavailable on another rank"
            return None
        import datetime

        torch.cuda.set_device(0)
        kwargs: dict[str, Any] = dict(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                      world_size=self.ws, timeout=datetime.timedelta(seconds=120))
        try:
            dist.init_process_group(device_id=torch.device("cuda", 0), **kwargs)
        except TypeError:  # torch before 2.3 has no device_id
            dist.init_process_group(**kwargs)
        self.notes["torch"] = f"torch {torch.__version__} (its NCCL {torch.cuda.nccl.version()})"
        return torch

    def stop(self) -> None:
        if self.torch is not None:
            self.torch.distributed.destroy_process_group()
        self.comm.stop()

    # ------------------------------------------------------------------ timing
    def align(self) -> None:
        """A device barrier: the next timed block starts on every rank together."""
        if self.ws > 1:
            one = self._one
            self.raw.allReduce(one.data.ptr, one.data.ptr, 1, F32, nccl.NCCL_SUM, 0)
        sync()

    def time_block(self, fn: Callable[[], Any], calls: int) -> float:
        self.align()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - t0) / calls

    def rounds(self, impls: dict[str, Callable[[], Any]], calls: int, rounds: int) -> dict[str, list[float]]:
        for fn in impls.values():
            self.time_block(fn, max(10, calls // 10))  # warm-up (NCCL connects lazily)
        names = list(impls)
        samples: dict[str, list[float]] = {k: [] for k in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(self.time_block(impls[name], calls))
        return samples

    # ------------------------------------------------------------------ the calls
    def impls(self, op: str, count: int, peers: tuple[str, ...]) -> dict[str, Callable[[], Any]]:
        """Zero-argument calls of collective ``op`` over ``count`` float32 per rank, one per peer."""
        ws, rank, raw, comm, cx, torch = self.ws, self.rank, self.raw, self.comm, self.cx, self.torch
        out_count = count * ws if op == "all_gather" else count
        x = cupy.ones(count, dtype=cupy.float32)
        y = cupy.zeros(out_count, dtype=cupy.float32)
        peer = rank ^ 1 if (rank ^ 1) < ws else rank
        sends = rank % 2 == 0
        out: dict[str, Callable[[], Any]] = {"raw": self._raw_call(raw, op, x, y, peer, sends)}
        if "rawgc" in peers:  # raw calls on gridcomm's own communicator (tells call path from communicator)
            out["rawgc"] = self._raw_engine_call(comm._backend, op, x, y, peer, sends)
        out["gridcomm"] = self._api_call(comm, op, x, y, count, peer, sends)
        if "cupyx" in peers and cx is not None:
            out["cupyx"] = self._api_call(cx, op, x, y, count, peer, sends)
        if "torch" in peers and torch is not None:
            fn = self._torch_call(op, count, out_count, peer, sends)
            if fn is not None:
                out["torch"] = fn
        return {name: out[name] for name in PEERS if name in out}

    @staticmethod
    def _api_call(comm: Any, op: str, x: Any, y: Any, count: int, peer: int, sends: bool) -> Callable[[], Any]:
        """``op`` through the cupyx NCCLBackend API, which gridcomm's Communicator shares."""
        if op == "all_reduce":
            return lambda: comm.all_reduce(x, y, "sum")
        if op == "broadcast":
            return lambda: comm.broadcast(x, 0)
        if op == "all_gather":
            return lambda: comm.all_gather(x, y, count)
        if op == "send_recv":
            return lambda: comm.send_recv(x, y, peer)
        return (lambda: comm.send(x, peer)) if sends else (lambda: comm.recv(y, peer))

    @staticmethod
    def _raw_call(raw: Any, op: str, x: Any, y: Any, peer: int, sends: bool) -> Callable[[], Any]:
        """``op`` written by hand on an NcclCommunicator: pointers and the current stream read per call."""
        stream = cupy.cuda.get_current_stream
        if op == "all_reduce":
            return lambda: raw.allReduce(x.data.ptr, y.data.ptr, x.size, F32, nccl.NCCL_SUM, stream().ptr)
        if op == "broadcast":
            return lambda: raw.broadcast(x.data.ptr, x.data.ptr, x.size, F32, 0, stream().ptr)
        if op == "all_gather":
            return lambda: raw.allGather(x.data.ptr, y.data.ptr, x.size, F32, stream().ptr)
        if op == "send_recv":
            def raw_send_recv() -> None:
                s = stream().ptr
                nccl.groupStart()
                try:
                    raw.send(x.data.ptr, x.size, F32, peer, s)
                    raw.recv(y.data.ptr, y.size, F32, peer, s)
                finally:
                    nccl.groupEnd()

            return raw_send_recv
        if sends:
            return lambda: raw.send(x.data.ptr, x.size, F32, peer, stream().ptr)
        return lambda: raw.recv(y.data.ptr, y.size, F32, peer, stream().ptr)

    @staticmethod
    def _raw_engine_call(backend: Any, op: str, x: Any, y: Any, peer: int, sends: bool) -> Callable[[], Any]:
        """``op`` written by hand on gridcomm's own communicator, through its engine's per-call
        function (nccl4py's nccl.bindings.nccl.*, or CuPy's method): the call path without gridcomm's."""
        backend.ready()  # nccl4py: its split done, so the functions and handle read here are NCCL's own
        stream, c = cupy.cuda.get_current_stream, backend._c
        if op == "all_reduce":
            ar = backend._nccl_all_reduce
            return lambda: ar(x.data.ptr, y.data.ptr, x.size, F32, nccl.NCCL_SUM, c, stream().ptr)
        if op == "broadcast":
            bc = backend._nccl_broadcast
            return lambda: bc(x.data.ptr, x.data.ptr, x.size, F32, 0, c, stream().ptr)
        if op == "all_gather":
            ag = backend._nccl_all_gather
            return lambda: ag(x.data.ptr, y.data.ptr, x.size, F32, c, stream().ptr)
        send, recv, start, end = backend._nccl_send, backend._nccl_recv, backend._group_start, backend._group_end
        if op == "send_recv":
            def raw_send_recv() -> None:
                s = stream().ptr
                start()
                try:
                    send(x.data.ptr, x.size, F32, peer, c, s)
                    recv(y.data.ptr, y.size, F32, peer, c, s)
                finally:
                    end()

            return raw_send_recv
        if sends:
            return lambda: send(x.data.ptr, x.size, F32, peer, c, stream().ptr)
        return lambda: recv(y.data.ptr, y.size, F32, peer, c, stream().ptr)

    def _torch_call(self, op: str, count: int, out_count: int, peer: int, sends: bool) -> Callable[[], Any] | None:
        torch = self.torch
        dist = torch.distributed
        tx = torch.ones(count, dtype=torch.float32, device="cuda")
        ty = torch.zeros(out_count, dtype=torch.float32, device="cuda")
        if op == "all_reduce":
            return lambda: dist.all_reduce(tx)  # in place: torch has no out-of-place all_reduce
        if op == "broadcast":
            return lambda: dist.broadcast(tx, src=0)
        if op == "all_gather":
            return lambda: dist.all_gather_into_tensor(ty, tx)
        if peer == self.rank:
            return None  # torch's NCCL send/recv refuse oneself
        if op == "send_recv":
            def pair() -> None:
                ops = [dist.P2POp(dist.isend, tx, peer), dist.P2POp(dist.irecv, ty, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            return pair
        return (lambda: dist.send(tx, peer)) if sends else (lambda: dist.recv(ty, peer))

    # ------------------------------------------------------------------ the two parts
    def small(self, peers: tuple[str, ...], rounds: int) -> list[dict[str, Any]]:
        rows = []
        # One-way send/recv pairs rank 2k with 2k+1, so it needs an even world size.
        ops = ["all_reduce", "broadcast", "all_gather", "send_recv"] + (["send/recv"] if self.ws % 2 == 0 else [])
        for op in ops:
            for nbytes in SMALL_SIZES:
                impls = self.impls(op, nbytes // 4, peers)
                samples = self.rounds(impls, self.args.calls, rounds)
                rows.append({"op": op, "bytes": nbytes, "samples_s": samples})
                if self.rank == 0:
                    base = statistics.median(samples["raw"])
                    print(f"  {op} {human(nbytes)}: " + ", ".join(
                        f"{k} {statistics.median(v) * 1e6:.2f} us ({statistics.median(v) / base:.3f}x)"
                        for k, v in samples.items()), flush=True)
        return rows

    def calibrate(self, fn: Callable[[], Any]) -> int:
        """Calls per sweep block (~30 ms), the same on every rank."""
        self.time_block(fn, 2)
        per_call = self.time_block(fn, 3)
        calls = cupy.array([max(3, min(self.args.calls, int(0.03 / max(per_call, 1e-7))))], dtype=cupy.int64)
        self.comm.all_reduce(calls, calls, op="max")
        return int(calls.get()[0])

    def sweep(self) -> list[dict[str, Any]]:
        rows = []
        sizes = []
        size = 4
        while size <= self.args.sweep_max:
            sizes.append(size)
            size *= self.args.sweep_step
        pool = cupy.get_default_memory_pool()
        for op in ("all_reduce", "all_gather", "broadcast"):
            for nbytes in sizes:
                per_rank = nbytes // self.ws if op == "all_gather" else nbytes
                count = max(1, per_rank // 4)
                actual = count * 4 * (self.ws if op == "all_gather" else 1)
                impls = self.impls(op, count, ("raw", "gridcomm"))
                calls = self.calibrate(impls["raw"])
                samples = self.rounds(impls, calls, self.args.sweep_rounds)
                rows.append({"op": op, "bytes": actual, "calls": calls, "samples_s": samples})
                if self.rank == 0:
                    g, r = statistics.median(samples["gridcomm"]), statistics.median(samples["raw"])
                    print(f"  {op} {human(actual)}: raw {r * 1e6:.1f} us, gridcomm {g * 1e6:.1f} us "
                          f"({g / r:.3f}x)", flush=True)
                del impls
                pool.free_all_blocks()
        return rows

    def graph_replay(self) -> list[float]:
        stream = cupy.cuda.Stream(non_blocking=True)
        x = cupy.ones(1, dtype=cupy.float32)
        y = cupy.empty_like(x)
        ops = 1000
        replay = []
        with stream:
            self.comm.all_reduce(x, y)
            stream.synchronize()
            stream.begin_capture()
            for _ in range(ops):
                self.comm.all_reduce(x, y)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            for _ in range(self.args.rounds):
                self.align()
                t0 = time.perf_counter()
                graph.launch(stream)
                stream.synchronize()
                replay.append((time.perf_counter() - t0) / ops)
        return replay


def init_times(ports: dict[str, int]) -> dict[str, list[float]]:
    """World size 1 only: communicator set-up, raw NCCL vs gridcomm (rendezvous included)."""
    raw_init, grid_init, grid_split, grid_stop = [], [], [], []
    for _ in range(3):
        t0 = time.perf_counter()
        c = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        raw_init.append(time.perf_counter() - t0)
        c.destroy()
        t0 = time.perf_counter()
        g = gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=free_port())
        grid_init.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        g.split(0)
        grid_split.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        g.stop()
        grid_stop.append(time.perf_counter() - t0)
    return {"raw": raw_init, "gridcomm": grid_init, "gridcomm split()": grid_split, "gridcomm stop()": grid_stop}


# ---------------------------------------------------------------------- reporting
def med_spread(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e6:.2f} [{min(samples) * 1e6:.2f}..{max(samples) * 1e6:.2f}]"


def small_table(rows: list[dict[str, Any]], title: str) -> list[str]:
    lines = [title, ""]
    peers = [p for p in PEERS if any(p in row["samples_s"] for row in rows)]
    head = "| collective | size per rank | " + " | ".join(
        f"{p} us" + ("" if p == "raw" else f" | {p}/raw [per round]") for p in peers) + " |"
    lines += [head, "|" + " --- |" * (2 + 2 * len(peers) - 1)]
    for row in rows:
        s = row["samples_s"]
        base = statistics.median(s["raw"])
        cells = []
        for p in peers:
            if p not in s:
                cells += ["–"] if p == "raw" else ["–", "–"]
                continue
            cells.append(med_spread(s[p]))
            if p != "raw":
                paired = statistics.median([a / b for a, b in zip(s[p], s["raw"], strict=True)])
                cells.append(f"{statistics.median(s[p]) / base:.3f} [{paired:.3f}]")
        lines.append(f"| {row['op']} | {human(row['bytes'])} | " + " | ".join(cells) + " |")
    return lines + [""]


def report(result: dict[str, Any], notes: dict[str, str]) -> str:
    ws = result["world_size"]
    lines = small_table(result["small"], f"#### Small collectives, world size {ws}, gridcomm vs raw (no other peer "
                                         f"started yet): per-call time in us, median [min..max of {result['rounds']} "
                                         f"round medians], {result['calls']} calls per round")
    if result.get("peers"):
        lines += small_table(result["peers"], f"#### Small collectives, world size {ws}, every peer (cupyx and torch "
                                              f"started): median [min..max of {result['peer_rounds']} rounds]")
    for p in ("cupyx", "torch"):
        if p in notes:
            lines.append(f"- {p}: {notes[p]}")
    if ws == 1:
        lines.append("- send/recv one way needs 2 ranks (a send to oneself outside a group never completes); "
                     "send_recv at world size 1 exchanges with itself inside one NCCL group.")
        lines.append("- broadcast at world size 1 is in place on one rank, so NCCL launches no work: its rows "
                     "time the call path alone.")
    if result.get("sweep"):
        zero = "; with 1 rank, all_reduce and all_gather busbw are 0 by definition" if ws == 1 else ""
        lines += ["", f"#### Sweep, world size {ws}: median of {result['sweep_rounds']} rounds (busbw: nccl-tests "
                      f"formulas{zero})", "",
                  "| collective | bytes | raw us | gridcomm us [min..max] | gridcomm/raw | raw algbw GB/s | "
                  "gridcomm algbw GB/s | raw busbw GB/s | gridcomm busbw GB/s |",
                  "|" + " --- |" * 9]
        for row in result["sweep"]:
            s = row["samples_s"]
            r, g = statistics.median(s["raw"]), statistics.median(s["gridcomm"])
            factor = BUSBW_FACTOR[row["op"]](ws)
            ra, ga = row["bytes"] / r / 1e9, row["bytes"] / g / 1e9
            lines.append(f"| {row['op']} | {human(row['bytes'])} | {r * 1e6:.2f} | {med_spread(s['gridcomm'])} | "
                         f"{g / r:.3f} | {ra:.2f} | {ga:.2f} | {ra * factor:.2f} | {ga * factor:.2f} |")
    if result.get("graph_replay_s"):
        lines += ["", f"Graph replay of 1000 captured gridcomm all_reduce (4 B): "
                      f"{med_spread(result['graph_replay_s'])} us per op."]
    if result.get("init_s"):
        init = result["init_s"]
        lines += ["", "Init (world size 1, median of 3): " + ", ".join(
            f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in init.items())]
    return "\n".join(lines)


# ---------------------------------------------------------------------- entry points
def run_rank(args: argparse.Namespace, rank: int, ports: dict[str, int]) -> int:
    bench = Bench(args, rank, ports)
    result: dict[str, Any] = {"world_size": args.world_size, "rounds": args.rounds, "calls": args.calls,
                              "peer_rounds": args.peer_rounds,
                              "sweep_rounds": args.sweep_rounds, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "versions": {"cupy": cupy.__version__, "nccl": nccl.get_version(),
                                           "python": sys.version.split()[0]}}
    try:
        if rank == 0:
            print(f"world size {args.world_size}: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
                  f"{result['versions']}, gridcomm from {os.path.dirname(gridcomm.__file__)}", flush=True)
        result["small"] = bench.small(tuple(p for p in args.peers if p in ("raw", "gridcomm", "rawgc")), args.rounds)
        result["sweep"] = [] if args.no_sweep else bench.sweep()
        result["graph_replay_s"] = bench.graph_replay()
        bench.init_peers()
        if bench.cx is not None or bench.torch is not None:
            result["peers"] = bench.small(args.peers, args.peer_rounds)
        if args.world_size == 1:
            init = init_times(ports)
            if bench.cx is not None:
                init["cupyx (once)"] = [bench.cupyx_init_s]
            result["init_s"] = init
    finally:
        bench.stop()
    result["notes"] = bench.notes
    if rank == 0:
        print(report(result, bench.notes), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
    return 0


def launch(args: argparse.Namespace) -> int:
    """Starts one process per rank, one GPU each; rank 0's output is ours."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(cupy.cuda.runtime.getDeviceCount())]
    if len(gpus) < args.world_size:
        print(f"world size {args.world_size} needs {args.world_size} GPUs; {len(gpus)} visible.")
        return 2
    ports = {"gridcomm": free_port(), "cupyx": free_port(), "torch": free_port()}
    procs, logs = {}, {}
    for rank in range(args.world_size):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[rank], GRIDCOMM_BENCH_PORTS=json.dumps(ports),
                   GRIDCOMM_BIND="127.0.0.1", PYTHONUNBUFFERED="1")
        logs[rank] = None if rank == 0 else tempfile.TemporaryFile(mode="w+")
        procs[rank] = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(rank)], env=env,
                                       stdout=logs[rank], stderr=subprocess.STDOUT if rank else None, text=True)
    deadline = time.monotonic() + args.timeout
    codes: dict[int, int | None] = {}
    try:
        for rank, proc in procs.items():
            try:
                codes[rank] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[rank] = None
                print(f"rank {rank} still running after {args.timeout} s: killed")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for rank, fh in logs.items():
        if fh is not None and codes.get(rank) != 0:
            fh.seek(0)
            print(f"--- rank {rank} exited {codes.get(rank)}:\n{fh.read()[-6000:]}")
    return 0 if all(c == 0 for c in codes.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the gridcomm-vs-raw small table")
    parser.add_argument("--peer-rounds", type=int, default=7, help="rounds of the table with every peer")
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed block (small collectives)")
    parser.add_argument("--peers", default="raw,gridcomm,cupyx,torch",
                        help="comma-separated subset of " + ",".join(PEERS) + " (rawgc: the raw calls on "
                             "gridcomm's own NCCL communicator, a diagnostic)")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-max", type=int, default=1 << 30, help="largest sweep size in bytes")
    parser.add_argument("--sweep-step", type=int, default=4)
    parser.add_argument("--sweep-rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write every sample here (rank 0)")
    parser.add_argument("--timeout", type=float, default=540, help="multi-process runs: kill the ranks after this")
    args = parser.parse_args()
    args.peers = tuple(p for p in args.peers.split(",") if p)
    if "raw" not in args.peers or "gridcomm" not in args.peers:
        parser.error("--peers must include raw and gridcomm")
    os.environ.setdefault("GRIDCOMM_BIND", "127.0.0.1")
    if args.world_size > 1 and args.rank is None:
        return launch(args)
    if args.rank is None:
        ports = {"gridcomm": free_port(), "cupyx": free_port(), "torch": free_port()}
    else:
        ports = json.loads(os.environ["GRIDCOMM_BENCH_PORTS"])
    return run_rank(args, args.rank or 0, ports)


if __name__ == "__main__":
    sys.exit(main())
