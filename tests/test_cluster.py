"""Cluster detection with plain inputs: a fake environment and host names, no network."""

from __future__ import annotations

import dataclasses
import doctest
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gridcomm import _config
from gridcomm._config import cluster as _cluster
from gridcomm._config import format_relay_address
from gridcomm._config.cluster import ClusterInfo, detect
from gridcomm._config.settings import ClientSettings
from gridcomm._errors import ConfigError
from tests.support.procs import ROOT

NS = "ns.svc.cluster.local"


def pod(job: str, index: int, subdomain: str | None, **env: str) -> ClusterInfo:
    """What an Indexed Job pod named <job>-<index> in <subdomain> would detect."""
    hostname = f"{job}-{index}"
    fqdn = hostname if subdomain is None else f"{hostname}.{subdomain}.{NS}"
    return detect({"JOB_COMPLETION_INDEX": str(index), **env}, hostname=hostname, fqdn=fqdn)


# --- Kubernetes Indexed Job ---------------------------------------------------------------------

def test_indexed_job_rank_and_coordinator_from_hostname_and_subdomain():
    info = pod("train", 3, "train-svc", GRIDCOMM_WORLD_SIZE="8")
    assert info == ClusterInfo(3, 8, f"train-0.train-svc.{NS}", 13333, 0, "kubernetes")


def test_the_relay_tree_addresses_are_every_group_leaders_pod_name():
    # Rank 40's group (fan-in 32) is led by rank 32, pod train-32 of the same Job and Service; the
    # manifests give GRIDCOMM_HOST, which does not stop the pods' names from being known.
    template = pod("train", 40, "svc", GRIDCOMM_WORLD_SIZE="256").relay_addresses
    assert format_relay_address(template, 32, 1) == f"train-32.svc.{NS}:13336"
    given = pod("train", 40, "svc", GRIDCOMM_WORLD_SIZE="256", GRIDCOMM_HOST="train-0.svc").relay_addresses
    assert given == template
    js = jobset_pod("js", "w", 0, 40, "js", GRIDCOMM_WORLD_SIZE="64", GRIDCOMM_RELAY="on").relay_addresses
    assert format_relay_address(js, 32, 1) == f"js-w-0-32.js.{NS}:13336"
    # Nothing where no tree is used (below 256 ranks by default, or GRIDCOMM_RELAY=off), where a
    # group could span the jobs of a JobSet, or where the pods have no DNS subdomain.
    assert pod("train", 3, "svc", GRIDCOMM_WORLD_SIZE="255").relay_addresses is None
    assert pod("train", 3, "svc", GRIDCOMM_WORLD_SIZE="512", GRIDCOMM_RELAY="off").relay_addresses is None
    assert jobset_pod("js", "w", 1, 2, "js", GRIDCOMM_WORLD_SIZE="512",
                      JOBSET_REPLICATED_JOB_REPLICAS="2").relay_addresses is None
    assert pod("train", 2, None, GRIDCOMM_WORLD_SIZE="512", GRIDCOMM_HOST="c.example").relay_addresses is None


def test_an_explicit_relay_template_wins_and_a_bad_one_is_named_at_start():
    env = {"GRIDCOMM_WORLD_SIZE": "64", "GRIDCOMM_RANK": "3", "GRIDCOMM_HOST": "c",
           "GRIDCOMM_RELAY_ADDRESSES": "10.0.0.{group}:7000"}
    assert ClientSettings.resolve(environ=env).relay_addresses == "10.0.0.{group}:7000"
    for bad, message in [("10.0.0.1:7000", "names no relay per group"), ("h-{rank}:1", "KeyError"),
                         ("h-{leader}", "gives 'h-0'"), ("h-{leader:x}.{group:q}:1", "ValueError"),
                         ("h-{leader}:99999", "gives 'h-0:99999'")]:
        with pytest.raises(ConfigError, match=message):
            ClientSettings.resolve(environ={**env, "GRIDCOMM_RELAY_ADDRESSES": bad})


def test_indexed_job_rank_zero_names_itself():
    assert pod("train", 0, "svc", GRIDCOMM_WORLD_SIZE="2").host == f"train-0.svc.{NS}"


def test_job_names_with_dashes_and_digits_keep_everything_but_the_index():
    info = pod("llm-run-2", 5, "svc", GRIDCOMM_WORLD_SIZE="6")
    assert (info.rank, info.host) == (5, f"llm-run-2-0.svc.{NS}")


def test_subdomain_from_environment_wins_over_fqdn():
    info = detect({"JOB_COMPLETION_INDEX": "1", "GRIDCOMM_WORLD_SIZE": "2", "GRIDCOMM_SUBDOMAIN": "svc"},
                  hostname="job-1", fqdn="job-1.elsewhere.example")
    assert info.host == "job-0.svc"


def test_gridcomm_host_and_port_win_over_derived_name():
    info = pod("train", 2, None, GRIDCOMM_WORLD_SIZE="4", GRIDCOMM_HOST="coord.example", GRIDCOMM_PORT="4000")
    assert (info.host, info.port, info.rank, info.source) == ("coord.example", 4000, 2, "kubernetes")


