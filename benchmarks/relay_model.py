"""The coordinator's cost per aggregated message: the measured input of the relay tree's model.

A coordinator runs in a process of its own; R relay streams (threads of this process, each its own
connection, as R relays are) each speak for K ranks: the K joins go up in one message, then B
barriers, each one operation naming all K ranks (SessionOp.aggregate), as a relay sends them.
The coordinator's CPU time (from /proc) over the barriers, divided by R x B, is its cost per
aggregated barrier message; runs at several K and R separate the per-message part from the
per-rank part (cost = a + b x K), which BENCHMARKS.md uses to model a 100,000-rank job.

    python benchmarks/relay_model.py --shapes 64x32,256x32,64x128,16x128 --barriers 50 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from loadgen_wire import cpu_s  # noqa: E402

from gridcomm._proto import coordinator_pb2 as pb  # noqa: E402
from gridcomm._wire import WIRE  # noqa: E402

SERVE = """
import sys, gridcomm
server = gridcomm.Coordinator(int(sys.argv[1]), bind="127.0.0.1", port=0).start()
print(server.port, flush=True)
sys.stdin.read()
"""


class FakeRelay:
    """One relay's stream: K ranks' joins in one message, then one aggregated barrier op at a time."""

    def __init__(self, port: int, first: int, k: int, world: int, options: list[tuple[str, Any]]) -> None:
        self.ranks = list(range(first, first + k))
        self.world = world
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        self.requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        call = self.channel.stream_stream("/gridcomm.v1.Coordinator/Session",
                                          request_serializer=pb.SessionRequest.SerializeToString,
                                          response_deserializer=pb.SessionReply.FromString)
        self.replies = call(iter(self.requests.get, None))
        self.callers: list[pb.Caller] = []

    def results(self, n: int) -> list[pb.SessionResult]:
        out: list[pb.SessionResult] = []
        while len(out) < n:
            out.extend(next(self.replies).results)
        return out

    def join(self) -> None:
        ops = [pb.SessionOp(id=i + 1, join=pb.JoinRequest(job_id="default", rank=r, world_size=self.world,
                                                          incarnation=1000 + r, hostname="bench", wait_s=120,
                                                          wire=WIRE))
               for i, r in enumerate(self.ranks)]
        self.requests.put(pb.SessionRequest(ops=ops))
        results = self.results(len(ops))
        bad = [r for r in results if r.code]
        if bad:
            raise RuntimeError(f"join refused: {bad[0].details}")
        generation = results[0].join.generation
        self.callers = [pb.Caller(job_id="default", rank=r, incarnation=1000 + r, generation=generation)
                        for r in self.ranks]

    def barrier(self, seq: int) -> None:
        request = pb.BarrierRequest(caller=self.callers[0], name="model", seq=seq, wait_s=120)
        aggregate = pb.Aggregate(ranks=[pb.RelayedRank(rank=c.rank, incarnation=c.incarnation)
                                        for c in self.callers[1:]])
        self.requests.put(pb.SessionRequest(ops=[pb.SessionOp(id=1000 + seq, barrier=request, aggregate=aggregate)]))
        result = self.results(1)[0]
        if result.code:
            raise RuntimeError(f"barrier refused: {result.details}")

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def channel_options(name: str) -> list[tuple[str, Any]]:
    """``library``: the options a relay's channel to the coordinator has (gridcomm's); ``grpc``:
    gRPC's defaults (BDP probing on), what this model measured before c3d3f7f."""
    from gridcomm._runtime.channel import channel_options as library

    own = [("grpc.use_local_subchannel_pool", 1)]
    return library() if name == "library" else own


def run(relays: int, k: int, barriers: int, options: str = "library") -> dict[str, Any]:
    world = relays * k
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(world)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        port = int(server.stdout.readline())
        fakes = [FakeRelay(port, i * k, k, world, channel_options(options)) for i in range(relays)]
        threads = [threading.Thread(target=f.join) for f in fakes]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        gate = threading.Barrier(relays + 1)

        def loop(fake: FakeRelay) -> None:
            gate.wait()
            for seq in range(1, barriers + 1):
                fake.barrier(seq)
            gate.wait()

        threads = [threading.Thread(target=loop, args=(f,)) for f in fakes]
        [t.start() for t in threads]
        gate.wait()
        cpu0, t0 = cpu_s(server.pid), time.monotonic()
        gate.wait()
        cpu1, t1 = cpu_s(server.pid), time.monotonic()
        [t.join(10) for t in threads]
        for f in fakes:
            f.close()
        return {"relays": relays, "k": k, "world": world, "options": options, "barrier_ms": (t1 - t0) / barriers * 1e3,
                "coordinator_cpu_ms_per_barrier": (cpu1 - cpu0) / barriers * 1e3,
                "us_per_aggregate": (cpu1 - cpu0) / (barriers * relays) * 1e6,
                "us_per_rank_op": (cpu1 - cpu0) / (barriers * world) * 1e6}
    finally:
        server.kill()
        server.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="64x32,256x32,64x128,16x128", help="RELAYSxFANIN,...")
    ap.add_argument("--barriers", type=int, default=50)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--channel-options", default="library",
                    help="library (a relay's channel options), grpc (gRPC's defaults), or both, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    options = [o for o in args.channel_options.split(",") if o]
    if not options or set(options) - {"library", "grpc"}:
        ap.error("--channel-options takes library and/or grpc")
    runs = [(relays, k, o) for relays, k in shapes for o in options]
    rows = []
    for rep in range(args.reps):
        for relays, k, o in runs[rep % len(runs):] + runs[:rep % len(runs)]:
            res = run(relays, k, args.barriers, o)
            res["rep"] = rep
            rows.append(res)
            print(json.dumps(res), flush=True)
    print("\n| relays x fan-in (ranks) | channel options | barrier | coordinator CPU per barrier | per aggregate | per rank-op |")
    print("| --- | --- | --- | --- | --- | --- |")
    for relays, k, o in runs:
        cell = [r for r in rows if r["relays"] == relays and r["k"] == k and r["options"] == o]

        def med(key: str, cell: list = cell) -> str:
            values = [r[key] for r in cell]
            return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"

        print(f"| {relays} x {k} ({relays * k}) | {o} | {med('barrier_ms')} ms | {med('coordinator_cpu_ms_per_barrier')} ms | "
              f"{med('us_per_aggregate')} us | {med('us_per_rank_op')} us |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
