"""The pure decision module, with an injected clock and no network."""

from __future__ import annotations

import pytest

from gridcomm._coordinator.state import (
    ABORTED,
    ALREADY_EXISTS,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    JobState,
    Limits,
    MemberState,
    StateError,
)


def joined(n: int = 3, now: float = 0.0) -> JobState:
    state = JobState(n, "job", now=now)
    for r in range(n):
        state.join("job", r, n, incarnation=100 + r, hostname=f"h{r}", now=now)
    return state


def test_join_completes_when_last_rank_arrives():
    state = JobState(3, "job", now=0.0)
    assert state.join("job", 2, 3, 7, "h2", now=1.0) is False
    assert state.missing_join() == [0, 1]
    assert state.join("job", 0, 3, 8, "h0", now=2.0) is False
    assert state.generation == 0
    assert state.join("job", 1, 3, 9, "h1", now=3.0) is True
    assert state.generation == 1 and state.complete and state.missing_join() == []


@pytest.mark.parametrize(
    "kwargs, code, words",
    [
        (dict(job_id="other"), INVALID_ARGUMENT, "does not match"),
        (dict(world_size=4), INVALID_ARGUMENT, "world size is 4"),
        (dict(rank=3), INVALID_ARGUMENT, "out of range"),
        (dict(rank=-1), INVALID_ARGUMENT, "out of range"),
        (dict(incarnation=0), INVALID_ARGUMENT, "incarnation 0"),
    ],
)
def test_join_rejections_name_the_problem(kwargs, code, words):
    state = JobState(3, "job", now=0.0)
    args = dict(job_id="job", rank=0, world_size=3, incarnation=5, hostname="h", now=0.0)
    args.update(kwargs)
    with pytest.raises(StateError) as info:
        state.join(**args)
    assert info.value.code == code and words in info.value.message


def test_same_incarnation_rejoin_is_idempotent():
    state = JobState(2, "job", now=0.0)
    state.join("job", 0, 2, 5, "h", now=0.0)
    assert state.join("job", 0, 2, 5, "h", now=1.0) is False
    assert list(state.members) == [0]


def test_duplicate_live_rank_is_refused_but_stale_one_is_replaced():
    state = JobState(2, "job", now=0.0)
    state.join("job", 0, 2, 5, "h", now=0.0)
    state.members[0].active_calls = 1
    with pytest.raises(StateError) as info:
        state.join("job", 0, 2, 6, "other", now=100.0)
    assert info.value.code == ALREADY_EXISTS
    # Recently seen, no call in flight: still live (between long-poll slices).
    state.members[0].active_calls = 0
    state.members[0].last_seen = 99.5
    with pytest.raises(StateError):
        state.join("job", 0, 2, 6, "other", now=100.0)
    # No call and stale: the process died while joining; the new incarnation takes over.
    state.members[0].last_seen = 90.0
    state.join("job", 0, 2, 6, "other", now=100.0)
    assert state.members[0].incarnation == 6


def test_a_second_process_for_a_live_rank_is_refused_and_fails_nobody():
    state = joined(2)
    with pytest.raises(StateError) as info:
        state.join("job", 1, 2, 999, "h1", now=5.0)
    assert info.value.code == ALREADY_EXISTS and info.value.predecessor_alive
    assert "live process" in info.value.message and "0x64" not in info.value.message
    assert not state.failed and state.members[1].incarnation == 101 and state.recovery is None


def failed_one(n: int = 4, victim: int = 2, now: float = 10.0) -> JobState:
    state = joined(n)
    state.set("k", b"v")
    state.arrive("b", 0, 1, now=1.0)
    assert state.fail(victim, "killed", -1, now=now) is not None
    return state


def test_rebuild_admits_a_replacement_into_the_next_generation_only():
    state = failed_one()
    # The replacement comes first: it waits in the forming generation, not in the failed one.
    assert state.join("job", 2, 4, 555, "h2b", now=11.0) is False
    assert state.generation == 1 and state.members[2].incarnation == 102
    assert state.missing_join() == [0, 1, 3]
    assert state.recovery_check(2, 555, 1) is False
    assert state.join("job", 0, 4, 100, "h0", now=12.0, base=1, mode="rebuild") is False
    assert state.join("job", 1, 4, 101, "h1", now=12.0, base=1, mode="rebuild") is False
    assert state.join("job", 3, 4, 103, "h3", now=13.0, base=1, mode="rebuild") is True
    assert state.generation == 2 and state.active == (0, 1, 2, 3)
    assert state.members[2].incarnation == 555 and state.members[2].state is MemberState.JOINED
    # A fresh generation: no failure, no key, no barrier; the old failure is history.
    assert not state.failed and state.kv == {} and state.barriers == {}
    assert [f.rank for f in state.past_failures] == [2]
    assert all(state.recovery_check(r, 100 + r if r != 2 else 555, 1) for r in range(4))
    # A survivor that re-polls its recovery gets the new generation; the old process is refused.
    assert state.join("job", 0, 4, 100, "h0", now=14.0, base=1, mode="rebuild") is False
    with pytest.raises(StateError, match="process"):
        state.check_caller("job", 2, 102, 2, "set")
    assert state.check_caller("job", 2, 555, 2, "set").hostname == "h2b"


