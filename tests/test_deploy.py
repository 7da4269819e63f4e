"""Offline checks of deploy/: every manifest against yamllint, the Kubernetes API schemas and the
JobSet CRD, and the cross-field facts schemas cannot see (names that must agree, ports, env names
the library reads, exit codes the failure policy relies on); every pod template against the Pod
Security Standards' "restricted" profile (our own table of its controls), and each layout's
NetworkPolicy against who must and must not reach each port; and, as root, the example program
under a read-only root filesystem with only the manifests' volumes writable.

Each check runs on the committed manifests and on the generator's output for other values, so a
template that only works for the defaults fails here.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from gridcomm import _config
from gridcomm._cli import main as _cli
from gridcomm._config import cluster as _cluster
from tests.support import k8s_jobs
from tests.support.procs import ROOT, free_port

DEPLOY = os.path.join(ROOT, "deploy")
#: The folders of deploy/k8s that each run a job (one `kubectl apply -f` each).
LAYOUTS = ("job", "jobset", "recoverable")
K8S = os.path.join(DEPLOY, "k8s")
CRD = os.path.join(ROOT, "tests", "data", "jobset-crd.yaml")  # see tests/data/README.md
NAMESPACE_DOMAIN = "team-a.svc.cluster.local"


def _load_module(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_module("gridcomm_deploy_generate", os.path.join(K8S, "generate.py"))
train = _load_module("gridcomm_deploy_train", os.path.join(DEPLOY, "docker", "train.py"))
K8S_VERSIONS = [generate.MIN_KUBERNETES, kubernetes_validate.latest_version()]

CUSTOM_ARGS = ["--name", "llm-train", "--service", "llm-net", "--world-size", "16", "--image",
               "registry.example.com/team/llm@sha256:" + "a" * 64, "--backend", "host", "--replicated-job", "gpu-workers",
               "--monitoring-namespace", "observability"]


def _committed() -> dict[str, str]:
    files = {}
    for folder, _dirs, names in os.walk(K8S):
        for name in names:
            if name.endswith((".yaml", ".yml")):
                path = os.path.join(folder, name)
                files[os.path.relpath(path, K8S)] = open(path, encoding="utf-8").read()
    return dict(sorted(files.items()))


def _rendered(argv: list[str]) -> dict[str, str]:
    args = generate.parser().parse_args(argv)
    args.service = args.service or args.name
    return generate.render(args)


SETS = {"committed": _committed(), "custom": _rendered(CUSTOM_ARGS)}


def _docs(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


class Manifests:
    """One set of files, parsed: the headless Service, the Job, the JobSet, the metrics Services
    (one per variant) and the ServiceMonitor."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.by_file = {name: _docs(text) for name, text in files.items()}
        self.docs = [doc for docs in self.by_file.values() for doc in docs]
        assert sorted(self.by_file) == sorted(generate.LAYOUT), sorted(self.by_file)
        one = {name: docs[0] for name, docs in self.by_file.items() if len(docs) == 1}
        assert len(one) == len(self.by_file), "one object per file"
        self.service, self.job = one["job/service.yaml"], one["job/job.yaml"]
        self.job_metrics, self.jobset_metrics = one["job/metrics-service.yaml"], one["jobset/metrics-service.yaml"]
        self.jobset, self.servicemonitor = one["jobset/jobset.yaml"], one["monitoring/servicemonitor.yaml"]
        (self.rjob,) = self.jobset["spec"]["replicatedJobs"]
        self.coordinator, self.coordinator_service = one["recoverable/coordinator.yaml"], one["recoverable/coordinator-service.yaml"]
        self.checkpoints, self.recoverable_job = one["recoverable/checkpoints.yaml"], one["recoverable/job.yaml"]
        self.recoverable_metrics = one["recoverable/metrics-service.yaml"]
        self.network_policies = {folder: one[f"{folder}/network-policy.yaml"] for folder in LAYOUTS}

    def pod_specs(self) -> Iterator[tuple[str, dict]]:
        yield "Job", self.job["spec"]["template"]["spec"]
        yield "JobSet", self.rjob["template"]["spec"]["template"]["spec"]


@pytest.fixture(params=sorted(SETS))
def m(request: pytest.FixtureRequest) -> Manifests:
    return Manifests(SETS[request.param])


def _worker(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def _literal_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


# --- the generator --------------------------------------------------------------------------------

def test_committed_manifests_are_the_generators_output_with_defaults():
    assert SETS["committed"] == _rendered([]), "run: python deploy/k8s/generate.py --out deploy/k8s"


@pytest.mark.parametrize("argv, message", [
    (["--name", "Train"], "DNS label"),
    (["--service", "1svc"], "DNS label"),
    (["--name", "a" * 60, "--world-size", "100"], "longer than 63"),
    (["--world-size", "0"], "at least 1"),
    (["--image", "bad image"], "image reference"),
    (["--backend", "mpi"], "one of auto, nccl, host"),
    (["--monitoring-namespace", "Prometheus"], "namespace name"),
])
def test_generator_refuses_values_kubernetes_would_reject(argv: list[str], message: str):
    with pytest.raises(SystemExit, match=message):
        _rendered(argv)


def test_generator_backends_are_the_librarys():
    assert tuple(generate.BACKENDS) == _config.BACKENDS


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, kinds", [([], ["Service", "Job", "Service", "NetworkPolicy"]),
                                          (["--jobset"], ["JobSet", "Service", "NetworkPolicy"]),
                                          (["--servicemonitor"], ["ServiceMonitor"]),
                                          (["--recoverable"], ["Deployment", "Service", "PersistentVolumeClaim", "Job",
                                                               "Service", "NetworkPolicy"])])
