"""A load generator: tens of thousands of simulated ranks against a real coordinator.

The coordinator runs in a process of its own with its real defaults (``gridcomm.Coordinator``:
heartbeat bound 15 s, no token unless ``--token``). This process plays the ranks on one asyncio
loop, speaking the real proto (gridcomm._proto only), as the relay tree puts them on the wire:

- ``template`` (relay addresses known, ``GRIDCOMM_RELAY_ADDRESSES``): N / K groups of K consecutive
  ranks, K the fan-in ``auto`` picks at N. Each group's leader joins on a Session stream of its own,
  naming its relay's address, and heartbeats there every bound / 3 (held for that long), as a
  rank's watcher does; its relay (another connection) sends the members' first joins as one
  aggregate (``JoinRequest.also``), a heartbeat for its members every bound / 6 (packed ages,
  progress in full once and then flagged as the same, as an idle rank's is), and each barrier as
  one aggregate naming all K ranks (``also_ranks``), the leader's own arrival included.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from gridcomm._config import DEFAULT_HEARTBEAT_TIMEOUT_S, auto_relay_fanin  # noqa: E402
from gridcomm._proto import coordinator_pb2 as pb  # noqa: E402
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402

JOB = "default"
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
#: A rank's long-poll slice (a join or barrier waits this long per call, then asks again).
SLICE_S = 10.0
#: How long a relay holds a group's first joins for the rest of its group.
RELAY_HOLD_S = 1.0
#: The longest one first contact may take before it is asked again (after a backoff).
ASK_TIMEOUT_S = 10.0
#: A rank's process identity: incarnation = INCARNATION + rank (a real one is random).
INCARNATION = 0x5EED_0000_0000

#: A channel as the library makes one (its own connection; no BDP probing; generous keepalive).
OPTIONS: list[tuple[str, Any]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", 80 * 1024 * 1024),
    ("grpc.max_send_message_length", 80 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 5_000),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]

SERVE = """
import sys, gridcomm
server = gridcomm.Coordinator(int(sys.argv[1]), bind="127.0.0.1", port=0, token=sys.argv[2] or None,
                              heartbeat_timeout_s=float(sys.argv[3])).start()
print(server.port, flush=True)
sys.stdin.read()
"""


def cpu_s(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class Stream:
    """One Session stream on a connection of its own: operations batched into messages as they
    come, results routed back by id."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...], stats: Counter[str]) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=OPTIONS)
        self.call = pb_grpc.CoordinatorStub(self.channel).Session(metadata=metadata, wait_for_ready=True)
        self.stats = stats
        self.waiting: dict[int, asyncio.Future[pb.SessionResult]] = {}
        self.outbox: list[pb.SessionOp] = []
        self.has_work = asyncio.Event()
        self.next_id = 0
        self.tasks = (asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read()))
        stats["connections"] += 1

    def run(self, kind: str, request: Any) -> asyncio.Future[pb.SessionResult]:
        self.next_id += 1
        future: asyncio.Future[pb.SessionResult] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        self.outbox.append(pb.SessionOp(id=self.next_id, **{kind: request}))
        self.stats[f"sent_{kind}"] += 1
        self.has_work.set()
        return future

    async def _write(self) -> None:
        while True:
            await self.has_work.wait()
            self.has_work.clear()
            batch, self.outbox = self.outbox, []
            if batch:
                self.stats["messages"] += 1
                await self.call.write(pb.SessionRequest(ops=batch))

    async def _read(self) -> None:
        try:
            async for reply in self.call:
                for result in reply.results:
                    future = self.waiting.pop(result.id, None)
                    if future is not None and not future.done():
                        future.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - the stream ended: every waiter learns it
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"the Session stream ended: {exc!r}"))
            self.waiting.clear()
            raise

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.call.cancel()
        await self.channel.close()


class Run:
    """What one run shares: the target, the bound, the counters, the failures seen."""

    def __init__(self, target: str, world: int, fanin: int, bound: float, token: str) -> None:
        self.target, self.world, self.fanin, self.bound = target, world, fanin, bound
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.stats: Counter[str] = Counter()
        self.failures: dict[int, str] = {}
        self.joined_at: dict[int, float] = {}
        self.stopping = False
        self.generation = 0

    def saw(self, beat: pb.HeartbeatResponse) -> None:
        for failure in beat.failures:
            self.failures.setdefault(failure.rank, failure.reason)


def progress(communicator_entered: int, rank: int | None = None) -> pb.Progress:
    """An idle rank's progress in its world communicator: the barriers it has entered, none inside."""
    entry = pb.Progress(communicator="world", entered=communicator_entered, kind="barrier" if communicator_entered else "",
                        age_s=1.0, inside=False)
    if rank is not None:
        entry.rank = rank
    return entry


