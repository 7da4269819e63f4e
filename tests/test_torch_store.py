"""gridcomm.TorchStore: torch.distributed on gridcomm's control plane.

The coordinator's Add, CompareSet, DeleteKey and Keys (state and wire, repeats applied once, bad
input refused readably); then real torch (the CPU wheel, a dev extra): one process per rank runs
``init_process_group("gloo", store=gridcomm.TorchStore())`` with ``TORCH_DIST_INIT_BARRIER=1``,
an all_reduce, a ``new_group`` and store calls across ranks; a killed rank turns a peer's store
wait into RankFailedError naming it; and random keys and operations are judged against a dict.
The torch tests skip, saying why, only where torch cannot be imported.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gridcomm
from gridcomm._coordinator.state import INVALID_ARGUMENT, JobState, StateError
from gridcomm._proto import coordinator_pb2 as pb
from tests.support import fuzz_keys
from tests.support.procs import ROOT, RankProcesses, assert_all_ok, free_port, report

try:
    import torch  # noqa: F401
    import torch.distributed as dist

    TORCH_PROBLEM = None
except ImportError as exc:  # pragma: no cover - the dev extra installs it
    TORCH_PROBLEM = f"torch cannot be imported ({exc}); `pip install -e '.[dev]'` installs the CPU wheel"
needs_torch = pytest.mark.skipif(TORCH_PROBLEM is not None, reason=str(TORCH_PROBLEM))


# ---------------------------------------------------------------------- the state
def test_state_add_compare_set_delete_and_count_as_torch_stores_do():
    state = JobState(2, "job", now=0.0)
    assert state.add("c", 5) == 5 and state.add("c", -2) == 3 and state.kv["c"] == b"3"
    assert state.compare_set("k", b"", b"first") == b"first"  # not set, expected empty: set
    assert state.compare_set("k", b"other", b"no") == b"first"  # mismatch: what it holds
    assert state.compare_set("absent", b"x", b"y") == b"x" and "absent" not in state.kv  # torch's answer
    assert state.compare_set("k", b"first", b"second") == b"second"
    assert state.count() == 2
    assert state.delete("k") is True and state.delete("k") is False and state.count() == 1
    state.set("text", b"hello")
    with pytest.raises(StateError, match="not an integer") as refused:
        state.add("text", 1)
    assert refused.value.code == INVALID_ARGUMENT
    state.set("big", str((1 << 63) - 1).encode())
    with pytest.raises(StateError, match="64-bit"):
        state.add("big", 1)
    with pytest.raises(StateError, match="key length 0"):
        state.add("", 1)


def test_state_answers_a_repeated_request_as_the_first_without_applying_it_again():
    state = JobState(2, "job", now=0.0)
    caller, other = (0, 11), (1, 22)
    assert state.add("c", 1, caller, request_id=7) == 1
    assert state.add("c", 1, caller, request_id=7) == 1  # the same call again (a broken stream)
    assert state.add("c", 1, other, request_id=7) == 2  # another rank's id 7 is its own
    assert state.kv["c"] == b"2"
    assert state.compare_set("k", b"", b"a", caller, request_id=8) == b"a"
    state.set("k", b"b")
    assert state.compare_set("k", b"", b"a", caller, request_id=8) == b"a" and state.kv["k"] == b"b"
    assert state.delete("k", caller, request_id=9) is True
    assert state.delete("k", caller, request_id=9) is True  # answered as the first, not "was not set"
    # A freed key's bytes are given back: the store can fill again after deletes.
    before = state._state_bytes()
    state.set("x" * 100, b"v" * 1000)
    state.delete("x" * 100)
    assert state._state_bytes() == before


# ---------------------------------------------------------------------- the wire
def test_the_rpcs_apply_a_repeat_once_and_refuse_bad_input_readably(coordinator_factory):
    server = coordinator_factory(1)
    client = gridcomm.CoordinatorClient("127.0.0.1", server.port, 0, 1, timeout_s=20)
    client.join()
    try:
        request = pb.AddRequest(caller=client.caller, key="c", amount=5, request_id=1)
        assert client._op("add", request, "add", 10).value == 5  # on the Session stream
        assert client._stub.Add(request, timeout=10).value == 5  # the same request again, unary: not applied
        assert client._stub.Add(pb.AddRequest(caller=client.caller, key="c", amount=1, request_id=2),
                                timeout=10).value == 6
        assert client.get("c") == b"6"
        keys = client._stub.Keys(pb.KeysRequest(caller=client.caller, keys=["c", "nope"]), timeout=10)
        assert list(keys.present) == [True, False] and keys.count == 1
        client.set("text", b"hello")
        cases = [
            (client._stub.Add, pb.AddRequest(caller=client.caller, key="text", amount=1), "not an integer"),
            (client._stub.Keys, pb.KeysRequest(caller=client.caller, keys=["k"] * 1025), "at most 1024"),
            (client._stub.DeleteKey, pb.DeleteKeyRequest(caller=client.caller, key=""), "key length 0"),
            (client._stub.CompareSet, pb.CompareSetRequest(caller=client.caller, key="k" * 2000), "key length 2000"),
        ]
        for method, bad, words in cases:
            with pytest.raises(grpc.RpcError) as refused:
                method(bad, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
        with pytest.raises(gridcomm.ConfigError, match="not an integer"):
            client._op("add", pb.AddRequest(caller=client.caller, key="text", amount=1), "add", 10)
        with pytest.raises(grpc.RpcError) as waited:
            client._stub.Keys(pb.KeysRequest(caller=client.caller, keys=["late"], wait_s=0.3), timeout=10)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "'late'" in waited.value.details()
        assert client.get("c") == b"6"  # the coordinator is unharmed
    finally:
        client.leave()


# ---------------------------------------------------------------------- real torch, one process per rank
JOB = r"""
import datetime, os, torch, torch.distributed as dist, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
store = gridcomm.TorchStore(timeout_s=60)
dist.init_process_group("gloo", store=store, rank=store.rank, world_size=store.world_size,
                        timeout=datetime.timedelta(seconds=60))
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
assert x.item() == 6.0, x
group = dist.new_group([0, 2])                     # every rank calls it; ranks 0 and 2 are in it
if rank in (0, 2):
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=group)
    assert y.item() == 2.0, y
