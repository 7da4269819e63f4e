"""The wire side of benchmarks/loadgen.py: simulated ranks and relays as the relay tree puts them on
the wire (gridcomm._proto only), and the /proc readings of the processes measured. Shared with
benchmarks/relay_hop.py."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from gridcomm._client.directed import jittered  # noqa: E402
from gridcomm._proto import coordinator_pb2 as pb  # noqa: E402
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from gridcomm._wire import WIRE  # noqa: E402

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

    def run(self, kind: str, request: Any, aggregate: pb.Aggregate | None = None) -> asyncio.Future[pb.SessionResult]:
        self.next_id += 1
        future: asyncio.Future[pb.SessionResult] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        self.outbox.append(pb.SessionOp(id=self.next_id, aggregate=aggregate, **{kind: request}))
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
        #: Whether the ranks are busy: each enters a collective between two heartbeats, so its
        #: progress changes every time (idle ranks' stays the same after its first report).
        self.busy = False

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
        #: Collectives entered while the ranks are busy (see Run.busy), counted in their progress.
        self.collectives = 0
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
                                     hostname="loadgen", wait_s=SLICE_S, relay_address=relay_address, wire=WIRE,
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
        aggregate = pb.Aggregate(ranks=[pb.RelayedRank(rank=r, incarnation=INCARNATION + r, hostname="loadgen")
                                        for r in ranks[1:]]) if len(ranks) > 1 else None
        while True:
            request = pb.JoinRequest(job_id=JOB, rank=ranks[0], world_size=self.run.world,
                                     incarnation=INCARNATION + ranks[0], hostname="loadgen", wait_s=SLICE_S,
                                     wants_relay=True, relay_rank=self.leader, wire=WIRE)
            result = await self.upstream().run("join", request, aggregate)
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
            request = pb.HeartbeatRequest(caller=self.caller(rank), wait_s=interval, progress=[progress(self.entered + self.collectives)])
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
            if self.run.busy:
                self.collectives += 1
            said = self.entered + self.collectives
            same = [self.progress_up.get(r) == said for r in ranks]
            request = pb.HeartbeatRequest(caller=self.caller(ranks[0]), wait_s=period,
                                          progress=[progress(said, r) for r, s in zip(ranks, same, strict=True) if not s])
            generation = self.run.generation
            aggregate = pb.Aggregate(ranks=[
                pb.RelayedRank(rank=r, incarnation=INCARNATION + r, generation=generation, age_s=age, progress_same=s)
                for r, age, s in zip(ranks, ages, same, strict=True)])
            try:
                result = await asyncio.wait_for(self.upstream().run("heartbeat", request, aggregate),
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
                    self.progress_up[r] = said
            for r in result.aggregate.progress_resend:
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
            request = pb.BarrierRequest(caller=self.caller(ranks[0]), name="loadgen", seq=seq, wait_s=SLICE_S)
            aggregate = pb.Aggregate(ranks=[pb.RelayedRank(rank=r, incarnation=INCARNATION + r)
                                            for r in ranks[1:]]) if len(ranks) > 1 else None
            result = await stream.run("barrier", request, aggregate)
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


async def ask_and_join(run: Run, group: Group, rank: int, stub: pb_grpc.CoordinatorStub, kinds: Counter[str],
                       delay_s: float) -> None:
    """The directed join of one rank: ask (again as told) where to join, then join there."""
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    leader = rank == group.leader
    backoff = 0.2
    while True:
        request = pb.JoinRequest(job_id=JOB, rank=rank, world_size=run.world, incarnation=INCARNATION + rank,
                                 hostname="loadgen", first_contact=True, fanin=0, wire=WIRE,
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
