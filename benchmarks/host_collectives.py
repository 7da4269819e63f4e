"""The host backend's all_reduce against torch's gloo, side by side in one run (`make bench-host`).

One OS process per rank, for both peers. Each job times, at each size, a loop of back-to-back
all_reduce calls on float32 NumPy arrays (gloo: the same memory as a torch tensor) after a
warm-up, and reports each rank's per-call period; a job's figure is the period of its slowest
rank. Jobs alternate between the peers (gridcomm, gloo, gridcomm, ...), so drift of the machine
falls on both; the table shows each peer's median over the repetitions with its spread
(min..max) and the ratio of the medians, gridcomm / gloo. Every result is checked.

Layouts:
- ``--hosts 1`` (default): every rank on this host; gridcomm's ranks meet through shared memory,
  gloo's over loopback TCP (gloo has no shared-memory transport).
- ``--hosts H`` (H > 1; root and iproute2): H network-namespace "hosts" on one bridge
  (``tests/netns.py``; 10.200.x addresses inside namespaces this run creates and deletes),
  ranks spread evenly in rank order, each rank with its host's name. gloo talks over each
  host's eth0 (GLOO_SOCKET_IFNAME), as it would in a pod.

Run in a virtualenv that has torch (the CPU build) and gridcomm::

    make bench-host
    .venv-gloo/bin/python benchmarks/host_collectives.py --ranks 4 --sizes 4,1048576,16777216 --reps 7
    .venv-gloo/bin/python benchmarks/host_collectives.py --ranks 8 --hosts 2 --reps 5
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ("gridcomm", "gloo")
#: Calls timed per size: enough for ~0.2 s of work at the sizes measured.
DEFAULT_ITERS = {4: 400, 1 << 20: 40, 16 << 20: 8}


def iterations(size: int, scale: float) -> int:
    base = DEFAULT_ITERS.get(size) or max(4, int(40 * (1 << 20) / max(size, 4096)))
    return max(2, int(base * scale))


# ---------------------------------------------------------------------------------------------- one rank
def worker() -> None:
    import numpy as np

    peer = os.environ["BENCH_PEER"]
    rank, world = int(os.environ["GRIDCOMM_RANK"]), int(os.environ["GRIDCOMM_WORLD_SIZE"])
    sizes = [int(s) for s in os.environ["BENCH_SIZES"].split(",")]
    scale = float(os.environ["BENCH_SCALE"])
    if peer == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['BENCH_STORE']}", rank=rank,
                                world_size=world)

        def all_reduce(x: Any, out: Any) -> None:
            dist.all_reduce(x)  # in place, like the gridcomm call below (in and out the same array)

        def barrier() -> None:
            dist.barrier()

        def tensor(a: Any) -> Any:
            return torch.from_numpy(a)

        def finish() -> None:
            dist.destroy_process_group()
    else:
        import gridcomm

        comm = gridcomm.init_process_group(world, rank, backend="host")

        def all_reduce(x: Any, out: Any) -> None:
            comm.all_reduce(out, out)

        def barrier() -> None:
            comm.barrier()

        def tensor(a: Any) -> Any:
            return a

        def finish() -> None:
            comm.stop()

    results = []
    for size in sizes:
        count = max(1, size // 4)
        # Zeros while timing (an in-place sum of zeros stays in range however many calls run),
        # then one call on distinct values that is checked.
        buf = np.zeros(count, dtype=np.float32)
        x = tensor(buf)
        iters = iterations(size, scale)
        for _ in range(max(2, iters // 10)):
            all_reduce(x, buf)
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            all_reduce(x, buf)
        period = (time.perf_counter() - start) / iters
        buf[...] = rank + 1
        all_reduce(x, buf)
        ok = bool(np.all(buf == np.float32(world * (world + 1) / 2)))
        results.append({"size": size, "iters": iters, "period_s": period, "ok": ok})
    barrier()
    finish()
    print("RESULT " + json.dumps({"rank": rank, "results": results}), flush=True)


# ---------------------------------------------------------------------------------------------- jobs
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def base_env(peer: str, sizes: list[int], scale: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               BENCH_PEER=peer, BENCH_SIZES=",".join(map(str, sizes)), BENCH_SCALE=str(scale),
               OMP_NUM_THREADS="1", GRIDCOMM_TIMEOUT_S="120")
    return env


def collect(procs: list[Any], outputs: list[Any], timeout_s: float) -> dict[int, list[dict[str, Any]]]:
    deadline = time.monotonic() + timeout_s
    per_rank: dict[int, list[dict[str, Any]]] = {}
    try:
        for proc in procs:
            proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, out in zip(procs, outputs, strict=True):
        out.seek(0)
        text = out.read()
        for line in text.splitlines():
            if line.startswith("RESULT "):
                record = json.loads(line[7:])
                per_rank[record["rank"]] = record["results"]
        if proc.returncode != 0:
            raise RuntimeError(f"a rank exited {proc.returncode}:\n{text[-3000:]}")
    return per_rank


def run_local(peer: str, ranks: int, sizes: list[int], scale: float, timeout_s: float) -> dict[int, list[dict[str, Any]]]:
    port = free_port()
    env = base_env(peer, sizes, scale)
    env.update(GRIDCOMM_PORT=str(port), GRIDCOMM_BIND="127.0.0.1", GRIDCOMM_HOST="127.0.0.1",
               BENCH_STORE=f"127.0.0.1:{port}")
    procs, outputs = [], []
    for rank in range(ranks):
        out = tempfile.TemporaryFile(mode="w+")
        outputs.append(out)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], stdout=out, stderr=subprocess.STDOUT,
                                      text=True, env=dict(env, GRIDCOMM_RANK=str(rank), GRIDCOMM_WORLD_SIZE=str(ranks))))
    return collect(procs, outputs, timeout_s)


def run_netns(topo: Any, peer: str, ranks: int, hosts: int, sizes: list[int], scale: float,
              timeout_s: float) -> dict[int, list[dict[str, Any]]]:
    port = 29500
    env = base_env(peer, sizes, scale)
    env.update(GRIDCOMM_PORT=str(port), GRIDCOMM_BIND="0.0.0.0", GRIDCOMM_HOST="job-0.svc",
               BENCH_STORE=f"job-0.svc:{port}", GLOO_SOCKET_IFNAME="eth0")
    per_host = ranks // hosts
    procs = []
    for rank in range(ranks):
        host = rank // per_host
        procs.append(topo.popen(host, [sys.executable, __file__, "--worker"], hostname=f"job-{host}",
                                env=dict(env, GRIDCOMM_RANK=str(rank), GRIDCOMM_WORLD_SIZE=str(ranks))))
    deadline = time.monotonic() + timeout_s
    per_rank: dict[int, list[dict[str, Any]]] = {}
    for proc in procs:
        try:
            line = proc.expect_line(r"^RESULT ", max(0.1, deadline - time.monotonic())).string
        except TimeoutError as exc:
            raise RuntimeError(f"{peer}: a rank gave no result:\n{exc}") from exc
        record = json.loads(line[7:])
        per_rank[record["rank"]] = record["results"]
    for proc in procs:
        proc.wait(30)
    return per_rank


# ---------------------------------------------------------------------------------------------- report
def human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


def table(runs: dict[str, list[dict[int, float]]], sizes: list[int]) -> str:
    lines = ["| size | gridcomm median [min..max] | gloo median [min..max] | ratio (median) | ratio per rep [min..max] |",
             "| --- | --- | --- | --- | --- |"]
    for size in sizes:
        cells = []
        medians = {}
        for peer in PEERS:
            values = [rep[size] for rep in runs.get(peer, [])]
            if not values:
                cells.append("-")
                continue
            medians[peer] = statistics.median(values)
            cells.append(f"{fmt_s(medians[peer])} [{fmt_s(min(values))}..{fmt_s(max(values))}]")
        if len(medians) == 2:
            ratio = f"{medians['gridcomm'] / medians['gloo']:.2f}x"
            per_rep = [g[size] / t[size] for g, t in zip(runs["gridcomm"], runs["gloo"], strict=True)]
            spread = f"{min(per_rep):.2f}x..{max(per_rep):.2f}x"
        else:
            ratio = spread = "-"
        lines.append(f"| {human(size)} | {cells[0]} | {cells[1]} | {ratio} | {spread} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hosts", type=int, default=1, help="network-namespace hosts (needs root)")
    parser.add_argument("--sizes", default="4,1048576,16777216", help="bytes per all_reduce, comma separated")
    parser.add_argument("--reps", type=int, default=5, help="jobs per peer, alternating")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the timed calls per size")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on one job")
    parser.add_argument("--json", help="write every job's per-rank periods here")
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    if args.ranks % args.hosts:
        parser.error(f"--ranks {args.ranks} must be a multiple of --hosts {args.hosts}")
    topo = None
    if args.hosts > 1:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import netns

        reason = netns.unusable_reason()
        if reason:
            print(f"skipped: {reason}", file=sys.stderr)
            return 2
        topo = netns.Topology(args.hosts).build()
    runs: dict[str, list[dict[int, float]]] = {p: [] for p in peers}
    raw: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for peer in peers:
                started = time.monotonic()
                if topo is None:
                    per_rank = run_local(peer, args.ranks, sizes, args.scale, args.timeout_s)
                else:
                    per_rank = run_netns(topo, peer, args.ranks, args.hosts, sizes, args.scale, args.timeout_s)
                bad = [(r, x["size"]) for r, rs in per_rank.items() for x in rs if not x["ok"]]
                if len(per_rank) != args.ranks or bad:
                    raise RuntimeError(f"{peer}: wrong or missing results: ranks {sorted(per_rank)}, wrong {bad}")
                slowest = {size: max(rs[i]["period_s"] for rs in per_rank.values()) for i, size in enumerate(sizes)}
                runs[peer].append(slowest)
                raw.append({"rep": rep, "peer": peer, "per_rank": per_rank})
                print(f"rep {rep + 1}/{args.reps} {peer:8s} " + "  ".join(f"{human(s)} {fmt_s(t)}" for s, t in
                                                                          slowest.items()) +
                      f"  ({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)
    finally:
        if topo is not None:
            topo.close()
    layout = f"{args.ranks} ranks on one host" if args.hosts == 1 else \
        f"{args.ranks} ranks on {args.hosts} network-namespace hosts ({args.ranks // args.hosts} each)"
    print(f"all_reduce, float32, {layout}, one process per rank; per-call period of the slowest rank, "
          f"median over {args.reps} jobs per peer [min..max]\n")
    print(table(runs, sizes))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "runs": runs, "raw": raw}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