def test_hostname_that_does_not_end_in_the_index_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"'worker-a'.*JOB_COMPLETION_INDEX=1.*GRIDCOMM_HOST"):
        detect({"JOB_COMPLETION_INDEX": "1", "GRIDCOMM_WORLD_SIZE": "2"}, hostname="worker-a", fqdn="worker-a.s.x")
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX=1"):
        detect({"JOB_COMPLETION_INDEX": "1", "GRIDCOMM_WORLD_SIZE": "2"}, hostname="train-2", fqdn="train-2.s.x")


def test_pod_without_subdomain_is_told_to_set_one():
    with pytest.raises(ConfigError, match=r"no DNS subdomain.*spec\.template\.spec\.subdomain"):
        pod("train", 1, None, GRIDCOMM_WORLD_SIZE="2")


def test_indexed_job_needs_the_world_size():
    with pytest.raises(ConfigError, match="GRIDCOMM_WORLD_SIZE"):
        pod("train", 1, "svc")


def test_index_beyond_world_size_is_refused():
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX=4 is out of range for world size 4"):
        pod("train", 4, "svc", GRIDCOMM_WORLD_SIZE="4")


def test_bad_index_text_is_quoted():
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX='x'"):
        detect({"JOB_COMPLETION_INDEX": "x", "GRIDCOMM_WORLD_SIZE": "2"}, hostname="t-x", fqdn="t-x.s")


dns_label = st.from_regex(r"\A[a-z]([-a-z0-9]{0,20}[a-z0-9])?\Z")


@given(job=dns_label, service=dns_label, size=st.integers(1, 512), data=st.data())
def test_any_valid_job_and_service_name_round_trips(job: str, service: str, size: int, data: st.DataObject):
    index = data.draw(st.integers(0, size - 1))
    info = pod(job, index, service, GRIDCOMM_WORLD_SIZE=str(size))
    assert (info.rank, info.world_size, info.host) == (index, size, f"{job}-0.{service}.{NS}")


# --- JobSet ----------------------------------------------------------------------------------------

def jobset_pod(js: str, rjob: str, job_index: int, pod_index: int, subdomain: str | None = None, **env: str):
    hostname = f"{js}-{rjob}-{job_index}-{pod_index}"
    fqdn = hostname if subdomain is None else f"{hostname}.{subdomain}.{NS}"
    environ = {"JOB_COMPLETION_INDEX": str(pod_index), "JOBSET_NAME": js, **env}
    return detect(environ, hostname=hostname, fqdn=fqdn)


def test_jobset_pod_rank_and_coordinator():
    info = jobset_pod("js", "workers", 0, 3, "js", GRIDCOMM_WORLD_SIZE="4")
    assert info == ClusterInfo(3, 4, f"js-workers-0-0.js.{NS}", 13333, 0, "jobset")


def test_jobset_ranks_across_replicated_jobs():
    env = {"GRIDCOMM_WORLD_SIZE": "8", "JOBSET_REPLICATED_JOB_REPLICAS": "2"}
    ranks = sorted(jobset_pod("my-js", "work-ers", j, p, "my-js", **env).rank for j in range(2) for p in range(4))
    assert ranks == list(range(8))
    info = jobset_pod("my-js", "work-ers", 1, 2, "my-js", **env)
    assert (info.rank, info.host) == (6, f"my-js-work-ers-0-0.my-js.{NS}")


def test_jobset_without_fqdn_subdomain_uses_the_jobset_name():
    assert jobset_pod("js", "w", 0, 1, None, GRIDCOMM_WORLD_SIZE="2").host == "js-w-0-0.js"


def test_jobset_hostname_of_another_jobset_is_refused():
    with pytest.raises(ConfigError, match="does not look like a pod of JobSet 'other'"):
        detect({"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "other", "GRIDCOMM_WORLD_SIZE": "2"},
               hostname="js-w-0-1", fqdn="js-w-0-1.js.x")


def test_jobset_world_size_must_split_evenly_over_replicas():
    with pytest.raises(ConfigError, match="not a multiple of the 2 replicas"):
        jobset_pod("js", "w", 0, 1, "js", GRIDCOMM_WORLD_SIZE="5", JOBSET_REPLICATED_JOB_REPLICAS="2")
    with pytest.raises(ConfigError, match="outside 2 jobs of 2 pods"):
        jobset_pod("js", "w", 0, 2, "js", GRIDCOMM_WORLD_SIZE="4", JOBSET_REPLICATED_JOB_REPLICAS="2")


# --- torchrun and Kubeflow ---------------------------------------------------------------------------

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "master.example", "MASTER_PORT": "29500"}


def test_torchrun_variables():
    assert detect(TORCHRUN, hostname="h") == ClusterInfo(5, 8, "master.example", 29500, 1, "torchrun")


