"""A relay hop's cost: one real rank process hosting its group's relay, K - 1 simulated members on it.

A coordinator runs in a process of its own (world size K); rank 0 is a real client process
(``gridcomm.CoordinatorClient`` with ``GRIDCOMM_RELAY=on`` and ``GRIDCOMM_RELAY_FANIN=K``, no
relay addresses), so it leads the one group of the directed join: it starts its relay, asks,
and joins. This process plays ranks 1..K-1 as a rank's client does: each asks the coordinator
where to join (first contact), then opens a Session stream of its own to the relay, joins there,
heartbeats there (held bound / 3, with an idle rank's progress) and arrives at barriers there.
The leader's process CPU (from /proc) is measured over B barriers (K - 1 members' arrivals and
answers, one aggregate up and its answer, the leader's own barrier call) and over an idle window
(the members' heartbeats, the relay's aggregated heartbeat every bound / 6). Divided by the
members' messages: the relay's CPU per member message pair, the model's per-hop input.

    python benchmarks/relay_hop.py --fanins 64,128,256,512 --barriers 50 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
from loadgen_wire import INCARNATION, JOB, OPTIONS, ROOT, SERVE, SLICE_S, Stream, cpu_s, loadavg, progress  # noqa: E402

from gridcomm._config import DEFAULT_HEARTBEAT_TIMEOUT_S  # noqa: E402
from gridcomm._proto import coordinator_pb2 as pb  # noqa: E402
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from gridcomm._wire import WIRE  # noqa: E402

LEADER = """
import sys, gridcomm
c = gridcomm.CoordinatorClient("127.0.0.1", int(sys.argv[1]), 0, world_size=int(sys.argv[2]), timeout_s=120)
c.join()
print("joined", c.relay.target if c.relay is not None else "", flush=True)
for line in sys.stdin:
    if line.startswith("b"):
        c.barrier("hop")
        print("ok", flush=True)
    else:
        break