def test_generator_command_line_prints_what_kubectl_applies(extra: list[str], kinds: list[str]):
    out = subprocess.run([sys.executable, os.path.join(K8S, "generate.py"), "--name", "demo", "--world-size", "3", *extra],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert sorted(d["kind"] for d in docs) == sorted(kinds)
    assert {d["metadata"]["name"] for d in docs} <= {"demo", "demo-metrics", "demo-coordinator", "demo-checkpoints"}


def test_one_folder_per_kubectl_apply():
    """`kubectl apply -f deploy/k8s/` applies nothing (no YAML at the top); `-f deploy/k8s/job/` the
    Indexed Job without the JobSet, and the other way round; no folder holds a Secret."""
    assert not [n for n in os.listdir(K8S) if n.endswith((".yaml", ".yml", ".json"))]
    kinds = {folder: sorted(d["kind"] for name, text in SETS["committed"].items() if name.startswith(folder + "/")
                            for d in _docs(text)) for folder in ("job", "jobset", "monitoring", "recoverable")}
    assert kinds == {"job": ["Job", "NetworkPolicy", "Service", "Service"], "jobset": ["JobSet", "NetworkPolicy", "Service"],
                     "monitoring": ["ServiceMonitor"],
                     "recoverable": ["Deployment", "Job", "NetworkPolicy", "PersistentVolumeClaim", "Service", "Service"]}
    assert not any(d["kind"] == "Secret" for text in SETS["committed"].values() for d in _docs(text))


@pytest.mark.timeout(60)
def test_generator_out_makes_missing_folders_and_says_when_it_cannot(tmp_path):
    target = tmp_path / "new" / "deeper"
    made = subprocess.run([sys.executable, os.path.join(K8S, "generate.py"), "--out", str(target)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*.yaml")) == sorted(generate.LAYOUT)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    refused = subprocess.run([sys.executable, os.path.join(K8S, "generate.py"), "--out", str(blocker)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--out" in refused.stderr and "cannot write" in refused.stderr, refused.stderr


# --- schemas ----------------------------------------------------------------------------------------

def test_yamllint_clean():
    config = YamlLintConfig(file=os.path.join(DEPLOY, ".yamllint.yaml"))
    texts = {f"custom/{k}": v for k, v in SETS["custom"].items()}
    for folder, _dirs, names in os.walk(DEPLOY):
        for name in names:
            if name.endswith((".yaml", ".yml")):
                path = os.path.join(folder, name)
                texts[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    problems = [f"{name}:{p.line}:{p.column} {p.level} {p.desc} ({p.rule})"
                for name, text in texts.items() for p in linter.run(text, config)]
    assert not problems, "\n".join(problems)


def test_yamllint_can_fail():
    config = YamlLintConfig(file=os.path.join(DEPLOY, ".yamllint.yaml"))
    assert list(linter.run("---\nkey: value\nkey: again\n", config))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_strictly(m: Manifests, version: str):
    for doc in (m.service, m.job, m.job_metrics, m.jobset_metrics, m.network_policies["job"],
                m.network_policies["jobset"]):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_stated_minimum_kubernetes_is_the_minimum(m: Manifests):
    """The release before MIN_KUBERNETES rejects the Job, so the stated minimum is not too low to
    be true nor higher than it needs to be (deploy/README.md states it)."""
    major, minor = generate.MIN_KUBERNETES.split(".")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(m.job, f"{major}.{int(minor) - 1}", strict=True)
    readme = open(os.path.join(DEPLOY, "README.md"), encoding="utf-8").read()
    assert f"Kubernetes {generate.MIN_KUBERNETES}" in readme and f"JobSet {generate.MIN_JOBSET}" in readme


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_jobsets_job_template_is_a_valid_job(m: Manifests, version: str):
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "child"}, "spec": m.rjob["template"]["spec"]}
    kubernetes_validate.validate(job, version, strict=True)


@pytest.mark.parametrize("path, value", [
    (("spec", "template", "spec", "containers", 0, "readinesProbe"), {}),
    (("spec", "completions"), "two"),
    (("spec", "podFailurePolicy", "rules", 1, "onExitCodes", "values"), "2"),
])
def test_strict_validation_catches_typos_and_types(m: Manifests, path: tuple, value: object):
    job = copy.deepcopy(m.job)
    node: Any = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


def _closed(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever it lists properties (what the API server's
    pruning would silently drop)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def jobset_validator() -> jsonschema.protocols.Validator:
    with open(CRD, encoding="utf-8") as handle:
        crd = yaml.safe_load(handle)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return jsonschema.Draft4Validator(_closed(version["schema"]["openAPIV3Schema"]))


def test_jobset_matches_the_crd_schema(m: Manifests, jobset_validator: jsonschema.protocols.Validator):
    assert m.jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in jobset_validator.iter_errors(m.jobset)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("mutate", [
    lambda js: js["spec"]["network"].update(enableDnsHostnames=True),
    lambda js: _worker(js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]).update(imagePullPolicy=3),
    lambda js: js["spec"]["failurePolicy"].update(restartStrategy="Sometimes"),
    lambda js: js["spec"].update(replicatedJob=[]),
])
def test_jobset_schema_rejects_unknown_fields_and_bad_values(m: Manifests, jobset_validator, mutate):
    jobset = copy.deepcopy(m.jobset)
    mutate(jobset)
    assert list(jobset_validator.iter_errors(jobset))


# --- what the schemas cannot see ---------------------------------------------------------------------

def test_headless_service_selects_the_jobs_pods_and_is_their_subdomain(m: Manifests):
    spec = m.service["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    pod = m.job["spec"]["template"]
    assert pod["spec"]["subdomain"] == m.service["metadata"]["name"]
    assert spec["selector"].items() <= pod["metadata"]["labels"].items()
    names = {p["name"] for p in _worker(pod["spec"])["ports"]}
    assert {p["targetPort"] for p in spec["ports"]} <= names


def test_jobset_makes_its_own_headless_service(m: Manifests):
    network = m.jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True and network.get("publishNotReadyAddresses", True) is True
    # The JobSet controller sets hostname and subdomain itself; one set by hand would disagree.
    assert "subdomain" not in m.rjob["template"]["spec"]["template"]["spec"]


def test_pod_count_equals_world_size(m: Manifests):
    spec = m.job["spec"]
    size = int(_literal_env(_worker(spec["template"]["spec"]))["GRIDCOMM_WORLD_SIZE"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == size
    child = m.rjob["template"]["spec"]
    size = int(_literal_env(_worker(child["template"]["spec"]))["GRIDCOMM_WORLD_SIZE"])
    assert child["completionMode"] == "Indexed" and child["completions"] == child["parallelism"]
    assert m.rjob["replicas"] * child["parallelism"] == size


def test_coordinator_address_is_rank_zeros_dns_name(m: Manifests):
    job_env = _literal_env(_worker(m.job["spec"]["template"]["spec"]))
    assert job_env["GRIDCOMM_HOST"] == f"{m.job['metadata']['name']}-0.{m.service['metadata']['name']}"
    js = m.jobset["metadata"]["name"]
    subdomain = m.jobset["spec"]["network"].get("subdomain", js)
    js_env = _literal_env(_worker(m.rjob["template"]["spec"]["template"]["spec"]))
    assert js_env["GRIDCOMM_HOST"] == f"{js}-{m.rjob['name']}-0-0.{subdomain}"


def test_probes_use_container_ports_and_distinct_services(m: Manifests):
    for where, pod_spec in m.pod_specs():
        container = _worker(pod_spec)
        ports = {p["containerPort"] for p in container["ports"]} | {p["name"] for p in container["ports"]}
        env = _literal_env(container)
        health = _config.health_port(environ=env)
        _, coordinator = _config.coordinator_address(environ=env)
        assert {health, coordinator, _config.metrics_port(environ=env)} <= ports, where
        probes = {kind: container[kind]["grpc"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert all(p["port"] == health for p in probes.values()), (where, probes)
        assert probes["livenessProbe"]["service"] == "" and probes["readinessProbe"]["service"] == "gridcomm.v1.Coordinator"


def test_every_env_name_is_one_gridcomm_reads(m: Manifests):
    read = set(_cluster.ENV_NAMES) | _string_constants(os.path.join(ROOT, "gridcomm", "_config", "readers.py"))
    for where, pod_spec in m.pod_specs():
        names = {e["name"] for e in _worker(pod_spec)["env"]}
        assert names <= read, (where, sorted(names - read))


def _string_constants(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _kubelet_env(container: dict, index: int, labels: dict[str, str],
                 annotations: dict[str, str]) -> dict[str, str]:
    """The environment the kubelet would give this container in the pod of completion index
    ``index``: literal values, downward-API fields and JOB_COMPLETION_INDEX."""
    env = {"JOB_COMPLETION_INDEX": str(index)}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        source = item["valueFrom"]
        path = source["fieldRef"]["fieldPath"]
        found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        assert found, f"unexpected fieldPath {path}"
        table = labels if found.group(1) == "labels" else annotations
        assert found.group(2) in table, f"{path} is not set on the pod by Kubernetes or JobSet"
        env[item["name"]] = table[found.group(2)]
    return env


def test_every_pod_of_the_job_detects_its_rank_and_rank_zero(m: Manifests):
    job, service = m.job["metadata"]["name"], m.service["metadata"]["name"]
    container = _worker(m.job["spec"]["template"]["spec"])
    size = m.job["spec"]["completions"]
    for index in range(size):
        labels = {"batch.kubernetes.io/controller-uid": "0c6f-uid", "batch.kubernetes.io/job-name": job,
                  "batch.kubernetes.io/job-completion-index": str(index)}
        env = _kubelet_env(container, index, labels, {"batch.kubernetes.io/job-completion-index": str(index)})
        hostname = f"{job}-{index}"
        fqdn = f"{hostname}.{service}.{NAMESPACE_DOMAIN}"
        info = _cluster.detect(env, hostname=hostname, fqdn=fqdn)
        assert (info.rank, info.world_size, info.source) == (index, size, "kubernetes")
        assert (info.host, info.port) == (env["GRIDCOMM_HOST"], _config.DEFAULT_PORT)
        # Without GRIDCOMM_HOST the detector derives the same pod's fully qualified name.
        derived = _cluster.detect({k: v for k, v in env.items() if k != "GRIDCOMM_HOST"}, hostname=hostname, fqdn=fqdn)
        assert derived.host == f"{env['GRIDCOMM_HOST']}.{NAMESPACE_DOMAIN}"
        _check_settings(env, container)


@pytest.mark.parametrize("replicas", [1, 3])
def test_every_pod_of_the_jobset_detects_its_rank_and_rank_zero(m: Manifests, replicas: int):
    js, rjob = m.jobset["metadata"]["name"], m.rjob["name"]
    subdomain = m.jobset["spec"]["network"].get("subdomain", js)
    child = m.rjob["template"]["spec"]
    container = copy.deepcopy(_worker(child["template"]["spec"]))
    per_job = child["parallelism"]
    # Raising `replicas` is documented as all it takes, besides the world size.
    for item in container["env"]:
        if item["name"] == "GRIDCOMM_WORLD_SIZE":
            item["value"] = str(replicas * per_job)
    ranks = []
    for job_index in range(replicas):
        for index in range(per_job):
            labels = {"jobset.sigs.k8s.io/jobset-name": js, "jobset.sigs.k8s.io/jobset-uid": "7d1e-uid",
                      "jobset.sigs.k8s.io/replicatedjob-name": rjob, "jobset.sigs.k8s.io/job-index": str(job_index)}
            annotations = {**labels, "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicas)}
            env = _kubelet_env(container, index, labels, annotations)
            hostname = f"{js}-{rjob}-{job_index}-{index}"
            info = _cluster.detect(env, hostname=hostname, fqdn=f"{hostname}.{subdomain}.{NAMESPACE_DOMAIN}")
            assert (info.world_size, info.source, info.host) == (replicas * per_job, "jobset", env["GRIDCOMM_HOST"])
            ranks.append(info.rank)
            _check_settings(env, container)
    assert sorted(ranks) == list(range(replicas * per_job))


def _check_settings(env: dict[str, str], container: dict) -> None:
    """Every other setting the manifest gives parses the way the library reads it."""
    assert _config.metrics_port(environ=env) == generate.METRICS_PORT
    assert _config.job_id(environ=env) == env["GRIDCOMM_JOB_ID"]
    assert _config.backend(environ=env) == env["GRIDCOMM_BACKEND"]
    assert _config.timeout_s(environ=env) >= _config.DEFAULT_TIMEOUT_S
    assert _config.health_port(environ=env) == container["livenessProbe"]["grpc"]["port"]


def test_failure_policies_match_the_exit_codes_of_the_command(m: Manifests):
    assert (generate.EXIT_CONFIG_ERROR, generate.EXIT_PEER_FAILED) == (train.EXIT_CONFIG_ERROR, train.EXIT_PEER_FAILED)
    job_rules = m.job["spec"]["podFailurePolicy"]["rules"]
    fail = [r for r in job_rules if r["action"] == "FailJob"]
    assert fail and fail[0]["onExitCodes"]["values"] == [train.EXIT_CONFIG_ERROR, train.EXIT_PEER_FAILED]
    assert {"type": "DisruptionTarget", "status": "True"} in [c for r in job_rules if r["action"] == "Ignore"
                                                             for c in r["onPodConditions"]]
    js_rules = m.rjob["template"]["spec"]["podFailurePolicy"]["rules"]
    assert js_rules[0]["onExitCodes"]["values"] == [train.EXIT_CONFIG_ERROR]
    assert m.rjob["template"]["spec"]["backoffLimit"] == 0, "any other failure must restart the whole JobSet"
    for where, pod_spec in m.pod_specs():
        # podFailurePolicy is only allowed with restartPolicy Never, and must name the real container.
        assert pod_spec["restartPolicy"] == "Never", where
        rules = m.job["spec"]["podFailurePolicy"]["rules"] if where == "Job" else js_rules
        assert {r["onExitCodes"]["containerName"] for r in rules if "onExitCodes" in r} == {_worker(pod_spec)["name"]}


def test_one_gpu_per_pod(m: Manifests):
    for where, pod_spec in m.pod_specs():
        resources = _worker(pod_spec)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1, where
        assert {"cpu", "memory"} <= set(resources["requests"]), where


def test_container_command_is_what_the_image_holds(m: Manifests):
    dockerfile = open(os.path.join(DEPLOY, "docker", "Dockerfile"), encoding="utf-8").read()
    assert re.search(r"^FROM nvidia/cuda:12[\w.]*-runtime-", dockerfile, re.M)
    assert "[cuda12]" in dockerfile
    assert re.search(r"^COPY deploy/docker/train\.py /app/train\.py$", dockerfile, re.M)
    user = re.search(r"^USER (\d+)", dockerfile, re.M)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()}  # type: ignore[union-attr]
    for where, pod_spec in m.pod_specs():
        container = _worker(pod_spec)
        assert container["command"] == ["python", "/app/train.py"], where
        assert user and pod_spec["securityContext"]["runAsUser"] == int(user.group(1)), where
        assert {p["containerPort"] for p in container["ports"]} == exposed, where


def test_token_is_a_file_from_an_optional_secret_volume(m: Manifests):
    """The token comes from the Secret <job>-token as a file; the volume is optional, so a missing
    Secret or key starts the container without the file, which train.py ends with exit code 2."""
    name = m.job["metadata"]["name"]
    for where, pod_spec in m.pod_specs():
        container = _worker(pod_spec)
        env = _literal_env(container)
        assert "GRIDCOMM_TOKEN" not in env and all("secretKeyRef" not in e.get("valueFrom", {}) for e in container["env"])
        folder, key = os.path.split(env["GRIDCOMM_TOKEN_FILE"])
        (mount,) = [v for v in container["volumeMounts"] if v["mountPath"] == folder]
        (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"] == {"secretName": f"{name}-token", "optional": True, "defaultMode": 0o440}, where
        assert key == generate.TOKEN_KEY and mount["readOnly"] is True
        # The image's user reads a 0440 file through the pod's fsGroup.
        assert pod_spec["securityContext"]["fsGroup"] == pod_spec["securityContext"]["runAsGroup"], where


@pytest.mark.timeout(60)
def test_a_missing_token_secret_exits_2(tmp_path):
    """What the exit-code table in deploy/README.md says: no Secret (so no token file) -> exit 2."""
    env = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_RANK="0", GRIDCOMM_WORLD_SIZE="2", GRIDCOMM_BACKEND="host",
               GRIDCOMM_TOKEN_FILE=str(tmp_path / "absent" / "token"), GRIDCOMM_BIND="127.0.0.1")
    env.pop("GRIDCOMM_TOKEN", None)
    done = subprocess.run([sys.executable, os.path.join(DEPLOY, "docker", "train.py")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == train.EXIT_CONFIG_ERROR, done.stderr
    assert "GRIDCOMM_TOKEN_FILE" in done.stderr and "Traceback" not in done.stderr


def test_activedeadline_bounds_every_job(m: Manifests):
    assert m.job["spec"]["activeDeadlineSeconds"] == generate.DEFAULT_ACTIVE_DEADLINE_S
    assert m.rjob["template"]["spec"]["activeDeadlineSeconds"] == generate.DEFAULT_ACTIVE_DEADLINE_S
    rules = {r["name"]: r for r in m.jobset["spec"]["failurePolicy"]["rules"]}
    assert rules["deadlineIsFinal"] == {"name": "deadlineIsFinal", "action": "FailJobSet",
                                        "onJobFailureReasons": ["DeadlineExceeded"]}


def test_metrics_services_select_rank_zero_and_the_servicemonitor_finds_them(m: Manifests):
    job_pod = m.job["spec"]["template"]
    container = _worker(job_pod["spec"])
    names = {p["name"]: p["containerPort"] for p in container["ports"]}
    # Pod labels the Job controller (and the JobSet controller) add, for rank 0.
    rank0 = {**job_pod["metadata"]["labels"], "batch.kubernetes.io/job-completion-index": "0"}
    for service, extra in ((m.job_metrics, {}), (m.jobset_metrics, {"jobset.sigs.k8s.io/job-index": "0"})):
        selector = service["spec"]["selector"]
        assert selector.items() <= {**rank0, **extra}.items()
        assert selector["batch.kubernetes.io/job-completion-index"] == "0"
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == "metrics" and names["metrics"] == port["port"] == generate.METRICS_PORT
        assert m.servicemonitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = m.servicemonitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert m.servicemonitor["apiVersion"] == "monitoring.coreos.com/v1"


# --- the recoverable variant (recoverable/) -----------------------------------------------------------

def _validated_at(version: str) -> str:
    """kubernetes-validate's schemas start at 1.25: an older stated minimum is checked there."""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split(".")[:2])
    oldest = ".".join(map(str, min(key(v) for v in kubernetes_validate.utils.all_versions())))
    return max(version, oldest, key=key)


@pytest.mark.parametrize("path", sorted(generate.MIN_KUBERNETES_RECOVERABLE))
def test_recoverable_manifests_validate_at_their_stated_minimum_and_newest(m: Manifests, path: str):
    (doc,) = m.by_file[path]
    minimum = generate.MIN_KUBERNETES_RECOVERABLE[path]
    for version in (_validated_at(minimum), kubernetes_validate.latest_version()):
        kubernetes_validate.validate(doc, version, strict=True)
    # Each file says what it needs, and so does deploy/README.md.
    assert f"# Needs Kubernetes {minimum} or newer" in m.files[path], path
    readme = open(os.path.join(DEPLOY, "README.md"), encoding="utf-8").read()
    assert re.search(rf"`k8s/{re.escape(path)}`.*\\| {re.escape(minimum)} \\|", readme), f"README's table lacks {path} ({minimum})"


def test_recoverable_job_minimum_is_where_its_fields_are_beta():
    """backoffLimitPerIndex, maxFailedIndexes and podReplacementPolicy are alpha, off by default, in
    1.28 and beta, on by default, from 1.29 (KEP-3850 and KEP-3939 metadata): the Job's stated
    minimum is 1.29, the variant's (deploy/README.md) that of its most demanding file."""
    assert generate.MIN_KUBERNETES_RECOVERABLE["recoverable/job.yaml"] == "1.29"
    spec = SETS["committed"]["recoverable/job.yaml"]
    for field in ("backoffLimitPerIndex", "maxFailedIndexes", "podReplacementPolicy", "podFailurePolicy"):
        assert f"  {field}:" in spec, field
    readme = open(os.path.join(DEPLOY, "README.md"), encoding="utf-8").read()
    assert "recoverable variant needs Kubernetes 1.29" in readme


def test_recoverable_job_restarts_a_lost_index_and_fails_on_what_no_retry_fixes(m: Manifests):
    """The podFailurePolicy's meaning, through what the Job controller would decide for each way a
    pod of the recoverable Job can end (tests/support/k8s_jobs.py)."""
    job = m.recoverable_job
    spec = job["spec"]
    pod_spec = spec["template"]["spec"]
    container = _worker(pod_spec)["name"]
    assert (spec["completionMode"], pod_spec["restartPolicy"], spec["podReplacementPolicy"]) == ("Indexed", "Never", "Failed")
    assert spec["backoffLimitPerIndex"] == generate.BACKOFF_LIMIT_PER_INDEX >= 1 and spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec, "backoffLimitPerIndex bounds retries; a Job-wide limit would cut them short"
    named = {code for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r for code in r["onExitCodes"]["values"]}
    assert named == {train.EXIT_CONFIG_ERROR, train.EXIT_PEER_FAILED}, "the rules name train.py's exit codes"
    assert {r["onExitCodes"]["containerName"] for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r} == {container}

    def first_failure(exit_code: int | None, conditions: tuple = ()) -> k8s_jobs.Decision:
        return k8s_jobs.on_pod_failure(job, k8s_jobs.IndexState(1), 0, container, exit_code, conditions)

    sigkill, oom = 128 + 9, 137
    disrupted = (("DisruptionTarget", "True"),)
    # A SIGKILLed, OOM-killed or crashed pod: its index is recreated (10 s later) and counted.
    for code in (sigkill, oom, 1):
        decision = first_failure(code)
        assert (decision.action, decision.recreate, decision.delay_s, decision.job_failed) == ("Count", True, 10.0, "")
    # A survivor that gave up recovering (exit 3): retried, counted, never fails the Job by itself.
    decision = first_failure(train.EXIT_PEER_FAILED)
    assert (decision.action, decision.recreate, decision.job_failed) == ("Count", True, "")
    # Preempted, drained, evicted (DisruptionTarget), whatever its exit code: recreated, not counted.
    for code in (sigkill, train.EXIT_PEER_FAILED, train.EXIT_CONFIG_ERROR, 143):
        decision = first_failure(code, disrupted)
        assert (decision.action, decision.recreate, decision.job_failed) == ("Ignore", True, ""), code
    # A configuration error is the same in every pod: the Job fails at once.
    assert first_failure(train.EXIT_CONFIG_ERROR).job_failed == "PodFailurePolicy"
    # A real bug (exit 1 each time): backoffLimitPerIndex retries, then the index and the Job fail.
    state = k8s_jobs.IndexState(1)
    decisions = [k8s_jobs.on_pod_failure(job, state, 0, container, 1) for _ in range(spec["backoffLimitPerIndex"] + 1)]
    assert [d.recreate for d in decisions] == [True] * spec["backoffLimitPerIndex"] + [False]
    assert [d.delay_s for d in decisions[:-1]] == [10.0 * 2 ** i for i in range(spec["backoffLimitPerIndex"])]
    assert decisions[-1].job_failed == "MaxFailedIndexesExceeded" and state.failed
    # Ignored disruptions do not use the budget up.
    state = k8s_jobs.IndexState(1)
    for _ in range(10):
        assert k8s_jobs.on_pod_failure(job, state, 0, container, sigkill, disrupted).recreate
    assert state.counted == 0


def test_recoverable_workers_dial_the_coordinator_pod(m: Manifests):
    job, deployment, service = m.recoverable_job, m.coordinator, m.coordinator_service
    worker = _worker(job["spec"]["template"]["spec"])
    env = _literal_env(worker)
    assert _config.coordinator_mode(environ=env) == "external"
    host, port = _config.coordinator_address(environ=env)
    assert host == service["metadata"]["name"] and service["spec"].get("clusterIP") != "None"
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["port"] == port == generate.COORDINATOR_PORT and service["spec"]["publishNotReadyAddresses"] is True
    coordinator_pod = deployment["spec"]["template"]
    (server,) = coordinator_pod["spec"]["containers"]
    assert service["spec"]["selector"].items() <= coordinator_pod["metadata"]["labels"].items()
    assert not service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items(), \
        "the coordinator Service must not select the workers"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= coordinator_pod["metadata"]["labels"].items()
    names = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert names[svc_port["targetPort"]] == port
    # One coordinator, never two at once, serving the workers' world size, job id and token.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert server["command"][0] == "gridcomm"
    serve = _cli._build_parser().parse_args(server["command"][1:])
    server_env = _literal_env(server)
    assert serve.command == "serve"
    assert _config.world_size(serve.world_size) == job["spec"]["completions"] == job["spec"]["parallelism"] \
        == _config.world_size(environ=env)
    assert _config.coordinator_address("x", serve.port, environ=server_env)[1] == port
    assert _config.job_id(serve.job_id, environ=server_env) == _config.job_id(environ=env)
    assert _config.metrics_port(serve.metrics_port, environ=server_env) == names["metrics"] == generate.METRICS_PORT
    worker_token = [v for v in job["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    server_token = [v for v in coordinator_pod["spec"]["volumes"] if "secret" in v]
    assert worker_token == server_token and env["GRIDCOMM_TOKEN_FILE"] == server_env["GRIDCOMM_TOKEN_FILE"]
    # Probes: the coordinator's health port, liveness "" and readiness gridcomm.v1.Coordinator.
    health = _config.health_port(environ=server_env)
    probes = {kind: server[kind]["grpc"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert all(p["port"] == health == names["health"] for p in probes.values())
    assert probes["livenessProbe"]["service"] == "" and probes["readinessProbe"]["service"] == "gridcomm.v1.Coordinator"
    # The coordinator needs no GPU and tolerates no GPU taint.
    assert "nvidia.com/gpu" not in server["resources"]["requests"] and "tolerations" not in coordinator_pod["spec"]


def test_every_pod_of_the_recoverable_job_detects_its_rank_and_the_coordinator(m: Manifests):
    job = m.recoverable_job
    container = _worker(job["spec"]["template"]["spec"])
    size = job["spec"]["completions"]
    for index in range(size):
        labels = {"batch.kubernetes.io/controller-uid": "0c6f-uid", "batch.kubernetes.io/job-completion-index": str(index)}
        env = _kubelet_env(container, index, labels, {"batch.kubernetes.io/job-completion-index": str(index)})
        hostname = f"{job['metadata']['name']}-{index}"
        # No subdomain: the pod's FQDN is its bare host name, and nothing needs more.
        info = _cluster.detect(env, hostname=hostname, fqdn=hostname)
        assert (info.rank, info.world_size, info.host) == (index, size, m.coordinator_service["metadata"]["name"])
        assert _config.health_port(environ=env) == container["livenessProbe"]["grpc"]["port"]
        assert _config.timeout_s(environ=env) >= _config.DEFAULT_TIMEOUT_S


def test_recoverable_workers_share_a_checkpoint_volume_train_py_uses(m: Manifests):
    pod_spec = m.recoverable_job["spec"]["template"]["spec"]
    worker = _worker(pod_spec)
    env = _literal_env(worker)
    assert env["TRAIN_RECOVERY"] in train.RECOVERY_MODES and env["TRAIN_RECOVERY"] != "off"
    (mount,) = [v for v in worker["volumeMounts"] if v["mountPath"] == env["TRAIN_CHECKPOINT_DIR"]]
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == m.checkpoints["metadata"]["name"]
    assert "ReadWriteMany" in m.checkpoints["spec"]["accessModes"], "pods on different nodes share it"
    assert mount.get("readOnly") is not True
    # The names a worker is given are gridcomm's or train.py's own.
    read = set(_cluster.ENV_NAMES) | _string_constants(os.path.join(ROOT, "gridcomm", "_config", "readers.py")) \
        | {n for n in _string_constants(os.path.join(DEPLOY, "docker", "train.py")) if n.startswith("TRAIN_")}
    names = {e["name"] for e in worker["env"]}
    assert names <= read, sorted(names - read)


def test_recoverable_metrics_service_selects_the_coordinator(m: Manifests):
    service, pod = m.recoverable_metrics, m.coordinator["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not service["spec"]["selector"].items() <= m.recoverable_job["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    (server,) = pod["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in server["ports"]}[port["targetPort"]] == port["port"]
    assert m.servicemonitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_recoverable_pods_run_what_the_image_holds(m: Manifests):
    dockerfile = open(os.path.join(DEPLOY, "docker", "Dockerfile"), encoding="utf-8").read()
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()}  # type: ignore[union-attr]
    pyproject = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    assert re.search(r'^gridcomm = "gridcomm\._cli\.main:main"$', pyproject, re.M), "the image's `gridcomm` command"
    for pod_spec in (m.recoverable_job["spec"]["template"]["spec"], m.coordinator["spec"]["template"]["spec"]):
        (container,) = pod_spec["containers"]
        assert {p["containerPort"] for p in container["ports"]} <= exposed
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert _worker(m.recoverable_job["spec"]["template"]["spec"])["command"] == ["python", "/app/train.py"]


def _without_gridcomm(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith(("GRIDCOMM_", "TRAIN_"))}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, message", [
    ({"TRAIN_RECOVERY": "rebuild"}, "needs TRAIN_CHECKPOINT_DIR"),
    ({"TRAIN_RECOVERY": "sometimes", "TRAIN_CHECKPOINT_DIR": "/tmp"}, "must be one of off, rebuild, shrink"),
    ({"TRAIN_STEPS": "ten"}, "not a number"),
])
def test_train_py_settings_errors_exit_2(env: dict[str, str], message: str):
    done = subprocess.run([sys.executable, os.path.join(DEPLOY, "docker", "train.py")], capture_output=True, text=True,
                          env={**_without_gridcomm(os.environ), "PYTHONPATH": ROOT, **env}, timeout=60)
    assert done.returncode == train.EXIT_CONFIG_ERROR, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


# --- Pod Security Standards: the "restricted" profile ------------------------------------------------
# Our own table of the profile's controls, as https://kubernetes.io/docs/concepts/security/pod-security-standards/
# lists them: each control's "Restricted Fields" and their "Allowed Values" (Restricted includes every
# Baseline control). Why our own: no offline checker of exactly these controls is installed or a
# dependency here (Pod Security Admission runs inside the API server; checkov, on PyPI, checks a
# list of its own). HARDENING adds what this project asks beyond the profile: a read-only root
# filesystem, no service-account token, and a non-root user and group set explicitly.

#: Baseline "Sysctls": the safe sysctls a pod may set.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
#: Restricted "Volume Types": the only volume sources a pod may use.
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}
#: Baseline "SELinux": the types a pod may ask for.
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
#: Restricted "Capabilities": the only one a container may add, after dropping ALL.
RESTRICTED_ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}
#: Kinds that hold no pod template; any other kind must be taught to pod_templates().
NO_POD_TEMPLATE = {"Service", "PersistentVolumeClaim", "NetworkPolicy", "ServiceMonitor", "ConfigMap", "Secret",
                   "PodDisruptionBudget", "PrometheusRule"}


@dataclass(frozen=True)
class PodTemplate:
    """One pod template of a manifest: where it is, its metadata and its spec."""

    where: str
    metadata: dict
    spec: dict

    def containers(self) -> Iterator[tuple[str, dict]]:
        for kind in ("initContainers", "containers", "ephemeralContainers"):
            for container in self.spec.get(kind) or []:
                yield f"{kind}[{container.get('name')}]", container

    @property
    def security(self) -> dict:
        return self.spec.get("securityContext") or {}


def _sc(container: dict) -> dict:
    return container.get("securityContext") or {}


def _effective(pod: PodTemplate, container: dict, key: str) -> Any:
    """A setting as the container gets it: its own securityContext's, else the pod's."""
    own = _sc(container).get(key)
    return own if own is not None else pod.security.get(key)


def _host_process(pod: PodTemplate) -> Iterator[str]:
    if (pod.security.get("windowsOptions") or {}).get("hostProcess"):
        yield "spec.securityContext.windowsOptions.hostProcess is true"
    for where, c in pod.containers():
        if (_sc(c).get("windowsOptions") or {}).get("hostProcess"):
            yield f"{where}.securityContext.windowsOptions.hostProcess is true"


def _host_namespaces(pod: PodTemplate) -> Iterator[str]:
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.spec.get(key):
            yield f"spec.{key} is true"


def _privileged(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        if _sc(c).get("privileged"):
            yield f"{where}.securityContext.privileged is true"


def _host_path(pod: PodTemplate) -> Iterator[str]:
    for volume in pod.spec.get("volumes") or []:
        if "hostPath" in volume:
            yield f"spec.volumes[{volume['name']}].hostPath is set"


def _host_ports(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                yield f"{where}.ports[{port.get('name')}].hostPort is {port['hostPort']}"


def _apparmor(pod: PodTemplate) -> Iterator[str]:
    contexts = [("spec.securityContext", pod.security)] + [(f"{w}.securityContext", _sc(c)) for w, c in pod.containers()]
    for where, sc in contexts:
        kind = (sc.get("appArmorProfile") or {}).get("type")
        if kind not in (None, "RuntimeDefault", "Localhost"):
            yield f"{where}.appArmorProfile.type is {kind}"
    for key, value in (pod.metadata.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and value != "runtime/default" \
                and not value.startswith("localhost/"):
            yield f"metadata.annotations[{key}] is {value}"


def _selinux(pod: PodTemplate) -> Iterator[str]:
    contexts = [("spec.securityContext", pod.security)] + [(f"{w}.securityContext", _sc(c)) for w, c in pod.containers()]
    for where, sc in contexts:
        options = sc.get("seLinuxOptions") or {}
        if options.get("type", "") not in SELINUX_TYPES:
            yield f"{where}.seLinuxOptions.type is {options['type']}"
        for key in ("user", "role"):
            if options.get(key):
                yield f"{where}.seLinuxOptions.{key} is set"


def _proc_mount(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        if _sc(c).get("procMount", "Default") != "Default":
            yield f"{where}.securityContext.procMount is {_sc(c)['procMount']}"


def _sysctls(pod: PodTemplate) -> Iterator[str]:
    for sysctl in pod.security.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            yield f"spec.securityContext.sysctls names {sysctl['name']}, not a safe sysctl"


def _volume_types(pod: PodTemplate) -> Iterator[str]:
    for volume in pod.spec.get("volumes") or []:
        other = set(volume) - {"name"} - RESTRICTED_VOLUME_TYPES
        if other:
            yield f"spec.volumes[{volume['name']}] is {sorted(other)}"


def _privilege_escalation(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        if _sc(c).get("allowPrivilegeEscalation") is not False:
            yield f"{where}.securityContext.allowPrivilegeEscalation is {_sc(c).get('allowPrivilegeEscalation')!r}, not false"


def _run_as_non_root(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        value = _effective(pod, c, "runAsNonRoot")
        if value is not True:
            yield f"{where}: runAsNonRoot is {value!r} (container, else pod securityContext), not true"


def _run_as_user(pod: PodTemplate) -> Iterator[str]:
    if pod.security.get("runAsUser") == 0:
        yield "spec.securityContext.runAsUser is 0"
    for where, c in pod.containers():
        if _sc(c).get("runAsUser") == 0:
            yield f"{where}.securityContext.runAsUser is 0"


def _seccomp(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        kind = (_effective(pod, c, "seccompProfile") or {}).get("type")
        if kind not in ("RuntimeDefault", "Localhost"):
            yield f"{where}: seccompProfile.type is {kind!r} (container, else pod securityContext), not RuntimeDefault"


def _capabilities(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        capabilities = _sc(c).get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield f"{where}.securityContext.capabilities.drop does not name ALL"
        added = set(capabilities.get("add") or []) - RESTRICTED_ADDABLE_CAPABILITIES
        if added:
            yield f"{where}.securityContext.capabilities.add has {sorted(added)}"


def _read_only_root(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        if _sc(c).get("readOnlyRootFilesystem") is not True:
            yield f"{where}.securityContext.readOnlyRootFilesystem is not true"


def _no_token(pod: PodTemplate) -> Iterator[str]:
    if pod.spec.get("automountServiceAccountToken") is not False:
        yield "spec.automountServiceAccountToken is not false"
    for volume in pod.spec.get("volumes") or []:
        if any("serviceAccountToken" in s for s in (volume.get("projected") or {}).get("sources", [])):
            yield f"spec.volumes[{volume['name']}] projects a service-account token"


def _non_root_ids(pod: PodTemplate) -> Iterator[str]:
    for where, c in pod.containers():
        for key in ("runAsUser", "runAsGroup"):
            value = _effective(pod, c, key)
            if not isinstance(value, int) or value <= 0:
                yield f"{where}: {key} is {value!r} (container, else pod securityContext), not a non-zero id"
    if pod.security.get("fsGroup") == 0 or 0 in (pod.security.get("supplementalGroups") or []):
        yield "spec.securityContext: fsGroup or supplementalGroups name group 0"


@dataclass(frozen=True)
class Rule:
    profile: str                                 # "baseline", "restricted" (the page's), or "hardening"
    control: str                                 # the control's name on the page
    fields: str                                  # the fields it checks
    check: Callable[[PodTemplate], Iterator[str]]


C = "spec.{containers,initContainers,ephemeralContainers}[*].securityContext"
RULES = (
    Rule("baseline", "HostProcess", f"spec.securityContext.windowsOptions.hostProcess, {C}.windowsOptions.hostProcess",
         _host_process),
    Rule("baseline", "Host Namespaces", "spec.hostNetwork, spec.hostPID, spec.hostIPC", _host_namespaces),
    Rule("baseline", "Privileged Containers", f"{C}.privileged", _privileged),
    Rule("baseline", "HostPath Volumes", "spec.volumes[*].hostPath", _host_path),
    Rule("baseline", "Host Ports", "spec.{containers,...}[*].ports[*].hostPort", _host_ports),
    Rule("baseline", "AppArmor", f"spec.securityContext.appArmorProfile.type, {C}.appArmorProfile.type, "
         "metadata.annotations['container.apparmor.security.beta.kubernetes.io/*']", _apparmor),
    Rule("baseline", "SELinux", f"spec.securityContext.seLinuxOptions.{{type,user,role}}, {C}.seLinuxOptions.*",
         _selinux),
    Rule("baseline", "/proc Mount Type", f"{C}.procMount", _proc_mount),
    Rule("baseline", "Sysctls", "spec.securityContext.sysctls[*].name", _sysctls),
    Rule("restricted", "Volume Types", "spec.volumes[*]", _volume_types),
    Rule("restricted", "Privilege Escalation", f"{C}.allowPrivilegeEscalation", _privilege_escalation),
    Rule("restricted", "Running as Non-root", f"spec.securityContext.runAsNonRoot, {C}.runAsNonRoot", _run_as_non_root),
    Rule("restricted", "Running as Non-root user", f"spec.securityContext.runAsUser, {C}.runAsUser", _run_as_user),
    # Baseline's Seccomp (not Unconfined) is the weaker form of this one.
    Rule("restricted", "Seccomp", f"spec.securityContext.seccompProfile.type, {C}.seccompProfile.type", _seccomp),
    # Baseline's Capabilities (add only the runtime's defaults) is the weaker form of this one.
    Rule("restricted", "Capabilities", f"{C}.capabilities.drop, {C}.capabilities.add", _capabilities),
    Rule("hardening", "Read-only root filesystem", f"{C}.readOnlyRootFilesystem", _read_only_root),
    Rule("hardening", "No service-account token", "spec.automountServiceAccountToken, spec.volumes[*].projected",
         _no_token),
    Rule("hardening", "Non-root user and groups", f"spec.securityContext.{{runAsUser,runAsGroup,fsGroup,"
         f"supplementalGroups}}, {C}.{{runAsUser,runAsGroup}}", _non_root_ids),
)


def pss_findings(pod: PodTemplate) -> list[tuple[Rule, str]]:
    return [(rule, problem) for rule in RULES for problem in rule.check(pod)]


def _show(pod: PodTemplate, findings: list[tuple[Rule, str]]) -> list[str]:
    return [f"{pod.where}: {rule.profile} '{rule.control}' ({rule.fields}): {problem}" for rule, problem in findings]


def pod_templates(by_file: Mapping[str, list[dict]]) -> Iterator[PodTemplate]:
    """Every pod template of the manifests: a Pod's own, a workload's, each replicatedJob's of a
    JobSet. A kind it does not know fails, so a new workload kind is not left unchecked."""
    for name, docs in by_file.items():
        for doc in docs:
            kind, spec = doc["kind"], doc.get("spec", {})
            label = f"{name} {kind}/{doc['metadata']['name']}"
            if kind in ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController"):
                templates = [("spec.template", spec["template"])]
            elif kind == "CronJob":
                templates = [("spec.jobTemplate.spec.template", spec["jobTemplate"]["spec"]["template"])]
            elif kind == "JobSet":
                templates = [(f"spec.replicatedJobs[{r['name']}].template.spec.template", r["template"]["spec"]["template"])
                             for r in spec["replicatedJobs"]]
            elif kind == "Pod":
                templates = [("", {"metadata": doc["metadata"], "spec": spec})]
            else:
                assert kind in NO_POD_TEMPLATE, f"{label}: teach pod_templates() where a {kind} keeps its pod templates"
                continue
            for path, template in templates:
                yield PodTemplate(f"{label} {path}", template.get("metadata") or {}, template["spec"])


def test_every_pod_template_passes_the_restricted_profile(m: Manifests):
    templates = list(pod_templates(m.by_file))
    assert sorted(t.where.split()[0] for t in templates) == [
        "job/job.yaml", "jobset/jobset.yaml", "recoverable/coordinator.yaml", "recoverable/job.yaml"]
    problems = [line for t in templates for line in _show(t, pss_findings(t))]
    assert not problems, "\n".join(problems)


def _first_container_sc(spec: dict) -> dict:
    return spec["containers"][0].setdefault("securityContext", {})


#: One way to break each rule, on an otherwise compliant pod (the committed Job's).
VIOLATIONS: list[tuple[str, Callable[[dict], Any]]] = [
    ("HostProcess", lambda s: s["securityContext"].update(windowsOptions={"hostProcess": True})),
    ("Host Namespaces", lambda s: s.update(hostNetwork=True)),
    ("Host Namespaces", lambda s: s.update(hostIPC=True)),
    ("Privileged Containers", lambda s: _first_container_sc(s).update(privileged=True)),
    ("HostPath Volumes", lambda s: s["volumes"].append({"name": "host", "hostPath": {"path": "/"}})),
    ("Host Ports", lambda s: s["containers"][0]["ports"][0].update(hostPort=13333)),
    ("AppArmor", lambda s: _first_container_sc(s).update(appArmorProfile={"type": "Unconfined"})),
    ("SELinux", lambda s: s["securityContext"].update(seLinuxOptions={"type": "spc_t"})),
    ("/proc Mount Type", lambda s: _first_container_sc(s).update(procMount="Unmasked")),
    ("Sysctls", lambda s: s["securityContext"].setdefault("sysctls", []).append({"name": "kernel.msgmax", "value": "1"})),
    ("Volume Types", lambda s: s["volumes"].append({"name": "nfs", "nfs": {"server": "nfs", "path": "/"}})),
    ("Privilege Escalation", lambda s: _first_container_sc(s).pop("allowPrivilegeEscalation")),
    ("Running as Non-root", lambda s: s["securityContext"].pop("runAsNonRoot")),
    ("Running as Non-root", lambda s: _first_container_sc(s).update(runAsNonRoot=False)),
    ("Running as Non-root user", lambda s: _first_container_sc(s).update(runAsUser=0)),
    ("Seccomp", lambda s: s["securityContext"].pop("seccompProfile")),
    ("Seccomp", lambda s: _first_container_sc(s).update(seccompProfile={"type": "Unconfined"})),
    ("Capabilities", lambda s: _first_container_sc(s)["capabilities"].update(drop=["NET_RAW"])),
    ("Capabilities", lambda s: _first_container_sc(s)["capabilities"].update(add=["SYS_ADMIN"])),
    ("Read-only root filesystem", lambda s: _first_container_sc(s).pop("readOnlyRootFilesystem")),
    ("No service-account token", lambda s: s.pop("automountServiceAccountToken")),
    ("Non-root user and groups", lambda s: s["securityContext"].pop("runAsGroup")),
    ("Non-root user and groups", lambda s: s["securityContext"].update(supplementalGroups=[0])),
]


@pytest.mark.parametrize("control, mutate", VIOLATIONS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(VIOLATIONS)])
def test_the_checker_finds_each_violation(control: str, mutate: Callable[[dict], Any]):
    spec = copy.deepcopy(Manifests(SETS["committed"]).job["spec"]["template"]["spec"])
    assert not pss_findings(PodTemplate("compliant", {}, spec))
    mutate(spec)
    found = {rule.control for rule, _ in pss_findings(PodTemplate("mutated", {}, spec))}
    assert control in found, found


def test_every_rule_is_shown_to_fail():
    assert {rule.control for rule in RULES} == {control for control, _ in VIOLATIONS}


def test_a_pod_that_says_nothing_fails_and_an_init_container_is_checked():
    """What the API server fills in for a pod that sets nothing is what the issue found missing; an
    initContainer is held to the same rules as the containers."""
    bare = PodTemplate("bare", {}, {"containers": [{"name": "c", "image": "x"}]})
    assert {rule.control for rule, _ in pss_findings(bare)} == {
        "Privilege Escalation", "Running as Non-root", "Seccomp", "Capabilities", "Read-only root filesystem",
        "No service-account token", "Non-root user and groups"}
    spec = copy.deepcopy(Manifests(SETS["committed"]).job["spec"]["template"]["spec"])
    spec["initContainers"] = [{"name": "fetch", "image": "x"}]
    problems = [p for _, p in pss_findings(PodTemplate("init", {}, spec))]
    assert problems and all(p.startswith("initContainers[fetch]") for p in problems), problems


def test_pods_run_as_the_images_numeric_user_with_a_volume_for_all_they_write(m: Manifests):
    """The image's USER is numeric and non-root (runAsNonRoot can only verify a numeric one), the
    pods run as it, and under the read-only root filesystem every path the program writes is an
    emptyDir: /tmp everywhere; the workers' /dev/shm in memory (NCCL) and the user's home (CuPy's
    kernel cache, CUDA's JIT cache), sized so that none can grow without bound."""
    dockerfile = open(os.path.join(DEPLOY, "docker", "Dockerfile"), encoding="utf-8").read()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    account = re.search(r"^RUN useradd --uid (\d+) --user-group --create-home (\S+)$", dockerfile, re.M)
    assert user and account, "the Dockerfile's USER uid:gid and its useradd line"
    uid, gid = int(user.group(1)), int(user.group(2))
    assert uid > 0 and gid > 0 and int(account.group(1)) == uid
    assert (generate.RUN_AS_USER, generate.RUN_AS_GROUP, generate.HOME_DIR) == (uid, gid, f"/home/{account.group(2)}")
    for pod in pod_templates(m.by_file):
        assert (pod.security["runAsUser"], pod.security["runAsGroup"]) == (uid, gid), pod.where
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        for where, c in pod.containers():
            assert _sc(c)["readOnlyRootFilesystem"] is True
            writable = {mount["mountPath"]: volumes[mount["name"]] for mount in c["volumeMounts"]
                        if not mount.get("readOnly")}
            needed = {"/tmp"} | ({"/dev/shm", generate.HOME_DIR} if c["name"] == "worker" else set())
            assert needed <= set(writable), (pod.where, where, sorted(writable))
            for path in needed:
                assert writable[path]["emptyDir"]["sizeLimit"], (pod.where, path)
            if c["name"] == "worker":
                assert writable["/dev/shm"]["emptyDir"]["medium"] == "Memory"
                assert c["resources"]["limits"]["memory"], "a memory emptyDir counts against the memory limit"


# --- NetworkPolicy -------------------------------------------------------------------------------------
# NetworkPolicy's meaning (https://kubernetes.io/docs/concepts/services-networking/network-policies/):
# a pod some policy selects for Ingress accepts only connections from its own node and those some
# rule admits; a rule admits when one of its `from` peers matches (podSelector alone: pods of the
# policy's namespace; namespaceSelector alone: every pod of those namespaces; both: pods matching
# both; no `from`: everyone) and one of its ports does (none: every port; port..endPort a range).

@dataclass(frozen=True)
class Peer:
    """Who opens a connection: a pod's labels and namespace."""

    labels: Mapping[str, str]
    namespace: str


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "matchExpressions are not evaluated here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(source: Mapping[str, Any], peer: Peer, namespace: str) -> bool:
    assert "ipBlock" not in source, "ipBlock is not evaluated here"
    if "namespaceSelector" in source:
        in_namespace = _selects(source["namespaceSelector"], {generate.NAMESPACE_NAME_LABEL: peer.namespace})
    else:
        in_namespace = peer.namespace == namespace
    return in_namespace and ("podSelector" not in source or _selects(source["podSelector"], peer.labels))


def _port_matches(entry: Mapping[str, Any], port: int, named: Mapping[str, int]) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    first = entry.get("port")
    if first is None:
        return True
    if isinstance(first, str):
        if first not in named:
            return False
        first = named[first]
    return first <= port <= entry.get("endPort", first)


def admits(policy: Mapping[str, Any], namespace: str, named: Mapping[str, int], peer: Peer, port: int) -> bool:
    """Whether ``policy`` (which selects the destination pod) admits a TCP connection from ``peer``
    to ``port`` of a pod in ``namespace`` whose container ports are ``named``."""
    assert "Ingress" in policy["spec"]["policyTypes"]
    for rule in policy["spec"].get("ingress") or []:
        sources = rule.get("from") or []
        ports = rule.get("ports") or []
        if (not sources or any(_peer_matches(s, peer, namespace) for s in sources)) and \
                (not ports or any(_port_matches(p, port, named) for p in ports)):
            return True
    return False


def _sysctl_range(pod: PodTemplate) -> tuple[int, int] | None:
    for sysctl in pod.security.get("sysctls") or []:
        if sysctl["name"] == "net.ipv4.ip_local_port_range":
            first, last = sysctl["value"].split()
            return int(first), int(last)
    return None


def policy_problems(policy: Mapping[str, Any], pods: list[PodTemplate], monitoring: str) -> list[str]:
    """Who reaches which port of each pod of a layout, against who should: the job's own pods the
    coordinator, relay and data-plane ports; the monitoring namespace the metrics port; nobody the
    health port (kubelet probes it from the node, which NetworkPolicy does not filter); and nobody
    else anything: not a pod of another job, not an unlabelled pod, not the job's labels in another
    namespace."""
    namespace = "team-a"
    problems = []
    first, last = generate.DATA_PORTS
    for pod in pods:
        labels = {**pod.metadata["labels"], "batch.kubernetes.io/job-completion-index": "1"}
        if not _selects(policy["spec"]["podSelector"], labels):
            problems.append(f"{pod.where}: not selected by the NetworkPolicy")
            continue
        workers = [t for t in pods if t.spec.get("restartPolicy") == "Never"] or [pod]
        peers = {
            "job": Peer({**workers[0].metadata["labels"], "batch.kubernetes.io/job-completion-index": "0"}, namespace),
            "other-job": Peer({**pod.metadata["labels"], "app.kubernetes.io/instance": "someone-else"}, namespace),
            "unlabelled": Peer({}, namespace),
            "elsewhere": Peer(pod.metadata["labels"], "team-b"),
            "monitoring": Peer({"app.kubernetes.io/name": "prometheus"}, monitoring),
        }
        for _where, c in pod.containers():
            named = {p["name"]: p["containerPort"] for p in c.get("ports") or []}
            expected = {port: {"health": set(), "metrics": {"monitoring"}}.get(name, {"job"}) for name, port in named.items()}
            if _sysctl_range(pod) is not None:
                if _sysctl_range(pod) != generate.DATA_PORTS:
                    problems.append(f"{pod.where}: the pods' ephemeral range {_sysctl_range(pod)} is not {generate.DATA_PORTS}")
                expected.update({first: {"job"}, (first + last) // 2: {"job"}, last: {"job"}, first - 1: set(),
                                 last + 1: set()})
            expected.setdefault(generate.RELAY_PORT, {"job"})
            for port, who in sorted(expected.items()):
                got = {name for name, peer in peers.items() if admits(policy, namespace, named, peer, port)}
                if got != who:
                    problems.append(f"{pod.where}: port {port} is reached by {sorted(got)}, not {sorted(who)}")
    return problems


MONITORING = {"committed": generate.DEFAULT_MONITORING_NAMESPACE, "custom": "observability"}


@pytest.mark.parametrize("which", sorted(SETS))
@pytest.mark.parametrize("folder", LAYOUTS)
def test_each_layout_has_a_network_policy_that_admits_the_job_and_its_monitoring_only(which: str, folder: str):
    m = Manifests(SETS[which])
    policy = m.network_policies[folder]
    assert (policy["apiVersion"], policy["kind"], policy["spec"]["policyTypes"]) == (
        "networking.k8s.io/v1", "NetworkPolicy", ["Ingress"])
    pods = list(pod_templates({k: v for k, v in m.by_file.items() if k.startswith(folder + "/")}))
    assert pods
    problems = policy_problems(policy, pods, MONITORING[which])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mutate", [
    lambda p: p["spec"]["ingress"][0].pop("from"),                                   # everyone reaches the job's ports
    lambda p: p["spec"]["ingress"][0].pop("ports"),                                  # the job's pods reach health too
    lambda p: p["spec"]["ingress"][0]["ports"][2].pop("endPort"),                    # the data range is one port
    lambda p: p["spec"]["ingress"][1]["from"][0]["namespaceSelector"].update(matchLabels={}),  # every namespace
    lambda p: p["spec"]["podSelector"]["matchLabels"].update({"app.kubernetes.io/component": "x"}),  # selects nobody
    lambda p: p["spec"]["ingress"].pop(0),                                           # the coordinator is cut off
], ids=["no-from", "no-ports", "no-endPort", "any-namespace", "selects-nobody", "no-job-rule"])
def test_the_network_policy_check_can_fail(mutate: Callable[[dict], Any]):
    m = Manifests(SETS["committed"])
    policy = copy.deepcopy(m.network_policies["job"])
    mutate(policy)
    pods = list(pod_templates({k: v for k, v in m.by_file.items() if k.startswith("job/")}))
    assert policy_problems(policy, pods, MONITORING["committed"])


# --- a node drain in each layout ---------------------------------------------------------------------

def test_a_node_drain_in_each_layout(m: Manifests):
    """What deploy/README.md says a drain (pod condition DisruptionTarget) does, as the Job
    controller decides it: the first matching podFailurePolicy rule (tests/support/k8s_jobs.py)."""
    disrupted = (("DisruptionTarget", "True"),)
    sigkill, sigterm = 128 + 9, 128 + 15
    # job/: the drained pod is recreated, not counted, whatever it ended with: SIGKILL when the
    # grace period ends, or exit 3 when it saw a peer on the same node go first ...
    for code in (sigkill, sigterm, train.EXIT_PEER_FAILED, train.EXIT_CONFIG_ERROR, 1):
        assert k8s_jobs.matching_rule(m.job, "worker", code, disrupted)[0] == "Ignore", code
    # ... but once the ranks have met, the others exit 3, which fails the Job.
    assert k8s_jobs.matching_rule(m.job, "worker", train.EXIT_PEER_FAILED)[0] == "FailJob"
    # jobset/: no rule names a drain, so it is counted; backoffLimit 0 fails the child Job
    # (BackoffLimitExceeded), which no FailJobSet rule names: the JobSet recreates every pod, one
    # of its maxRestarts.
    child = {"spec": m.rjob["template"]["spec"]}
    assert k8s_jobs.matching_rule(child, "worker", sigkill, disrupted) == ("Count", None)
    assert child["spec"]["backoffLimit"] == 0
    final = {r for rule in m.jobset["spec"]["failurePolicy"]["rules"] if rule["action"] == "FailJobSet"
             for r in rule.get("onJobFailureReasons", [])}
    assert "BackoffLimitExceeded" not in final and m.jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    # recoverable/: recreated, not counted, while the others rebuild(); the coordinator pod is a
    # Deployment's, recreated by it.
    for code in (sigkill, train.EXIT_PEER_FAILED):
        assert k8s_jobs.matching_rule(m.recoverable_job, "worker", code, disrupted)[0] == "Ignore"
    readme = open(os.path.join(DEPLOY, "README.md"), encoding="utf-8").read()
    (row,) = [line for line in readme.splitlines() if line.startswith("| — | preemption, node drain")]
    assert "`Ignore`" in row and "`FailJob`" in row and "maxRestarts" in row, row
    # The Job's failure message the README quotes names the FailJob rule by its position.
    (fail_job,) = [i for i, r in enumerate(m.job["spec"]["podFailurePolicy"]["rules"]) if r["action"] == "FailJob"]
    assert f"matching FailJob rule at index {fail_job}`" in " ".join(readme.split())


# --- the program under a read-only root filesystem -----------------------------------------------------

_READ_ONLY_POD = r"""
set -eu
# Everything the program could write outside its volumes becomes read-only, as the root filesystem
# of a container with readOnlyRootFilesystem: the root mount and any mount holding the code.
for mp in $RO_MOUNTS; do mount -o remount,bind,ro "$mp"; done
# The manifest's emptyDir volumes, fresh and writable; a missing mount point is made on a tmpfs
# laid over its parent, itself read-only again afterwards.
for path in $VOLUMES; do
  if [ ! -d "$path" ]; then
    parent=$(dirname "$path"); mount -t tmpfs tmpfs "$parent"; mkdir -p "$path"; mount -o remount,ro "$parent"
  fi
  mount -t tmpfs tmpfs "$path"
done
if touch "$PROBE" 2>/dev/null; then echo "the root filesystem is writable" >&2; exit 97; fi
pids=""
for rank in 0 1; do
  GRIDCOMM_RANK=$rank GRIDCOMM_HEALTH_PORT=$(eval echo \$HEALTH_$rank) "$PYTHON" "$TRAIN" &
  pids="$pids $!"
done
status=0
for pid in $pids; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.timeout(120)
def test_train_py_runs_with_a_read_only_root_and_only_the_manifests_volumes_writable():
    """Two ranks of train.py (host backend, on one host, so its shared memory goes through /dev/shm)
    in a mount namespace whose root is read-only and whose only writable paths are the workers'
    emptyDir mounts: nothing the program does needs more (root only: mount namespaces)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a mount namespace")
    m = Manifests(SETS["committed"])
    pod_spec = m.job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    empty_dirs = sorted(mount["mountPath"] for mount in _worker(pod_spec)["volumeMounts"]
                        if "emptyDir" in volumes[mount["name"]])
    assert empty_dirs == sorted(["/tmp", "/dev/shm", generate.HOME_DIR])
    code = {os.path.realpath(p) for p in (ROOT, sys.prefix, sys.base_prefix)}
    if any(c == v or c.startswith(v + "/") for c in code for v in empty_dirs):
        pytest.skip(f"the checkout or Python lies under a volume's mount path ({sorted(code)})")
    mounts = [line.split()[4] for line in open("/proc/self/mountinfo", encoding="utf-8")]
    holding = {mp for mp in mounts if any(c == mp or c.startswith(mp.rstrip("/") + "/") for c in code)}
    env = {**_without_gridcomm(os.environ), "PYTHONPATH": ROOT, "HOME": generate.HOME_DIR, "PYTHON": sys.executable,
           "TRAIN": os.path.join(DEPLOY, "docker", "train.py"), "RO_MOUNTS": " ".join(sorted({"/"} | holding)),
           "VOLUMES": " ".join(empty_dirs), "PROBE": os.path.join(ROOT, ".read-only-probe"),
           "GRIDCOMM_WORLD_SIZE": "2", "GRIDCOMM_BACKEND": "host", "GRIDCOMM_HOST": "127.0.0.1",
           "GRIDCOMM_BIND": "127.0.0.1", "GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_TOKEN": "t" * 32,
           "GRIDCOMM_TIMEOUT_S": "60", "HEALTH_0": str(free_port()), "HEALTH_1": str(free_port()),
           "TRAIN_STEPS": "3", "TRAIN_ELEMENTS": str(1 << 20)}
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", _READ_ONLY_POD], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its group: the shell and both ranks
            proc.wait(timeout=10)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert out.count("correct") == 2, out
    assert not os.path.exists(env["PROBE"])