def test_torchrun_agent_store_keeps_master_port_so_the_coordinator_takes_another():
    agent = {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "run-a"}
    info = detect(agent, hostname="h")
    assert info.host == "master.example" and 20000 <= info.port < 32000 and info.port != 29500
    # Every rank of the job derives the same port; another job (its own store port or run id) another.
    assert detect({**agent, "RANK": "0", "LOCAL_RANK": "0"}, hostname="other").port == info.port
    assert detect({**agent, "MASTER_PORT": "29501"}, hostname="h").port != info.port
    assert detect({**agent, "TORCHELASTIC_RUN_ID": "run-b"}, hostname="h").port != info.port
    info = detect({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True", "GRIDCOMM_PORT": "7000"}, hostname="h")
    assert info.port == 7000


def test_torchrun_inside_an_indexed_job_numbers_processes_itself():
    info = detect({**TORCHRUN, "JOB_COMPLETION_INDEX": "2", "GRIDCOMM_WORLD_SIZE": "8"}, hostname="t-2", fqdn="t-2.s")
    assert (info.rank, info.source) == (5, "torchrun")


def test_gridcomm_world_size_wins_over_torchrun_world_size():
    assert detect({**TORCHRUN, "GRIDCOMM_WORLD_SIZE": "16"}, hostname="h").world_size == 16


PET = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "3", "LOCAL_RANK": "1",
       "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}


def test_kubeflow_pet_variables_number_ranks_like_torchrun():
    assert detect(PET, hostname="h") == ClusterInfo(7, 8, "job-master-0", 23456, 1, "kubeflow")


def test_kubeflow_without_local_rank_and_with_a_fixed_range():
    info = detect({**PET, "LOCAL_RANK": "", "PET_NNODES": "4:4"}, hostname="h")
    assert (info.rank, info.world_size, info.local_rank) == (6, 8, 0)


def test_kubeflow_gridcomm_address_wins():
    info = detect({**PET, "GRIDCOMM_HOST": "c.example", "GRIDCOMM_PORT": "1234"}, hostname="h")
    assert (info.host, info.port) == ("c.example", 1234)


@pytest.mark.parametrize("name, value, message", [
    ("PET_NNODES", "2:4", "elastic range"),
    ("PET_NPROC_PER_NODE", "auto", "PET_NPROC_PER_NODE='auto' is not an integer"),
    ("LOCAL_RANK", "2", "local rank 2 is out of range for PET_NPROC_PER_NODE=2"),
])
def test_kubeflow_values_gridcomm_cannot_use(name: str, value: str, message: str):
    with pytest.raises(ConfigError, match=message):
        detect({**PET, name: value}, hostname="h")


# --- explicit GRIDCOMM_* and the registry ---------------------------------------------------------------

def test_explicit_gridcomm_rank_wins_over_every_convention():
    env = {"GRIDCOMM_RANK": "1", "GRIDCOMM_WORLD_SIZE": "3", "JOB_COMPLETION_INDEX": "2", **TORCHRUN}
    info = detect(env, hostname="t-2", fqdn="t-2.s")
    assert (info.rank, info.world_size, info.host, info.source) == (1, 3, "master.example", "gridcomm")


def test_explicit_defaults_to_cupyx_address():
    info = detect({"GRIDCOMM_RANK": "0", "GRIDCOMM_WORLD_SIZE": "1"}, hostname="h")
    assert info == ClusterInfo(0, 1, _config.DEFAULT_HOST, _config.DEFAULT_PORT, 0, "gridcomm")


def test_nothing_to_detect_says_what_was_looked_for():
    with pytest.raises(ConfigError, match="GRIDCOMM_RANK.*RANK and WORLD_SIZE.*PET_NODE_RANK.*JOB_COMPLETION_INDEX"):
        detect({"WORLD_SIZE": "2", "GRIDCOMM_HOST": "x"}, hostname="h")


def test_empty_values_count_as_unset():
    with pytest.raises(ConfigError, match="cannot tell this process's rank"):
        detect({"GRIDCOMM_RANK": " ", "JOB_COMPLETION_INDEX": "", "RANK": ""}, hostname="h")


def test_registry_order_and_names():
    assert [d.name for d in _cluster.DETECTORS] == ["gridcomm", "torchrun", "kubeflow", "jobset", "kubernetes"]
    assert not any(d.present({}) for d in _cluster.DETECTORS)


def test_cluster_info_is_frozen_and_checked():
    info = ClusterInfo(0, 1, "h", 1, 0, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="rank 2 is out of range for world size 2"):
        ClusterInfo(2, 2, "h", 1, 0, "x")


def test_docstring_example():
    assert doctest.testmod(_cluster, raise_on_error=True).attempted >= 1


def test_process_environment_is_read_through_config():
    assert _config.process_environ() is os.environ
    code = ("from gridcomm._config import cluster; "
            "print(cluster.detect(hostname='t-1', fqdn='t-1.svc.ns.svc.cluster.local'))")
    env = dict(os.environ, PYTHONPATH=ROOT, JOB_COMPLETION_INDEX="1", GRIDCOMM_WORLD_SIZE="2")
    for name in ("GRIDCOMM_RANK", "RANK", "PET_NODE_RANK", "GRIDCOMM_HOST", "MASTER_ADDR", "CUPYX_DISTRIBUTED_HOST"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "rank=1, world_size=2, host='t-0.svc.ns.svc.cluster.local'" in out.stdout
