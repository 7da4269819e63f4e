"""Several ranks per GPU, the parts that need no GPU: where ``gridcomm launch`` puts each rank and
what NCCL settings it gives them (a real launcher and real rank processes, which print their
environment), and the ConfigError a rank gets when it shares a GPU without NCCL's multi-rank
mode (real marker files; the NCCL version is passed in, as the engine reads it on a GPU).
tests/test_gpu_ranks.py runs the ranks on one GPU for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

import gridcomm
from gridcomm._backends.nccl import sharing
from gridcomm._backends.nccl.backend import NcclBackend
from gridcomm._cli.launch import rank_environments
from gridcomm._cli.placement import gpu_sharing, placed_gpus

MODE = sharing.MODE_ENV


def _envs(nproc: int, devices: str, backend: str = "nccl", **extra: str) -> list[dict[str, str]]:
    environ = {"CUDA_VISIBLE_DEVICES": devices, **extra}
    return rank_environments(nproc, backend, 29500, environ, master_port=29501)


@pytest.mark.parametrize("nproc,devices,expected", [
    (4, "0", ["0", "0", "0", "0"]),
    (4, "3,5", ["3", "5", "3", "5"]),
    (3, "0,1", ["0", "1", "0"]),
])
def test_ranks_beyond_the_gpus_share_them_round_robin_in_nccls_mode(nproc, devices, expected):
    envs = _envs(nproc, devices)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == expected
    for env in envs:
        for name, value in MODE.items():
            assert env[name] == value


def test_a_gpu_per_rank_leaves_nccls_settings_alone():
    envs = _envs(2, "0,1")
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1"]
    assert not any(name in env for env in envs for name in MODE)


def test_the_users_own_nccl_settings_win():
    envs = _envs(4, "0", NCCL_MAX_CTAS="1", NCCL_MULTI_RANK_GPU_ENABLE="0")
    assert {env["NCCL_MAX_CTAS"] for env in envs} == {"1"}
    assert {env["NCCL_MULTI_RANK_GPU_ENABLE"] for env in envs} == {"0"}  # the backend refuses it, saying why
    assert {env["NCCL_NVLS_ENABLE"] for env in envs} == {"0"}


def test_the_host_backend_gets_no_nccl_settings():
    envs = _envs(4, "0", backend="host")
    assert not any(name in env for env in envs for name in MODE)
    assert gpu_sharing(4, ["0"], "host", {}) == ({}, None)


def test_gpus_flag_picks_the_first_n_visible_and_zero_places_none():
    environ = {"CUDA_VISIBLE_DEVICES": "2,4,6"}
    assert placed_gpus(environ) == ["2", "4", "6"]
    assert placed_gpus(environ, 1) == ["2"]
    assert placed_gpus(environ, 0) == []
    envs = rank_environments(2, "nccl", 29500, environ, master_port=29501, gpus=[])
    assert {env["CUDA_VISIBLE_DEVICES"] for env in envs} == {"2,4,6"}  # as the launcher had it
    with pytest.raises(gridcomm.ConfigError, match=r"--gpus=4, but only 3 GPU\(s\) are visible"):
        placed_gpus(environ, 4)
    with pytest.raises(gridcomm.ConfigError, match=r"--gpus=-1 must be"):
        placed_gpus(environ, -1)


_PRINT_ENV = textwrap.dedent("""
    import json, os
    names = ["GRIDCOMM_RANK", "CUDA_VISIBLE_DEVICES", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_MAX_CTAS"]
    print(json.dumps({n: os.environ.get(n) for n in names}))
""")


def test_launch_places_its_rank_processes_and_says_so_in_one_line(tmp_path):
    script = tmp_path / "show_env.py"
    script.write_text(_PRINT_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GRIDCOMM_"))}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    done = subprocess.run([sys.executable, "-m", "gridcomm", "launch", "--nproc", "3", "--backend", "nccl",
                           str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        seen[prefix] = json.loads(rest)
    assert sorted(seen) == ["[rank 0", "[rank 1", "[rank 2"]
    for rank in range(3):
        assert seen[f"[rank {rank}"] == {"GRIDCOMM_RANK": str(rank), "CUDA_VISIBLE_DEVICES": "0",
                                         "NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0",
                                         "NCCL_MAX_CTAS": "2"}
    said = [line for line in done.stderr.splitlines() if "several-ranks-per-GPU" in line]
    assert len(said) == 1
    assert "3 ranks on 1 GPU (0), up to 3 per GPU" in said[0] and "NCCL >= 2.30" in said[0]


# ---------------------------------------------------------------------- the backend's check
UID = bytes(range(128))


def test_version_codes_read_as_versions():
    assert sharing.version_text(23206) == "2.32.6"
    assert sharing.version_text(22809) == "2.28.9"
    assert sharing.version_text(2708) == "2.7.8"


def test_a_second_rank_on_a_gpu_without_the_mode_gets_a_config_error_naming_the_fix(tmp_path):
    first = sharing.check(UID, "0000:1b:00.0", 0, 2, 23206, environ={}, root=str(tmp_path))
    assert first is not None
    with pytest.raises(gridcomm.ConfigError) as info:
        sharing.check(UID, "0000:1b:00.0", 1, 2, 23206, environ={}, root=str(tmp_path))
    message = str(info.value)
    assert "rank 1 of 2 shares GPU 0000:1b:00.0 with rank 0" in message
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in message and "2.32.6" in message
    assert "gridcomm[cuda13]" in message
    first.remove()
    assert os.listdir(tmp_path) == []  # the refused rank's marker went with its error; the last one out takes the folder


def test_an_nccl_older_than_2_30_is_named_even_with_the_mode_on(tmp_path):
    on = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    first = sharing.check(UID, "0000:1b:00.0", 0, 4, 22809, environ=on, root=str(tmp_path))
    with pytest.raises(gridcomm.ConfigError, match=r"NCCL \(2\.28\.9\) cannot run several ranks on one GPU: NCCL >= 2\.30"):
        sharing.check(UID, "0000:1b:00.0", 3, 4, 22809, environ=on, root=str(tmp_path))
    assert first is not None
    first.remove()


def test_with_the_mode_on_nccl_2_30_ranks_share_and_other_gpus_or_jobs_never_clash(tmp_path):
    on = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    markers = [sharing.check(UID, "0000:1b:00.0", r, 4, 23206, environ=on, root=str(tmp_path)) for r in range(4)]
    # Without the mode: another GPU, or another communicator (another unique ID) on the same GPU, is no clash.
    other_gpu = sharing.check(UID, "0000:2c:00.0", 0, 2, 22809, environ={}, root=str(tmp_path))
    other_job = sharing.check(bytes(128), "0000:1b:00.0", 0, 2, 22809, environ={}, root=str(tmp_path))
    assert sharing.check(UID, "0000:1b:00.0", 0, 1, 22809, environ={}, root=str(tmp_path)) is None  # one rank
    for marker in [*markers, other_gpu, other_job]:
        assert marker is not None
        marker.remove()
        marker.remove()  # idempotent
    assert os.listdir(tmp_path) == []


def test_the_backend_removes_its_marker_at_destroy_and_at_abort(tmp_path):
    for end in ("destroy", "abort"):
        marker = sharing.check(UID, "0000:1b:00.0", 0, 2, 23206, environ={}, root=str(tmp_path))
        assert marker is not None and os.path.exists(marker.path)
        backend = object.__new__(NcclBackend)
        backend._owner = SimpleNamespace(destroy=lambda: None, abort=lambda: None)
        backend._engine = SimpleNamespace(null=None)
        backend.rank, backend.world_size, backend.engine, backend._marker = 0, 2, "cupy", marker
        getattr(backend, end)()
        assert not os.path.exists(marker.path)
        assert os.listdir(tmp_path) == []
