"""The coordinator keeps state for every rank in compact forms (gridcomm._coordinator.tree's
directed-join bookkeeping, one byte a rank; progress values shared between ranks that report the
same): what they answer is what the plain forms answered. Pure: no network."""

from __future__ import annotations

import dataclasses

import pytest

from gridcomm._coordinator.state import progress as progress_mod
from gridcomm._coordinator.state.common import Member
from gridcomm._coordinator.state.progress import Entry, Progress
from gridcomm._coordinator.tree import Tree
from gridcomm._proto import coordinator_pb2 as pb

WORLD, FANIN = 32, 8


def ask(tree: Tree, rank: int, *, relay: str = "", now: float = 0.0) -> str:
    request = pb.JoinRequest(job_id="j", rank=rank, world_size=tree.world_size, first_contact=True,
                             relay_address=relay)
    kind, _ = tree.first_contact(request, job_id="j", formed=False, relay_at=lambda _leader: "",
                                 leader_joined=lambda _leader: False, now=now)
    return kind


def test_a_relay_speaks_for_the_group_its_ranks_were_sent_to():
    tree = Tree(WORLD, FANIN)
    assert ask(tree, 0, relay="10.0.0.1:1") == "lead" and ask(tree, 8, relay="10.0.0.2:1") == "lead"
    assert ask(tree, 3) == "relay" and ask(tree, 9) == "relay"
    assert tree.aggregate_problem([0, 1, 2, 3]) is None
    mixed = tree.aggregate_problem([3, 9])
    assert mixed is not None and "relays of ranks [0, 8]" in mixed
    outside = tree.aggregate_problem([3, 20])
    assert outside is not None and "rank(s) [20] are outside the group of rank 0's relay (0..7)" in outside
    # Ranks the coordinator never directed, or outside the job, name no relay (the join refuses them).
    assert tree.aggregate_problem([-1, 5, WORLD, WORLD + 7]) is None
    wrapped = tree.aggregate_problem([3, -WORLD + 9])  # not rank 9, which was sent to rank 8's relay
    assert wrapped is not None and "rank(s) [-23] are outside the group of rank 0's relay" in wrapped


def test_come_back_counts_each_rank_once_however_often_it_asks():
    world = 4000  # "come back in t": t = undirected ranks / ASKS_PER_S (4,000 a second)
    tree = Tree(world, FANIN)
    assert tree.retry_after_s() == pytest.approx(1.0)
    for _ in range(3):
        assert ask(tree, 0, relay="10.0.0.1:1") == "lead"
        for rank in range(1, FANIN):
            assert ask(tree, rank) == "relay"
    assert ask(tree, FANIN + 1) == "retry"  # its leader has not asked: not directed yet
    assert tree.retry_after_s() == pytest.approx((world - FANIN) / 4000.0)


def entry(entered: int, kind: str = "barrier", name: str = "world") -> Entry:
    return Entry(name, entered, kind, 1.0, False)


def said(e: Entry) -> tuple[object, ...]:
    return ((e.communicator, e.entered, e.kind, e.inside, e.completed, e.digest, e.inside_s),)


def test_ranks_in_step_share_their_progress_and_each_still_reads_as_its_own():
    progress = Progress()
    progress.reset(1)
    for rank in range(4):
        e = entry(3)
        assert progress.report(rank, 1, [e], 10.0, said(e)) is None
    assert progress._reported[0] is progress._reported[3] and progress._said[0] is progress._said[3]
    assert all(progress.unchanged(rank, 1, said(entry(3)), 11.0) for rank in range(4))
    # One rank moves on: the others' reports stand as they were.
    moved = entry(4)
    progress.report(2, 1, [moved], 12.0, said(moved))
    assert not progress.unchanged(2, 1, said(entry(3)), 13.0) and progress.unchanged(2, 1, said(moved), 13.0)
    assert progress.unchanged(1, 1, said(entry(3)), 13.0)
    assert progress.communicators["world"].ranks[2].entered == 4
    assert progress.communicators["world"].ranks[1].entered == 3


def test_the_shared_values_are_bounded_and_a_full_table_changes_no_answer(monkeypatch):
    monkeypatch.setattr(progress_mod, "MAX_SHARED", 3)
    progress = Progress()
    progress.reset(1)
    for rank in range(10):  # each rank says something else: the table starts afresh when full
        e = entry(rank + 1, kind=f"k{rank}")
        progress.report(rank, 1, [e], 10.0, said(e))
        assert len(progress._shared) <= 3
    assert all(progress.unchanged(rank, 1, said(entry(rank + 1, kind=f"k{rank}")), 11.0) for rank in range(10))
    assert not progress.unchanged(0, 1, said(entry(1, kind="k1")), 11.0)


def test_a_member_record_takes_no_attribute_it_does_not_declare():
    member = Member(1, 7, "host", joined_at=0.0, last_seen=0.0)
    with pytest.raises(AttributeError):
        member.extra = 1  # type: ignore[attr-defined]
    assert dataclasses.replace(member, last_seen=2.0).last_seen == 2.0
