"""The coordinator's progress state (gridcomm._coordinator.state.progress) with an injected clock:
who is a laggard, when, and what is a mismatch; every branch without a network."""

from __future__ import annotations

import pytest

from gridcomm._coordinator.state.progress import MISMATCH, STALL, CommunicatorProgress, Entry, Progress, check_entry

BOUND = 60.0
FRESH = 15.0


def entry(entered: int, kind: str = "all_reduce", age: float = 0.0, inside: bool = False,
          recent: tuple[str, ...] = (), name: str = "world") -> Entry:
    return Entry(name, entered, kind, age, inside, recent)


def comm_with(reports: dict[int, Entry], now: float = 0.0) -> CommunicatorProgress:
    comm = CommunicatorProgress("world")
    for rank, e in reports.items():
        comm.report(rank, e, now)
    return comm


def test_a_laggard_is_named_only_after_the_bound_counted_from_the_first_entry():
    comm = comm_with({0: entry(5, inside=True, age=10), 1: entry(5, inside=True, age=3), 2: entry(4, "broadcast")},
                     now=100.0)
    # Rank 0 entered #5 at 90: the bound ends at 150.
    assert comm.hang(149.0, BOUND, 1e9) is None
    hang = comm.hang(151.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 2 and hang.cause == STALL
    assert "rank 2 has not entered all_reduce #5 of communicator 'world' for 61 s" in hang.reason
    assert "ranks 0-1 wait in it" in hang.reason and "its last was broadcast #4" in hang.reason


def test_a_laggard_that_catches_up_is_not_named():
    comm = comm_with({0: entry(5, inside=True, age=50), 1: entry(4)}, now=100.0)
    comm.report(1, entry(5, inside=True), 105.0)
    assert comm.hang(160.0, BOUND, 1e9) is None  # caught up before the bound: no laggard
    # Both are now inside #5 (every rank entered it): no laggard; inside for 95 s since the last
    # entry (at 105) is the other kind of hang.
    hang = comm.hang(200.0, BOUND, 1e9)
    assert hang is not None and "every rank of communicator 'world' entered all_reduce #5" in hang.reason
    comm.report(0, entry(5, inside=False), 120.0)
    comm.report(1, entry(5, inside=False), 120.0)
    assert comm.hang(500.0, BOUND, 1e9) is None


def test_the_earliest_report_of_an_entry_dates_it_whichever_arrives_first():
    comm = comm_with({0: entry(3, age=1), 1: entry(2)}, now=100.0)   # rank 0: #3 at 99
    comm.report(2, entry(3, age=30), 101.0)                            # rank 2: #3 at 71
    hang = comm.hang(132.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 1 and "for 61 s" in hang.reason


def test_a_stale_laggard_is_left_to_liveness():
    comm = comm_with({0: entry(5, inside=True), 1: entry(4)}, now=0.0)
    comm.report(0, entry(5, inside=True), 50.0)
    assert comm.hang(70.0, BOUND, FRESH) is None  # rank 1's last report is 70 s old


def test_several_laggards_are_named_together_and_the_first_is_failed():
    comm = comm_with({0: entry(9, inside=True), 1: entry(8), 2: entry(9, inside=True), 3: entry(8),
                      4: entry(9, inside=True)}, now=0.0)
    hang = comm.hang(61.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 1 and "ranks 1, 3 are behind with it" in hang.reason


def test_an_older_report_never_moves_a_rank_back():
    comm = comm_with({0: entry(5), 1: entry(5)}, now=0.0)
    comm.report(1, entry(3), 1.0)
    assert comm.rows(1.0)[1][1] == 5


def test_a_rank_that_left_is_waited_for_no_longer():
    progress = Progress()
    progress.reset(1)
    progress.report(0, 1, [entry(5, inside=True)], 0.0)
    progress.report(1, 1, [entry(4)], 0.0)
    progress.remove(1)
    hang = progress.hang(100.0, BOUND, 1e9)
    assert hang is None or hang.rank != 1


def test_another_generations_report_is_ignored_and_a_communicator_not_reported_is_dropped():
    progress = Progress()
    progress.reset(2)
    progress.report(0, 1, [entry(5)], 0.0)
    assert not progress.communicators
    progress.report(0, 2, [entry(5), entry(1, name="world.s1c0")], 0.0)
    assert set(progress.communicators) == {"world", "world.s1c0"}
    progress.report(0, 2, [entry(6)], 1.0)
    assert set(progress.communicators) == {"world"}


def test_mismatch_is_named_once_every_rank_reported_that_count_and_names_the_odd_one():
    fp_ar, fp_bc = "all_reduce(sum, 4 x float32)", "broadcast(root=0, 4 x float32)"
    comm = CommunicatorProgress("world")
    comm.report(1, entry(3, "broadcast", inside=True, recent=("all_reduce(sum, 4 x float32)", "barrier('warm')",
                                                              fp_bc)), 0.0)
    comm.report(2, entry(3, inside=True, recent=(fp_ar, "barrier('warm')", fp_ar)), 0.0)
    comm.report(0, entry(2, "barrier", recent=(fp_ar, "barrier('warm')")), 0.0)
    assert comm.hang(0.0, BOUND, 1e9) is None  # rank 0 has not reached #3: wait for it
    comm.report(0, entry(3, inside=True, recent=(fp_ar, "barrier('warm')", fp_ar)), 1.0)
    comm.report(3, entry(3, inside=True, recent=(fp_ar, "barrier('warm')", fp_ar)), 1.0)
    hang = comm.hang(1.0, BOUND, 1e9)
    assert hang is not None and hang.cause == MISMATCH and hang.rank == 1
    assert hang.reason.startswith(f"collective #3 of communicator 'world': rank 1 called {fp_bc}, rank 0 called {fp_ar}")


def test_matching_fingerprints_are_forgotten():
    comm = CommunicatorProgress("world")
    for step in range(1, 200):
        for rank in range(3):
            comm.report(rank, entry(step, recent=(f"all_reduce(sum, {step} x float32)",)), float(step))
        assert comm.hang(float(step), BOUND, 1e9) is None
    assert len(comm._prints) <= 2


@pytest.mark.parametrize(("args", "wrong"), [
    (("", 1, "x", 0.0, ()), "communicator name"),
    (("w" * 300, 1, "x", 0.0, ()), "communicator name"),
    (("world", 1, "k" * 65, 0.0, ()), "kind"),
    (("world", 2**63, "x", 0.0, ()), "counts"),
    (("world", 1, "x", float("nan"), ()), "age"),
    (("world", 1, "x", -1.0, ()), "age"),
    (("world", 1, "x", 0.0, ("a", "b")), "fingerprints"),
    (("world", 100, "x", 0.0, ("a" * 300,)), "fingerprint"),
])
def test_bad_entries_are_described(args, wrong):
    text = check_entry(*args)
    assert text is not None and wrong in text


def test_counts_are_kept_as_a_histogram_not_a_history():
    comm = CommunicatorProgress("world")
    for step in range(1, 5000):
        comm.report(step % 4, entry(step), float(step))
    assert len(comm._first) < 16 and len(comm._last) < 16


def test_the_stall_bound_defaults_to_120_s_or_the_call_timeout_and_is_refused_above_it():
    from gridcomm import ConfigError
    from gridcomm._config import stall_timeout_s

    assert stall_timeout_s(None, {}) == 120.0
    assert stall_timeout_s(None, {"GRIDCOMM_TIMEOUT_S": "60"}) == 60.0
    assert stall_timeout_s(None, {}, call_timeout_s=30.0) == 30.0
    assert stall_timeout_s(None, {"GRIDCOMM_STALL_TIMEOUT_S": "0"}) == 0.0
    with pytest.raises(ConfigError, match="GRIDCOMM_STALL_TIMEOUT_S=400 is longer than the call timeout"):
        stall_timeout_s(None, {"GRIDCOMM_STALL_TIMEOUT_S": "400"})
    with pytest.raises(ConfigError, match="GRIDCOMM_STALL_TIMEOUT_S"):
        stall_timeout_s(None, {"GRIDCOMM_STALL_TIMEOUT_S": "soon"})


def test_debug_flags_name_what_they_know():
    from gridcomm import ConfigError
    from gridcomm._config import debug_flags

    assert debug_flags({"GRIDCOMM_DEBUG": "Collectives"}) == {"collectives"}
    assert debug_flags({}) == frozenset()
    with pytest.raises(ConfigError, match="knows collectives"):
        debug_flags({"GRIDCOMM_DEBUG": "collectives,everything"})


def test_a_gpu_that_never_completes_a_collective_every_rank_entered_is_named():
    def gpu(entered, wait, completed):
        return Entry("world", entered, "all_reduce", 0.0, False, (), completed, wait)

    comm = CommunicatorProgress("world")
    for rank in range(4):
        comm.report(rank, gpu(7, 0.0, 7), 0.0)
    comm.report(2, gpu(8, 1.0, 7), 10.0)  # every rank enters #8 ...
    for rank in (0, 1, 3):
        comm.report(rank, gpu(8, 0.0, 8), 10.0)
    assert comm.hang(60.0, BOUND, 1e9) is None  # ... rank 2's GPU has waited 51 s
    comm.report(2, gpu(8, 62.0, 7), 71.0)
    hang = comm.hang(71.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 2 and hang.cause == STALL
    assert "on ranks 2 the GPU has not completed collective #8 for 62 s" in hang.reason
    comm.report(2, gpu(8, 0.0, 8), 72.0)  # it completed after all
    assert comm.hang(200.0, BOUND, 1e9) is None


def test_a_laggard_blocked_on_its_gpu_is_named_with_that():
    comm = CommunicatorProgress("world")
    comm.report(0, Entry("world", 9, "all_reduce", 0.0, False, (), 9, 0.0), 0.0)
    comm.report(1, Entry("world", 8, "all_reduce", 0.0, False, (), 6, 30.0), 0.0)
    hang = comm.hang(70.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 1 and "its GPU has not completed collective #7 for 100 s" in hang.reason


# ---------------------------------------------------------------- forged or buggy reports

def test_a_forged_age_dates_an_entry_no_earlier_than_the_floor_or_the_previous_report():
    comm = CommunicatorProgress("world")
    comm.report(0, entry(1), 100.0, floor=90.0)
    comm.report(1, entry(2, age=1e6, inside=True), 100.0, floor=90.0)   # its first report: not before 90
    assert comm.rows(100.0)[1][3] == pytest.approx(10.0)
    comm.report(0, entry(2, age=1e6, inside=True), 120.0, floor=90.0)   # advanced: not before its report at 100
    assert comm.rows(120.0)[0][3] == pytest.approx(20.0)
    comm.report(0, entry(2, age=1e6, inside=True), 130.0, floor=90.0)   # the same entry: the first date stands
    assert comm.rows(130.0)[0][3] == pytest.approx(30.0)


def test_one_rank_far_ahead_is_the_odd_one_out_and_names_nobody_else():
    comm = comm_with({0: entry(3), 1: entry(3), 2: entry(3)}, now=0.0)
    comm.report(3, entry(50, inside=True, age=1e6), 1.0, floor=0.0)
    assert comm.hang(60.0, BOUND, 1e9) is None  # dated at 0 (the floor), not a million seconds ago
    hang = comm.hang(61.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 3 and hang.cause == STALL
    assert "rank 3 has entered all_reduce #50 of communicator 'world', which ranks 0-2 (the majority)" in hang.reason
    assert "odd one out" in hang.reason


def test_an_even_split_names_the_laggard_only_for_the_next_collective_or_on_its_own_word():
    # Rank 1 waits in the very next collective: the shape of an honest wait, two ranks named.
    honest = comm_with({0: entry(3), 1: entry(4, inside=True)}, now=0.0)
    hang = honest.hang(1000.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 0 and "has not entered all_reduce #4" in hang.reason, hang
    # Rank 1 claims to wait three collectives further on: its word alone names nobody ...
    comm = comm_with({0: entry(3), 1: entry(7, inside=True)}, now=0.0)
    assert comm.hang(1000.0, BOUND, 1e9) is None
    # ... unless the laggard itself says its GPU is stuck.
    comm.report(0, Entry("world", 3, "all_reduce", 0.0, False, (), 2, 70.0), 1000.0)
    hang = comm.hang(1000.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 0 and "its GPU has not completed" in hang.reason


def test_an_implausible_count_is_refused_and_nothing_of_the_report_is_kept():
    progress = Progress()
    progress.reset(1)
    assert progress.report(0, 1, [entry(2)], 10.0, floor=9.0) is None
    wrong = progress.report(0, 1, [entry(3, name="other"), entry(10**9)], 11.0, floor=9.0)
    assert wrong is not None and "1000000000 collectives entered" in wrong
    assert "other" not in progress.communicators and progress.communicators["world"].rows(11.0)[0][1] == 2
    wrong = progress.report(1, 1, [entry(10**9)], 11.0, floor=9.0)  # a first report, 2 s after the floor
    assert wrong is not None and "world" in wrong
    assert progress.report(1, 1, [entry(50_000)], 11.0, floor=9.0) is None  # a plausible burst


def test_an_even_split_of_fingerprints_names_nobody():
    comm = comm_with({0: entry(1, recent=("all_reduce(a)",)), 1: entry(1, recent=("broadcast(b)",))})
    assert comm.hang(0.0, BOUND, 1e9) is None
    comm2 = comm_with({0: entry(1, recent=("all_reduce(a)",)), 1: entry(1, recent=("broadcast(b)",)),
                       2: entry(1, recent=("all_reduce(a)",))})
    hang = comm2.hang(0.0, BOUND, 1e9)
    assert hang is not None and hang.rank == 1 and hang.cause == MISMATCH
