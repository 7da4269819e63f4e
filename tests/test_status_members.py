"""Status names every member of the job, each as the coordinator keeps it: rank order, hostname,
process tag, state and when it joined (the members are built into the answer in place)."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from gridcomm._coordinator.state.common import process_tag
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._wire import WIRE

WORLD = 3


@pytest.mark.timeout(60)
def test_status_names_each_member_as_it_joined(coordinator_factory):
    server = coordinator_factory(WORLD)
    before = time.time()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)

        def join(rank: int) -> pb.JoinResponse:
            return stub.Join(pb.JoinRequest(job_id="default", rank=rank, world_size=WORLD, incarnation=1000 + rank,
                                            hostname=f"node-{rank % 2}", wait_s=20.0, wire=WIRE), timeout=30)

        with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
            answers = list(pool.map(join, [2, 0, 1]))
        assert all(a.generation for a in answers)
        after = time.time()
        status = stub.Status(pb.StatusRequest(), timeout=30)
    assert [m.rank for m in status.members] == [0, 1, 2]
    assert [m.hostname for m in status.members] == ["node-0", "node-1", "node-0"]
    assert [m.process_tag for m in status.members] == [process_tag(1000 + r) for r in range(WORLD)]
    assert all(m.state == pb.MEMBER_STATE_JOINED for m in status.members)
    for m in status.members:  # wall-clock times (a second's slack for the clocks' reading apart)
        assert before - 1.0 <= m.joined_at_unix_s <= after + 1.0, (m.rank, before, m.joined_at_unix_s, after)


@pytest.mark.timeout(60)
def test_status_lists_each_ranks_progress_the_world_first_and_at_most_four_rows_a_rank(coordinator_factory):
    server = coordinator_factory(WORLD)
    names = ["b", "world", "a", "c", "d"]  # 5 communicators each: 15 rows, of which 12 are listed
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)

        def join(rank: int) -> pb.JoinResponse:
            return stub.Join(pb.JoinRequest(job_id="default", rank=rank, world_size=WORLD, incarnation=1000 + rank,
                                            hostname="h", wait_s=20.0, wire=WIRE), timeout=30)

        with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
            generation = list(pool.map(join, range(WORLD)))[0].generation
        for rank in range(WORLD):
            caller = pb.Caller(job_id="default", rank=rank, incarnation=1000 + rank, generation=generation)
            progress = [pb.Progress(communicator=name, entered=rank + 1, kind="barrier", age_s=0.5, inside=rank == 1)
                        for name in names]
            stub.Heartbeat(pb.HeartbeatRequest(caller=caller, wait_s=0.0, progress=progress), timeout=30)
        status = stub.Status(pb.StatusRequest(), timeout=30)
    rows = [(p.communicator, p.rank, p.entered, p.kind, p.inside) for p in status.progress]
    assert rows == ([("world", r, r + 1, "barrier", r == 1) for r in range(WORLD)]
                    + [(name, r, r + 1, "barrier", r == 1) for name in ["a", "b", "c"] for r in range(WORLD)])
    assert all(0.0 <= p.age_s < 30.0 for p in status.progress)  # entries are dated no earlier than the join
