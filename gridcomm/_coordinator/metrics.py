"""What the coordinator counts for operators, and its Prometheus endpoint (``/metrics``).

Counting is plain Python on the coordinator's own loop thread, kept off the per-arrival path:
a barrier is counted once per completed instance (its wait, its participants), never per
arrival; calls are counted as they end; everything else (ranks joined, connected, pending
barriers, generation) is read from the coordinator's state when Prometheus scrapes, on the
coordinator's loop, so nothing is read while the loop changes it. ``prometheus_client`` is
imported only by :func:`serve_metrics`, so a coordinator without a metrics port never loads it;
the port's HTTP server is :mod:`gridcomm._coordinator.metrics_http`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

# The port's bounds, also read as metrics.MAX_CONNECTIONS and metrics.REQUEST_DEADLINE_S.
from gridcomm._coordinator.metrics_http import MAX_CONNECTIONS as MAX_CONNECTIONS
from gridcomm._coordinator.metrics_http import REQUEST_DEADLINE_S as REQUEST_DEADLINE_S
from gridcomm._coordinator.metrics_http import MetricsServer, serve_http
from gridcomm._wire import shown_generation

log = logging.getLogger(__name__)

#: Barrier waits (first arrival to completion), seconds: from a loopback barrier to a straggler.
BARRIER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
#: Trailing metadata of a Status answer: the latest refused joins, as JSON.
REFUSED_JOINS_KEY = "gridcomm-refused-joins"
#: The refused joins' trailer at most (gRPC clients drop an answer whose metadata passes 8 KiB).
MAX_REFUSALS_TRAILER_BYTES = 4096
#: Refused joins kept for status, and how many the Status trailer carries.
_KEEP_REFUSALS = 16
_SEND_REFUSALS = 8
#: A scrape waits this long for the coordinator's loop to take its snapshot.
SNAPSHOT_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class RefusedJoin:
    rank: int
    hostname: str
    at_unix_s: float
    code: str
    reason: str

    def text(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.at_unix_s))
        return f"rank {self.rank} (from {self.hostname or '?'} at {when}) was refused: {self.reason}"


class CoordinatorMetrics:
    """The coordinator's counters. Every method runs on the coordinator's loop thread."""

    def __init__(self) -> None:
        self.rank_failures = 0
        #: Unix time of the latest rank failure (0: none yet), for alerts that need no sample from before it.
        self.last_failure_unix_s = 0.0
        #: Generations formed by a recovery in place (rebuild or shrink).
        self.recoveries = 0
        self.barriers_completed = 0
        self.barrier_arrivals = 0
        self.barrier_wait_buckets = [0] * (len(BARRIER_BUCKETS) + 1)
        self.barrier_wait_sum = 0.0
        #: Finished gRPC calls, by (method, status code name).
        self.rpcs: collections.Counter[tuple[str, str]] = collections.Counter()
        #: join, set, get and leave operations (Session or unary), as they start (a group counts each member).
        self.ops: collections.Counter[str] = collections.Counter()
        #: Join, barrier, get and heartbeat operations received, by kind: a relay's aggregate counts once (so
        #: ops / messages is how many ranks the relays fold into each).
        self.messages: collections.Counter[str] = collections.Counter()
        #: The directed join's first contacts, by answer: lead, relay, retry, direct.
        self.first_contacts: collections.Counter[str] = collections.Counter()
        #: Session operations answered with an error, by (kind, status code name).
        self.session_op_errors: collections.Counter[tuple[str, str]] = collections.Counter()
        #: Joins refused (wrong world size, job id, rank taken ...), by status code name.
        self.join_refusals: collections.Counter[str] = collections.Counter()
        self.refused_joins: collections.deque[RefusedJoin] = collections.deque(maxlen=_KEEP_REFUSALS)
        #: Ranks failed for a hang, by cause ("stall", "mismatch").
        self.hangs: collections.Counter[str] = collections.Counter()
        self._refusal_logged_at = -1e9
        self._refusals_unlogged = 0

    # ------------------------------------------------------------------ hooks (called by _server)
    def barrier_completed(self, wait_s: float, instances: int, participants: int) -> None:
        """``instances`` of one barrier completed on one arrival; the oldest waited ``wait_s``
        from its first arrival (the others' first arrivals are not kept: they count as 0 s)."""
        self.barriers_completed += instances
        self.barrier_arrivals += instances * participants
        self.barrier_wait_sum += wait_s
        self.barrier_wait_buckets[bisect_left(BARRIER_BUCKETS, wait_s)] += 1
        if instances > 1:
            self.barrier_wait_buckets[0] += instances - 1

    def rank_failed(self) -> None:
        self.rank_failures += 1
        self.last_failure_unix_s = time.time()

    def recovered(self, generation: int) -> None:
        self.recoveries += 1

    def watch_call(self, context: Any, method: str) -> None:
        """Counts ``context``'s call by method and final status when it ends."""
        def done(_: object) -> None:
            code = context.code()
            if code is None:
                name = "CANCELLED" if context.cancelled() else "OK"
            else:
                name = getattr(code, "name", str(code))
            self.rpcs[(method, name)] += 1

        try:
            context.add_done_callback(done)
        except Exception:  # noqa: BLE001 - a context without callbacks is simply not counted
            pass

    def session_op_error(self, name: str, code: Any, count: int) -> None:
        kind = name.rsplit(" ", 1)[-1]
        self.session_op_errors[(kind, getattr(code, "name", str(code)))] += count

    def join_refused(self, rank: int, hostname: str, code: str, reason: str) -> None:
        """Keeps a refused join for status and logs it (the first of each 10 s, then a count).
        Why: a rank refused for a wrong world size exits at once, and the ranks that wait for it
        otherwise only learn, at their deadline, that it is 'missing'."""
        self.join_refusals[code] += 1
        self.refused_joins.append(RefusedJoin(rank, hostname[:256], time.time(), code, reason[:400]))
        now = time.monotonic()
        if now - self._refusal_logged_at >= 10.0:
            more = f" ({self._refusals_unlogged} more refused joins in the last 10 s)" if self._refusals_unlogged else ""
            log.warning("coordinator: refused the join of rank %d from %s: %s%s", rank, hostname or "?", reason, more)
            self._refusal_logged_at = now
            self._refusals_unlogged = 0
        else:
            self._refusals_unlogged += 1

    def refusal_note(self, missing: Sequence[int]) -> str:
        """What the ranks still awaited were refused for, if they tried to join: '; rank 1 ...'."""
        latest: dict[int, RefusedJoin] = {}
        wanted = set(missing[:1024])
        for refusal in self.refused_joins:
            if refusal.rank in wanted:
                latest[refusal.rank] = refusal
        notes = [latest[r].text() for r in sorted(latest)[:2]]
        return "".join(f"; {note}" for note in notes)

    def refusals_trailer(self) -> tuple[tuple[str, str], ...]:
        """The latest refused joins as Status trailing metadata (ASCII JSON, bounded)."""
        if not self.refused_joins:
            return ()
        recent = [{"rank": r.rank, "hostname": r.hostname[:64], "at_unix_s": round(r.at_unix_s, 3), "code": r.code,
                   "reason": r.reason[:200]} for r in list(self.refused_joins)[-_SEND_REFUSALS:]]
        text = json.dumps(recent, ensure_ascii=True)
        while len(text) > MAX_REFUSALS_TRAILER_BYTES and len(recent) > 1:
            # Why by bytes, not only by count: escaped non-ASCII host names grow six-fold, and past
            # gRPC's 8 KiB metadata soft limit the client drops the whole answer. Oldest go first.
            recent.pop(0)
            text = json.dumps(recent, ensure_ascii=True)
        if len(text) > MAX_REFUSALS_TRAILER_BYTES:
            return ()
        return ((REFUSED_JOINS_KEY, text),)


def parse_refusals(trailing: Sequence[tuple[str, Any]] | None) -> list[RefusedJoin]:
    """The refused joins a Status answer carried (see refusals_trailer); [] if none or unreadable."""
    for key, value in trailing or ():
        if key != REFUSED_JOINS_KEY:
            continue
        try:
            items = json.loads(value if isinstance(value, str) else value.decode())
            return [RefusedJoin(int(i["rank"]), str(i["hostname"]), float(i["at_unix_s"]), str(i["code"]),
                                str(i["reason"])) for i in items]
        except (ValueError, KeyError, TypeError):
            return []
    return []


# ---------------------------------------------------------------------- the scrape


@dataclasses.dataclass
class _Snapshot:
    """What one scrape reports, taken on the coordinator's loop."""

    world_size: int
    generation: int
    joined: int
    by_state: dict[str, int]
    connected: int
    complete: bool
    serving: bool
    pending_barriers: int
    oldest_barrier_s: float
    failures_recorded: int
    uptime_s: float
    refused_calls: int
    restarts: int
    rank_failures: int
    recoveries: int
    barriers_completed: int
    barrier_arrivals: int
    barrier_buckets: list[int]
    barrier_sum: float
    rpcs: dict[tuple[str, str], int]
    ops: dict[str, int]
    messages: dict[str, int]
    first_contacts: dict[str, int]
    session_op_errors: dict[tuple[str, str], int]
    join_refusals: dict[str, int]
    loop_lag_s: float = 0.0
    hangs: dict[str, int] = dataclasses.field(default_factory=dict)
    longest_collective_wait_s: float = 0.0
    last_failure_unix_s: float = 0.0
    #: rank -> seconds it enters collectives behind the first entrant (state.lag).
    entry_lags: dict[int, float] = dataclasses.field(default_factory=dict)


def _snapshot(coordinator: Any) -> _Snapshot:
    state = coordinator.state
    metrics: CoordinatorMetrics = coordinator.metrics
    now = time.monotonic()
    members = list(state.members.values())
    by_state = collections.Counter(m.state.name.lower() for m in members)
    timeout = coordinator.heartbeat_timeout_s
    connected = sum(1 for m in members if m.state.name == "JOINED" and (m.active_calls or now - m.last_seen <= timeout))
    servicer = getattr(coordinator, "_servicer", None)
    refusals = getattr(servicer, "refusals", None)
    restarts = sum(getattr(s, "restarts", 0) for s in (getattr(coordinator, "_main", None),
                                                       getattr(coordinator, "_health_server", None)) if s is not None)
    return _Snapshot(
        world_size=state.world_size, generation=shown_generation(state.generation), joined=len(members),
        by_state={s: by_state.get(s, 0) for s in ("joined", "left", "failed")}, connected=connected,
        # Why counts kept by the state, never a scan: a rank may hold thousands of pending
        # barriers, and the scrape runs on the coordinator's loop (needs no token).
        complete=state.complete, serving=coordinator.serving, pending_barriers=state.pending_barrier_count,
        oldest_barrier_s=state.oldest_barrier_wait(now), failures_recorded=len(state.failures),
        uptime_s=now - state.started_at, refused_calls=getattr(refusals, "total", 0),
        restarts=restarts, rank_failures=metrics.rank_failures, recoveries=metrics.recoveries,
        barriers_completed=metrics.barriers_completed, barrier_arrivals=metrics.barrier_arrivals,
        barrier_buckets=list(metrics.barrier_wait_buckets), barrier_sum=metrics.barrier_wait_sum,
        rpcs=dict(metrics.rpcs), ops=dict(metrics.ops), messages=dict(metrics.messages),
        first_contacts=dict(metrics.first_contacts),
        session_op_errors=dict(metrics.session_op_errors), join_refusals=dict(metrics.join_refusals),
        loop_lag_s=servicer.lag.total_s if servicer is not None else 0.0,
        hangs=dict(metrics.hangs), longest_collective_wait_s=state.progress.longest_wait(now),
        last_failure_unix_s=metrics.last_failure_unix_s,
        entry_lags={rank: lag for rank, (lag, _) in state.progress.lag.lags().items()},
    )


class _Collector:
    """A prometheus_client collector that asks the coordinator's loop for a snapshot per scrape."""

    def __init__(self, coordinator: Any) -> None:
        self._coordinator = coordinator

    def _take(self) -> _Snapshot | None:
        loop: asyncio.AbstractEventLoop | None = getattr(self._coordinator, "_loop", None)
        if loop is None or loop.is_closed():
            return None
        future: concurrent.futures.Future[_Snapshot] = concurrent.futures.Future()

        def take() -> None:
            try:
                future.set_result(_snapshot(self._coordinator))
            except Exception as exc:  # noqa: BLE001 - reported as an unresponsive coordinator
                future.set_exception(exc)

        try:
            loop.call_soon_threadsafe(take)
            return future.result(SNAPSHOT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a stopped or stuck loop: gridcomm_coordinator_responsive 0
            log.debug("metrics: no snapshot from the coordinator's loop", exc_info=True)
            return None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self._take()
        yield GaugeMetricFamily("gridcomm_coordinator_responsive",
                                "1 when the coordinator's event loop answered this scrape within "
                                f"{SNAPSHOT_TIMEOUT_S:g} s, else 0 (stuck or stopped).", value=0 if snap is None else 1)
        if snap is None:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("gridcomm_world_size", "Ranks the job has.", snap.world_size)
        yield gauge("gridcomm_ranks_joined", "Ranks that have joined (including those that left or failed since).",
                    snap.joined)
        by_state = GaugeMetricFamily("gridcomm_ranks", "Joined ranks by state.", labels=["state"])
        for state, count in snap.by_state.items():
            by_state.add_metric([state], count)
        yield by_state
        yield gauge("gridcomm_ranks_connected", "Joined ranks heard from within the heartbeat timeout (or with a "
                    "call in flight).", snap.connected)
        yield gauge("gridcomm_rendezvous_complete", "1 once every rank has joined.", int(snap.complete))
        yield gauge("gridcomm_generation", "The job's generation: 0 at the first rendezvous, +1 per recovery (-1 before the first completes).", snap.generation)
        yield gauge("gridcomm_serving", "1 while the coordinator accepts calls and no rank has failed "
                    "(its readiness).", int(snap.serving))
        yield gauge("gridcomm_barriers_pending", "Barrier instances some rank waits at.", snap.pending_barriers)
        yield gauge("gridcomm_barrier_oldest_pending_seconds", "How long the longest-waiting pending barrier has "
                    "waited since its first arrival (0 when none).", snap.oldest_barrier_s)
        yield gauge("gridcomm_uptime_seconds", "Seconds since the coordinator started.", snap.uptime_s)
        yield counter("gridcomm_rank_failures", "Ranks marked failed (died, hung, lost, or reported an error).",
                      snap.rank_failures)
        yield gauge("gridcomm_rank_failure_last_timestamp_seconds", "Unix time of the latest rank failure (0: none "
                    "yet); an alert on it needs no sample from before the failure.", snap.last_failure_unix_s)
        yield counter("gridcomm_recoveries", "Generations formed by a recovery in place (rebuild or shrink).",
                      snap.recoveries)
        yield counter("gridcomm_coordinator_loop_lag_seconds", "Seconds the coordinator's event loop ran behind "
                      "(timers fired late): time it could not hear ranks, left out of their liveness silence.",
                      snap.loop_lag_s)
        yield counter("gridcomm_barriers_completed", "Barrier instances completed.", snap.barriers_completed)
        yield counter("gridcomm_barrier_arrivals", "Arrivals at completed barrier instances (participants per "
                      "instance, counted at completion).", snap.barrier_arrivals)
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*BARRIER_BUCKETS, float("inf")), snap.barrier_buckets, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        yield HistogramMetricFamily("gridcomm_barrier_wait_seconds", "Barrier instances by the time from their first "
                                    "arrival to their completion.", buckets=buckets, sum_value=snap.barrier_sum)
        rpcs = CounterMetricFamily("gridcomm_rpcs", "gRPC calls to the coordinator by method and final status "
                                   "(a Session stream counts once, when it ends).", labels=["method", "code"])
        for (method, code), count in sorted(snap.rpcs.items()):
            rpcs.add_metric([method, code], count)
        yield rpcs
        ops = CounterMetricFamily("gridcomm_ops", "join, set, get, heartbeat and leave operations (on a "
                                  "Session stream or as a unary call), by kind; barriers: gridcomm_barrier_arrivals.", labels=["op"])
        for kind, count in sorted(snap.ops.items()):
            ops.add_metric([kind], count)
        yield ops
        messages = CounterMetricFamily("gridcomm_messages", "Join, barrier, get and heartbeat operations received, by kind: a relay's "
                                       "aggregate for its ranks counts once.", labels=["op"])
        for kind, count in sorted(snap.messages.items()):
            messages.add_metric([kind], count)
        yield messages
        contacts = CounterMetricFamily("gridcomm_first_contacts", "The relay tree's directed join: first contacts "
                                       "answered, by answer (lead: host a relay; relay: join through it; retry: come "
                                       "back later; direct: join the coordinator; held: held first for its leader, then counted by its "
                                       "answer too).", labels=["answer"])
        for kind, count in sorted(snap.first_contacts.items()):
            contacts.add_metric([kind], count)
        yield contacts
        errors = CounterMetricFamily("gridcomm_session_op_errors", "Session operations answered with an error, by "
                                     "kind and status.", labels=["op", "code"])
        for (kind, code), count in sorted(snap.session_op_errors.items()):
            errors.add_metric([kind, code], count)
        yield errors
        yield counter("gridcomm_refused_calls", "Calls refused for a missing or wrong token.", snap.refused_calls)
        joins = CounterMetricFamily("gridcomm_join_refusals", "Joins refused (wrong world size or job id, rank out "
                                    "of range or taken, restarted process), by status.", labels=["code"])
        for code, count in sorted(snap.join_refusals.items()):
            joins.add_metric([code], count)
        yield joins
        hangs = CounterMetricFamily("gridcomm_hangs", "Ranks failed for a hang: `stall` (a live rank did not enter "
                                    "a collective its peers waited in, GRIDCOMM_STALL_TIMEOUT_S) or `mismatch` "
                                    "(ranks called different collectives, GRIDCOMM_DEBUG=collectives).", labels=["cause"])
        for cause in ("stall", "mismatch"):
            hangs.add_metric([cause], snap.hangs.get(cause, 0))
        yield hangs
        yield gauge("gridcomm_collective_longest_wait_seconds", "How long the ranks furthest ahead in a communicator "
                    "have waited for its last rank to enter their collective (0: none behind).",
                    snap.longest_collective_wait_s)
        lags = GaugeMetricFamily("gridcomm_rank_entry_lag_seconds", "How late each rank enters collectives behind "
                                 "the first entrant, over its last few heartbeats (stragglers; never a failure).",
                                 labels=["rank"])
        for rank, lag in sorted(snap.entry_lags.items()):
            lags.add_metric([str(rank)], lag)
        yield lags
        yield counter("gridcomm_server_restarts", "Times a server of the coordinator was found dead and bound again.",
                      snap.restarts)


def serve_metrics(coordinator: Any, port: int, bind: str) -> MetricsServer:
    """Serves ``coordinator``'s metrics as Prometheus text at ``http://BIND:PORT/metrics`` (see
    :class:`~gridcomm._coordinator.metrics_http.MetricsServer` for how it stays bounded);
    ``port=0`` picks a free port (``.port`` says which)."""
    return serve_http(_Collector(coordinator), port, bind)