def test_rebuild_waits_for_the_replacement():
    state = failed_one()
    for r in (0, 1, 3):
        assert state.join("job", r, 4, 100 + r, f"h{r}", now=11.0, base=1, mode="rebuild") is False
    assert state.missing_join() == [2] and state.generation == 1
    assert state.join("job", 2, 4, 556, "h2b", now=12.0) is True
    assert state.generation == 2 and state.members[2].incarnation == 556


def test_shrink_keeps_the_survivors_and_refuses_a_replacement():
    state = failed_one()
    assert state.join("job", 2, 4, 555, "h2b", now=11.0) is False  # came before the survivors chose
    for r in (0, 1):
        assert state.join("job", r, 4, 100 + r, f"h{r}", now=11.0, base=1, mode="shrink") is False
    with pytest.raises(StateError, match="shrink"):
        state.recovery_check(2, 555, 1)
    assert state.join("job", 3, 4, 103, "h3", now=12.0, base=1, mode="shrink") is True
    assert state.generation == 2 and state.active == (0, 1, 3) and sorted(state.members) == [0, 1, 3]
    with pytest.raises(StateError, match="shrink"):
        state.recovery_check(2, 555, 1)
    with pytest.raises(StateError, match="not part of generation 1"):
        state.join("job", 2, 4, 777, "h2c", now=13.0)
    # A whole-generation barrier is over the survivors; the departed rank is no participant.
    for r in (0, 1):
        assert state.arrive("b", r, 1, now=14.0) == 0
    assert state.barrier_missing("b", 1) == [3]
    assert state.arrive("b", 3, 1, now=14.0) == 1
    with pytest.raises(StateError, match="participants"):
        state.arrive("c", 0, 1, now=14.0, participants=[0, 2])


def test_a_failure_during_the_recovery_ends_the_waits_and_can_be_retried():
    state = failed_one()
    state.join("job", 0, 4, 100, "h0", now=11.0, base=1, mode="rebuild")
    assert state.recovery_check(0, 100, 1) is False
    state.fail(3, "killed too", -1, now=12.0)
    with pytest.raises(StateError) as info:
        state.recovery_check(0, 100, 1)
    assert info.value.code == ABORTED and info.value.failed_rank == 3
    # The retry counts again; the recovery now needs replacements of 2 and 3.
    state.join("job", 0, 4, 100, "h0", now=13.0, base=1, mode="rebuild")
    state.join("job", 1, 4, 101, "h1", now=13.0, base=1, mode="rebuild")
    assert state.recovery_check(0, 100, 1) is False and state.missing_join() == [2, 3]
    state.join("job", 2, 4, 1002, "h2b", now=14.0)
    assert state.join("job", 3, 4, 1003, "h3b", now=14.0) is True
    assert state.generation == 2 and [f.rank for f in state.past_failures] == [2, 3]


@pytest.mark.parametrize(
    "rank, incarnation, kwargs, code, words",
    [
        (0, 100, dict(base=1, mode="shrink"), FAILED_PRECONDITION, "same call"),
        (2, 102, dict(base=1, mode="rebuild"), ABORTED, "marked failed"),
        (0, 999, dict(base=1, mode="rebuild"), FAILED_PRECONDITION, "not a member"),
        (0, 100, dict(base=3, mode="rebuild"), FAILED_PRECONDITION, "job is at generation 0"),
        (0, 100, dict(base=1, mode="grow"), INVALID_ARGUMENT, "rebuild or shrink"),
        (0, 100, dict(mode="rebuild"), INVALID_ARGUMENT, "generation"),
    ],
)
def test_recovery_refusals(rank, incarnation, kwargs, code, words):
    state = failed_one()
    state.join("job", 1, 4, 101, "h1", now=11.0, base=1, mode="rebuild")
    with pytest.raises(StateError) as info:
        state.join("job", rank, 4, incarnation, "h", now=12.0, **kwargs)
    assert info.value.code == code and words in info.value.message, info.value.message


def test_recovery_without_a_failure_and_a_replacement_for_a_rank_that_left_are_refused():
    state = joined(2)
    with pytest.raises(StateError, match="no rank of generation 0 has failed"):
        state.join("job", 0, 2, 100, "h0", now=1.0, base=1, mode="rebuild")
    state.leave(1, now=2.0)
    with pytest.raises(StateError, match="left generation 0 cleanly"):
        state.join("job", 1, 2, 999, "h1", now=3.0)


def test_every_rank_replaced_restarts_the_job_in_place():
    state = joined(2)
    state.fail(0, "gone", -1, now=1.0)
    state.fail(1, "gone", -1, now=1.0)
    assert state.join("job", 1, 2, 11, "a", now=2.0) is False
    assert state.join("job", 0, 2, 10, "b", now=2.0) is True
    assert state.generation == 2 and {m.incarnation for m in state.members.values()} == {10, 11}


def test_a_heartbeat_speaks_for_the_process_across_generations():
    state = failed_one(n=2, victim=1)
    state.join("job", 1, 2, 555, "h1b", now=11.0)
    assert state.join("job", 0, 2, 100, "h0", now=12.0, base=1, mode="rebuild") is True
    assert state.check_caller("job", 0, 100, 1, "heartbeat", any_generation=True).rank == 0
    # Shown as users count: the wire's generations 1 and 2 are generations 0 and 1.
    with pytest.raises(StateError, match="for generation 0, but the job is at generation 1"):
        state.check_caller("job", 0, 100, 1, "set")


