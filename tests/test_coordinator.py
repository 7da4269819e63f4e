"""The coordinator and client over real gRPC on loopback, one OS process per rank."""

from __future__ import annotations

import time

import grpc
import pytest

import gridcomm
from gridcomm._wire import WIRE
from tests.support.procs import RankProcesses, assert_all_ok, report, wait_for

RANK_CLIENT = """
import os, sys, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, world, timeout_s=float(os.environ.get("T", "60")))
"""


@pytest.mark.timeout(240)
def test_eight_processes_blob_and_1000_barriers(coordinator_factory):
    server = coordinator_factory(8)
    code = RANK_CLIENT + """
client.join()
blob = bytes(range(128))
if rank == 0:
    client.set("blob", blob)
got = client.get("blob")
assert got == blob, got
for i in range(1000):
    client.barrier("loop")
client.leave()
print("done", rank)
"""
    results = RankProcesses(code, 8, env={"PORT": str(server.port)}).wait(200)
    assert_all_ok(results)
    assert all(f"done {r}" in results[r].stdout for r in range(8))
    assert server.wait_all_left(5.0)
    assert not server.state.failed


@pytest.mark.timeout(60)
def test_barrier_with_absent_rank_names_it_within_deadline(coordinator_factory):
    server = coordinator_factory(4)
    # Rank 3 joins (so the rendezvous completes) but never arrives at the barrier.
    code = RANK_CLIENT + """
import time
client.join()
if rank == 3:
    time.sleep(8)
    sys.exit(0)
t = time.monotonic()
try:
    client.barrier("stuck", timeout_s=2.0)
except gridcomm.RendezvousTimeout as exc:
    print("elapsed", time.monotonic() - t)
    print("missing", exc.missing_ranks)
    print("message", exc)
    sys.exit(0)
sys.exit("barrier did not time out")
"""
    results = RankProcesses(code, 4, env={"PORT": str(server.port)}).wait(40)
    assert_all_ok(results)
    for rank in range(3):
        out = results[rank].stdout
        assert "missing [3]" in out, report(results)
        elapsed = float(out.split("elapsed ")[1].split()[0])
        assert 1.9 <= elapsed <= 3.0, elapsed
        assert "rank 3" in out or "[3]" in out.split("message")[1]


@pytest.mark.timeout(60)
def test_join_timeout_names_missing_ranks(coordinator_factory):
    server = coordinator_factory(3)
    client = gridcomm.CoordinatorClient("127.0.0.1", server.port, 1, 3, timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(gridcomm.RendezvousTimeout) as info:
        client.join()
    assert time.monotonic() - t0 < 2.5
    assert info.value.missing_ranks == [0, 2]
    assert "[0, 2]" in str(info.value)
    client.close()


@pytest.mark.timeout(60)
def test_a_rank_that_left_before_the_rendezvous_does_not_complete_it(coordinator_factory):
    server = coordinator_factory(3)
    quitter = gridcomm.CoordinatorClient("127.0.0.1", server.port, 1, 3, timeout_s=1.0)
    with pytest.raises(gridcomm.RendezvousTimeout):
        quitter.join()
    quitter.leave()  # its process gives up before the others come
    quitter.close()
    others = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 3, timeout_s=2.0) for r in (0, 2)]
    results: dict[int, object] = {}

    def join(client) -> None:
        try:
            results[client.rank] = client.join()
        except gridcomm.GridcommError as exc:
            results[client.rank] = exc

    import threading
    threads = [threading.Thread(target=join, args=(c,)) for c in others]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Two live ranks and one that left: the rendezvous waits for rank 1, it does not complete.
    for rank in (0, 2):
        assert isinstance(results[rank], gridcomm.RendezvousTimeout) and results[rank].missing_ranks == [1], results
    assert not server.state.complete
    for c in others:
        c.close()


def _client(server, rank, world, **kw):
    return gridcomm.CoordinatorClient("127.0.0.1", server.port, rank, world, timeout_s=kw.pop("timeout_s", 5.0), **kw)


