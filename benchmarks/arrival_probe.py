"""The coordinator's own cost of one barrier operation, without the network: every rank's barrier
coroutine as the Session stream runs it (checks, arrival, the wait, wake-ups, the answer, and
the metrics of a completed instance) timed in-process, best of several rounds. For A/B runs of a change on the hot path, where a
networked probe on a shared 2-core machine is too noisy to see a few percent:

    python benchmarks/arrival_probe.py                               # this checkout
    python benchmarks/arrival_probe.py --gridcomm /tmp/other/checkout  # another one
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--barriers", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gridcomm", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the checkout to import gridcomm from")
    args = ap.parse_args()
    sys.path.insert(0, args.gridcomm)
    from gridcomm._coordinator import server as _server
    from gridcomm._coordinator import servicer as _servicer
    from gridcomm._proto import coordinator_pb2 as pb

    async def run() -> list[float]:
        owner = _server.Coordinator(args.ranks, bind="127.0.0.1", port=0)
        servicer = _servicer.Servicer(owner)
        state = owner.state
        for rank in range(args.ranks):
            state.join("default", rank, args.ranks, rank + 1, "h", time.monotonic())
        callers = [pb.Caller(job_id="default", rank=rank, incarnation=rank + 1, generation=state.generation)
                   for rank in range(args.ranks)]
        per_arrival = []
        for round_ in range(args.rounds):
            name = f"b{round_}"
            requests = [pb.BarrierRequest(caller=c, name=name, seq=0, wait_s=1.0) for c in callers]
            began = time.perf_counter()
            for seq in range(1, args.barriers + 1):
                # Every rank's operation as the Session stream runs it (a coroutine each): the
                # arrival, the wait of all but the last, the wake-up and the answer.
                await asyncio.gather(*(servicer.barrier(pb.BarrierRequest(caller=r.caller, name=name, seq=seq,
                                                                          wait_s=1.0), None) for r in requests))
            per_arrival.append((time.perf_counter() - began) / (args.barriers * args.ranks))
        return per_arrival

    times = asyncio.run(run())
    print(f"{args.gridcomm}: {args.ranks} ranks x {args.barriers} barriers, best of {args.rounds}: "
          f"{min(times) * 1e6:.1f} us per rank-operation (median {statistics.median(times) * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