def test_check_caller_refuses_old_incarnation_and_generation():
    state = joined(2)
    assert state.check_caller("job", 0, 100, 1, "set").rank == 0
    with pytest.raises(StateError, match="process"):
        state.check_caller("job", 0, 101, 1, "set")
    with pytest.raises(StateError, match="generation 0"):
        state.check_caller("job", 0, 100, 0, "set")
    fresh = JobState(2, "job", now=0.0)
    with pytest.raises(StateError, match="before joining"):
        fresh.check_caller("job", 0, 100, 0, "set")


def test_barrier_completes_on_last_arrival_and_counts_instances():
    state = joined(3)
    assert state.arrive("b", 0, 1, now=1.0) == 0
    assert state.arrive("b", 1, 1, now=1.0) == 0
    assert state.barrier_missing("b", 1) == [2]
    # Rank 0 runs ahead to the second instance; it does not complete the first.
    assert state.arrive("b", 0, 2, now=1.5) == 0
    assert state.arrive("b", 2, 1, now=2.0) == 1
    assert state.barrier_missing("b", 2) == [1, 2]
    # Retries of an old arrival are idempotent.
    assert state.arrive("b", 2, 1, now=2.5) == 1
    state.arrive("b", 1, 2, now=3.0)
    assert state.arrive("b", 2, 2, now=3.0) == 2


def test_barrier_seq_cannot_skip():
    state = joined(2)
    with pytest.raises(StateError, match="count up by one"):
        state.arrive("b", 0, 2, now=0.0)


def test_pending_barriers_report_missing_and_wait_time():
    state = joined(3, now=0.0)
    state.arrive("x", 1, 1, now=10.0)
    (name, seq, arrived, missing, waited), = list(state.pending_barriers(now=12.5))
    assert (name, seq, arrived, missing) == ("x", 1, [1], [0, 2])
    assert waited == pytest.approx(2.5)


def test_barrier_blocked_by_a_rank_that_left():
    state = joined(2)
    state.leave(1, now=1.0)
    state.arrive("b", 0, 1, now=1.0)
    assert state.barrier_blocker("b", 1).rank == 1


def test_kv_limits():
    state = JobState(1, "job", now=0.0, limits=Limits(max_value_bytes=10, max_keys=2, max_key_bytes=4))
    state.set("a", b"1" * 10)
    with pytest.raises(StateError) as info:
        state.set("b", b"1" * 11)
    assert info.value.code == RESOURCE_EXHAUSTED
    with pytest.raises(StateError) as info:
        state.set("toolong", b"")
    assert info.value.code == INVALID_ARGUMENT
    state.set("b", b"")
    with pytest.raises(StateError, match="limit"):
        state.set("c", b"")
    state.set("a", b"2")  # overwriting does not count as a new key
    assert state.get("a") == b"2"


def test_a_value_in_pieces_is_stored_once_whole_and_counts_while_it_arrives():
    state = JobState(2, "job", now=0.0, limits=Limits(max_value_bytes=10, max_total_value_bytes=15))
    assert state.set_piece(0, "k", 0, 6, b"abc") is False
    assert state.get("k") is None
    # A second value of 10 bytes does not fit beside the 6 announced (15 in all).
    with pytest.raises(StateError) as full:
        state.set("other", b"x" * 10)
    assert full.value.code == RESOURCE_EXHAUSTED
    assert state.set_piece(0, "k", 3, 6, b"def") is True
    assert state.get("k") == b"abcdef" and state.version("k") > 0


def test_value_pieces_out_of_order_are_refused_but_a_repeat_is_harmless():
    state = JobState(2, "job", now=0.0)
    state.set_piece(1, "k", 0, 6, b"ab")
    assert state.set_piece(1, "k", 0, 6, b"ab") is False  # offset 0 restarts
    state.set_piece(1, "k", 2, 6, b"cd")
    assert state.set_piece(1, "k", 2, 6, b"cd") is False  # the same piece again (a repeated call)
    with pytest.raises(StateError) as gap:
        state.set_piece(1, "k", 5, 6, b"f")
    assert gap.value.code == INVALID_ARGUMENT and "does not follow" in gap.value.message
    with pytest.raises(StateError):  # what came before the gap was dropped
        state.set_piece(1, "k", 4, 6, b"ef")
    with pytest.raises(StateError) as past:
        state.set_piece(1, "k", 0, 6, b"abcdefg")
    assert past.value.code == INVALID_ARGUMENT
    with pytest.raises(StateError) as big:
        state.set_piece(1, "k", 0, state.limits.max_value_bytes + 1, b"a")
    assert big.value.code == RESOURCE_EXHAUSTED
    assert state.get("k") is None and state._pieces_bytes == 0


def test_a_rank_that_leaves_or_fails_drops_its_unfinished_pieces():
    state = joined(2)
    state.set_piece(0, "a", 0, 100, b"x")
    state.set_piece(1, "b", 0, 100, b"y")
    state.leave(0, now=1.0)
    assert state._pieces_bytes == 100
    state.fail(1, "gone", reported_by=-1, now=2.0)
    assert state._pieces_bytes == 0


def test_setting_a_key_again_changes_its_version():
    state = JobState(1, "job", now=0.0)
    state.set("k", b"1")
    first = state.version("k")
    state.set("k", b"1")
    assert state.version("k") != first and state.version("missing") == 0