dist.barrier()
total = store.add("visits", 1)
dist.barrier()
assert store.get("visits") == b"3", store.get("visits")
winner = store.compare_set("leader", b"", str(rank).encode())
assert winner in (b"0", b"1", b"2"), winner
dist.barrier()
assert store.get("leader") == winner               # the losers were told the winner's value
assert store.check(["visits", "leader"]) and not store.check(["never"])
if rank == 0:
    try:
        store.wait(["never"], datetime.timedelta(seconds=1))
        raise AssertionError("wait returned")
    except dist.DistStoreError:
        pass
    for bad in (lambda: store.set(3, b"v"), lambda: store.add("visits", "1"), lambda: store.set("k", 3.5),
                lambda: store.wait("visits")):
        try:
            bad()
            raise AssertionError("accepted")
        except gridcomm.ConfigError:
            pass
dist.barrier()
dist.destroy_process_group()
store.close()
print("OK", rank, total, flush=True)
"""


def _env(port: int, **extra: str) -> dict[str, str]:
    return {"GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(port), "GRIDCOMM_BIND": "127.0.0.1",
            "GRIDCOMM_TOKEN": "torch-store-test", **extra}


@needs_torch
@pytest.mark.timeout(300)
def test_torch_gloo_new_group_and_init_barrier_over_torch_store():
    with RankProcesses(JOB, 3, env=_env(free_port(), TORCH_DIST_INIT_BARRIER="1")) as ranks:
        results = ranks.wait(240)
    assert_all_ok(results)
    assert sorted(int(r.stdout.split()[-1]) for r in results.values()) == [1, 2, 3], report(results)


KILLED = r"""
import datetime, os, time, torch, torch.distributed as dist, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
store = gridcomm.TorchStore(timeout_s=120)
dist.init_process_group("gloo", store=store, rank=store.rank, world_size=store.world_size)
dist.barrier()
if rank == 1:
    os._exit(9)                                    # dies without a word
started = time.monotonic()
try:
    store.get("never set")                         # would wait the store's 120 s
    raise AssertionError("get returned")
except gridcomm.RankFailedError as exc:
    print("FAILED", exc.rank, round(time.monotonic() - started, 1), flush=True)
