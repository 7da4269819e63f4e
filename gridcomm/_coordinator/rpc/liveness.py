"""Liveness: Heartbeat (a rank's own long poll, or a relay's for the ranks it serves, with their
progress reports), the watch that fails silent and hung ranks, ReportFailure and Leave. The
decisions are the state's (:mod:`gridcomm._coordinator.state.liveness`, ``progress``).
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Iterable
from typing import Any

import grpc

from gridcomm._coordinator.answers import Abort, failure_pb
from gridcomm._coordinator.rpc.base import Operations, log
from gridcomm._coordinator.state import Member
from gridcomm._coordinator.state.digests import answers_of, check_answers
from gridcomm._coordinator.state.progress import MAX_ENTRIES as MAX_PROGRESS_ENTRIES
from gridcomm._coordinator.state.progress import MAX_FINGERPRINT, Entry, check_entry
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import progress_said


class LivenessOps(Operations):
    """Heartbeat, ReportFailure, Leave, and the liveness watch."""

    #: rank -> (incarnation, generation, failure count) its latest heartbeat answer carried
    #: while the generation was failed: what that process knows (see heartbeat).
    _told: dict[int, tuple[int, int, int]]

    @staticmethod
    def _entries(progress: Any, what: str) -> list[Entry]:
        """A heartbeat's progress entries, checked (bad bytes are refused, never stored)."""
        if len(progress) > MAX_PROGRESS_ENTRIES:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{what} reports {len(progress)} communicators (at most {MAX_PROGRESS_ENTRIES}).")
        entries = []
        for p in progress:
            wrong = check_entry(p.communicator, p.entered, p.kind, p.age_s, p.recent, p.gpu_wait_s) or \
                check_answers(p.entered, p.probe_counts, p.probe_digests, p.probe_prints, p.probe_lost, MAX_FINGERPRINT)
            if wrong is not None:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {wrong}.")
            # Why interned: the state keeps a rank's communicator names and kind for every rank,
            # and ranks in step all report the same few (one string each, not one per rank).
            entries.append(Entry(sys.intern(p.communicator), p.entered, sys.intern(p.kind), p.age_s, p.inside,
                                 tuple(p.recent), min(p.completed, p.entered), p.gpu_wait_s, p.digest,
                                 answers_of(p.probe_counts, p.probe_digests, p.probe_prints, p.probe_lost),
                                 p.inside_s if 0.0 <= p.inside_s < math.inf else 0.0))
        return entries

    async def heartbeat(self, request: pb.HeartbeatRequest, deadline: float | None) -> pb.HeartbeatResponse:
        """Long-poll: answered after wait_s, or as soon as a rank fails that the caller's process
        was not yet told of, with every failure of the generation. Held in every phase (also
        while the generation is failed), so a caller's death always ends a call in flight."""
        self.metrics.messages["heartbeat"] += 1
        state = self._state
        caller = request.caller
        member = state.check_caller(caller.job_id, caller.rank, caller.incarnation, caller.generation, "heartbeat",
                                    any_generation=True)
        self.metrics.ops["heartbeat"] += 1
        now = self._now()
        if request.progress:
            said = progress_said(request.progress)
            if said is None or not state.progress_unchanged(member.rank, caller.generation, said, now):
                wrong = state.report_progress(member.rank, caller.generation,
                                              self._entries(request.progress, "a heartbeat"), now, said)
                if wrong is not None:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"a heartbeat of rank {member.rank}: {wrong}.")
        state.heartbeat(member.rank, now, self.lag.total_s)
        self._lost.heard(member.rank)
        beat = member.last_heartbeat
        self._wake(("beat", member.rank))  # a second process for this rank may wait to learn it is alive
        known = (member.incarnation, state.generation, len(state.failures))
        held = state.failed and self._told.get(member.rank) == known

        def news() -> bool:
            # Why held while failed: this process was already answered with these failures; a
            # heartbeat answered at once would leave nothing in flight between two of them, and
            # a death meanwhile would wait out the silence bound instead of the connection grace
            # (the held call's cancellation is how a death is seen). It is answered at a new
            # failure, at a failure of a later generation, or at its wait.
            return ((state.generation, len(state.failures)) != known[1:] if held else state.failed) or \
                state.progress.probing(member.rank)

        try:
            await self._wait(("failure",), news, min(request.wait_s, self._owner.heartbeat_timeout_s),
                             deadline, "heartbeat", fail_fast=False)
        except asyncio.CancelledError:
            # Why: the call ended without an answer: the caller's process died or its network
            # went away (or it merely re-dials). Give it a moment to heartbeat again, then fail it.
            self._loop.call_later(self._owner.connection_grace_s, self._check_lost, member, beat, self.lag.total_s)
            raise
        if state.failed and request.wait_s > 0:
            # Why only a heartbeat that could wait (a watcher's, not a poll), remembered before
            # the answer is delivered: one lost with its connection costs that rank at most one
            # wait before it hears of the failures again.
            self._told[member.rank] = (member.incarnation, state.generation, len(state.failures))
        return pb.HeartbeatResponse(failures=[failure_pb(f) for f in state.failures], generation=state.generation,
                                    digest_probes=self._probes((member.rank,)))

    def _probes(self, ranks: Iterable[int]) -> list[pb.DigestProbe]:
        """The digest probes for ``ranks`` (GRIDCOMM_DEBUG=collectives; see state.digests)."""
        progress = self._state.progress
        if progress.generation != self._state.generation:
            return []
        return [pb.DigestProbe(communicator=name, counts=counts, prints=prints, rank=rank)
                for rank in ranks for name, counts, prints in progress.probes(rank)]

    async def relayed_heartbeat(self, request: pb.HeartbeatRequest,
                                aggregate: pb.Aggregate) -> tuple[pb.HeartbeatResponse, pb.AggregateAnswer | None]:
        """A relay's heartbeat for the ranks it serves (``aggregate.ranks``), each with the age of
        its last heartbeat at the relay; and the processes whose stream to it ended
        (``aggregate.lost``). A rank the state refuses (failed, left, replaced) is skipped: the
        answer's failures say what the relay needs to know. A relay's call that drops fails
        nobody: its ranks fail over, and each is judged by its own heartbeats.

        Why a flag for a repeated progress report: this runs for every rank of every relay every
        bound / 6, and a rank between collectives reports the same progress each time; parsing a
        Caller and comparing the entries cost ~7 us per rank."""
        served, resend = self._take_relayed(request, aggregate)
        state, bound = self._state, self._owner.heartbeat_timeout_s
        await self._wait(("failure",), lambda: state.failed or any(state.progress.probing(r) for r in served),
                         min(request.wait_s, bound), None, "heartbeat", fail_fast=False)
        response = pb.HeartbeatResponse(failures=[failure_pb(f) for f in state.failures], generation=state.generation,
                                        digest_probes=self._probes(served))
        return response, (pb.AggregateAnswer(progress_resend=resend) if resend else None)

    def _take_relayed(self, request: pb.HeartbeatRequest, aggregate: pb.Aggregate) -> tuple[list[int], list[int]]:
        """What a relay's heartbeat says, taken into the state; returns the ranks it serves that
        are members, and those whose progress the relay must send again. Why apart from the
        long poll: the lists built here for every rank it carries are freed before the wait, not
        held through it (a relay's heartbeat waits nearly all the time)."""
        self.metrics.messages["heartbeat"] += 1
        state = self._state
        world = state.world_size
        # One pass over the ranks' messages (each field read once). Why a rank out of range is
        # skipped, not refused: the aggregate speaks for other ranks too.
        rows = [(r.rank, r.incarnation, r.generation, r.age_s, r.progress_same) for r in aggregate.ranks]
        if any(not 0 <= row[0] < world for row in rows):
            rows = [row for row in rows if 0 <= row[0] < world]
        ranks = [row[0] for row in rows]
        incarnations, generations = [row[1] for row in rows], [row[2] for row in rows]
        ages, same = [row[3] for row in rows], [row[4] for row in rows]
        count = len(ranks)
        job_id = request.caller.job_id
        if job_id != state.job_id:
            state.check_caller(job_id, request.caller.rank, request.caller.incarnation, request.caller.generation,
                               "heartbeat", any_generation=True)  # raises: another job's relay
        if len(request.progress) > MAX_PROGRESS_ENTRIES * count:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a relayed heartbeat reports {len(request.progress)} progress entries for {count} ranks "
                        f"(at most {MAX_PROGRESS_ENTRIES} each).")
        now, lag = self._now(), self.lag.total_s
        bound = self._owner.heartbeat_timeout_s
        self.metrics.ops["heartbeat"] += count
        carried: list[int] = []
        progress: dict[int, list[Any]] = {}
        for p in request.progress:
            progress.setdefault(p.rank, []).append(p)
        waiters, limit = self._waiters, 2 * bound
        refresh: list[tuple[Member, int]] = []
        for member, generation, age, repeated in zip(
                state.relayed_members(job_id, ranks, incarnations, generations), generations, ages, same, strict=True):
            if member is None:  # refused (failed, left, replaced): the answer's failures say why
                continue
            rank = member.rank
            if repeated:
                refresh.append((member, generation))
            else:
                mine = progress.get(rank)
                if mine:
                    said = progress_said(mine)
                    try:
                        if said is None or not state.progress_unchanged(rank, generation, said, now):
                            wrong = state.report_progress(
                                rank, generation, self._entries(mine, f"rank {rank}'s relayed heartbeat"), now, said)
                            if wrong is not None:
                                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                            f"rank {rank}'s relayed heartbeat: {wrong}.")
                    except Abort as exc:
                        state.progress_forget(rank)  # a later "same" gets a resend, not a refresh
                        log.warning("coordinator: %s (its progress is left out)", exc.message)
            # Why clamped: the age comes off the wire (NaN, negative, absurd).
            at = now - (min(age, limit) if age == age and age > 0 else 0.0)
            if member.last_heartbeat is None or at > member.last_heartbeat:
                state.heartbeat(rank, at, lag)
                carried.append(rank)
                if ("beat", rank) in waiters:
                    self._wake(("beat", rank))
        self._lost.heard_relayed(carried)
        self._lost.report(aggregate)  # after the ranks it still carries: a report is about them
        resend = state.progress_refresh(refresh, now) if refresh else []
        return [rank for rank in ranks if rank in state.members], resend

    def _check_lost(self, member: Member, beat: float | None, lag_then: float) -> None:
        if self.lag.total_s - lag_then > self._owner.connection_grace_s / 4:
            # Why: this loop fell behind during the grace, so the rank's next heartbeat may be
            # unread yet. Why looked at again after another grace rather than left to the
            # heartbeat bound: on a loaded machine that turned a 2 s verdict into 15 s; a rank
            # is failed only after a grace in which this loop kept up and heard nothing of it.
            if self._state.lost_connection(member, beat) and not self._owner.closing:
                self._loop.call_later(self._owner.connection_grace_s, self._check_lost, member, beat, self.lag.total_s)
            return
        if self._state.lost_connection(member, beat):
            self._fail(member.rank, f"rank {member.rank} on {member.hostname or '?'} lost its connection to the "
                       "coordinator without leaving (process killed, crashed, or network cut)")

    async def watch_liveness(self) -> None:
        """Marks failed every heartbeating rank silent for longer than the heartbeat timeout."""
        timeout = self._owner.heartbeat_timeout_s
        period = max(0.05, min(1.0, timeout / 4))
        meter = asyncio.ensure_future(self.lag.run())
        try:
            while not self._owner.closing:
                await asyncio.sleep(period)
                now, lag = self._now(), self.lag.total_s
                for rank in self._state.expired(now, timeout, lag):
                    member = self._state.members[rank]
                    silent = self._state.silence(member, now, lag) or timeout
                    why = ("sent no heartbeat within {t:.1f} s of its join being answered (died while joining?)"
                           if member.last_heartbeat is None else
                           "sent no heartbeat for {t:.1f} s (hung, partitioned, or overloaded)").format(t=silent)
                    note = f"; the coordinator's own lag of {lag:.1f} s so far is not counted" if lag >= 0.5 else ""
                    self._fail(rank, f"rank {rank} on {member.hostname or '?'} {why}{note}")
                # Why the liveness bound as freshness: a rank whose reports stopped is judged by
                # liveness (silent), not named as the laggard on a stale report. A stall bound of
                # 0 leaves only mismatches to name.
                hang = self._state.hang(now, max(0.0, self._owner.stall_timeout_s), timeout)
                if hang is not None:
                    self._fail(hang.rank, hang.reason, hang.cause)
                elif self._state.progress.probing_any():
                    self._wake(("failure",))  # held heartbeats carry the new digest probes
        finally:
            meter.cancel()

    async def report_failure(self, request: pb.ReportFailureRequest, deadline: float | None) -> pb.ReportFailureResponse:
        rank = request.caller.rank
        self._caller(request.caller, "report_failure")
        failure = self._state.fail(rank, request.reason or "reported an error", rank, self._now())
        if failure is not None:
            log.error("coordinator: rank %d reported a failure: %s", rank, failure.reason)
            self._on_failure()
        return pb.ReportFailureResponse()

    async def leave(self, request: pb.LeaveRequest, deadline: float | None) -> pb.LeaveResponse:
        caller = request.caller
        self.metrics.ops["leave"] += 1
        self._state.depart(caller.job_id, caller.rank, caller.incarnation, caller.generation, self._now())
        # Why: barriers waiting on this rank can never complete; let them fail now.
        self._wake_departure(caller.rank)
        self._note_departures()
        return pb.LeaveResponse()

    def _wake_departure(self, rank: int) -> None:
        """After ``rank`` left: the waits a departure can concern re-check their condition (barriers,
        joins and recoveries, a new process waiting on that rank's old one); held heartbeats and
        gets do not, since a leave changes nothing they wait for. Why not wake_all: at the end of a
        job every rank leaves at once, and each leave would re-arm every held heartbeat, O(ranks x
        waiters), enough at thousands of ranks for leaves to outlast their bound and for a rank
        whose leave had not landed when its relay stopped reporting it to be failed as silent."""
        for key in [k for k in self._waiters if k[0] in ("barrier", "join") or k == ("beat", rank)]:
            self._wake(key)