def test_a_caller_unknown_after_the_rendezvous_is_told_the_coordinator_restarted():
    state = JobState(2, "job", now=0.0)  # a coordinator that never saw this job's rendezvous
    with pytest.raises(StateError) as unknown:
        state.check_caller("job", 1, 7, 1, "heartbeat")
    assert "restarted" in unknown.value.message and "before joining" not in unknown.value.message
    assert unknown.value.restarted and unknown.value.code == FAILED_PRECONDITION
    with pytest.raises(StateError, match="before joining") as early:
        state.check_caller("job", 1, 7, 0, "heartbeat")
    assert not early.value.restarted  # a rank that never joined is a caller's mistake, not a restart
    # A survivor of a generation this coordinator never formed, asking to rebuild it.
    with pytest.raises(StateError) as survivor:
        state.join("job", 1, 2, 7, "h1", now=1.0, base=1, mode="rebuild")
    assert survivor.value.restarted and "restarted" in survivor.value.message
    # A known rank's mistake is not taken for a restart.
    running = joined(2)
    with pytest.raises(StateError) as stale:
        running.check_caller("job", 1, 999, 1, "set")
    assert not stale.value.restarted


def test_leaving_twice_is_answered_as_the_first_time_but_only_for_the_same_process():
    state = joined(2)
    state.depart("job", 1, 101, 1, now=1.0)
    state.depart("job", 1, 101, 1, now=2.0)  # its first answer was lost: the same answer
    assert state.members[1].state is MemberState.LEFT and state.left_count == 1
    with pytest.raises(StateError, match="process"):
        state.depart("job", 1, 999, 1, now=3.0)  # another process for the rank
    with pytest.raises(StateError):
        state.depart("other-job", 0, 100, 1, now=3.0)


def test_a_dropped_heartbeat_call_is_a_lost_connection_only_without_a_later_heartbeat():
    state = joined(2)
    state.heartbeat(0, now=1.0)
    member = state.members[0]
    beat = member.last_heartbeat
    assert state.lost_connection(member, beat)
    state.heartbeat(0, now=2.0)  # it dialled again within the grace
    assert not state.lost_connection(member, beat)
    state.heartbeat(1, now=1.0)
    beat1 = state.members[1].last_heartbeat
    state.leave(1, now=1.5)  # a clean leave, then the connection went: not a failure
    assert not state.lost_connection(state.members[1], beat1)


def test_a_member_replaced_while_joining_is_no_longer_current():
    state = JobState(2, "job", now=0.0, limits=Limits(stale_join_s=1.0))
    state.join("job", 0, 2, 7, "h0", now=0.0)
    first = state.members[0]
    assert state.is_current(first)
    state.join("job", 0, 2, 8, "h0", now=5.0)  # a new process for rank 0 before the rendezvous
    assert not state.is_current(first) and state.is_current(state.members[0])


def test_a_barrier_after_a_failure_names_a_bad_name_first_then_the_failure():
    state = joined(2)
    state.fail(1, "gone", reported_by=-1, now=1.0)
    with pytest.raises(StateError) as bad_name:
        state.arrive("", 0, 1, now=2.0)
    assert bad_name.value.code == INVALID_ARGUMENT
    with pytest.raises(StateError) as failed:
        state.arrive("b", 0, 1, now=2.0)
    assert failed.value.code == ABORTED and failed.value.failed_rank == 1 and "b" not in state.barriers


def test_failure_is_first_report_wins_and_blocks_later_work():
    state = joined(3)
    first = state.fail(2, "boom", reported_by=2, now=5.0)
    assert first is not None and state.fail(2, "again", reported_by=0, now=6.0) is None
    with pytest.raises(StateError) as info:
        state.check_not_failed("barrier 'x'")
    assert info.value.code == ABORTED and info.value.failed_rank == 2 and "boom" in info.value.message


def test_leave_is_not_failure_and_all_left():
    state = joined(2)
    state.leave(0, now=1.0)
    assert not state.all_left()
    state.leave(1, now=1.0)
    assert state.all_left()
    assert state.fail(1, "connection lost after leave", reported_by=-1, now=2.0) is None
    assert not state.failed


class _CountingMembers(dict):
    """The members dict, counting the scans over every member."""

    scans = 0

    def values(self):
        type(self).scans += 1
        return super().values()


def test_the_end_of_a_large_job_does_not_scan_every_member_at_every_leave():
    # At a job's end every rank leaves and each leave asks whether all have left (so that rank 0
    # may stop serving): with a scan each time, ranks leaving in rank order cost O(ranks^2).
    n = 4096
    state = joined(n)
    state.members = _CountingMembers(state.members)
    state.fail(7, "killed", reported_by=-1, now=1.0)
    for r in range(n):
        if r != 7:
            state.leave(r, now=2.0)
            assert state.all_left() == (r == n - 1)
    assert _CountingMembers.scans <= 2, _CountingMembers.scans


def test_expired_counts_only_heartbeats_of_ranks_that_send_them():
    state = joined(4, now=0.0)
    state.heartbeat(0, now=8.0)
    state.heartbeat(1, now=1.0)
    state.members[1].active_calls = 1  # an open barrier call is no sign of life
    state.heartbeat(2, now=1.0)
    state.leave(2, now=2.0)
    # Rank 3 never heartbeats while the others do: it counts as silent since the rendezvous.
    assert state.expired(now=10.0, timeout_s=5.0) == [1, 3]


def test_a_rank_that_never_heartbeats_expires_once_the_job_uses_heartbeats():
    state = joined(3, now=0.0)
    state.completed_at = 0.0
    assert state.expired(now=10.0, timeout_s=5.0) == []  # bare clients: nobody heartbeats
    state.heartbeat(0, now=9.0)
    state.heartbeat(1, now=9.0)
    # Rank 2 died while joining: it never heartbeats and is not in a call.
    assert state.expired(now=10.0, timeout_s=5.0) == [2]
    state.members[2].active_calls = 1  # ...unless it is still in a call (e.g. its join)
    assert state.expired(now=10.0, timeout_s=5.0) == []