c.close()
"""


class Member:
    """A simulated rank on its own Session stream to the relay."""

    def __init__(self, rank: int, relay: str, bound: float) -> None:
        self.rank, self.bound = rank, bound
        self.stream = Stream(relay, (), _STATS)
        self.caller = pb.Caller(job_id=JOB, rank=rank, incarnation=INCARNATION + rank)
        self.entered = 0
        self.beats: asyncio.Task[None] | None = None

    async def join(self, world: int) -> None:
        while True:
            request = pb.JoinRequest(job_id=JOB, rank=self.rank, world_size=world, incarnation=INCARNATION + self.rank,
                                     hostname="hop", wait_s=SLICE_S, wants_relay=True, relay_rank=0, wire=WIRE)
            result = await self.stream.run("join", request)
            if result.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]:
                continue
            if result.code:
                raise RuntimeError(f"rank {self.rank}'s join refused: {result.details}")
            self.caller.generation = result.join.generation
            self.beats = asyncio.ensure_future(self.heartbeats())
            return

    async def heartbeats(self) -> None:
        interval = self.bound / 3
        while True:
            started = time.monotonic()
            request = pb.HeartbeatRequest(caller=self.caller, wait_s=interval, progress=[progress(self.entered)])
            result = await self.stream.run("heartbeat", request)
            _STATS["member_heartbeats"] += 1
            if result.code or result.heartbeat.failures:
                _STATS["heartbeat_trouble"] += 1
            if time.monotonic() - started < interval / 2:
                await asyncio.sleep(interval - (time.monotonic() - started))

    async def barrier(self, seq: int) -> None:
        while True:
            request = pb.BarrierRequest(caller=self.caller, name="hop", seq=seq, wait_s=SLICE_S)
            result = await self.stream.run("barrier", request)
            if result.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]:
                continue
            if result.code:
                raise RuntimeError(f"rank {self.rank}'s barrier refused: {result.details}")
            self.entered = seq
            return


_STATS: Any = __import__("collections").Counter()


async def ask(stub: pb_grpc.CoordinatorStub, rank: int, world: int) -> str:
    while True:
        answer = await stub.Join(pb.JoinRequest(job_id=JOB, rank=rank, world_size=world, incarnation=INCARNATION + rank,
                                                hostname="hop", first_contact=True, fanin=world, wire=WIRE),
                                 timeout=30, wait_for_ready=True)
        if answer.retry_after_s > 0:
            await asyncio.sleep(answer.retry_after_s)
            continue
        return str(answer.relay_address)


async def hop(args: argparse.Namespace, k: int) -> dict[str, Any]:
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(k), "", str(args.heartbeat_timeout_s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    leader = None
    members: list[Member] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        env = {key: v for key, v in os.environ.items() if not key.startswith("GRIDCOMM_")}
        env.update(PYTHONPATH=str(ROOT), GRIDCOMM_RELAY="on", GRIDCOMM_RELAY_FANIN=str(k),
                   GRIDCOMM_HEARTBEAT_TIMEOUT_S=str(args.heartbeat_timeout_s))
        leader = subprocess.Popen([sys.executable, "-c", LEADER, str(port), str(k)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        loop = asyncio.get_running_loop()
        # Why several: one connection carries at most 256 calls at once (the server's stream cap).
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) for _ in range(1 + k // 128)]
        stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
        addresses = await asyncio.gather(*(ask(stubs[r % len(stubs)], r, k) for r in range(1, k)))
        for channel in channels:
            await channel.close()
        if len(set(addresses)) != 1 or not addresses[0]:
            raise RuntimeError(f"members were not all sent to one relay: {sorted(set(addresses))[:4]}")
        members = [Member(r, addresses[0], args.heartbeat_timeout_s) for r in range(1, k)]
        await asyncio.wait_for(asyncio.gather(*(m.join(k) for m in members)), 120)
        assert leader.stdout is not None and leader.stdin is not None
        line = await asyncio.wait_for(loop.run_in_executor(None, leader.stdout.readline), 120)
        if not line.startswith("joined"):
            raise RuntimeError(f"the leader did not join: {line!r}")
        await asyncio.sleep(args.heartbeat_timeout_s / 3 + 1)  # every member's heartbeat going
        idle0, beats0, t0 = cpu_s(leader.pid), _STATS["member_heartbeats"], time.monotonic()
        await asyncio.sleep(args.idle_s)
        idle1, beats1, t1 = cpu_s(leader.pid), _STATS["member_heartbeats"], time.monotonic()
        walls = []
        c0 = cpu_s(leader.pid)
        for seq in range(1, args.barriers + 1):
            tb = time.monotonic()
            leader.stdin.write("b\n")
            leader.stdin.flush()
            answered = loop.run_in_executor(None, leader.stdout.readline)
            await asyncio.wait_for(asyncio.gather(*(m.barrier(seq) for m in members)), 60)
            if not (await asyncio.wait_for(answered, 60)).startswith("ok"):
                raise RuntimeError("the leader's barrier failed")
            walls.append(time.monotonic() - tb)
        c1 = cpu_s(leader.pid)
        # The barriers' window holds heartbeats too: take out the idle rate for its length.
        idle_rate = (idle1 - idle0) / (t1 - t0)
        barrier_cpu = (c1 - c0) - idle_rate * sum(walls)
        return {"fanin": k, "members": k - 1, "loadavg": loadavg(), "barrier_ms": statistics.median(walls) * 1e3,
                "relay_cpu_per_barrier_ms": barrier_cpu / args.barriers * 1e3,
                "relay_us_per_member_barrier": barrier_cpu / args.barriers / (k - 1) * 1e6,
                "relay_cpu_idle_per_s": idle_rate,
                "relay_us_per_member_heartbeat": (idle1 - idle0) / max(1, beats1 - beats0) * 1e6,
                "heartbeat_trouble": _STATS["heartbeat_trouble"]}
    finally:
        for m in members:
            if m.beats is not None:
                m.beats.cancel()
            await m.stream.close()
        for proc in (leader, server):
            if proc is not None:
                proc.kill()
                proc.wait(10)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    fanins = [int(x) for x in args.fanins.split(",")]
    for rep in range(args.reps):
        for k in fanins[rep % len(fanins):] + fanins[:rep % len(fanins)]:
            res = await hop(args, k)
            res["rep"] = rep
            rows.append(res)
            print(json.dumps(res), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fanins", default="64,128,256,512")
    ap.add_argument("--barriers", type=int, default=50)
    ap.add_argument("--idle-s", type=float, default=15.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--heartbeat-timeout-s", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    print("\n| fan-in K | barrier wall ms | relay CPU per barrier ms | per member arrival us | relay CPU idle s/s "
          "| per member heartbeat us |\n| ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in dict.fromkeys(r["fanin"] for r in rows):
        cell = [r for r in rows if r["fanin"] == k]

        def med(key: str, digits: int = 1, cell: list[dict[str, Any]] = cell) -> str:
            v = [r[key] for r in cell]
            return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}..{max(v):.{digits}f}]"

        print(f"| {k} | {med('barrier_ms')} | {med('relay_cpu_per_barrier_ms')} | {med('relay_us_per_member_barrier')} "
              f"| {med('relay_cpu_idle_per_s', 3)} | {med('relay_us_per_member_heartbeat')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
