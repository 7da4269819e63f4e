"""The coordinator's digest rounds (state.digests) against ranks' real digest logs: the first
differing collective is found however far behind the ranks' reports it lies."""

from __future__ import annotations

from gridcomm._client.digest import DigestLog
from gridcomm._coordinator.state.digests import CommunicatorDigests, answers_of
from gridcomm._coordinator.state.progress import digest_reason


def _run(logs: dict[int, DigestLog], counts: dict[int, int], rounds: int = 40) -> CommunicatorDigests:
    """Ranks report their digests, then answer every probe, until a round finds something."""
    state = CommunicatorDigests("world")
    for rank, log in logs.items():
        state.report(rank, counts[rank], log.digest, None)
    for _ in range(rounds):
        if state.check() is not None:
            break
        for rank, log in logs.items():
            asked = state.probes(rank)
            if asked is not None:
                got = log.answer(list(asked[0]), asked[1], counts[rank])
                state.report(rank, counts[rank], log.digest, answers_of(*got))
    return state


def _logs(counts: dict[int, int], odd_rank: int = -1, odd_step: int = -1, keep: int = 1 << 17) -> dict[int, DigestLog]:
    """Each rank's log after its count of all_reduces (``odd_rank`` uses max once)."""
    logs = {}
    for rank, steps in counts.items():
        log = DigestLog(keep)
        for n in range(1, steps + 1):
            op = "max" if rank == odd_rank and n == odd_step else "sum"
            log.add(n, f"all_reduce({op}, 16 x float64)")
        logs[rank] = log
    return logs


def test_a_mismatch_long_before_the_reports_is_named_exactly():
    counts = dict.fromkeys(range(4), 10_000)
    state = _run(_logs(counts, odd_rank=1, odd_step=5), counts)
    found = state.found
    assert found is not None and (found.first, found.last, found.odd, found.main) == (5, 5, 1, 0)
    reason = digest_reason("world", found)
    assert reason.startswith("collective #5 of communicator 'world': rank 1 called all_reduce(max, 16 x float64), "
                             "rank 0 called all_reduce(sum, 16 x float64)"), reason


def test_ranks_at_different_counts_are_compared_where_they_all_were():
    counts = {0: 9_000, 1: 8_100, 2: 8_700}
    state = _run(_logs(counts, odd_rank=2, odd_step=4_321), counts)
    assert state.found is not None and (state.found.first, state.found.odd) == (4_321, 2)


def test_agreeing_ranks_are_never_named():
    counts = {0: 5_000, 1: 4_990, 2: 5_000, 3: 4_000}
    state = _run(_logs(counts), counts)
    assert state.found is None


def test_a_mismatch_older_than_ranks_keep_is_named_as_a_range():
    counts = {0: 3_000, 1: 3_000}
    state = _run(_logs(counts, odd_rank=0, odd_step=10, keep=1024), counts)
    found = state.found
    assert found is not None and found.first == 1 and found.last > 10 and found.odd in (0, 1)
    assert "older than the collectives ranks keep" in digest_reason("world", found)