def test_the_coordinators_own_lag_is_not_a_ranks_silence():
    state = joined(3, now=0.0)
    state.heartbeat(0, now=1.0, lag=0.0)
    state.heartbeat(1, now=1.0, lag=0.0)
    state.heartbeat(2, now=1.0, lag=0.0)
    # 10 s later, 7 of them the coordinator's loop could not run (it read nothing): each rank has
    # been silent 3 s in time the coordinator could have heard it.
    assert state.expired(now=11.0, timeout_s=5.0, lag=7.0) == []
    assert state.silence(state.members[0], now=11.0, lag=7.0) == 3.0
    # Rank 1 heartbeats after the lag; the lag before its heartbeat no longer matters to it.
    state.heartbeat(1, now=11.5, lag=7.0)
    assert state.expired(now=14.0, timeout_s=5.0, lag=7.0) == [0, 2]
    assert state.expired(now=14.0, timeout_s=5.0, lag=7.0) == [0, 2]
    # Lag that came after a rank's last heartbeat is left out of its silence too.
    assert state.expired(now=17.0, timeout_s=5.0, lag=10.0) == [0, 2]
    assert 1 not in state.expired(now=17.0, timeout_s=5.0, lag=10.0)
    assert state.expired(now=20.0, timeout_s=5.0, lag=10.0) == [0, 1, 2]


def test_the_first_heartbeat_is_awaited_from_when_the_join_was_answered():
    state = joined(3, now=0.0)
    state.completed_at = 0.0
    state.heartbeat(0, now=5.0)
    state.answered(state.members[1], now=0.5)
    # Rank 2's answer went out 4 s after the rendezvous completed (thousands to write).
    state.answered(state.members[2], now=4.0, lag=1.0)
    state.answered(state.members[2], now=9.0, lag=3.0)  # a repeated answer does not restart it
    assert state.expired(now=6.0, timeout_s=5.0) == [1]
    # Rank 2: 6 s since its answer, 2 of them coordinator lag: 4 s of silence, within the bound.
    assert state.expired(now=10.0, timeout_s=5.0, lag=3.0) == [1]
    assert state.expired(now=11.5, timeout_s=5.0, lag=3.0) == [1, 2]


# ----------------------------------------------------------------- decisions the servicer asks for
def test_join_answer_tells_the_servicer_what_a_join_waits_for():
    state = JobState(2, "job", now=0.0)
    state.join("job", 0, 2, 100, "h0", now=0.0)
    assert state.join_answer(0, 100, 0) == "rendezvous"  # the first generation still forms
    state.join("job", 1, 2, 101, "h1", now=0.5)
    assert state.join_answer(0, 100, 0) == "joined"  # a member's re-poll is answered at once
    assert state.join_answer(0, 100, 1) == "recovery"  # a survivor naming its generation waits
    assert state.fail(1, "killed", -1, now=1.0) is not None
    assert state.join("job", 1, 2, 555, "h1b", now=2.0) is False
    assert state.join_answer(1, 555, 0) == "recovery"  # a replacement waits for the next generation


def test_recovery_waiter_is_the_replacement_or_the_survivor_of_that_incarnation():
    state = failed_one(n=3, victim=2)
    state.join("job", 2, 3, 555, "h2b", now=11.0)
    assert state.recovery_waiter(2, 555) is state.recovery.replacements[2]
    assert state.recovery_waiter(2, 102) is None  # the failed process no longer waits
    assert state.recovery_waiter(0, 100) is state.members[0]
    assert state.recovery_waiter(0, 999) is None


def test_a_new_process_waits_for_its_predecessor_until_it_fails_or_heartbeats():
    state = joined(2)
    state.heartbeat(1, now=1.0)
    old = state.members[1]
    assert not state.predecessor_settled(old, since=2.0)  # silent since the new one came
    state.heartbeat(1, now=2.5)
    assert state.predecessor_settled(old, since=2.0) and not state.gone(old)  # alive: the new one is refused
    state.fail(1, "silent", -1, now=3.0)
    assert state.predecessor_settled(old, since=4.0) and state.gone(old)  # failed: the join is tried again


def test_a_call_in_flight_keeps_a_joining_process_from_being_replaced():
    state = JobState(2, "job", now=0.0)
    state.join("job", 0, 2, 100, "h0", now=0.0)
    waiting = state.members[0]
    state.call_started(waiting)
    with pytest.raises(StateError) as taken:  # long past stale_join_s, but its call is still open
        state.join("job", 0, 2, 200, "h0b", now=10.0)
    assert taken.value.code == ALREADY_EXISTS
    state.call_ended(waiting, now=10.0)
    assert waiting.active_calls == 0 and waiting.last_seen == 10.0
    state.seen(waiting, now=11.0)
    with pytest.raises(StateError):  # seen a moment ago: still live
        state.join("job", 0, 2, 200, "h0b", now=11.5)
    assert state.join("job", 0, 2, 200, "h0b", now=11.0 + state.limits.stale_join_s + 0.1) is False
    assert state.members[0].incarnation == 200 and state.gone(waiting)


