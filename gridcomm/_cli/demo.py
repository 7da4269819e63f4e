"""``gridcomm demo``: a few local ranks run every collective, check each result, and time it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from gridcomm import _config
from gridcomm._cli.launch import free_port, rank_environments

ELEMENTS = 1024


def _worker() -> int:
    """One rank: every collective once checked, then timed."""
    from gridcomm._communicator.process_group import init_process_group

    t0 = time.perf_counter()
    comm = init_process_group()
    init_s = time.perf_counter() - t0
    if comm.backend == "nccl":
        import cupy as xp

        def sync() -> None:
            xp.cuda.get_current_stream().synchronize()

        def to_host(a: Any) -> Any:
            return xp.asnumpy(a)
    else:
        import numpy as xp

        def sync() -> None:
            pass

        def to_host(a: Any) -> Any:
            return a
    import numpy as np

    W, R = comm.world_size, comm.rank
    n = ELEMENTS
    x = xp.full(n, R + 1, dtype=xp.float32)
    y = xp.empty_like(x)
    xs = xp.full(W * n, R + 1, dtype=xp.float32)
    ys = xp.empty_like(xs)
    block = xp.full((W, n), R + 1, dtype=xp.float32)
    block_out = xp.empty_like(block)
    total = W * (W + 1) / 2
    peer = R ^ 1 if (R ^ 1) < W else R
    ranks = np.arange(1, W + 1, dtype=np.float32)

    cases: dict[str, tuple[Callable[[], None], Callable[[], bool]]] = {
        "all_reduce": (lambda: comm.all_reduce(x, y, op="sum"), lambda: bool((to_host(y) == total).all())),
        "reduce": (lambda: comm.reduce(x, y, root=0, op="max"), lambda: R != 0 or bool((to_host(y) == W).all())),
        "broadcast": (lambda: comm.broadcast(y, root=0), lambda: True),
        "reduce_scatter": (lambda: comm.reduce_scatter(xs, y, n, op="sum"), lambda: bool((to_host(y) == total).all())),
        "all_gather": (lambda: comm.all_gather(x, ys, n),
                       lambda: bool((to_host(ys).reshape(W, n)[:, 0] == ranks).all())),
        "send_recv": (lambda: comm.send_recv(x, y, peer), lambda: bool((to_host(y) == peer + 1).all())),
        "scatter": (lambda: comm.scatter(block, y, root=0), lambda: bool((to_host(y) == 1).all())),
        "gather": (lambda: comm.gather(x, block_out, root=0),
                   lambda: R != 0 or bool((to_host(block_out)[:, 0] == ranks).all())),
        "all_to_all": (lambda: comm.all_to_all(block, block_out),
                       lambda: bool((to_host(block_out)[:, 0] == ranks).all())),
        "barrier": (lambda: comm.barrier("demo"), lambda: True),
    }
    iters = _config.demo_iters(500 if comm.backend == "nccl" else 20)
    report: dict[str, Any] = {"rank": R, "backend": comm.backend, "init_s": init_s, "results": {}}
    for name, (call, check) in cases.items():
        if name == "broadcast":
            y[...] = 7 if R == 0 else 0
            call()
            sync()
            ok = bool((to_host(y) == 7).all())
        else:
            call()
            sync()
            ok = check()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - start)
        report["results"][name] = {"ok": ok, "median_us": statistics.median(times) * 1e6,
                                   "p90_us": sorted(times)[int(0.9 * (len(times) - 1))] * 1e6}
    comm.stop()
    print(json.dumps(report), flush=True)
    return 0 if all(r["ok"] for r in report["results"].values()) else 1


def _auto_backend(nproc: int, environ: dict[str, str]) -> str:
    """NCCL where every rank can have a GPU: one each, or several on one in NCCL's multi-rank mode
    (NCCL >= 2.30; rank_environments turns it on); else host."""
    from gridcomm._backends import nccl as _nccl
    from gridcomm._backends.nccl.sharing import MULTI_RANK_MIN_NCCL
    from gridcomm._cli.launch import visible_gpus

    gpus = len(visible_gpus(environ))
    if gpus == 0 or not _nccl.available():
        return "host"
    if gpus >= nproc:
        return "nccl"
    try:
        return "nccl" if _nccl.nccl_version() >= MULTI_RANK_MIN_NCCL else "host"
    except Exception:  # noqa: BLE001 - no version to read: the host backend runs anywhere
        return "host"


def run_demo(nproc: int = 4, backend: str | None = None, iters: int | None = None) -> int:
    """Starts ``nproc`` local ranks on the default backend, prints a checked, timed table."""
    environ = dict(_config.process_environ())
    chosen = _config.launch_backend(backend, environ)
    if chosen == "auto":
        chosen = _auto_backend(nproc, environ)
    if iters is not None:
        environ["DEMO_ITERS"] = str(iters)
    port = free_port()
    procs, files = [], []
    started = time.perf_counter()
    try:
        for env in rank_environments(nproc, chosen, port, environ):
            out = tempfile.TemporaryFile(mode="w+")
            err = tempfile.TemporaryFile(mode="w+")
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, "-m", "gridcomm._cli.demo"], env=env, stdout=out, stderr=err,
                                          text=True))
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    reports = []
    for rank, (out, err) in enumerate(files):
        out.seek(0)
        err.seek(0)
        text = out.read()
        lines = [line for line in text.splitlines() if line.startswith("{")]
        if lines:
            reports.append(json.loads(lines[-1]))
        if codes[rank] != 0:
            sys.stderr.write(f"--- rank {rank} exited {codes[rank]}\n{text[-2000:]}{err.read()[-4000:]}\n")
        out.close()
        err.close()
    print(f"gridcomm demo: {nproc} ranks, backend {chosen}, {ELEMENTS} float32 per call, "
          f"wall {time.perf_counter() - started:.1f} s")
    if reports:
        print(f"init_process_group: {max(r['init_s'] for r in reports) * 1e3:.0f} ms (slowest rank)")
        names = list(reports[0]["results"])
        print(f"{'collective':<16}{'median us':>11}{'p90 us':>10}  checked on every rank")
        for name in names:
            med = max(r["results"][name]["median_us"] for r in reports)
            p90 = max(r["results"][name]["p90_us"] for r in reports)
            ok = all(r["results"][name]["ok"] for r in reports)
            print(f"{name:<16}{med:>11.0f}{p90:>10.0f}  {'ok' if ok else 'WRONG'}")
    ok = all(c == 0 for c in codes) and len(reports) == nproc
    print("all checks passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_worker())