@pytest.mark.timeout(30)
def _joined(server, world):
    """Every rank's client, joined (the joins wait for each other: one thread each)."""
    import concurrent.futures

    clients = [_client(server, r, world, timeout_s=20.0) for r in range(world)]
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        list(pool.map(lambda c: c.join(), clients))
    return clients


def test_world_size_mismatch_is_rejected_at_once(coordinator_factory):
    server = coordinator_factory(2)
    t0 = time.monotonic()
    with pytest.raises(gridcomm.ConfigError, match="world size is 3.*2 ranks"):
        _client(server, 0, 3).join()
    assert time.monotonic() - t0 < 1.0


@pytest.mark.timeout(30)
def test_wrong_job_id_is_rejected_at_once(coordinator_factory):
    server = coordinator_factory(2, job_id="train-a")
    with pytest.raises(gridcomm.ConfigError, match="'train-b'.*'train-a'"):
        _client(server, 0, 2, job_id="train-b").join()


@pytest.mark.timeout(30)
def test_rank_out_of_range_is_rejected(coordinator_factory):
    server = coordinator_factory(2)
    # The client checks locally; a raw request shows the server refuses too.
    with pytest.raises(gridcomm.ConfigError, match="out of range"):
        _client(server, 2, 2)
    import grpc

    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(channel).Join(
                pb.JoinRequest(wire=WIRE, job_id="default", rank=7, world_size=2, incarnation=1, wait_s=1), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 7 is out of range for world size 2" in info.value.details()


@pytest.mark.timeout(60)
def test_duplicate_rank_from_two_live_processes(coordinator_factory):
    server = coordinator_factory(2)
    code = RANK_CLIENT + """
try:
    client.join()
except gridcomm.ConfigError as exc:
    print("REFUSED", exc)
    sys.exit(0)
except gridcomm.RendezvousTimeout:
    print("TIMEOUT")
    sys.exit(0)
"""
    # Two processes both claim rank 0; rank 1 never comes, so the first waits.
    procs = RankProcesses(code, 2, env={"PORT": str(server.port), "T": "4"}, ranks=[0])
    wait_for(lambda: 0 in server.state.members, "the first claim of rank 0 at the coordinator")
    second = RankProcesses(code, 2, env={"PORT": str(server.port), "T": "4"}, ranks=[0])
    r2 = second.wait(20)
    r1 = procs.wait(20)
    outs = r1[0].stdout + r2[0].stdout
    assert "REFUSED" in outs and "already taken by a live process" in outs, report(r1) + report(r2)
    assert "TIMEOUT" in outs


@pytest.mark.timeout(30)
def test_get_past_deadline(coordinator_factory):
    server = coordinator_factory(1)
    client = _client(server, 0, 1)
    client.join()
    t0 = time.monotonic()
    with pytest.raises(gridcomm.RendezvousTimeout, match="'never'"):
        client.get("never", timeout_s=0.5)
    assert 0.4 <= time.monotonic() - t0 < 1.5
    client.set("k", b"v")
    assert client.get("k", timeout_s=0.5) == b"v"
    client.leave()


@pytest.mark.timeout(30)
def test_bad_inputs_get_errors_and_server_keeps_serving(coordinator_factory):
    server = coordinator_factory(1)
    client = _client(server, 0, 1)
    client.join()
    with pytest.raises(gridcomm.ConfigError, match="key length 0"):
        client.set("", b"x")
    with pytest.raises(gridcomm.ConfigError, match="must be bytes"):
        client.set("k", "text")  # type: ignore[arg-type]
    with pytest.raises(gridcomm.ConfigError):
        client.barrier("")
    # A lone surrogate is a str that UTF-8 (a protobuf string) cannot carry.
    # (get with and without its own timeout: without, the first slice takes a shorter path.)
    for call in (lambda: client.get("half\ud800", timeout_s=1.0), lambda: client.get("half\ud800"),
                 lambda: client.set("half\ud800", b"x"), lambda: client.barrier("half\ud800")):
        with pytest.raises(gridcomm.ConfigError, match="not valid UTF-8"):
            call()
    client.set("ok", b"1")
    assert client.get("ok") == b"1"
    client.barrier("fine")
    # Text beyond ASCII that UTF-8 carries is a valid key and name.
    client.set("ключ-é", b"2")
    assert client.get("ключ-é") == b"2"
    client.barrier("барьер")
    client.leave()


@pytest.mark.timeout(30)
def test_token_required_when_set(coordinator_factory):
    server = coordinator_factory(1, token="s3cret")
    with pytest.raises(gridcomm.AuthenticationError, match="token is missing"):
        _client(server, 0, 1).join()
    with pytest.raises(gridcomm.AuthenticationError, match="token is wrong"):
        _client(server, 0, 1, token="nope").join()
    good = _client(server, 0, 1, token="s3cret")
    assert good.join() == 1
    good.leave()


@pytest.mark.timeout(30)
def test_nothing_listening_is_coordinator_unavailable(coordinator_factory):
    server = coordinator_factory(1)
    port = server.port
    server.stop()
    client = gridcomm.CoordinatorClient("127.0.0.1", port, 0, 1, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(gridcomm.CoordinatorUnavailable, match=f"127.0.0.1:{port}"):
        client.join()
    assert time.monotonic() - t0 < 3.5


@pytest.mark.timeout(30)
def test_second_server_on_same_port_fails(coordinator_factory):
    server = coordinator_factory(1)
    with pytest.raises(gridcomm.CoordinatorUnavailable, match="in use"):
        gridcomm.Coordinator(1, bind="127.0.0.1", port=server.port).start()


@pytest.mark.timeout(30)
def test_failure_report_reaches_waiters_and_turns_status(coordinator_factory):
    server = coordinator_factory(2)
    import threading

    clients = [_client(server, r, 2, timeout_s=10.0) for r in range(2)]
    threads = [threading.Thread(target=c.join) for c in clients]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    errors = []

    def wait_barrier():
        try:
            clients[0].barrier("x")
        except gridcomm.GridcommError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait_barrier)
    waiter.start()
    wait_for(lambda: "x" in server.state.barriers and server.state.barriers["x"].arrived[0] == 1,
             "rank 0 waiting at barrier 'x'")
    clients[1].report_failure("CUDA error: out of memory")
    waiter.join(5)
    assert not waiter.is_alive()
    assert isinstance(errors[0], gridcomm.RankFailedError)
    assert errors[0].rank == 1 and "out of memory" in str(errors[0])
    status = gridcomm._client.client.fetch_status("127.0.0.1", server.port)
    assert not status.serving and status.failures[0].rank == 1


@pytest.mark.timeout(120)
def test_a_value_larger_than_a_message_travels_in_pieces(coordinator_factory):
    """60 MiB (more than any one message the coordinator reads) set by rank 0's process and read
    whole by rank 1's; then set again while rank 1 reads, which must see one value or the other."""
    server = coordinator_factory(2)
    code = RANK_CLIENT + """
import hashlib
client.join()
big = hashlib.sha256(b"seed").digest() * (60 * 32768)   # 60 MiB, not one repeated byte
other = bytes(reversed(big))
if rank == 0:
    client.set("big", big)
    client.barrier("read")
    for _ in range(5):
        client.set("big", other)
        client.set("big", big)
else:
    got = client.get("big")
    assert got == big, (len(got), got[:16])
    client.barrier("read")
    for _ in range(5):
        assert client.get("big") in (big, other)
client.barrier("done")
print("ok", rank)
"""
    results = RankProcesses(code, 2, env={"PORT": str(server.port)}).wait(100)
    assert_all_ok(results)
    assert all(f"ok {r}" in results[r].stdout for r in range(2)), report(results)


@pytest.mark.timeout(60)
def test_value_pieces_out_of_order_are_refused_and_nothing_is_stored(coordinator_factory):
    import grpc

    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

    server = coordinator_factory(1)
    client = gridcomm.CoordinatorClient("127.0.0.1", server.port, 0, 1, timeout_s=10.0)
    try:
        client.join()
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            piece = b"p" * 1000
            stub.Set(pb.SetRequest(caller=client.caller, key="k", value=piece, total_bytes=3000, offset=0), timeout=5)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Set(pb.SetRequest(caller=client.caller, key="k", value=piece, total_bytes=3000, offset=2000),
                         timeout=5)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "does not follow" in refused.value.details()
            with pytest.raises(gridcomm.RendezvousTimeout):
                client.get("k", timeout_s=0.5)
            # A piece past the announced size is refused too.
            with pytest.raises(grpc.RpcError) as past:
                stub.Set(pb.SetRequest(caller=client.caller, key="k", value=piece * 4, total_bytes=3000, offset=0),
                         timeout=5)
            assert past.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert server.state._pieces_bytes == 0
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_coordinator_restarted_after_the_rendezvous_says_so(coordinator_factory):
    """An old rank's next call to a fresh coordinator on the same port raises CoordinatorRestarted:
    a CoordinatorUnavailable (so a supervisor restarts the job), never a ConfigError (a user mistake)."""
    import concurrent.futures

    first = coordinator_factory(2)
    clients = [gridcomm.CoordinatorClient("127.0.0.1", first.port, r, 2, timeout_s=5.0) for r in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(c.join) for c in clients]:
                done.result(timeout=30)
        port = first.port
        first.stop()
        coordinator_factory(2, port=port)
        for call in (lambda: clients[0].set("k", b"v"), lambda: clients[1].barrier("b", timeout_s=5.0)):
            with pytest.raises(gridcomm.CoordinatorRestarted) as refused:
                call()
            assert isinstance(refused.value, gridcomm.CoordinatorUnavailable)
            assert not isinstance(refused.value, gridcomm.ConfigError)
            text = str(refused.value)
            assert "no record of rank" in text and "restarted" in text, text
            assert "before joining" not in text
    finally:
        for c in clients:
            c.close()


@pytest.mark.timeout(60)
def test_a_failure_is_reported_once_and_survivors_that_exit_are_not_errors(coordinator_factory, caplog):
    import threading

    server = coordinator_factory(3, heartbeat_timeout_s=1.0)
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 3, timeout_s=10) for r in range(3)]
    threads = [threading.Thread(target=c.join) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with caplog.at_level("INFO", logger="gridcomm._coordinator.servicer"):
        clients[2].report_failure("boom")
        for c in clients:
            c.close()  # every process exits on the failure without leaving (a job's exit code 3)
        wait_for(lambda: len(server.state.failures) == 3, "the survivors' silence is recorded", 20)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["coordinator: rank 2 reported a failure: boom"], errors
    later = [r.getMessage() for r in caplog.records if "after rank 2's failure" in r.getMessage()]
    assert len(later) == 2 and all(r.levelname == "INFO" for r in caplog.records if r.getMessage() in later), later


@pytest.mark.timeout(60)
def test_status_carries_refused_joins_within_the_metadata_limit_whatever_their_host_names(fresh_server):
    """Refused joins from hosts with long non-ASCII names (escaped six-fold in the JSON trailer):
    Status still answers, with the latest refusals in a trailer well under gRPC's 8 KiB limit."""
    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

    server, channel = fresh_server
    stub = pb_grpc.CoordinatorStub(channel)
    host = "\U0001f600" * 64  # 256 bytes, the limit; 12 escaped bytes per character
    with pytest.raises(grpc.RpcError):  # rank 0 waits for rank 1 (its join's wait ends first)
        stub.Join(pb.JoinRequest(wire=WIRE, job_id=server.job_id, rank=0, world_size=2, incarnation=1, hostname=host,
                                 wait_s=0.1), timeout=10)
    for i in range(12):
        with pytest.raises(grpc.RpcError):  # a second process for rank 0: refused, naming the holder's host
            stub.Join(pb.JoinRequest(wire=WIRE, job_id=server.job_id, rank=0, world_size=2, incarnation=2 + i,
                                     hostname=host, wait_s=0.1), timeout=10)
    reply, call = stub.Status.with_call(pb.StatusRequest(), timeout=10)
    trailer = dict(call.trailing_metadata())["gridcomm-refused-joins"]
    assert 0 < len(trailer) <= 8192 - 1024, len(trailer)
    assert "ALREADY_EXISTS" in trailer, trailer[:300]


LEAVE_ONE = """
import os, sys, time, gridcomm
c = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), int(os.environ["GRIDCOMM_RANK"]), 3, timeout_s=30)
c.join()
print("JOINED", flush=True)
if c.rank == 2:
    end = time.monotonic() + 30
    while not os.path.exists(os.environ["GO"]) and time.monotonic() < end:
        time.sleep(0.05)
else:
    time.sleep(20)
c.leave()
print("LEFT", flush=True)
"""


@pytest.mark.timeout(90)
def test_a_leave_does_not_wake_the_held_heartbeats(coordinator_factory, tmp_path):
    """A leave wakes the waits it can concern (barriers, joins), not every rank's held heartbeat:
    at the end of a job every rank leaves at once, and each leave re-arming every held heartbeat
    cost the coordinator O(ranks x waiters) (8,192 ranks: thousands of leaves outlasted their
    bound, and those ranks were then failed as silent)."""
    import asyncio

    server = coordinator_factory(3, heartbeat_timeout_s=60.0)  # heartbeats held 20 s each
    servicer = server._servicer
    held_key = ("failure",)

    def on_loop(fn):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), servicer._loop).result(10)

    go = tmp_path / "go"
    ranks = RankProcesses(LEAVE_ONE, 3, env={"PORT": str(server.port), "GO": str(go)})
    try:
        held = wait_for(lambda: (f := on_loop(lambda: list(servicer._waiters.get(held_key, ())))) and len(f) == 3 and f,
                        "three held heartbeats", 30)
        go.write_text("go")
        wait_for(lambda: server.state.members[2].state.name == "LEFT", "rank 2's leave", 20)
        # Ranks 0 and 1 still wait in the heartbeats they held before (a woken one is answered
        # or re-armed with a new future; rank 2's own ended with its stream).
        still = on_loop(lambda: [f for f in held if not f.done() and f in servicer._waiters.get(held_key, ())])
        assert len(still) >= 2, (len(still), held)
        assert not server.state.failures
    finally:
        ranks.close()