def test_a_shrink_refuses_the_replacements_that_wait():
    state = failed_one(n=3, victim=2)
    state.join("job", 2, 3, 555, "h2b", now=11.0)
    assert not state.refuses_waiting_replacements()  # nobody chose yet
    state.join("job", 0, 3, 100, "h0", now=12.0, base=1, mode="shrink")
    assert state.refuses_waiting_replacements()


def test_a_refusal_before_the_first_generation_says_none_has_formed():
    # A rank that joined (the rendezvous still waits for rank 1) but names generation 0 (wire 1),
    # as a process of a job whose coordinator restarted would: no "generation -1" in the text.
    state = JobState(2, "job", now=0.0)
    assert state.join("job", 0, 2, 100, "h0", now=0.0) is False
    with pytest.raises(StateError) as refused:
        state.check_caller("job", 0, 100, 1, "set")
    assert refused.value.code == FAILED_PRECONDITION
    assert "has not formed its first generation yet" in refused.value.message
    assert "-1" not in refused.value.message


def test_a_rank_that_leaves_before_the_rendezvous_is_not_a_member():
    state = JobState(3, "job", now=0.0)
    assert not state.join("job", 0, 3, 11, "a", 0.0)
    assert not state.join("job", 1, 3, 12, "b", 0.0)
    state.depart("job", 1, 12, 0, 1.0)  # rank 1's process gives up before the others came
    assert state.missing_join() == [1, 2]
    assert not state.join("job", 2, 3, 13, "c", 2.0)  # three joins, but one of them left
    assert not state.complete
    with pytest.raises(StateError):  # no longer a member: a second leave is refused, changing nothing
        state.depart("job", 1, 12, 0, 2.5)
    assert state.join("job", 1, 3, 14, "b2", 3.0)  # a new process for rank 1 completes it
    assert state.complete and state.members[1].incarnation == 14


# ------------------------------------------------------------------ bounded state (issue 27, items 4 and 5)


def test_a_barrier_every_member_passed_keeps_only_its_count_and_counts_on():
    state = joined(3)
    for rank in range(3):
        state.arrive("b", rank, 1, now=1.0)
    passed = state.barriers["b"]
    # Every member passed #1: its per-rank counts are freed, what it costs is its name and a few words.
    assert passed.arrived is None and passed.completed == 1 and state.pending_barrier_count == 0
    assert state._barrier_bytes < 1024
    assert state.arrive("b", 1, 1, now=2.0) == 1  # a repeated arrival (a wait's next slice) is done
    assert state.barrier_missing("b", 1) == [] and list(state.pending_barriers(now=2.0)) == []
    assert state.arrive("b", 0, 2, now=3.0) == 1  # the name's next instance counts on from #1
    assert state.pending_barrier_count == 1 and state.barrier_missing("b", 2) == [1, 2]
    with pytest.raises(StateError, match="count up by one"):
        state.arrive("b", 1, 3, now=3.0)
    state.arrive("b", 1, 2, now=3.0)
    assert state.arrive("b", 2, 2, now=4.0) == 2 and state.barriers["b"].arrived is None


def test_pending_barriers_are_limited_and_a_refused_one_leaves_no_trace():
    state = JobState(2, "job", now=0.0, limits=Limits(max_pending_barriers=3))
    for r in range(2):
        state.join("job", r, 2, 100 + r, "h", now=0.0)
    for i in range(3):
        state.arrive(f"b{i}", 0, 1, now=float(i))
    with pytest.raises(StateError) as full:
        state.arrive("b3", 1, 1, now=5.0)
    assert full.value.code == RESOURCE_EXHAUSTED and "3 barriers wait for ranks that have not arrived" in full.value.message
    assert "b3" not in state.barriers and state.pending_barrier_count == 3
    state.arrive("b0", 1, 1, now=6.0)  # b0 completes: a name that was passed is not pending
    assert state.arrive("b3", 1, 1, now=7.0) == 0
    # A passed name opening its next instance is a pending barrier again, within the same limit.
    with pytest.raises(StateError) as again:
        state.arrive("b0", 0, 2, now=8.0)
    assert again.value.code == RESOURCE_EXHAUSTED and state.barriers["b0"].arrived is None
    assert state.arrive("b0", 1, 1, now=8.5) == 1  # its repeated arrival is still answered


def test_one_rank_that_opens_barriers_nobody_reaches_is_refused_and_the_others_go_on():
    state = JobState(3, "job", now=0.0, limits=Limits(max_pending_barriers_per_rank=2))
    for r in range(3):
        state.join("job", r, 3, 100 + r, "h", now=0.0)
    state.arrive("leak-0", 2, 1, now=1.0)
    state.arrive("leak-1", 2, 1, now=1.0)
    with pytest.raises(StateError) as refused:
        state.arrive("leak-2", 2, 1, now=1.0)
    assert refused.value.code == RESOURCE_EXHAUSTED and "rank 2 has opened 2 barriers" in refused.value.message
    state.arrive("step", 0, 1, now=2.0)  # another rank opens one
    for r in (1, 2):  # rank 2 arriving where another rank opened it is not opening one
        state.arrive("step", r, 1, now=3.0)
    assert state.barriers["step"].completed == 1
    for r in (0, 1):  # once a barrier rank 2 opened passes, its share is free again
        state.arrive("leak-0", r, 1, now=4.0)
    assert state.arrive("leak-2", 2, 1, now=5.0) == 0


