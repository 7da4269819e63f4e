"""Pod simulation: the Indexed Job of deploy/k8s, run as kubelet would run it, without a cluster.

The manifests come fresh from ``deploy/k8s/generate.py`` (a job and a Service of different names,
world size 3). Each pod is a network namespace (``tests/netns.py``) with the host name the Job
controller gives it, ``<job>-<index>``; every namespace's /etc/hosts holds what the headless
Service's DNS would answer, ``<job>-<index>.<service>`` and its FQDN (plus, in the pod's own file
only, what kubelet writes there: the FQDN and the short host name). Each pod runs the container's
own ``command`` (``python /app/train.py``, mapped through the Dockerfile's COPY lines onto
``deploy/docker/train.py`` and its venv onto this test's Python) in the Dockerfile's WORKDIR,
with the environment kubelet would build: the Dockerfile's ENV, the
manifest's ``env`` with ``valueFrom`` resolved (``fieldRef`` from the pod's downward API: the Job
controller's labels and annotations) and its Secret volume (the token Secret made as
deploy/README.md says) written to a folder of the pod's own, which the paths in ``env`` that point
into the volume's ``mountPath`` are mapped onto,
``JOB_COMPLETION_INDEX`` (which the Job controller injects), ``HOSTNAME`` and
``KUBERNETES_SERVICE_*``.

Departures, each stated where it happens: ``GRIDCOMM_BACKEND=host`` replaces the manifest's
``nccl`` (no GPU here); the cases add ``TRAIN_*`` knobs that size and pace train.py (documented in
its docstring), as a user would add env to the manifest; the pods run as root rather than the
manifest's ``runAsUser`` (this machine's Python may sit where user 1000 cannot read it).

A prober in the switch namespace, which plays the node, runs the manifest's gRPC probes as kubelet
does: a fresh plaintext connection to the pod IP and the probe's port per check, grpc.health.v1
``Check`` with the probe's ``service``, within the probe's ``timeoutSeconds`` (at most 1 s). It
checks every 0.1 s rather than at the manifest's ``periodSeconds``, so short states are seen.

Exit codes are read as the Job controller would read them (a SIGKILL is 137) and run through the
manifest's ``podFailurePolicy``. Needs root and iproute2 (skips otherwise); ``-s`` prints the
outcome table.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import conftest_netns
import netns
import pytest
import yaml
from conftest_netns import OutcomeTable

from gridcomm import _config

make_topology = conftest_netns.make_topology
netns_usable = conftest_netns.netns_usable
outcome_table = conftest_netns.outcome_table

pytestmark = pytest.mark.netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "deploy", "docker", "Dockerfile")
GENERATE = os.path.join(ROOT, "deploy", "k8s", "generate.py")
JOB_NAME = "simjob"
SERVICE_NAME = "simnet"  # differs from the job's name, so a mix-up of the two cannot pass
NAMESPACE = "default"
WORLD = 3
READINESS = "gridcomm.v1.Coordinator"
PROBE_PERIOD_S = 0.1
#: Python, grpc and numpy start in three pods at once on two shared cores: allowed for on top of
#: every bound the library promises, never inside it.
STARTUP_S = 30.0
#: How long after its last peer is up one pod may take to finish train.py's work.
RUN_S = 60.0
#: Exit codes of deploy/docker/train.py (its docstring); the manifests' podFailurePolicy names them.
EXIT_OK, EXIT_PEER_FAILED = 0, 3
SIGKILL_EXIT = 128 + signal.SIGKILL  # what the container runtime reports for a kill -9


# --- the manifests and the image ----------------------------------------------------------------

@dataclass
class Manifests:
    service: dict[str, Any]
    job: dict[str, Any]

    @property
    def pod_spec(self) -> dict[str, Any]:
        return self.job["spec"]["template"]["spec"]

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod_spec["containers"]
        return container


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Manifests:
    """The generator's files for a small job, exactly as a user writes them (``--out``)."""
    out = tmp_path_factory.mktemp("manifests")
    subprocess.run([sys.executable, GENERATE, "--name", JOB_NAME, "--service", SERVICE_NAME, "--world-size",
                    str(WORLD), "--out", str(out)], check=True, timeout=60)
    docs = {}
    for name in ("job/service.yaml", "job/job.yaml"):
        (doc,) = [d for d in yaml.safe_load_all((out / name).read_text()) if d is not None]
        docs[name] = doc
    m = Manifests(docs["job/service.yaml"], docs["job/job.yaml"])
    assert m.job["spec"]["completionMode"] == "Indexed"
    assert m.job["spec"]["completions"] == m.job["spec"]["parallelism"] == WORLD
    assert m.pod_spec["subdomain"] == m.service["metadata"]["name"] == SERVICE_NAME
    return m