@pytest.mark.timeout(60)
def test_an_aggregate_naming_a_caller_the_coordinator_would_refuse_is_refused_whole(coordinator_factory):
    """A relay's aggregate (a barrier or get on a Session stream whose ``SessionOp.aggregate``
    names more ranks, each with its process) is checked rank by rank as each rank's own call would
    be: a stranger, a rank of another process, a rank that left, lost ranks (a heartbeat's), or
    more ranks than the job has are refused with a readable status, as is an aggregate of another
    job or generation (its caller's), and an aggregate on an operation that takes none; no arrival
    of a refused aggregate completes a barrier, and the coordinator goes on serving a good
    aggregate and the ranks' own calls."""
    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
    from tests.support.relayed import aggregate_of, relayed

    world = 4
    server = coordinator_factory(world)
    clients = _joined(server, world)
    callers = [c.caller for c in clients]

    def with_(caller: pb.Caller, **change) -> pb.Caller:
        other = pb.Caller()
        other.CopyFrom(caller)
        for field, value in change.items():
            setattr(other, field, value)
        return other

    def also(*others: pb.Caller) -> pb.Aggregate:
        return aggregate_of(*others)

    bad = {
        "a rank out of range": (callers[0], also(callers[1], with_(callers[1], rank=world + 3), callers[3]),
                                grpc.StatusCode.INVALID_ARGUMENT, "rank"),
        "another process": (callers[0], also(callers[1], with_(callers[2], incarnation=callers[2].incarnation + 1)),
                            grpc.StatusCode.FAILED_PRECONDITION, "as process"),
        "lost ranks": (callers[0],
                       aggregate_of(callers[1], lost=[pb.RelayedRank(rank=2, incarnation=callers[2].incarnation)]),
                       grpc.StatusCode.INVALID_ARGUMENT, "names lost ranks"),
        "more ranks than the job": (callers[0], also(*[callers[1]] * (world + 1)), grpc.StatusCode.INVALID_ARGUMENT,
                                    "more than the job's"),
        "another job": (with_(callers[0], job_id="someone-else"), also(callers[1]), None, "someone-else"),
        "another generation": (with_(callers[0], generation=callers[0].generation + 5), also(callers[1]),
                               grpc.StatusCode.FAILED_PRECONDITION, "rejoin first"),
    }
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for what, (caller, others, code, words) in bad.items():
            for kind, request in (
                    ("barrier", pb.BarrierRequest(caller=caller, name="agg", seq=1, wait_s=0.2)),
                    ("get", pb.GetRequest(caller=caller, key="nothing", wait_s=0.2))):
                with pytest.raises(grpc.RpcError) as caught:
                    relayed(stub, kind, request, others, timeout_s=10)
                assert code is None or caught.value.code() == code, (what, caught.value.code(), caught.value.details())
                assert caught.value.code() != grpc.StatusCode.UNKNOWN and words in caught.value.details(), \
                    (what, caught.value.details())
        # Only a join, get, barrier or heartbeat takes an aggregate.
        with pytest.raises(grpc.RpcError) as caught:
            relayed(stub, "set", pb.SetRequest(caller=callers[0], key="k", value=b"x"), also(callers[1]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries no aggregate" in \
            caught.value.details(), caught.value.details()
        # Nothing above completed instance 1: a good aggregate for ranks 0-2 still waits for 3.
        with pytest.raises(grpc.RpcError) as caught:
            relayed(stub, "barrier", pb.BarrierRequest(caller=callers[0], name="agg", seq=1, wait_s=0.3),
                    also(callers[1], callers[2]), timeout_s=10)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "[3]" in caught.value.details(), \
            caught.value.details()
        # Rank 3 arrives on its own and completes it; ranks 0-2 see it complete.
        assert stub.Barrier(pb.BarrierRequest(caller=callers[3], name="agg", seq=1, wait_s=5.0), timeout=10).seq == 1
        assert relayed(stub, "barrier", pb.BarrierRequest(caller=callers[0], name="agg", seq=1, wait_s=5.0),
                       also(callers[1], callers[2]), timeout_s=10).seq == 1
        clients[3].leave()
        with pytest.raises(grpc.RpcError) as caught:
            relayed(stub, "get", pb.GetRequest(caller=callers[0], key="k", wait_s=0.2), also(callers[3]), timeout_s=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "after it left" in \
            caught.value.details(), caught.value.details()
    assert not server.state.failures
    clients[0].set("k", b"v")
    assert [c.get("k") for c in clients[:3]] == [b"v"] * 3
    for c in clients[:3]:
        c.leave()


@pytest.mark.timeout(60)
def test_a_heartbeat_that_repeats_its_progress_refreshes_it_and_a_bad_age_is_still_refused(coordinator_factory):
    """A rank between collectives sends the same progress entries with every heartbeat (only the
    ages grow); the coordinator takes such a report as the rank being heard from (its progress
    stays fresh, so it is named as the laggard past the freshness bound), reads a changed report
    in full, and refuses a repeated entry whose age is not a number as it refuses a first one."""
    import math

    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

    world = 2
    server = coordinator_factory(world)
    clients = _joined(server, world)
    callers = [c.caller for c in clients]

    def beat(rank: int, entered: int, age: float, inside: bool) -> None:
        stub.Heartbeat(pb.HeartbeatRequest(caller=callers[rank], wait_s=0.0, progress=[pb.Progress(
            communicator="world", entered=entered, kind="all_reduce", age_s=age, inside=inside)]), timeout=10)

    progress = server.state.progress
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        beat(0, 5, 0.0, True)
        beat(1, 4, 0.0, False)
        first = progress.communicators["world"].ranks[1].reported_at
        time.sleep(0.05)
        beat(1, 4, 0.05, False)  # the same entry again: only when it was heard from moves
        again = progress.communicators["world"].ranks[1]
        assert again.reported_at > first and again.entered == 4
        # With a freshness bound its first report alone is past, rank 1 is still named: the repeat
        # counts as a report.
        now = server._servicer._now()
        assert progress.communicators["world"].late(now, fresh_s=now - first - 0.01)[0] == [1]
        beat(1, 5, 0.0, True)  # changed: read in full
        assert progress.communicators["world"].ranks[1].entered == 5 and progress.communicators["world"].ranks[1].inside
        for bad in (math.nan, -1.0, math.inf):
            with pytest.raises(grpc.RpcError) as caught:
                beat(1, 5, bad, True)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "age" in caught.value.details(), \
                caught.value.details()
        beat(1, 5, 0.1, True)
    assert not server.state.failures
    for c in clients:
        c.leave()


@pytest.mark.timeout(60)
def test_a_relayed_heartbeat_stands_for_repeated_progress_asks_again_for_what_it_lacks_and_refuses_bad_input(
        coordinator_factory):
    """A relay's heartbeat names its ranks in its aggregate and flags each rank whose progress is
    what it reported before. The coordinator refreshes the report it holds for a flagged rank,
    names in the answer's progress_resend each flagged rank it holds none for (never reported, or
    its last report refused), skips a rank of another process or out of range, and refuses more
    progress entries than its ranks may send, or another job's heartbeat, whole, with a readable
    status."""
    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
    from tests.support.relayed import refused, session_op

    world = 4
    server = coordinator_factory(world)
    clients = _joined(server, world)
    callers = [c.caller for c in clients]
    generation = callers[0].generation

    def entry(rank: int, communicator: str = "world") -> pb.Progress:
        return pb.Progress(communicator=communicator, entered=7, kind="barrier", age_s=0.5, inside=True, rank=rank)

    def beat(ranks, same=(), progress=(), incarnations=None, caller=None) -> pb.AggregateAnswer:
        """The relay's heartbeat for ``ranks``; the coordinator's answer to its aggregate."""
        incarnations = incarnations or [callers[r].incarnation if 0 <= r < world else 1 for r in ranks]
        aggregate = pb.Aggregate(ranks=[
            pb.RelayedRank(rank=r, incarnation=i, generation=generation, age_s=0.1, progress_same=bool(s))
            for r, i, s in zip(ranks, incarnations, same or [False] * len(ranks), strict=True)])
        request = pb.HeartbeatRequest(caller=caller or callers[0], wait_s=0.0, progress=progress)
        result = session_op(stub, "heartbeat", request, aggregate, timeout_s=10)
        if result.code:
            raise refused(result)
        assert result.HasField("heartbeat")
        return result.aggregate

    progress = server.state.progress
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        assert sorted(beat([1, 2], same=[True, True]).progress_resend) == [1, 2]  # nothing reported yet
        assert not beat([1, 2], progress=[entry(1), entry(2)]).progress_resend
        world_ranks = progress.communicators["world"].ranks
        first = {r: world_ranks[r].reported_at for r in (1, 2)}
        time.sleep(0.05)
        assert list(beat([1, 3], same=[True, True]).progress_resend) == [3]
        assert world_ranks[1].reported_at > first[1] and world_ranks[1].entered == 7 and world_ranks[1].inside
        assert world_ranks[2].reported_at == first[2]  # not named: not refreshed
        # Rank 2's process as another incarnation: skipped (neither refreshed nor asked again).
        stranger = beat([2], same=[True], incarnations=[callers[2].incarnation + 1])
        assert not stranger.progress_resend and world_ranks[2].reported_at == first[2]
        # A refused report (an empty communicator name) leaves nothing a flag could stand for.
        beat([1], progress=[entry(1, communicator="")])
        assert list(beat([1], same=[True]).progress_resend) == [1]
        # A rank out of range is skipped (the others are still carried), not refused.
        assert list(beat([world + 5, 1], same=[True, True]).progress_resend) == [1]
        # More progress entries than its ranks may send: refused whole.
        with pytest.raises(grpc.RpcError) as caught:
            beat([1], progress=[entry(1, communicator=f"c{i}") for i in range(200)])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "progress entries" in \
            caught.value.details(), caught.value.details()
        other = pb.Caller()
        other.CopyFrom(callers[0])
        other.job_id = "someone-else"
        with pytest.raises(grpc.RpcError) as caught:
            beat([1], caller=other)
        assert caught.value.code() != grpc.StatusCode.UNKNOWN and "someone-else" in caught.value.details(), \
            caught.value.details()
    assert not server.state.failures
    for c in clients:
        c.leave()


@pytest.mark.timeout(60)
def test_an_aggregated_join_registers_each_rank_and_sends_back_what_a_join_of_its_own_must_answer(coordinator_factory):
    """A relay's aggregate of first joins (``SessionOp.aggregate``): one wait and one answer for all
    its ranks, each registered as its own join would be. What only a join of its own can answer
    (a rank out of range, another world size, a second process for a rank of the running job) is
    refused with FAILED_PRECONDITION, which makes a relay repeat each join alone; an aggregate
    that is not a first join, or names more ranks than the job has, is refused as bad input."""
    import concurrent.futures
    import threading

    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

    world = 4
    server = coordinator_factory(world)

    from gridcomm._wire import WIRE
    from tests.support.relayed import relayed

    def joiner(rank: int, incarnation: int = 0) -> pb.RelayedRank:
        return pb.RelayedRank(rank=rank, incarnation=incarnation or 1000 + rank, hostname=f"host-{rank}")

    def aggregate(first: int, *others: pb.RelayedRank, wait_s: float = 0.3,
                  **fields) -> tuple[pb.JoinRequest, pb.Aggregate]:
        return (pb.JoinRequest(**{"job_id": "default", "rank": first, "world_size": world, "incarnation": 1000 + first,
                                  "hostname": f"host-{first}", "wait_s": wait_s, "wire": WIRE, **fields}),
                pb.Aggregate(ranks=list(others)))

    def refused(join: tuple[pb.JoinRequest, pb.Aggregate], code: grpc.StatusCode, words: str) -> None:
        with pytest.raises(grpc.RpcError) as caught:
            relayed(stub, "join", *join, timeout_s=10)
        assert caught.value.code() == code and words in caught.value.details(), \
            (caught.value.code(), caught.value.details())

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        refused(aggregate(0, joiner(1), generation=2), grpc.StatusCode.INVALID_ARGUMENT, "only a first join")
        refused(aggregate(0, *[joiner(1)] * world), grpc.StatusCode.INVALID_ARGUMENT, "more ranks than the job's")
        refused(aggregate(0, joiner(world + 2)), grpc.StatusCode.FAILED_PRECONDITION, "join each alone")
        refused(aggregate(0, joiner(1), world_size=world + 1), grpc.StatusCode.FAILED_PRECONDITION, "join each alone")
        # Ranks 0-2 in one aggregate wait, as one join, for rank 3, which the answer names.
        refused(aggregate(0, joiner(1), joiner(2)), grpc.StatusCode.DEADLINE_EXCEEDED, "[3]")
        assert sorted(server.state.members) == [0, 1, 2]
        assert {r: m.hostname for r, m in server.state.members.items()} == {0: "host-0", 1: "host-1", 2: "host-2"}
        assert not server.state.complete
        late = _client(server, 3, world, timeout_s=20.0)
        joined = threading.Thread(target=late.join)
        joined.start()
        answer = relayed(stub, "join", *aggregate(0, joiner(1), joiner(2), wait_s=10.0), timeout_s=20)
        joined.join(20)
        assert not joined.is_alive() and late.generation == answer.generation and answer.world_size == world
        assert server.state.complete and server.state.generation == answer.generation
        # Every rank of the aggregate is its own member: a barrier of all four passes.
        callers = [pb.Caller(job_id="default", rank=r, incarnation=1000 + r, generation=answer.generation)
                   for r in range(3)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(late.barrier, "all", timeout_s=20.0)
            assert relayed(stub, "barrier", pb.BarrierRequest(caller=callers[0], name="all", seq=1, wait_s=10.0),
                           pb.Aggregate(ranks=[pb.RelayedRank(rank=1, incarnation=1001),
                                               pb.RelayedRank(rank=2, incarnation=1002)]), timeout_s=20).seq == 1
            waiting.result(20)
        # New processes for ranks 0 and 1 of the running job: only their own joins can wait for
        # their predecessors' fate.
        refused((pb.JoinRequest(job_id="default", rank=0, world_size=world, incarnation=7, wait_s=0.3, wire=WIRE),
                 pb.Aggregate(ranks=[joiner(1, incarnation=8)])),
                grpc.StatusCode.FAILED_PRECONDITION, "join each alone")
    assert not server.state.failures and server.state.members[0].incarnation == 1000
    late.leave()