def test_the_oldest_pending_barrier_and_the_count_are_kept_not_scanned():
    state = joined(2, now=0.0)
    assert state.pending_barrier_count == 0 and state.oldest_barrier_wait(now=1.0) == 0.0
    state.arrive("x", 0, 1, now=10.0)
    state.arrive("y", 0, 1, now=11.0)
    state.arrive("z", 1, 1, now=12.0)
    assert state.pending_barrier_count == 3 and state.oldest_barrier_wait(now=20.0) == pytest.approx(10.0)
    assert [row[0] for row in state.pending_barriers(now=20.0)] == ["x", "y", "z"]  # longest-waiting first
    state.arrive("x", 1, 1, now=21.0)
    assert state.pending_barrier_count == 2 and state.oldest_barrier_wait(now=21.0) == pytest.approx(10.0)
    state.arrive("y", 1, 1, now=22.0)
    assert state.oldest_barrier_wait(now=25.0) == pytest.approx(13.0)  # z, since 12.0
    state.arrive("z", 0, 1, now=23.0)
    assert state.pending_barrier_count == 0 and state.oldest_barrier_wait(now=23.0) == 0.0


def test_a_pending_barrier_counts_8_bytes_a_member_against_the_budget():
    world = 1024
    state = JobState(world, "job", now=0.0, limits=Limits(max_state_bytes=1_000_000, state_bytes_per_rank=0))
    for r in range(world):
        state.join("job", r, world, 100 + r, "h", now=0.0)
    opened = 0
    with pytest.raises(StateError) as full:
        for i in range(1000):
            state.arrive(f"n{i}", 0, 1, now=1.0)
            opened += 1
    # Each costs its 8 KiB of counts and its bookkeeping: about 1,000,000 / 8,700 of them fit.
    assert full.value.code == RESOURCE_EXHAUSTED and "barriers" in full.value.message
    assert 100 <= opened <= 122 and state._state_bytes() <= 1_000_000
    with pytest.raises(StateError) as no_key:  # keys share the one budget
        state.set("k", b"x" * 10_000)
    assert no_key.value.code == RESOURCE_EXHAUSTED
    # A group's barrier costs its members, not the world.
    small = JobState(world, "job", now=0.0)
    for r in range(world):
        small.join("job", r, world, 100 + r, "h", now=0.0)
    small.arrive("pair", 3, 1, now=1.0, participants=[3, 700])
    assert small._barrier_bytes < 1024 and small.barrier_missing("pair", 1) == [700]
    assert small.arrive("pair", 700, 1, now=2.0, participants=[3, 700]) == 1


def test_passed_barriers_are_dropped_oldest_first_after_their_retention():
    # Passed barriers may hold a quarter of the budget; past it the oldest go, once retained 10 s.
    state = JobState(1, "job", now=0.0, limits=Limits(max_state_bytes=40_000, state_bytes_per_rank=0,
                                                       barrier_retain_s=10.0))
    state.join("job", 0, 1, 100, "h", now=0.0)
    for i in range(100):
        assert state.arrive(f"step-{i}", 0, 1, now=float(i) / 100) == 1  # a barrier of one: passed at once
    assert len(state.barriers) == 100 and state._barrier_bytes > 10_000  # all within their retention
    assert state.arrive("step-0", 0, 1, now=1.0) == 1  # so a repeated arrival is still answered
    state.arrive("later", 0, 1, now=20.0)
    assert "step-0" not in state.barriers and "later" in state.barriers
    assert state._passed_bytes <= 10_000 and state._state_bytes() <= 40_000
    # A dropped name the job uses again (every member had passed it) counts on from the caller's seq.
    assert state.arrive("step-0", 0, 2, now=21.0) == 2
    assert state.barriers["step-0"].completed == 2


def test_a_passed_barrier_is_dropped_to_make_room_for_a_pending_one():
    state = JobState(2, "job", now=0.0, limits=Limits(max_state_bytes=8_000, state_bytes_per_rank=0,
                                                       barrier_retain_s=5.0))
    for r in range(2):
        state.join("job", r, 2, 100 + r, "h", now=0.0)
    for i in range(6):  # each pending barrier costs ~600 bytes, a passed one ~300
        state.arrive(f"done-{i}", 0, 1, now=0.0, participants=[0])
    state.set("filler", b"x" * 5_000)
    with pytest.raises(StateError) as full:  # nothing may be dropped yet: all passed just now
        state.arrive("open", 0, 1, now=1.0)
    assert full.value.code == RESOURCE_EXHAUSTED and "open" not in state.barriers
    assert state.arrive("open", 0, 1, now=6.0) == 0  # after their retention, passed ones make room
    assert "done-0" not in state.barriers and state._state_bytes() <= 8_000


def test_key_bytes_count_in_the_budget():
    # 1,000-character keys with empty values: each costs its key and its entries, counted.
    state = JobState(1, "job", now=0.0, limits=Limits(max_state_bytes=300_000, state_bytes_per_rank=0,
                                                       max_key_bytes=1024))
    stored = 0
    with pytest.raises(StateError) as full:
        for i in range(10_000):
            state.set(f"k{i}".ljust(1000, "x"), b"")
            stored += 1
    assert full.value.code == RESOURCE_EXHAUSTED and "keys" in full.value.message
    assert 200 <= stored <= 300 and state._state_bytes() <= 300_000
    state.set("k0".ljust(1000, "x"), b"")  # a key set again costs nothing more
    # A value in pieces counts its announced size from its first piece.
    roomy = JobState(2, "job", now=0.0, limits=Limits(max_state_bytes=100_000, state_bytes_per_rank=0))
    roomy.set_piece(0, "big", 0, 80_000, b"a")
    with pytest.raises(StateError) as no_room:
        roomy.set("other", b"x" * 30_000)
    assert no_room.value.code == RESOURCE_EXHAUSTED
    roomy.fail(0, "gone", reported_by=-1, now=1.0)  # its pieces are dropped, and so is their cost
    assert roomy._state_bytes() == 0


