"""Leaving, failing and liveness: which ranks are gone, and which show no sign of life."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from gridcomm._coordinator.state.common import Failure, Member, MemberState, StateBase
from gridcomm._coordinator.state.progress import Entry, Hang, Progress


class Liveness(StateBase):
    """Clean leaves, failures (the first report wins) and heartbeat expiry."""

    def is_current(self, member: Member) -> bool:
        """Whether ``member`` still holds its rank (a newer process may have replaced it while it
        waited to join)."""
        return self.members.get(member.rank) is member

    def gone(self, member: Member) -> bool:
        """Whether ``member`` no longer holds its rank as a live process (failed, left, replaced)."""
        return member.state is not MemberState.JOINED or not self.is_current(member)

    def predecessor_settled(self, old: Member, since: float) -> bool:
        """Whether a new process waiting for ``old``'s rank may stop waiting: ``old`` is gone (the
        join is tried again) or it heartbeat after ``since``, when the new one came (it is alive:
        the new one is a second process for the rank, and is refused)."""
        return self.gone(old) or (old.last_heartbeat is not None and old.last_heartbeat > since)

    def seen(self, member: Member, now: float) -> None:
        """A call of ``member`` arrived or ended: it showed a sign of life."""
        member.last_seen = now

    def call_started(self, member: Member) -> None:
        """``member`` waits in a call: while it does, it is not taken for a process that died while
        joining (see Limits.stale_join_s)."""
        member.active_calls += 1

    def call_ended(self, member: Member, now: float) -> None:
        member.active_calls -= 1
        member.last_seen = now

    def lost_connection(self, member: Member, beat: float | None) -> bool:
        """Whether a rank whose heartbeat call dropped at ``beat`` (its last heartbeat then) and
        sent none since is lost: still joined, still the same process, no heartbeat after."""
        return member.state is MemberState.JOINED and member.last_heartbeat == beat and self.is_current(member)

    def leave(self, rank: int, now: float) -> None:
        member = self.members[rank]
        if not self.complete and member.state is MemberState.JOINED:
            # Why removed, not marked: before the rendezvous completes, a rank that left is not a
            # member; counted, it completed a rendezvous with a member that was gone, and the job
            # never started. A new process for the rank joins in its place.
            del self.members[rank]
            self.member_changes += 1
            self._drop_pieces(rank)
            self.progress.remove(rank)
            return
        if member.state is MemberState.JOINED:
            member.state = MemberState.LEFT
            member.last_seen = now
            self.left_count += 1
        self._drop_pieces(rank)  # O(1) while no value is in flight
        self.progress.remove(rank)

    def all_left(self) -> bool:
        """True when every rank has left or failed (rank 0 may stop serving). Why the count
        first: every leave asks, and the scan stops at the first member still joined, which is
        short when ranks leave in any order but O(ranks) per leave when they leave in rank order
        (33 million member checks for 8,192 ranks). Each member that is not joined left (counted
        in left_count) or failed (in _failed), so fewer of those than members means some are joined."""
        if not self.complete or self.left_count + len(self._failed) < len(self.members):
            return False
        return all(m.state is not MemberState.JOINED for m in self.members.values())

    def fail(self, rank: int, reason: str, reported_by: int, now: float, cause: str = "") -> Failure | None:
        """Marks ``rank`` failed; returns the failure if it is new (the first report wins)."""
        if rank in self._failed:
            return None
        member = self.members.get(rank)
        if member is not None and member.state is MemberState.LEFT:
            # Why: a clean leave followed by a lost connection is not a failure.
            return None
        failure = Failure(rank, reason[:2048], now, reported_by, cause)
        self._failed[rank] = failure
        self._drop_pieces(rank)  # O(1) while no value is in flight
        self.progress.remove(rank)
        self.failures.append(failure)
        if member is not None:
            member.state = MemberState.FAILED
        return failure

    progress: Progress
    #: +1 whenever the forming rendezvous gains or loses a member (what a cached missing list keys on).
    member_changes: int

    def report_progress(self, rank: int, generation: int, entries: Iterable[Entry], now: float,
                        said: Hashable | None = None) -> str | None:
        """``rank``'s progress in its communicators of ``generation`` (see state.progress); no
        entry is dated before the generation formed or the rank joined. Returns why the report
        cannot be true (nothing of it is kept), or None."""
        if self.progress.generation != self.generation:
            self.progress.reset(self.generation)
        member = self.members.get(rank)
        if member is None or member.state is not MemberState.JOINED or self._failed:
            return None
        floor = max(member.joined_at, self.completed_at if self.completed_at is not None else member.joined_at)
        return self.progress.report(rank, generation, entries, now, said, floor)

    def progress_unchanged(self, rank: int, generation: int, said: Hashable, now: float) -> bool:
        """True when ``rank``'s report says what its last one said (see Progress.unchanged), which
        it then stands for; False: the report goes through :meth:`report_progress`."""
        if self.progress.generation != self.generation or self._failed:
            return False
        member = self.members.get(rank)
        if member is None or member.state is not MemberState.JOINED:
            return False
        return self.progress.unchanged(rank, generation, said, now)

    def progress_refresh(self, ranks: list[tuple[Member, int]], now: float) -> list[int]:
        """A relay says each member's progress (of the generation beside it) is what it last
        reported: those reports stand as of ``now``. Returns the ranks that have none to refresh
        (the relay sends theirs again)."""
        if self.progress.generation != self.generation or self._failed:
            return [member.rank for member, _ in ranks]
        joined = MemberState.JOINED
        stale = [member.rank for member, _ in ranks if member.state is not joined]
        stale += self.progress.refresh([(member.rank, gen) for member, gen in ranks if member.state is joined], now)
        return stale

    def progress_forget(self, rank: int) -> None:
        """``rank``'s latest report was refused: nothing it said before stands for the next one."""
        self.progress.forget(rank)

    def hang(self, now: float, bound_s: float, fresh_s: float) -> Hang | None:
        """A stall or mismatch to name (None while the generation is failed or not formed)."""
        if self._failed or not self.complete or self.progress.generation != self.generation:
            return None
        return self.progress.hang(now, bound_s, fresh_s)

    def first_failure(self) -> Failure | None:
        return self.failures[0] if self.failures else None

    def heartbeat(self, rank: int, now: float, lag: float = 0.0) -> None:
        """``rank`` heartbeat at ``now``; ``lag``: the coordinator's cumulative lag then."""
        member = self.members[rank]
        member.last_heartbeat = now
        member.last_seen = now
        member.lag_mark = lag

    def answered(self, member: Member, now: float, lag: float = 0.0) -> None:
        """``member``'s join was answered: from now on it could heartbeat, so the clock of its
        first heartbeat starts here (not when the rendezvous completed: thousands of answers
        take the coordinator a while to write)."""
        if member.reachable_at is None:
            member.reachable_at = now
            if member.last_heartbeat is None:
                member.lag_mark = lag

    def silence(self, member: Member, now: float, lag: float) -> float | None:
        """How long ``member`` has been silent in time the coordinator could hear it: since its
        last heartbeat, or since its join was answered if it never sent one, less the lag the
        coordinator has had since (None: nothing to count from)."""
        since = member.last_heartbeat
        if since is None:
            since = member.reachable_at if member.reachable_at is not None else self.completed_at
        if since is None:
            return None
        return (now - since) - max(0.0, lag - member.lag_mark)

    def expired(self, now: float, timeout_s: float, lag: float = 0.0) -> list[int]:
        """Ranks that have not left or failed and show no sign of life within timeout_s, in time
        the coordinator could hear them (``lag``: its cumulative lag, see :meth:`silence`):

        - a rank that heartbeats, silent for timeout_s (calls in flight do not count: a silently
          partitioned rank's barrier call stays open on this side until TCP gives up);
        - once the job uses heartbeats, a rank that never sent one within timeout_s after its
          join was answered (it died while joining, so nothing else would ever notice).
        Jobs of bare clients (no heartbeats at all) are never expired.
        """
        # Why one pass that skips whoever was heard within the bound: this runs every second over
        # every member, and a silence is never longer than the time since the last heartbeat.
        cutoff, joined = now - timeout_s, MemberState.JOINED
        beating = False
        candidates = []
        for m in self.members.values():
            beat = m.last_heartbeat
            if beat is not None:
                beating = True
                if beat >= cutoff:
                    continue
            if m.state is joined:
                candidates.append(m)
        out = []
        for m in candidates:
            if m.last_heartbeat is None and (not beating or m.active_calls or self.completed_at is None):
                continue
            silent = self.silence(m, now, lag)
            if silent is not None and silent > timeout_s:
                out.append(m.rank)
        return sorted(out)