store.close()
"""


@needs_torch
@pytest.mark.timeout(300)
def test_a_dead_rank_turns_a_peers_store_wait_into_rank_failed():
    with RankProcesses(KILLED, 2, env=_env(free_port(), GRIDCOMM_HEARTBEAT_TIMEOUT_S="5")) as ranks:
        results = ranks.wait(240)
    assert results[1].returncode == 9, report(results)
    assert results[0].returncode == 0 and "FAILED 1 " in results[0].stdout, report(results)
    assert float(results[0].stdout.split()[-1]) < 60, report(results)  # named, not waited out


# ---------------------------------------------------------------------- random keys and operations
@pytest.fixture(scope="module")
def store():
    if TORCH_PROBLEM is not None:
        pytest.skip(TORCH_PROBLEM)
    one = gridcomm.TorchStore("127.0.0.1", free_port(), rank=0, world_size=1, timeout_s=20)
    yield one
    one.close()


_TOUCHED: set[str] = set()


def _call(store, name: str, key: str, arg):
    if name == "compare_set":
        return store.compare_set(key, *arg)
    if name == "check":
        return store.check([key])
    return getattr(store, name)(key, *([] if arg is None else [arg]))


@needs_torch
@pytest.mark.timeout(300)
@settings(max_examples=int(os.environ.get("GRIDCOMM_FUZZ_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(fuzz_keys.operations, max_size=12))
def test_random_keys_and_operations_answer_as_a_dict_would(store, ops):
    model = fuzz_keys.Model()
    for key in _TOUCHED:  # what an earlier, failed example left
        store.delete_key(key)
    _TOUCHED.clear()
    touched = _TOUCHED
    for name, key, arg in ops:
        want = model.apply(name, key, arg)
        touched.add(key)
        if want is ValueError:
            with pytest.raises(gridcomm.ConfigError, match="not an integer"):
                store.add(key, arg)
            continue
        got = _call(store, name, key, arg)
        assert got == want, (name, key, arg)
    for key in touched:
        if key in model.kv:
            assert store.get(key) == model.kv[key]
        assert store.delete_key(key) is (key in model.kv)
    assert store.num_keys() == 0


@needs_torch
@given(key=fuzz_keys.too_long_keys)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_keys_out_of_bounds_are_refused_by_name(store, key):
    for call in (lambda: store.set(key, b"v"), lambda: store.add(key, 1), lambda: store.delete_key(key),
                 lambda: store.check([key])):
        with pytest.raises(gridcomm.ConfigError, match="key length"):
            call()
    assert store.check(["still-fine"]) is False


@needs_torch
def test_wait_past_its_timeout_raises_dist_store_error(store):
    with pytest.raises(dist.DistStoreError, match="not set"):
        store.wait(["nobody sets this"], datetime.timedelta(seconds=0.5))
    with pytest.raises(dist.DistStoreError):
        store.set_timeout(datetime.timedelta(seconds=0.5))
        try:
            store.get("nobody sets this either")
        finally:
            store.set_timeout(datetime.timedelta(seconds=20))


def test_without_torch_gridcomm_imports_and_torch_store_says_what_is_missing():
    code = ("import sys; sys.modules['torch'] = None\n"  # import torch fails, as where it is not installed
            "import gridcomm\nfrom gridcomm import *\n"
            "try:\n    gridcomm.TorchStore()\nexcept gridcomm.ConfigError as exc:\n    print('REFUSED', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.startswith("REFUSED gridcomm.TorchStore needs torch"), out
    assert "gridcomm[torch]" in out.stdout


@needs_torch
@pytest.mark.timeout(200)
def test_the_readmes_torch_example_runs_as_written_under_gridcomm_launch(tmp_path):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("### Torch jobs: gridcomm.TorchStore", 1)[1].split("\n### ", 1)[0]
    script = re.search(r"```python\n(.*?)```", section, re.S)
    assert script and script.group(1).startswith("# train_torch.py: gridcomm launch --nproc 2 train_torch.py")
    (tmp_path / "train_torch.py").write_text(script.group(1))
    out = subprocess.run([sys.executable, "-m", "gridcomm", "launch", "--nproc", "2", "train_torch.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"rank {rank}: [3.0, 3.0, 3.0, 3.0]" in out.stdout, out.stdout + out.stderr