def test_the_default_budget_is_a_quarter_of_the_shipped_coordinator_pod_and_grows_with_the_world():
    limits = Limits()
    assert limits.state_budget(2) == 256 * 1024 * 1024 + 2 * 1024
    assert limits.state_budget(1_048_576) == 256 * 1024 * 1024 + 1024 * 1024 * 1024
    state = JobState(2, "job", now=0.0)
    for r in range(2):
        state.join("job", r, 2, 100 + r, "h", now=0.0)
    state.set("k", b"v" * 100)
    state.arrive("b", 0, 1, now=1.0)
    assert state._state_bytes() > 0
    state.fail(1, "gone", reported_by=-1, now=2.0)
    state.join("job", 0, 2, 100, "h", now=3.0, base=1, mode="shrink")  # a recovery starts with nothing
    assert state.generation == 2 and state._state_bytes() == 0 and state.pending_barrier_count == 0


def _barrier_view(state: JobState) -> list[tuple]:
    """Everything a barrier's record says, per name, for comparing two states."""
    return sorted((name, b.members, None if b.arrived is None else list(b.arrived), b.completed, b.count_next,
                   b.waiting_since, b.last_wait_s, b.cost) for name, b in state.barriers.items())


def _outcome(state: JobState, many: bool, name: str, ranks: list[int], seq: int, now: float,
             group: tuple[int, ...]) -> tuple:
    try:
        if many:
            return ("ok", state.arrive_many(name, ranks, seq, now, group))
        return ("ok", [state.arrive(name, r, seq, now, group) for r in ranks][-1])
    except StateError as exc:
        return ("refused", exc.code, str(exc))


def test_an_aggregates_arrivals_in_one_pass_are_each_ranks_arrival_in_turn():
    """arrive_many (a relay's aggregate) against arrive() rank by rank on a twin state: the same
    answers, the same refusals, the same records, over random aggregates with repeats, skips,
    groups, ranks outside the group, completions in the middle and a budget that drops passed
    barriers. The reference is arrive(), which the tests above pin down."""
    import random

    rng = random.Random(24)
    world = 12
    limits = Limits(max_state_bytes=0, state_bytes_per_rank=500, barrier_retain_s=0.0, max_pending_barriers=3)
    one, many = (JobState(world, "job", now=0.0, limits=limits) for _ in range(2))
    for state in (one, many):
        for r in range(world):
            state.join("job", r, world, incarnation=100 + r, hostname=f"h{r}", now=0.0)
    names, groups = ["a", "b", "c", "d"], [(), (), tuple(range(0, world, 2)), (1, 2, 3, 5, 8)]
    fast = 0
    for step in range(3_000):
        now = step * 0.01
        pick = rng.randrange(len(names))
        name, group = names[pick], groups[pick if rng.random() < 0.95 else rng.randrange(len(groups))]
        seen = one.barriers.get(name)
        base = seen.completed if seen is not None else 0
        seq = max(1, base + rng.choice((0, 1, 1, 1, 1, 2)))
        pool = list(group or range(world)) + ([rng.randrange(world)] if rng.random() < 0.2 else [])
        ranks = rng.sample(pool, rng.randint(1, len(pool)))
        results = [_outcome(one, False, name, ranks, seq, now, group),
                   _outcome(many, True, name, ranks, seq, now, group)]
        assert results[0] == results[1], (step, name, group, seq, ranks)
        assert _barrier_view(one) == _barrier_view(many), (step, name, group, seq, ranks)
        assert list(one.pending_barriers(now)) == list(many.pending_barriers(now))
        fast += results[0][0] == "ok" and len(ranks) > 2
    assert fast > 500  # most aggregates were answered, so the one-pass path ran
    assert one._forgotten > 0  # passed barriers were dropped for room, and names came back


def test_a_group_barrier_checks_its_group_when_it_opens_not_at_every_arrival(monkeypatch):
    """A split's barrier names its group at every arrival; checking the group is O(its size),
    so it is checked when the barrier opens, and a later arrival naming another group, a bad
    group, or a rank outside it is still refused."""
    state = joined(64)
    group = tuple(range(0, 64, 2))
    checks = []
    real = JobState._participants

    def counted(self, name, rank, participants):
        checks.append(rank)
        return real(self, name, rank, participants)

    monkeypatch.setattr(JobState, "_participants", counted)
    for seq in (1, 2, 3):
        for rank in group:
            state.arrive("split", rank, seq, now=float(seq), participants=group)
    assert state.barriers["split"].completed == 3
    assert len(checks) == 1  # the first arrival opened it; 95 more arrivals named the same group
    with pytest.raises(StateError, match="opened for"):
        state.arrive("split", 0, 4, now=4.0, participants=tuple(range(0, 64, 4)))
    with pytest.raises(StateError, match="participants must be distinct"):
        state.arrive("split", 0, 4, now=4.0, participants=(2, 0))
    with pytest.raises(StateError, match="not a participant"):
        state.arrive("split", 1, 4, now=4.0, participants=group)
