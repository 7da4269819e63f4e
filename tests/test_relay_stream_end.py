"""The end of a rank's stream to a relay (gridcomm/_relay/server.py): a rank that stops sending
while an operation of its own is still waiting at the coordinator gets that answer, and then its
stream ends with OK (the relay waits for what it sent to be answered, on events, and no longer).

A real coordinator and a real relay in this process; the one rank is a client of this process (it
joins and sets the key) and a raw Session stream of its own to the relay (the long get).
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

import gridcomm
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._relay.server import Relay
from tests.support.procs import wait_for


@pytest.mark.timeout(120)
def test_a_stream_closed_with_a_get_in_flight_gets_its_answer_then_ends(coordinator_factory):
    server = coordinator_factory(1)
    relay = Relay(server.address, world_size=1).start()
    client = gridcomm.CoordinatorClient("127.0.0.1", server.port, 0, 1, timeout_s=60)
    channel = grpc.insecure_channel(relay.target)
    try:
        client.join()
        get = pb.GetRequest(caller=client.caller, key="late", wait_s=30)
        outcome: dict[str, Any] = {"results": []}

        def stream() -> None:
            # One message, then the request side is closed: the get is still waiting at the relay.
            requests = iter([pb.SessionRequest(ops=[pb.SessionOp(id=7, get=get)])])
            try:
                for reply in pb_grpc.CoordinatorStub(channel).Session(requests, timeout=90):
                    outcome["results"].extend(reply.results)
                outcome["status"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                outcome["status"] = exc.code()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_for(lambda: relay.sent["get"] >= 1, "the relay sent the get up", 30)
        client.set("late", b"value")
        # Why 30 s: far below the call's 90 s deadline and the get's 30 s wait, far above a loaded
        # machine's scheduling; a stream the relay does not end waits for one of those.
        reader.join(30)
        assert not reader.is_alive(), f"the stream did not end after its answer: {outcome}"
        assert outcome["status"] == grpc.StatusCode.OK, outcome
        assert [(r.id, r.code, r.get.value) for r in outcome["results"]] == [(7, 0, b"value")], outcome
    finally:
        channel.close()
        client.close()
        relay.stop()