@dataclass
class Image:
    """What the Dockerfile puts in the image, mapped onto this machine: its single-file COPYs onto
    the repository's files, its venv (/opt/venv) onto this test's Python, its ENV and WORKDIR."""

    files: dict[str, str]
    env: dict[str, str]
    workdir: str

    @classmethod
    def from_dockerfile(cls, path: str = DOCKERFILE) -> Image:
        text = open(path, encoding="utf-8").read().replace("\\\n", " ")
        files = {}
        for src, dst in re.findall(r"^COPY (\S+) (/\S+)$", text, re.M):
            if os.path.isfile(os.path.join(ROOT, src)):
                files[dst] = os.path.join(ROOT, src)
        env = {}
        for line in re.findall(r"^ENV (.+)$", text, re.M):
            env.update(pair.split("=", 1) for pair in line.split())
        venv_bin = os.path.dirname(sys.executable)
        # The image's venv comes first on PATH; here that venv is the one running this test.
        env["PATH"] = env["PATH"].replace("/opt/venv/bin", venv_bin).replace("$PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.M)
        return cls(files, env, workdir)

    def host_path(self, container_path: str) -> str:
        if container_path in self.files:
            return self.files[container_path]
        folders = {os.path.dirname(dst): os.path.dirname(src) for dst, src in self.files.items()}
        if container_path in folders:
            return folders[container_path]
        raise AssertionError(f"{container_path} is not a file the Dockerfile copies into the image")

    def argv(self, command: Sequence[str]) -> list[str]:
        """The container's command with its program found on the image's PATH and its absolute
        paths mapped to the files the image holds."""
        program = shutil.which(command[0], path=self.env["PATH"])
        assert program, f"{command[0]!r} is not on the image's PATH {self.env['PATH']}"
        return [program, *(self.host_path(a) if a.startswith("/") else a for a in command[1:])]


# --- what the Job controller and kubelet give a pod -----------------------------------------------

@dataclass
class PodIdentity:
    """One pod of the Indexed Job as the Job controller makes it."""

    index: int
    name: str
    uid: str
    hostname: str
    fqdn: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ip: str


def pod_identity(m: Manifests, index: int, job_uid: str, ip: str) -> PodIdentity:
    job = m.job["metadata"]["name"]
    labels = dict(m.job["spec"]["template"]["metadata"].get("labels", {}))
    # The labels and annotation the Job controller adds to each pod of an Indexed Job.
    labels.update({
        "batch.kubernetes.io/controller-uid": job_uid, "controller-uid": job_uid,
        "batch.kubernetes.io/job-name": job, "job-name": job,
        "batch.kubernetes.io/job-completion-index": str(index),
    })
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    hostname = f"{job}-{index}"  # Indexed Job pods get the host name <job>-<index>
    # Without a subdomain the pod has no DNS name of its own: its FQDN is its host name.
    subdomain = m.pod_spec.get("subdomain")
    fqdn = f"{hostname}.{subdomain}.{NAMESPACE}.svc.cluster.local" if subdomain else hostname
    return PodIdentity(index, f"{hostname}-{secrets.token_hex(3)[:5]}", str(uuid.uuid4()), hostname, fqdn,
                       labels, annotations, ip)


def real_secret(m: Manifests) -> dict[str, Any]:
    """The Secret deploy/README.md has users create (``kubectl create secret generic <job>-token
    --from-literal=token=$(openssl rand -hex 32)``): named after the job, key ``token``, a random
    token, stored base64-encoded under ``data`` as the API server stores it."""
    token = secrets.token_hex(32)
    return {"metadata": {"name": f"{m.job['metadata']['name']}-token"},
            "data": {"token": base64.b64encode(token.encode()).decode()}}


def mount_secrets(m: Manifests, secret: dict[str, Any], folder: str) -> dict[str, str]:
    """kubelet's Secret volumes of the worker, written under ``folder``: {mountPath: host folder}.
    A volume whose Secret is not ``secret`` stays empty (kubelet's answer for an optional volume
    whose Secret does not exist)."""
    volumes = {v["name"]: v for v in m.pod_spec.get("volumes", [])}
    mounts = {}
    for mount in m.container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("secret")
        if source is None:
            continue
        host = os.path.join(folder, mount["name"])
        os.makedirs(host, exist_ok=True)
        if source["secretName"] == secret["metadata"]["name"]:
            for key, value in secret["data"].items():
                with open(os.path.join(host, key), "wb") as handle:
                    handle.write(base64.b64decode(value))
        else:
            assert source.get("optional"), f"volume {mount['name']}: Secret {source['secretName']} is missing"
        mounts[mount["mountPath"]] = host
    return mounts


def _downward(pod: PodIdentity, path: str) -> str:
    """A fieldRef value, for the fields the downward API offers to env."""
    simple = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "metadata.uid": pod.uid,
              "spec.nodeName": "sim-node", "spec.serviceAccountName": "default", "status.podIP": pod.ip,
              "status.podIPs": pod.ip}
    if path in simple:
        return simple[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        source = pod.labels if match.group(1) == "labels" else pod.annotations
        # kubelet refuses to start a container whose env names a missing key; so does this.
        assert match.group(2) in source, f"fieldRef {path}: the pod has no such {match.group(1)[:-1]}"
        return source[match.group(2)]
    raise AssertionError(f"fieldRef {path!r} is not simulated here; add it to _downward")


def _expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) references to earlier variables; $$ escapes a $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def container_env(m: Manifests, image: Image, pod: PodIdentity, mounts: Mapping[str, str],
                  api_server: str, *, indexed: bool = True) -> dict[str, str]:
    """The environment kubelet gives the worker container of ``pod`` (``indexed``: a pod of an
    Indexed Job, which the Job controller gives JOB_COMPLETION_INDEX)."""
    env = dict(image.env)
    env.update({
        "HOSTNAME": pod.hostname,
        # kubelet always sets these, also with enableServiceLinks: false. Nothing listens at
        # ``api_server``: the library must never need the API server.
        "KUBERNETES_SERVICE_HOST": api_server, "KUBERNETES_SERVICE_PORT": "443",
        "HOME": "/tmp",  # the image user's home does not exist here
    })
    # The Job controller adds JOB_COMPLETION_INDEX to every container of an Indexed Job, as a
    # fieldRef to the pod's completion-index annotation; it comes before the container's own env.
    index = [{"name": "JOB_COMPLETION_INDEX",
              "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
    entries = [*(index if indexed else []), *m.container.get("env", [])]
    for entry in entries:
        name = entry["name"]
        if "value" in entry:
            env[name] = _expand(str(entry["value"]), env)
            for mount_path, host in mounts.items():  # a mounted volume, or a path into it
                if env[name] == mount_path or env[name].startswith(mount_path + "/"):
                    env[name] = host + env[name][len(mount_path):]
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            env[name] = _downward(pod, source["fieldRef"]["fieldPath"])
        else:
            raise AssertionError(f"{name}: valueFrom {sorted(source)} is not simulated here")
    assert "envFrom" not in m.container, "envFrom is not simulated here"
    return env


def pod_failure_action(job: dict[str, Any], container: str, exit_code: int) -> tuple[str, int | None]:
    """What the Job controller does with a pod whose container ended with ``exit_code``: the
    matching podFailurePolicy rule's action and index, else counting against backoffLimit."""
    assert exit_code != 0, "a pod that exits 0 succeeds; the policy only reads failed pods"
    for index, rule in enumerate(job["spec"].get("podFailurePolicy", {}).get("rules", [])):
        on = rule.get("onExitCodes")
        if on is None:
            continue  # onPodConditions: a DisruptionTarget condition never arises here
        if on.get("containerName") not in (None, container):
            continue
        listed = exit_code in on["values"]
        if listed if on["operator"] == "In" else not listed:
            return rule["action"], index
    return "Count", None


def job_condition(job: dict[str, Any], container: str, exit_codes: Mapping[int, int]) -> str:
    """The Job's terminal condition for these exit codes (each index ran once)."""
    failed = {i: pod_failure_action(job, container, c) for i, c in exit_codes.items() if c != 0}
    if not failed:
        return "Complete" if len(exit_codes) == job["spec"]["completions"] else "Running"
    for i, (action, rule) in sorted(failed.items()):
        if action == "FailJob":
            return f"Failed (PodFailurePolicy: pod {i} matched rule {rule})"
    counted = sum(action == "Count" for action, _ in failed.values())
    return "Failed (BackoffLimitExceeded)" if counted > job["spec"]["backoffLimit"] else "Running (pods recreated)"


# --- probes ---------------------------------------------------------------------------------------

PROBER = r"""
import json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

out_path, period_s, lifetime_s, targets = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
# A fresh connection per check, as kubelet dials one per probe; no proxy, no shared subchannels.
options = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_http_proxy", 0)]
end = time.monotonic() + lifetime_s
with open(out_path, "a", buffering=1) as out:
    while time.monotonic() < end:
        began = time.monotonic()
        for t in targets:
            sent = time.monotonic()
            with grpc.insecure_channel(f"{t['ip']}:{t['port']}", options=options) as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=t["service"]), timeout=t["timeout_s"])
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.RpcError as exc:
                    status = exc.code().name
            out.write(json.dumps({"pod": t["pod"], "service": t["service"], "sent": sent,
                                  "got": time.monotonic(), "status": status}) + "\n")
        time.sleep(max(0.0, period_s - (time.monotonic() - began)))
"""


@dataclass(frozen=True)
class Check:
    pod: int
    service: str
    sent: float
    got: float
    status: str


class Prober:
    """Runs every probe of the manifest against every pod from the node (switch) namespace and
    keeps the results in a file of JSON lines."""

    def __init__(self, topo: netns.Topology, m: Manifests, out_path: str, lifetime_s: float) -> None:
        topo.node_addr()
        targets = []
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = m.container[kind]
            port = probe["grpc"]["port"]
            assert port in {p["containerPort"] for p in m.container["ports"]}, f"{kind} port is no container port"
            for i in range(topo.n_hosts):
                target = {"pod": i, "ip": topo.addr(i), "port": port, "service": probe["grpc"].get("service", ""),
                          "timeout_s": min(1.0, probe.get("timeoutSeconds", 1))}
                if target not in targets:  # startup and liveness ask the same question
                    targets.append(target)
        self.services = sorted({t["service"] for t in targets})
        self.path = out_path
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": ROOT}
        self.proc = topo.popen(netns.NODE, [sys.executable, "-c", PROBER, out_path, str(PROBE_PERIOD_S),
                                            str(lifetime_s), json.dumps(targets)], env=env)

    def checks(self, pod: int | None = None, service: str | None = None) -> list[Check]:
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        found = []
        for line in lines:
            try:
                check = Check(**json.loads(line))
            except (ValueError, TypeError):
                continue  # a line being written
            if (pod is None or check.pod == pod) and (service is None or check.service == service):
                found.append(check)
        return found


def summarize(checks: Sequence[Check]) -> str:
    """Runs of equal answers, e.g. ``UNAVAILABLE x12, NOT_SERVING x3, SERVING x40``."""
    runs: list[list[Any]] = []
    for check in checks:
        if runs and runs[-1][0] == check.status:
            runs[-1][1] += 1
        else:
            runs.append([check.status, 1])
    return ", ".join(f"{status} x{n}" for status, n in runs) or "none"


# --- the simulated job ----------------------------------------------------------------------------

@dataclass
class Pod:
    identity: PodIdentity
    proc: netns.HostProcess
    env: dict[str, str]
    started: float
    exit_code: int | None = None  # as the container runtime reports it (a signal N is 128 + N)
    exited: float | None = None


@dataclass
class SimulatedJob:
    topo: netns.Topology
    m: Manifests
    image: Image
    secret: dict[str, Any]
    prober: Prober
    #: Where each pod's volumes are written (a fresh folder per pod start).
    volumes: str
    extra_env: dict[str, str] = field(default_factory=dict)
    job_uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    pods: dict[int, Pod] = field(default_factory=dict)

    def pod_env(self, index: int, secret: dict[str, Any] | None = None) -> tuple[PodIdentity, dict[str, str]]:
        """Pod ``index`` as the Job controller would make it, and its container's environment."""
        identity = pod_identity(self.m, index, self.job_uid, self.topo.addr(index))
        api_server = str(self.topo.subnet.network_address + 250)  # in the pods' subnet, unused
        folder = os.path.join(self.volumes, f"{identity.name}-{secrets.token_hex(4)}")
        mounts = mount_secrets(self.m, secret or self.secret, folder)
        env = container_env(self.m, self.image, identity, mounts, api_server)
        assert env["GRIDCOMM_BACKEND"] == "nccl", env["GRIDCOMM_BACKEND"]
        env["GRIDCOMM_BACKEND"] = "host"  # no GPU here: the host backend, same API, NumPy arrays
        env["PYTHONPATH"] = ROOT  # stands in for the image's `pip install gridcomm`
        env.update(self.extra_env)
        return identity, env

    def start(self, index: int, secret: dict[str, Any] | None = None) -> Pod:
        identity, env = self.pod_env(index, secret)
        # As root, not the manifest's runAsUser: this machine's Python may live under /root (mode 700).
        argv = ["env", "-C", self.image.host_path(self.image.workdir), *self.image.argv(self.m.container["command"]),
                *self.m.container.get("args", [])]
        proc = self.topo.popen(index, argv, hostname=identity.hostname, env=env)
        pod = Pod(identity, proc, env, time.monotonic())
        self.pods[index] = pod
        return pod

    def wait_probe(self, index: int, service: str, status: str, timeout_s: float, after: float = 0.0) -> Check:
        """The first check of pod ``index``'s ``service``, sent after ``after``, that answered
        ``status``; fails at the deadline, or once the pod has exited and the prober has had time
        to see it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for check in self.prober.checks(index, service):
                if check.sent >= after and check.status == status:
                    return check
            self.poll()
            pod = self.pods.get(index)
            gone = pod is not None and pod.exited is not None and time.monotonic() > pod.exited + 1.0
            if gone or time.monotonic() > deadline:
                raise AssertionError(f"pod {index} never answered {status} for service {service!r} "
                                     f"({'it exited' if gone else f'within {timeout_s} s'})\n{self.report()}")
            assert self.prober.proc.popen.poll() is None, f"the prober exited: {self.prober.proc.stderr()[-2000:]}"
            time.sleep(PROBE_PERIOD_S)

    def poll(self) -> None:
        for pod in self.pods.values():
            if pod.exit_code is None:
                rc = pod.proc.popen.poll()
                if rc is not None:
                    pod.exited = time.monotonic()
                    pod.exit_code = 128 - rc if rc < 0 else rc

    def wait_exits(self, indexes: Sequence[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            running = [i for i in indexes if self.pods[i].exit_code is None]
            if not running:
                return
            assert time.monotonic() < deadline, f"pods {running} still running after {timeout_s} s\n{self.report()}"
            time.sleep(0.05)

    def kill9(self, index: int) -> float:
        pod = self.pods[index]
        self.topo.kill9(pod.proc.pid)
        return time.monotonic()

    def wait_log(self, index: int, pattern: str, timeout_s: float) -> float:
        """Waits for a line of pod ``index``'s log (its stderr) matching ``pattern``."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            lines = self.pods[index].proc.stderr().splitlines()
            if any(re.search(pattern, line) for line in lines[seen:]):
                return time.monotonic()
            seen = max(0, len(lines) - 1)
            assert time.monotonic() < deadline, f"pod {index} logged no line matching {pattern!r}\n{self.report()}"
            assert self.pods[index].proc.popen.poll() is None, f"pod {index} exited\n{self.report()}"
            time.sleep(0.02)

    def exit_codes(self) -> dict[int, int]:
        self.poll()
        return {i: p.exit_code for i, p in self.pods.items() if p.exit_code is not None}

    def report(self) -> str:
        self.poll()
        parts = []
        for i, pod in sorted(self.pods.items()):
            if pod.exit_code is not None:
                pod.proc.wait(2.0)
            parts.append(f"--- pod {i} ({pod.identity.hostname}, {pod.identity.ip}) exit {pod.exit_code}\n"
                         f"stdout: {pod.proc.stdout()[-1500:]}\nstderr: {pod.proc.stderr()[-3000:]}\n"
                         + "".join(f"probe {s!r}: {summarize(self.prober.checks(i, s))}\n" for s in self.prober.services))
        return "\n".join(parts)


@pytest.fixture
def sim(make_topology: Callable[..., netns.Topology], manifests: Manifests,
        tmp_path: Any) -> Iterator[Callable[..., SimulatedJob]]:
    """``sim(**extra_env)``: a topology of WORLD pods with their names, a prober, and nothing started."""

    def make(**extra_env: str) -> SimulatedJob:
        service = manifests.pod_spec["subdomain"]
        job = manifests.job["metadata"]["name"]
        names = {i: [f"{job}-{i}.{service}", f"{job}-{i}.{service}.{NAMESPACE}.svc.cluster.local"] for i in range(WORLD)}
        own = {i: [f"{job}-{i}.{service}.{NAMESPACE}.svc.cluster.local", f"{job}-{i}"] for i in range(WORLD)}
        topo = make_topology(WORLD, names=names, own_names=own)
        prober = Prober(topo, manifests, str(tmp_path / f"{topo.prefix}-probes.jsonl"), lifetime_s=300.0)
        return SimulatedJob(topo, manifests, Image.from_dockerfile(), real_secret(manifests), prober,
                            str(tmp_path / f"{topo.prefix}-volumes"), extra_env)

    yield make


def record(table: OutcomeTable, job: SimulatedJob, fault: str, expected: str, time_s: float, bound: str) -> None:
    outcome = ", ".join(f"{i}:{'running' if p.exit_code is None else p.exit_code}" for i, p in sorted(job.pods.items()))
    table.add(fault=fault, expected=expected, outcome=f"exit {outcome}", time=time_s, bound=bound,
              setup_s=job.topo.setup_s or 0.0, teardown_s="")


def assert_ran_as_the_pod(job: SimulatedJob, index: int) -> None:
    """train.py's own lines: the rank is the completion index, the world the manifest's."""
    stderr = job.pods[index].proc.stderr()
    assert re.search(rf"train: rank {index} of {WORLD} joined", stderr), job.report()


# --- the cases ------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_clean_run_every_pod_ready_then_exits_zero(sim: Callable[..., SimulatedJob], outcome_table: OutcomeTable) -> None:
    # 40 steps instead of train.py's 10 keep each pod ready for a few seconds, long enough to be
    # probed many times; the work is otherwise the manifest's (1 Mi float32 per all_reduce).
    job = sim(TRAIN_STEPS="40")
    started = time.monotonic()
    for i in range(WORLD):
        job.start(i)
    for i in range(WORLD):
        job.wait_probe(i, READINESS, "SERVING", STARTUP_S + RUN_S)
        job.wait_probe(i, "", "SERVING", 1.0)
    job.wait_exits(range(WORLD), STARTUP_S + RUN_S)
    elapsed = time.monotonic() - started
    record(outcome_table, job, "none (clean run)", "all exit 0", elapsed, f"{STARTUP_S + RUN_S:g} s")
    assert job.exit_codes() == {i: EXIT_OK for i in range(WORLD)}, job.report()
    for i in range(WORLD):
        assert_ran_as_the_pod(job, i)
        assert job.pods[i].proc.wait(5.0) == 0
        assert re.search(rf"^rank {i}/{WORLD}: 40 all_reduce of 1048576 float32 correct", job.pods[i].proc.stdout(), re.M)
        # Ready from the communicator's start until the clean stop (which turns it NOT_SERVING as
        # the pod leaves), without a flap in between; live all that time (what a stopping server
        # answers is not judged).
        ready = job.prober.checks(i, READINESS)
        serving = [c for c in ready if c.status == "SERVING"]
        during = [c for c in ready if serving[0].sent <= c.sent <= serving[-1].sent]
        assert {c.status for c in during} == {"SERVING"}, f"pod {i} readiness: {summarize(ready)}"
        live = [c for c in job.prober.checks(i, "") if serving[0].sent <= c.sent <= serving[-1].sent]
        assert {c.status for c in live} == {"SERVING"}, f"pod {i} liveness: {summarize(job.prober.checks(i, ''))}"
    assert job_condition(job.m.job, job.m.container["name"], job.exit_codes()) == "Complete"


@pytest.mark.timeout(150)
def test_rank_zero_started_ten_seconds_late_workers_wait_and_succeed(sim: Callable[..., SimulatedJob],
                                                                      outcome_table: OutcomeTable) -> None:
    job = sim(TRAIN_STEPS="20")
    rank0_names = job.topo.names[0]
    for name in rank0_names:  # no pod, no DNS record
        job.topo.hide_name(name)
    for i in range(1, WORLD):
        job.start(i)
    # Running, not ready: liveness (and the startup probe) pass while the workers wait.
    for i in range(1, WORLD):
        job.wait_probe(i, "", "SERVING", STARTUP_S)
    late_start = job.pods[1].started + 10.0
    time.sleep(max(0.0, late_start - time.monotonic()))
    for i in range(1, WORLD):
        assert job.pods[i].proc.popen.poll() is None, f"pod {i} gave up before rank 0 existed\n{job.report()}"
        up = job.wait_probe(i, "", "SERVING", 0.0).sent  # from the first answer on (before: not listening yet)
        for service in ("", READINESS):
            answers = {c.status for c in job.prober.checks(i, service) if c.sent >= up}
            want = {"SERVING"} if service == "" else {"NOT_SERVING"}
            assert answers == want, f"pod {i} without rank 0, {service!r}: {summarize(job.prober.checks(i, service))}"
    for name in rank0_names:
        job.topo.show_name(name)
    rank0_started = time.monotonic()
    job.start(0)
    ready_s = max(job.wait_probe(i, READINESS, "SERVING", STARTUP_S + RUN_S).got for i in range(WORLD)) - rank0_started
    job.wait_exits(range(WORLD), STARTUP_S + RUN_S)
    record(outcome_table, job, "rank 0 pod and DNS 10 s late", "all ready, exit 0", ready_s,
           f"all ready {ready_s:.1f} s, exited {time.monotonic() - rank0_started:.1f} s after rank 0 started "
           f"(<= {STARTUP_S + RUN_S:g})")
    assert job.exit_codes() == {i: EXIT_OK for i in range(WORLD)}, job.report()
    for i in range(WORLD):
        assert_ran_as_the_pod(job, i)
    assert job_condition(job.m.job, job.m.container["name"], job.exit_codes()) == "Complete"


class ServingAgain(AssertionError):
    """A pod's health service answered SERVING again after it had turned NOT_SERVING."""


@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "rank0"])
@pytest.mark.timeout(150)
def test_pod_killed_mid_job_others_fail_named_and_turn_not_serving(
        sim: Callable[..., SimulatedJob], outcome_table: OutcomeTable, victim: int) -> None:
    """The kill lands at the start of a step's compute (train.py's TRAIN_STEP_SLEEP_S), which lasts
    longer than the liveness bound: the others must learn of it while busy, not only at their next
    collective, and turn not ready while still alive (liveness stays SERVING: kubelet must not kill
    a survivor); then fail that collective with a named error and exit 3. A worker's death reaches
    them through the coordinator; rank 0's takes the coordinator with it, which their heartbeats
    notice."""
    job = sim(TRAIN_STEPS="1000", TRAIN_ELEMENTS="1024")
    heartbeat_s = _config.heartbeat_timeout_s(environ=job.pod_env(0)[1])  # the manifest's, else the default
    compute_s = heartbeat_s + 4.0
    job.extra_env["TRAIN_STEP_SLEEP_S"] = str(compute_s)
    for i in range(WORLD):
        job.start(i)
    for i in range(WORLD):
        job.wait_probe(i, READINESS, "SERVING", STARTUP_S + RUN_S)
    job.wait_log(victim, rf"rank {victim}: step 1 of 1000 done", RUN_S)
    killed = job.kill9(victim)
    survivors = [i for i in range(WORLD) if i != victim]
    notice_bound_s = heartbeat_s + 2.0
    for i in survivors:
        job.wait_probe(i, READINESS, "NOT_SERVING", notice_bound_s + PROBE_PERIOD_S * 3, after=killed)
    noticed = max(job.wait_probe(i, READINESS, "NOT_SERVING", 0.0, after=killed).got for i in survivors) - killed
    job.wait_exits([victim], 5.0)
    exit_bound_s = compute_s + heartbeat_s + 5.0
    job.wait_exits(survivors, exit_bound_s)
    exited = max(job.pods[i].exited or 0.0 for i in survivors) - killed
    record(outcome_table, job, f"kill -9 pod {victim} mid-job ({compute_s:g} s steps)",
           f"others NOT_SERVING, exit {EXIT_PEER_FAILED}", exited,
           f"NOT_SERVING {noticed:.1f} s (<= {notice_bound_s:g}), exit <= {exit_bound_s:g} s")
    codes = job.exit_codes()
    assert codes[victim] == SIGKILL_EXIT, job.report()
    assert {i: codes[i] for i in survivors} == {i: EXIT_PEER_FAILED for i in survivors}, job.report()
    coordinator = job.pods[survivors[0]].env["GRIDCOMM_HOST"]
    named = (rf"RankFailedError: .*\brank {victim}\b" if victim else
             # rank 0 hosted the coordinator: its silence is reported as rank 0's failure
             rf"(RankFailedError|CoordinatorLost): .*\brank 0\b.*\b{re.escape(coordinator)}\b")
    for i in survivors:
        assert re.search(named, job.pods[i].proc.stderr()), f"pod {i} does not name pod {victim}\n{job.report()}"
    # What the Job controller makes of these exit codes: the survivors' 3 fails the Job at once
    # through the FailJob rule; the victim's 137 alone would only count against backoffLimit.
    container = job.m.container["name"]
    assert pod_failure_action(job.m.job, container, codes[victim]) == ("Count", None)
    for i in survivors:
        assert pod_failure_action(job.m.job, container, codes[i]) == ("FailJob", 1)
    assert job_condition(job.m.job, container, codes).startswith("Failed (PodFailurePolicy: pod ")
    # Readiness: once out of service, never back (no recovery here). Liveness: SERVING from the
    # kill until the survivor's process is on its way out (what a stopping server answers in its
    # last moment is not judged).
    for i in survivors:
        after = [c for c in job.prober.checks(i, READINESS) if c.sent >= killed]
        statuses = [c.status for c in after]
        if "SERVING" in statuses[statuses.index("NOT_SERVING"):]:
            raise ServingAgain(f"pod {i} readiness after the kill: {summarize(after)}\n{job.report()}")
        exited = job.pods[i].exited
        assert exited is not None
        live = [c for c in job.prober.checks(i, "") if killed <= c.sent and c.got <= exited - 0.5]
        assert live and {c.status for c in live} == {"SERVING"}, \
            f"pod {i} liveness after the kill: {summarize(job.prober.checks(i, ''))}\n{job.report()}"


