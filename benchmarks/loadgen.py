"""A load generator: tens of thousands of simulated ranks against a real coordinator.

The coordinator runs in a process of its own with its real defaults (``gridcomm.Coordinator``:
heartbeat bound 15 s, no token unless ``--token``). This process plays the ranks on one asyncio
loop, speaking the real proto (gridcomm._proto only), as the relay tree puts them on the wire:

- ``template`` (relay addresses known, ``GRIDCOMM_RELAY_ADDRESSES``): N / K groups of K consecutive
  ranks, K the fan-in ``auto`` picks at N. Each group's leader joins on a Session stream of its own,
  naming its relay's address, and heartbeats there every bound / 3 (held for that long), as a
  rank's watcher does; its relay (another connection) sends the members' first joins as one
  aggregate (``SessionOp.aggregate``), a heartbeat for its members every bound / 6 (each rank's
  age, progress in full once and then flagged as the same, as an idle rank's is), and each barrier
  as one aggregate naming all K ranks, the leader's own arrival included.
- ``no-template`` (Slurm, bare metal): each rank first asks the coordinator where to join
  (``first_contact``), honouring "come back in t" with the client's jitter; a leader names its
  relay's address in its ask. Then the members join through their relay, which holds a group's
  first joins until the whole group has arrived or for 1 s, as the real relay does; a rank told
  "join directly" joins on a stream of its own. The asks go over a pool of ``--ask-connections``
  channels (a real rank dials one of its own), all at once unless ``--ask-rate`` spreads the
  ranks' starts (random order either way).

Per run: T1 (start until every rank's join is answered), T2 (one barrier of all ranks, median of
``--barriers``), the coordinator's CPU per phase and its RSS (VmRSS at start, VmHWM at the end,
from /proc), and whether any rank was failed while heartbeats ran for ``--live-s`` (2 bounds by
default) after the barriers: the heartbeats' answers and a final Status call must name no failure.

    python benchmarks/loadgen.py --ranks 2048,16384,65536 --shapes template,no-template --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
from loadgen_wire import (  # noqa: E402
    OPTIONS,
    ROOT,
    SERVE,
    Group,
    Run,
    ask_and_join,
    cpu_s,
    loadavg,
    status_mb,
)

from gridcomm._client.directed import start_delay_s  # noqa: E402
from gridcomm._config import DEFAULT_HEARTBEAT_TIMEOUT_S, auto_relay_fanin  # noqa: E402
from gridcomm._proto import coordinator_pb2 as pb  # noqa: E402
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402


async def simulate(args: argparse.Namespace, shape: str, world: int, port: int, pid: int) -> dict[str, Any]:
    fanin = args.fanin or auto_relay_fanin(world)
    run = Run(f"127.0.0.1:{port}", world, fanin, args.heartbeat_timeout_s, args.token)
    groups = [Group(run, leader) for leader in range(0, world, fanin)]
    lag = {"max": 0.0}

    async def meter() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.1)
            lag["max"] = max(lag["max"], time.monotonic() - t - 0.1)

    meter_task = asyncio.ensure_future(meter())
    kinds: Counter[str] = Counter()
    pool: list[grpc.aio.Channel] = []
    out: dict[str, Any] = {"shape": shape, "world": world, "fanin": fanin, "relays": len(groups), "ask_rate": args.ask_rate, "paced": args.paced,
                           "busy": args.busy,
                           "loadavg_start": loadavg()}
    me0, cpu0, t0 = cpu_s(), cpu_s(pid), time.monotonic()
    try:
        if shape == "template":
            joins = [g.join_own(g.leader, g.address) for g in groups]
            joins += [g.through_relay(r) for g in groups for r in g.ranks[1:]]
        else:
            pool = [grpc.aio.insecure_channel(run.target, options=OPTIONS) for _ in range(args.ask_connections)]
            stubs = [pb_grpc.CoordinatorStub(c) for c in pool]
            order = list(range(world))
            random.Random(world).shuffle(order)  # ranks start in no particular order
            rate = args.ask_rate or float("inf")
            if args.paced:  # as gridcomm's ranks start: leaders ask at once, members spread
                delays = [0.0 if r % fanin == 0 else start_delay_s(world) for r in order]
            else:
                delays = [i / rate for i in range(len(order))]
            joins = [ask_and_join(run, groups[r // fanin], r, stubs[i % len(stubs)], kinds, delays[i])
                     for i, r in enumerate(order)]
        await asyncio.wait_for(asyncio.gather(*joins), args.timeout_s)
        t1 = max(run.joined_at.values()) - t0
        for channel in pool:
            await channel.close()  # a directed rank closes its asking connection
        cpu1, me1 = cpu_s(pid), cpu_s()
        out.update(t1_s=t1, joined=len(run.joined_at), coordinator_cpu_join_s=cpu1 - cpu0, generator_cpu_join_s=me1 - me0,
                   asks=dict(kinds), ask_connections=len(pool), join_messages=run.stats["sent_join"],
                   loadavg_joined=loadavg())
        barriers = []
        for seq in range(1, args.barriers + 1):
            tb = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(g.barrier(seq) for g in groups)), args.timeout_s)
            barriers.append(time.monotonic() - tb)
        cpu2 = cpu_s(pid)
        out.update(t2_s=statistics.median(barriers), t2_all_s=barriers,
                   coordinator_cpu_barrier_ms=(cpu2 - cpu1) / args.barriers * 1e3,
                   us_per_barrier_message=(cpu2 - cpu1) / args.barriers / len(groups) * 1e6)
        hb0 = run.stats["sent_heartbeat"]
        run.busy = args.busy
        await asyncio.sleep(args.live_s)
        cpu3 = cpu_s(pid)
        live_messages = run.stats["sent_heartbeat"] - hb0
        out.update(live_s=args.live_s, coordinator_cpu_per_s_live=(cpu3 - cpu2) / args.live_s,
                   heartbeat_messages_live=live_messages,
                   us_per_heartbeat_message=(cpu3 - cpu2) / max(1, live_messages) * 1e6,
                   us_per_rank_s_live=(cpu3 - cpu2) / args.live_s / world * 1e6)
        async with grpc.aio.insecure_channel(run.target, options=OPTIONS) as channel:
            status = await pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), metadata=run.metadata, timeout=60)
        for failure in status.failures:
            run.failures.setdefault(failure.rank, failure.reason)
        live = sum(1 for m in status.members if m.state == pb.MEMBER_STATE_JOINED)
        out.update(status_joined=live, failed=len(run.failures), failures=sorted(run.failures.items())[:5],
                   heartbeat_timeouts=run.stats["heartbeat_timeouts"], heartbeat_refused=run.stats["heartbeat_refused"],
                   ok=live == world and not run.failures and len(run.joined_at) == world)
    except asyncio.TimeoutError:
        out.update(ok=False, error=f"timed out after {args.timeout_s:g} s", joined=len(run.joined_at), asks=dict(kinds))
    finally:
        meter_task.cancel()
        run.stopping = True
        out.update(connections=run.stats["connections"] + len(pool), generator_cpu_s=cpu_s() - me0,
                   generator_loop_lag_max_s=lag["max"], coordinator_cpu_s=cpu_s(pid) - cpu0,
                   loadavg_end=loadavg(), failed=len(run.failures), failures=sorted(run.failures.items())[:5])
        for g in groups:
            await g.close()
        for channel in pool:
            await channel.close()
    return out


async def one_run(args: argparse.Namespace, shape: str, world: int) -> dict[str, Any]:
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(world), args.token, str(args.heartbeat_timeout_s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        await asyncio.sleep(0.5)
        rss0 = status_mb(server.pid, "VmRSS")
        out = await simulate(args, shape, world, port, server.pid)
        peak = status_mb(server.pid, "VmHWM")
        out.update(coordinator_rss_start_mb=rss0, coordinator_rss_peak_mb=peak, coordinator_rss_growth_mb=peak - rss0)
        return out
    finally:
        server.kill()
        server.wait(10)


def fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    if not values:
        return "-"
    v = [x * scale for x in values]
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}..{max(v):.{digits}f}]"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | ranks (K, relays) | ok | T1 s | T2 s | coord. CPU join s | coord. CPU per barrier ms "
             "| coord. CPU s per s live | RSS start MB | RSS growth MB | gen. CPU s | load avg (start) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["shape"], r["world"]), []).append(r)
    for (shape, world), cell in cells.items():
        def col(key: str, cell: list[dict[str, Any]] = cell) -> list[float]:
            return [r[key] for r in cell if key in r]
        oks = sum(1 for r in cell if r.get("ok"))
        lines.append(f"| {shape} | {world:,} ({cell[0]['fanin']}, {cell[0]['relays']}) | {oks}/{len(cell)} "
                     f"| {fmt(col('t1_s'))} | {fmt(col('t2_s'), digits=3)} | {fmt(col('coordinator_cpu_join_s'))} "
                     f"| {fmt(col('coordinator_cpu_barrier_ms'), digits=1)} | {fmt(col('coordinator_cpu_per_s_live'), digits=3)} "
                     f"| {fmt(col('coordinator_rss_start_mb'), digits=0)} | {fmt(col('coordinator_rss_growth_mb'), digits=0)} "
                     f"| {fmt(col('generator_cpu_s'), digits=1)} | {'; '.join(r['loadavg_start'] for r in cell)} |")
    return "\n".join(lines)


async def run_all(args: argparse.Namespace, shapes: list[str]) -> list[dict[str, Any]]:
    """Every run on one event loop (grpc.aio's poller stays bound to the loop it first ran on)."""
    rows = []
    for rep in range(args.reps):
        for world in (int(n) for n in args.ranks.split(",")):
            for shape in shapes if rep % 2 == 0 else shapes[::-1]:
                res = await one_run(args, shape, world)
                res["rep"] = rep
                rows.append(res)
                print(json.dumps(res), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2048", help="world sizes, comma-separated")
    ap.add_argument("--shapes", default="template,no-template")
    ap.add_argument("--fanin", type=int, default=0, help="ranks per relay group (0: what auto picks at each size)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--barriers", type=int, default=5)
    ap.add_argument("--heartbeat-timeout-s", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                    help="the coordinator's liveness bound (its default unless set)")
    ap.add_argument("--live-s", type=float, default=None, help="heartbeats after the barriers (default 2 bounds)")
    ap.add_argument("--ask-connections", type=int, default=256, help="channels the no-template asks share")
    ap.add_argument("--busy", action="store_true",
                    help="in the heartbeat window, every rank's progress changes between two heartbeats (a "
                         "training rank's does); default: idle, the same after its first report")
    ap.add_argument("--ask-rate", type=float, default=0.0,
                    help="no-template: ranks starting per second, in random order (0: all at once)")
    ap.add_argument("--paced", action="store_true",
                    help="no-template: start as gridcomm's ranks do (leaders ask at once, members after "
                         "gridcomm._client.directed.start_delay_s); overrides --ask-rate")
    ap.add_argument("--token", default="", help="the coordinator's token (default: none, as its default)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="bound on the join and on each barrier")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    args = ap.parse_args(argv)
    if args.live_s is None:
        args.live_s = 2 * args.heartbeat_timeout_s
    shapes = [s for s in args.shapes.split(",") if s]
    if set(shapes) - {"template", "no-template"}:
        ap.error("--shapes takes template and/or no-template")
    rows = asyncio.run(run_all(args, shapes))
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
