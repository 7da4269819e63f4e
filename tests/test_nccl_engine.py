"""What the NCCL backend decides without a GPU: the engine (GRIDCOMM_NCCL_ENGINE), the ranks per
bootstrap root (GRIDCOMM_RANKS_PER_ROOT), and the multi-root unique-ID plan, the last over a real
coordinator on loopback, one OS process per rank. The GPU side is in tests/test_gpu.py."""

from __future__ import annotations

import pytest

import gridcomm
from gridcomm._backends import nccl as _nccl
from tests.support.procs import RankProcesses, assert_all_ok, report


def test_engine_setting_defaults_to_auto_and_accepts_each_engine():
    assert _nccl.engine_setting({}) == "auto"
    assert _nccl.engine_setting({"GRIDCOMM_NCCL_ENGINE": ""}) == "auto"
    for value, expected in (("cupy", "cupy"), ("NCCL4PY", "nccl4py"), (" auto ", "auto")):
        assert _nccl.engine_setting({"GRIDCOMM_NCCL_ENGINE": value}) == expected


def test_an_unknown_engine_is_refused_with_the_choices():
    with pytest.raises(gridcomm.ConfigError, match=r"GRIDCOMM_NCCL_ENGINE='nccl3'.*auto, nccl4py, cupy"):
        _nccl.engine_setting({"GRIDCOMM_NCCL_ENGINE": "nccl3"})


def test_cupy_is_chosen_when_asked_and_nccl4py_only_where_it_loads():
    assert _nccl.engine({"GRIDCOMM_NCCL_ENGINE": "cupy"}) == "cupy"
    usable = _nccl.load_nccl4py() is not None
    assert _nccl.engine({}) == ("nccl4py" if usable else "cupy")
    if usable:
        assert _nccl.engine({"GRIDCOMM_NCCL_ENGINE": "nccl4py"}) == "nccl4py"
    else:  # the CI machine: no nccl4py, or no libnccl for it
        with pytest.raises(gridcomm.ConfigError, match=r"nccl4py cannot be used here .*GRIDCOMM_NCCL_ENGINE=auto"):
            _nccl.engine({"GRIDCOMM_NCCL_ENGINE": "nccl4py"})


def test_ranks_per_root_parsing():
    assert _nccl.ranks_per_root({}) == 128
    assert _nccl.ranks_per_root({"GRIDCOMM_RANKS_PER_ROOT": "64"}) == 64
    for bad in ("0", "-3", "lots", "1.5"):
        with pytest.raises(gridcomm.ConfigError, match="GRIDCOMM_RANKS_PER_ROOT"):
            _nccl.ranks_per_root({"GRIDCOMM_RANKS_PER_ROOT": bad})


def _nccl_root_of(rank: int, n_ranks: int, n_roots: int) -> int:
    """NCCL's bootstrap assignment of a rank to a root (rootIdFromRank in bootstrap.cc)."""
    rmr, rpr = n_ranks % n_roots, n_ranks // n_roots
    border = rmr * (rpr + 1)
    return rank // (rpr + 1) if rank < border else (rank - border) // rpr + rmr


@pytest.mark.parametrize("size,per_root", [(1, 128), (128, 128), (129, 128), (256, 128), (300, 128), (1000, 128),
                                           (2048, 128), (10, 3), (7, 1), (5, 2)])
def test_each_root_is_the_first_rank_of_the_partition_nccl_gives_it(size, per_root):
    roots = _nccl.root_ranks(size, per_root)
    assert len(roots) == -(-size // per_root)
    assert roots[0] == 0 and roots == sorted(set(roots))
    for index, rank in enumerate(roots):
        assert _nccl_root_of(rank, size, len(roots)) == index
        assert rank == 0 or _nccl_root_of(rank - 1, size, len(roots)) == index - 1
    if size % per_root == 0:
        assert roots == [i * per_root for i in range(size // per_root)]


def test_a_world_of_at_most_k_ranks_uses_the_one_key_it_always_used():
    assert _nccl.root_ranks(128, 128) == [0]
    assert _nccl.id_key("world", 0) == "world/nccl-unique-id"
    assert _nccl.id_key("world.s1c0", 2) == "world.s1c0/nccl-unique-id/2"


EXCHANGE = """
import os, sys, time, gridcomm
from gridcomm._backends import nccl as _nccl
rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, world, timeout_s=30)
client.join()
roots = _nccl.root_ranks(world, int(os.environ["PER_ROOT"]))
absent = int(os.environ.get("ABSENT_ROOT", "-1"))
if rank == absent:
    time.sleep(float(os.environ["T"]) + 3)   # a root that never publishes its ID
    sys.exit(0)
made = []
def make_id():
    made.append(rank)
    return bytes([rank]) * 128
t0 = time.monotonic()
try:
    ids = _nccl.exchange_ids(client, "world", rank, roots, make_id, float(os.environ["T"]))
except gridcomm.RendezvousTimeout as exc:
    print(f"TIMEOUT after={time.monotonic() - t0:.2f} {exc}", flush=True)
    sys.exit(0)
print("ROOTS", roots, "MADE", made, "IDS", [i[0] for i in ids], "LEN", {len(i) for i in ids}, flush=True)
client.leave()
"""


@pytest.mark.timeout(90)
def test_multi_root_exchange_over_a_real_coordinator(coordinator_factory):
    """5 ranks, 2 per root: roots 0, 2 and 4 (NCCL's partitions 0-1, 2-3, 4) each make one ID
    under its own key; every rank ends with the three IDs in root order."""
    server = coordinator_factory(5)
    results = RankProcesses(EXCHANGE, 5, env={"PORT": str(server.port), "PER_ROOT": "2", "T": "30"}).wait(80)
    assert_all_ok(results)
    for rank, result in results.items():
        made = [rank] if rank in (0, 2, 4) else []
        assert f"ROOTS [0, 2, 4] MADE {made} IDS [0, 2, 4] LEN {{128}}" in result.stdout, report(results)


@pytest.mark.timeout(60)
def test_an_absent_root_ends_the_exchange_at_the_deadline_naming_its_key(coordinator_factory):
    server = coordinator_factory(4)
    env = {"PORT": str(server.port), "PER_ROOT": "2", "T": "2", "ABSENT_ROOT": "2"}
    results = RankProcesses(EXCHANGE, 4, env=env).wait(50)
    assert_all_ok(results)
    for rank in (0, 1, 3):
        out = results[rank].stdout
        assert "TIMEOUT" in out and "world/nccl-unique-id/1" in out, report(results)
        assert float(out.split("after=")[1].split()[0]) < 2 + 3, out