@pytest.mark.timeout(120)
def test_pod_with_another_token_exits_2_and_fails_the_job(sim: Callable[..., SimulatedJob],
                                                          outcome_table: OutcomeTable) -> None:
    """deploy/README.md: "the ranks were given different tokens, or the Secret changed during the
    run" ends in AuthenticationError and exit code 2, which the FailJob rule ends the Job on."""
    job = sim()
    job.start(0)
    job.wait_probe(0, "", "SERVING", STARTUP_S)  # rank 0's process is up (its coordinator follows)
    started = time.monotonic()
    job.start(1, secret=real_secret(job.m))  # the Secret re-created in between: a new token
    job.wait_exits([1], STARTUP_S)
    record(outcome_table, job, "pod 1 has another token", "pod 1 exits 2", time.monotonic() - started,
           f"{STARTUP_S:g} s")
    codes = job.exit_codes()
    assert codes == {1: 2}, job.report()  # rank 0 still waits for its ranks
    # Rank 0 waits alone: live, and not ready before the rendezvous (it hosts the coordinator).
    up = job.wait_probe(0, "", "SERVING", 0.0).sent
    for service, want in (("", {"SERVING"}), (READINESS, {"NOT_SERVING"})):
        answers = {c.status for c in job.prober.checks(0, service) if c.sent >= up}
        assert answers == want, f"pod 0 {service!r} before the rendezvous: {summarize(job.prober.checks(0, service))}"
    assert re.search(r"configuration error: .*token", job.pods[1].proc.stderr(), re.I), job.report()
    container = job.m.container["name"]
    assert pod_failure_action(job.m.job, container, codes[1]) == ("FailJob", 1)
    assert job_condition(job.m.job, container, codes).startswith("Failed (PodFailurePolicy: pod 1 matched rule 1)")
