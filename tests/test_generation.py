"""One generation numbering wherever a person reads it: ``comm.generation``, the library's log
line, ``gridcomm status``, the raw ``Status`` RPC and the ``gridcomm_generation`` gauge agree (0 at the first init, 1
after one ``rebuild()``), with real rank processes against a real coordinator."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import grpc
import pytest
from google.protobuf import json_format

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from tests.support.procs import ROOT, RankProcesses, report, wait_for
from tests.test_metrics import scrape, value

HB = 2.0

# Each rank prints its generation, marks that it is there, and waits (bounded) for the test to
# look before going on; rank 1 of generation 0 then dies, rank 0 rebuilds, a replacement joins.
RANK_CODE = r"""
import logging, os, sys, time
import gridcomm

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
rank = int(os.environ["GRIDCOMM_RANK"]); folder = os.environ["MARKS"]


def mark_and_wait(comm):
    print("GENERATION", comm.generation, flush=True)
    open(os.path.join(folder, f"at-{comm.generation}-{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, f"go-{comm.generation}")):
        if time.monotonic() > deadline:
            sys.exit("the test never said go")
        time.sleep(0.05)


comm = gridcomm.init_process_group(2, rank, backend="host", timeout_s=60)
mark_and_wait(comm)
if comm.generation == 0:
    if rank == 1:
        os._exit(1)
    try:
        comm.barrier()
        sys.exit("a barrier without rank 1 passed")
    except gridcomm.RankFailedError:
        comm = comm.rebuild(timeout_s=60)
    mark_and_wait(comm)
comm.barrier()
comm.stop()
"""


def _status(port: int) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "gridcomm", "status", f"127.0.0.1:{port}"], capture_output=True,
                          text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _raw(port: int) -> dict:
    """The Status RPC's answer as JSON, as grpcurl prints it for a person."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=10)
    return json.loads(json_format.MessageToJson(reply))


def _shown(port: int, metrics_port: int) -> tuple[int, int, int]:
    """(the generation `gridcomm status` prints, the gridcomm_generation gauge, the raw Status RPC's)."""
    found = re.search(r"generation (-?\d+),", _status(port))
    assert found is not None
    return (int(found.group(1)), int(value(scrape(metrics_port), "gridcomm_generation")),
            int(_raw(port)["generation"]))


@pytest.mark.timeout(180)
def test_api_log_status_and_metric_agree_at_the_first_init_and_after_a_rebuild(coordinator_factory, tmp_path):
    server = coordinator_factory(2, heartbeat_timeout_s=HB, metrics_port=0)
    assert server.metrics_port is not None
    before = re.search(r"generation ([^,]+),", _status(server.port))
    assert before is not None and before.group(1) == "none yet"
    assert value(scrape(server.metrics_port), "gridcomm_generation") == -1
    assert "generation" not in _raw(server.port)  # none has formed: absent, not a number to misread
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "MARKS": str(tmp_path)}
    first = RankProcesses(RANK_CODE, 2, env=env)
    replacement: RankProcesses | None = None
    try:
        at = lambda generation, rank: (tmp_path / f"at-{generation}-{rank}").exists()  # noqa: E731
        wait_for(lambda: at(0, 0) and at(0, 1), "both ranks in generation 0", 60)
        assert _shown(server.port, server.metrics_port) == (0, 0, 0)
        (tmp_path / "go-0").touch()
        wait_for(lambda: first.procs[1].poll() is not None, "rank 1 exits", 30)
        replacement = RankProcesses(RANK_CODE, 2, env=env, ranks=[1])
        wait_for(lambda: at(1, 0) and at(1, 1), "both ranks in generation 1", 90)
        assert _shown(server.port, server.metrics_port) == (1, 1, 1)
        (tmp_path / "go-1").touch()
        results = first.wait(60)
        later = replacement.wait(30)
    finally:
        first.close()
        if replacement is not None:
            replacement.close()
    everything = report(results) + report(later)
    assert results[0].returncode == 0 and later[1].returncode == 0, everything
    assert results[0].stdout.split() == ["GENERATION", "0", "GENERATION", "1"], everything
    assert results[1].stdout.split() == ["GENERATION", "0"], everything
    assert later[1].stdout.split() == ["GENERATION", "1"], everything
    # The library's own log lines name the same numbers.
    assert re.search(r"communicator ready in [\d.]+ s \(generation 0\)", results[0].stderr), everything
    assert re.search(r"rebuild\(\) done in [\d.]+ s: generation 1,", results[0].stderr), everything
    assert re.search(r"communicator ready in [\d.]+ s \(generation 1\)", later[1].stderr), everything