class Group:
    """A relay's group of the tree: its leader (a client of its own) and its relay's stream."""

    def __init__(self, run: Run, leader: int) -> None:
        self.run = run
        self.leader = leader
        self.ranks = list(range(leader, min(leader + run.fanin, run.world)))
        self.address = f"127.0.0.{1 + leader // run.fanin % 250}:{20000 + leader // run.fanin % 40000}"
        self.up: Stream | None = None  # the relay's stream to the coordinator (opened on its first send)
        self.own: dict[int, Stream] = {}  # rank -> its own Session stream (the leader, ranks told "direct")
        self.relayed: list[int] = []  # ranks whose join the relay carried (its heartbeats name them)
        self.pending: list[int] = []
        self.waiting: set[int] = set(self.ranks[1:])
        self.opened = 0.0
        self.answers: dict[int, asyncio.Future[None]] = {}
        self.entered = 0
        self.progress_up: dict[int, int] = {}  # rank -> entered, as the coordinator last took it
        self.tasks: list[asyncio.Task[None]] = []

    def caller(self, rank: int) -> pb.Caller:
        return pb.Caller(job_id=JOB, rank=rank, incarnation=INCARNATION + rank, generation=self.run.generation)

    def upstream(self) -> Stream:
        if self.up is None:
            self.up = Stream(self.run.target, self.run.metadata, self.run.stats)
        return self.up

    def joined(self, rank: int, generation: int) -> None:
        self.run.generation = generation
        self.run.joined_at.setdefault(rank, time.monotonic())

    # ------------------------------------------------------------------ joins
    async def join_own(self, rank: int, relay_address: str = "") -> None:
        """A join on the rank's own stream (the leader naming its relay, or a rank told "direct")."""
        stream = self.own[rank] = Stream(self.run.target, self.run.metadata, self.run.stats)
        wants = rank != self.leader
        while True:
            request = pb.JoinRequest(job_id=JOB, rank=rank, world_size=self.run.world, incarnation=INCARNATION + rank,
                                     hostname="loadgen", wait_s=SLICE_S, relay_address=relay_address,
                                     wants_relay=wants, relay_rank=self.leader if wants else 0)
            result = await stream.run("join", request)
            if result.code == DEADLINE:
                continue
            if result.code:
                raise RuntimeError(f"rank {rank}'s join refused: {result.details}")
            self.joined(rank, result.join.generation)
            self.tasks.append(asyncio.ensure_future(self.own_beats(rank)))
            return

    def through_relay(self, rank: int) -> asyncio.Future[None]:
        """A member's first join reaches the relay: held for the rest of the group, at most 1 s."""
        loop = asyncio.get_running_loop()
        future = self.answers[rank] = loop.create_future()
        if not self.pending:
            self.opened = loop.time()
            loop.call_at(self.opened + RELAY_HOLD_S, self.flush)
        self.pending.append(rank)
        self.waiting.discard(rank)
        if not self.waiting:
            self.flush()
        return future

    def flush(self) -> None:
        if not self.pending:
            return
        ranks, self.pending = self.pending, []
        self.tasks.append(asyncio.ensure_future(self.aggregate_join(ranks)))

    async def aggregate_join(self, ranks: list[int]) -> None:
        joiners = [pb.Joiner(rank=r, incarnation=INCARNATION + r, hostname="loadgen") for r in ranks[1:]]
        while True:
            request = pb.JoinRequest(job_id=JOB, rank=ranks[0], world_size=self.run.world,
                                     incarnation=INCARNATION + ranks[0], hostname="loadgen", wait_s=SLICE_S,
                                     wants_relay=True, relay_rank=self.leader, also=joiners)
            result = await self.upstream().run("join", request)
            if result.code == DEADLINE:
                continue  # every rank's slice ended: each asks again, and they go up together
            if result.code:
                error = RuntimeError(f"the aggregated join of ranks {ranks[0]}..{ranks[-1]} refused: {result.details}")
                for r in ranks:
                    self.answers[r].set_exception(error)
                return
            first = not self.relayed
            for r in ranks:
                self.joined(r, result.join.generation)
                self.answers[r].set_result(None)
            self.relayed.extend(ranks)
            if first:
                self.tasks.append(asyncio.ensure_future(self.relay_beats()))
            return

    # ------------------------------------------------------------------ heartbeats
    async def own_beats(self, rank: int) -> None:
        """A rank's watcher on its own stream: held bound / 3, again at once."""
        interval = self.run.bound / 3
        stream = self.own[rank]
        while not self.run.stopping:
            started = time.monotonic()
            request = pb.HeartbeatRequest(caller=self.caller(rank), wait_s=interval, progress=[progress(self.entered)])
            try:
                result = await asyncio.wait_for(stream.run("heartbeat", request), interval + max(1.0, self.run.bound / 2))
            except asyncio.TimeoutError:
                self.run.stats["heartbeat_timeouts"] += 1
                continue
            if result.code:
                self.run.stats["heartbeat_refused"] += 1
            else:
                self.run.saw(result.heartbeat)
            if time.monotonic() - started < interval / 2:
                await asyncio.sleep(interval - (time.monotonic() - started))

    async def relay_beats(self) -> None:
        """The relay's heartbeat for its members every bound / 6, each rank's age since its last
        heartbeat at the relay (a member heartbeats every bound / 3), its progress in full only
        when changed."""
        period = max(0.05, self.run.bound / 6)
        interval = self.run.bound / 3
        phase = {r: random.random() * interval for r in self.ranks}
        await asyncio.sleep(random.random() * period)  # the relay's ticks run from its own start
        while not self.run.stopping:
            ranks = list(self.relayed)
            now = time.monotonic()
            ages = [(now + phase[r]) % interval for r in ranks]
            same = [self.progress_up.get(r) == self.entered for r in ranks]
            request = pb.HeartbeatRequest(caller=self.caller(ranks[0]), wait_s=period, relayed=True,
                                          also_ranks=ranks, also_incarnations=[INCARNATION + r for r in ranks],
                                          also_generations=[self.run.generation] * len(ranks), also_age_s=ages,
                                          progress=[progress(self.entered, r) for r, s in zip(ranks, same, strict=True) if not s])
            if any(same):
                request.also_progress_same.extend(same)
            entered = self.entered
            try:
                result = await asyncio.wait_for(self.upstream().run("heartbeat", request),
                                                period + max(1.0, self.run.bound / 2))
            except asyncio.TimeoutError:
                self.run.stats["heartbeat_timeouts"] += 1
                self.progress_up.clear()
                continue
            if result.code:
                self.run.stats["heartbeat_refused"] += 1
                self.progress_up.clear()
                await asyncio.sleep(period)
                continue
            for r, s in zip(ranks, same, strict=True):
                if not s:
                    self.progress_up[r] = entered
            for r in result.heartbeat.progress_resend:
                self.progress_up.pop(r, None)
            self.run.saw(result.heartbeat)
            if result.heartbeat.failures:
                await asyncio.sleep(period)

    # ------------------------------------------------------------------ barriers
    async def barrier(self, seq: int) -> None:
        """One barrier of the group: the relay's aggregate (its leader's arrival included, as a
        leader's barriers go through its own relay); a rank joined directly arrives on its own."""
        through = [r for r in self.ranks if r == self.leader or r in self.relayed]
        alone = [r for r in self.ranks if r not in through]
        calls = [self._arrive(self.upstream(), through)] + [self._arrive(self.own[r], [r]) for r in alone]
        await asyncio.gather(*calls)
        self.entered = seq

    async def _arrive(self, stream: Stream, ranks: list[int]) -> None:
        seq = self.entered + 1
        while True:
            request = pb.BarrierRequest(caller=self.caller(ranks[0]), name="loadgen", seq=seq, wait_s=SLICE_S,
                                        also_ranks=ranks[1:], also_incarnations=[INCARNATION + r for r in ranks[1:]])
            result = await stream.run("barrier", request)
            if result.code == DEADLINE:
                continue
            if result.code:
                raise RuntimeError(f"barrier #{seq} of ranks {ranks[0]}.. refused: {result.details}")
            return

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for stream in [self.up, *self.own.values()]:
            if stream is not None:
                await stream.close()


