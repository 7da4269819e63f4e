"""The coordinator's fingerprint state stays inside its budget (per communicator and per job),
whether or not stall detection runs: one rank reporting 64 communicators x 4,096 counts of
250-character fingerprints (what a buggy or hostile token holder can send) holds at most
MAX_JOB_PRINTED_COUNTS counts, a few MB."""

from __future__ import annotations

import tracemalloc

from gridcomm._coordinator.state.progress import (
    MAX_JOB_PRINTED_COUNTS,
    MAX_PRINTED_COUNTS,
    MAX_RECENT,
    Entry,
    Progress,
)


def _flood(progress: Progress, comms: int, counts: int) -> None:
    """Rank 0 reports ``comms`` communicators up to ``counts`` with distinct fingerprints, 64 a
    report (as many as a report may carry); rank 1 reports each communicator once, at count 0."""
    progress.report(1, 1, [Entry(f"c{i}", 0, "", 0.0, False) for i in range(comms)], 0.0)
    for end in range(MAX_RECENT, counts + 1, MAX_RECENT):
        entries = [Entry(f"c{i}", end, "all_reduce", 0.0, True,
                         tuple(f"all_reduce({c:08d}-{i:03d}-" + "x" * 226 + ")" for c in range(end - MAX_RECENT + 1,
                                                                                       end + 1)))
                   for i in range(comms)]
        progress.report(0, 1, entries, float(end))
        progress.report(1, 1, [Entry(f"c{i}", 0, "", 0.0, False) for i in range(comms)], float(end))


def test_one_rank_cannot_grow_the_fingerprint_state_past_its_budget():
    progress = Progress()
    progress.reset(1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _flood(progress, 64, 4096)  # no check runs (stall detection off or not yet due)
        held_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    held = [len(c._prints) for c in progress.communicators.values()]
    assert max(held) <= MAX_PRINTED_COUNTS
    assert sum(held) <= MAX_JOB_PRINTED_COUNTS
    print(f"\nheld {sum(held)} fingerprinted counts, {held_bytes / 2**20:.1f} MB")
    assert held_bytes < 40 * 2**20


def test_a_rank_far_ahead_is_not_kept_past_the_slowest_ranks_window():
    progress = Progress()
    progress.reset(1)
    _flood(progress, 1, 4096)
    (comm,) = progress.communicators.values()
    assert comm._prints and max(comm._prints) <= MAX_PRINTED_COUNTS  # rank 1 is still at 0