def jittered(seconds: float) -> float:
    return seconds * (0.5 + random.random())


async def ask_and_join(run: Run, group: Group, rank: int, stub: pb_grpc.CoordinatorStub, kinds: Counter[str],
                       delay_s: float) -> None:
    """The directed join of one rank: ask (again as told) where to join, then join there."""
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    leader = rank == group.leader
    backoff = 0.2
    while True:
        request = pb.JoinRequest(job_id=JOB, rank=rank, world_size=run.world, incarnation=INCARNATION + rank,
                                 hostname="loadgen", first_contact=True, fanin=0,
                                 relay_address=group.address if leader else "")
        kinds["asks"] += 1
        try:
            answer = await stub.Join(request, timeout=ASK_TIMEOUT_S, metadata=run.metadata, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise RuntimeError(f"rank {rank}'s first contact refused: {exc.details()}") from None
            kinds["ask_unanswered"] += 1
            await asyncio.sleep(jittered(backoff))
            backoff = min(2.0, backoff * 2)
            continue
        if answer.retry_after_s > 0:
            kinds["come_back"] += 1
            await asyncio.sleep(jittered(answer.retry_after_s))
            continue
        break
    if answer.host_relay:
        kinds["lead"] += 1
        await group.join_own(rank, group.address)
    elif answer.relay_address:
        kinds["relay"] += 1
        await group.through_relay(rank)
    else:
        kinds["direct"] += 1
        await group.join_own(rank)


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
    out: dict[str, Any] = {"shape": shape, "world": world, "fanin": fanin, "relays": len(groups), "ask_rate": args.ask_rate,
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
            joins = [ask_and_join(run, groups[r // fanin], r, stubs[i % len(stubs)], kinds, i / rate)
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
    ap.add_argument("--ask-rate", type=float, default=0.0,
                    help="no-template: ranks starting per second, in random order (0: all at once)")
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
