"""Pod simulation of deploy/k8s/recoverable/: a worker pod killed mid-training is replaced as the
Job controller would replace it, the survivors rebuild, and the job completes.

The manifests come fresh from ``deploy/k8s/generate.py --recoverable`` (world size 3). What
``tests/test_pod_simulation.py`` does for the embedded Job is done here too, with its helpers:
each pod is a network namespace with the host name Kubernetes gives it, runs its container's own
``command`` through the Dockerfile's files and venv, with the environment kubelet builds (the
manifest's ``env``, downward-API fields, the token Secret's volume), and is probed from the node
namespace as kubelet does. The pods are the coordinator Deployment's one pod (``gridcomm serve``,
its host name the pod's name) and the Indexed Job's three workers (``python /app/train.py``).

The Job controller's part is played by :func:`tests.support.k8s_jobs.on_pod_failure`: a worker pod
that fails is run through the manifest's ``podFailurePolicy`` and ``backoffLimitPerIndex``, and
when the verdict is to recreate the index, a new pod (new name and UID, new process, same index)
starts after the controller's back-off delay, which is waited for in full (10 s for an index's
first failure). A pod that exits 0 completes its index.

Departures, each also stated where it happens: ``GRIDCOMM_BACKEND=host`` (no GPU); the ``TRAIN_*``
knobs size and pace the work; pods run as root; the coordinator Service's ClusterIP is modelled as
its name resolving to the coordinator pod's address (kube-proxy's forwarding to the only endpoint
is not simulated); the checkpoint PersistentVolumeClaim is a folder of this machine that every
worker's ``/checkpoints`` maps onto (a ReadWriteMany volume); a replacement pod gets its index's
namespace, so the old pod's address (a real one usually gets another).

Needs root, iproute2 and gridcomm's recovery (``Communicator.rebuild``); ``-s`` prints the outcome
table with the death-to-first-good-step time.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import conftest_netns
import netns
import pytest
import test_pod_simulation as podsim
import yaml
from conftest_netns import OutcomeTable

import gridcomm
from tests.support import k8s_jobs

make_topology = conftest_netns.make_topology
netns_usable = conftest_netns.netns_usable
outcome_table = conftest_netns.outcome_table

pytestmark = pytest.mark.netns

JOB_NAME = "simjob"
WORLD = 3
COORDINATOR_HOST = WORLD  # the coordinator pod's namespace comes after the workers'
STEPS = 30
STEP_SLEEP_S = 0.2
VICTIM = 1
KILL_AFTER_STEP = 8
CHECKPOINT_EVERY = 5  # train.py's default, which the manifests keep
#: What the test allows on top of the Job controller's back-off for one recovery on two shared
#: cores: death noticed, a new Python process up, the rebuild, the steps since the checkpoint.
RECOVERY_SLACK_S = 30.0

needs_recovery = pytest.mark.skipif(
    not hasattr(gridcomm.Communicator, "rebuild"),
    reason="gridcomm.Communicator has no rebuild() here (recovery in place is missing from this checkout): "
           "train.py refuses TRAIN_RECOVERY=rebuild with exit code 2 without it")


@dataclass
class RecoverableManifests:
    """The generator's recoverable/ files; ``workers`` and ``coordinator`` in the shape
    tests/test_pod_simulation.py's helpers read (a Job-like object with a pod template)."""

    files: dict[str, dict[str, Any]]

    @property
    def workers(self) -> podsim.Manifests:
        return podsim.Manifests(self.files["coordinator-service.yaml"], self.files["job.yaml"])

    @property
    def coordinator(self) -> podsim.Manifests:
        deployment = self.files["coordinator.yaml"]
        return podsim.Manifests(self.files["coordinator-service.yaml"],
                                {"metadata": deployment["metadata"], "spec": {"template": deployment["spec"]["template"]}})

    @property
    def job(self) -> dict[str, Any]:
        return self.files["job.yaml"]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> RecoverableManifests:
    out = tmp_path_factory.mktemp("manifests")
    subprocess.run([sys.executable, podsim.GENERATE, "--name", JOB_NAME, "--world-size", str(WORLD), "--out", str(out)],
                   check=True, timeout=60)
    files = {}
    for path in sorted((out / "recoverable").iterdir()):
        (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        files[path.name] = doc
    m = RecoverableManifests(files)
    assert m.job["spec"]["completions"] == m.job["spec"]["parallelism"] == WORLD
    assert m.files["coordinator.yaml"]["spec"]["replicas"] == 1
    return m


@dataclass
class Simulation:
    """The coordinator pod, the Job's worker pods, and the Job controller's decisions."""

    topo: netns.Topology
    m: RecoverableManifests
    image: podsim.Image
    secret: dict[str, Any]
    prober: podsim.Prober
    volumes: str
    #: The host folder the checkpoint claim stands for.
    claim: str
    extra_env: dict[str, str]
    job_uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    coordinator: podsim.Pod | None = None
    #: The current pod of each index; every worker pod that ran, in start order.
    pods: dict[int, podsim.Pod] = field(default_factory=dict)
    history: list[podsim.Pod] = field(default_factory=list)
    states: dict[int, k8s_jobs.IndexState] = field(default_factory=dict)
    decisions: list[tuple[int, int, k8s_jobs.Decision]] = field(default_factory=list)
    #: Index -> when the controller makes its next pod.
    due: dict[int, float] = field(default_factory=dict)
    succeeded: set[int] = field(default_factory=set)
    job_failed: str = ""

    def _start(self, host: int, m: podsim.Manifests, identity: podsim.PodIdentity, *, indexed: bool,
               claim_mount: str | None) -> podsim.Pod:
        api_server = str(self.topo.subnet.network_address + 250)
        folder = os.path.join(self.volumes, f"{identity.name}-{secrets.token_hex(4)}")
        mounts = podsim.mount_secrets(m, self.secret, folder)
        if claim_mount is not None:
            mounts[claim_mount] = self.claim  # the PersistentVolumeClaim, one folder for every pod
        env = podsim.container_env(m, self.image, identity, mounts, api_server, indexed=indexed)
        if "GRIDCOMM_BACKEND" in env:
            assert env["GRIDCOMM_BACKEND"] == "nccl", env["GRIDCOMM_BACKEND"]
            env["GRIDCOMM_BACKEND"] = "host"  # no GPU here: the host backend, same API, NumPy arrays
        env["PYTHONPATH"] = podsim.ROOT  # stands in for the image's `pip install gridcomm`
        env.update(self.extra_env if indexed else {})
        argv = ["env", "-C", self.image.host_path(self.image.workdir), *self.image.argv(m.container["command"]),
                *m.container.get("args", [])]
        proc = self.topo.popen(host, argv, hostname=identity.hostname, env=env)
        return podsim.Pod(identity, proc, env, time.monotonic())

    def start_coordinator(self) -> podsim.Pod:
        m = self.m.coordinator
        name = f"{m.job['metadata']['name']}-{secrets.token_hex(5)[:9]}-{secrets.token_hex(3)[:5]}"
        labels = {**m.job["spec"]["template"]["metadata"]["labels"], "pod-template-hash": name.split("-")[-2]}
        # A Deployment's pod: its host name is its name, and it has no subdomain.
        identity = podsim.PodIdentity(0, name, str(uuid.uuid4()), name, name, labels, {}, self.topo.addr(COORDINATOR_HOST))
        self.coordinator = self._start(COORDINATOR_HOST, m, identity, indexed=False, claim_mount=None)
        return self.coordinator

    def start_worker(self, index: int) -> podsim.Pod:
        m = self.m.workers
        identity = podsim.pod_identity(m, index, self.job_uid, self.topo.addr(index))
        state = self.states.setdefault(index, k8s_jobs.IndexState(index))
        # The failure count the Job controller annotates each pod of an index with (KEP-3850).
        identity.annotations["batch.kubernetes.io/job-index-failure-count"] = str(state.counted)
        (mount,) = [v["mountPath"] for v in m.container["volumeMounts"] if v["name"] == "checkpoints"]
        pod = self._start(index, m, identity, indexed=True, claim_mount=mount)
        self.pods[index] = pod
        self.history.append(pod)
        return pod

    def reconcile(self) -> None:
        """One pass of the Job controller: failed pods through the policy, due pods made."""
        now = time.monotonic()
        for index, pod in list(self.pods.items()):
            if pod.exit_code is None:
                rc = pod.proc.popen.poll()
                if rc is None:
                    continue
                pod.exited, pod.exit_code = now, (128 - rc if rc < 0 else rc)
                if pod.exit_code == 0:
                    self.succeeded.add(index)
                    continue
                failed = sum(s.failed for s in self.states.values())
                decision = k8s_jobs.on_pod_failure(self.m.job, self.states[index], failed, self.m.workers.container["name"],
                                                   pod.exit_code)
                self.decisions.append((index, pod.exit_code, decision))
                if decision.job_failed:
                    self.job_failed = decision.job_failed
                elif decision.recreate:
                    self.due[index] = pod.exited + decision.delay_s
        if self.job_failed:
            return
        for index, when in list(self.due.items()):
            if now >= when:
                del self.due[index]
                self.start_worker(index)

    def run_until(self, done: Callable[[], bool], timeout_s: float, what: str) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            self.reconcile()
            if done():
                return time.monotonic()
            assert not self.job_failed, f"the Job failed ({self.job_failed}) while waiting for {what}\n{self.report()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s\n{self.report()}"
            assert self.coordinator is not None and self.coordinator.proc.popen.poll() is None, \
                f"the coordinator pod exited\n{self.report()}"
            time.sleep(0.02)

    def logged(self, pod: podsim.Pod, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in pod.proc.stderr().splitlines())

    def ready(self, host: int, after: float) -> bool:
        return any(c.sent >= after and c.status == "SERVING" for c in self.prober.checks(host, podsim.READINESS))

    def report(self) -> str:
        parts = []
        for pod in [*([self.coordinator] if self.coordinator else []), *self.history]:
            host = COORDINATOR_HOST if pod is self.coordinator else pod.identity.index
            parts.append(f"--- {pod.identity.name} ({pod.identity.ip}) exit {pod.proc.popen.poll()}\n"
                         f"stdout: {pod.proc.stdout()[-1500:]}\nstderr: {pod.proc.stderr()[-4000:]}\n"
                         + "".join(f"probe {s!r} of host {host}: {podsim.summarize(self.prober.checks(host, s))}\n"
                                   for s in self.prober.services))
        parts.append(f"Job controller: {self.decisions}")
        return "\n".join(parts)


@pytest.fixture
def sim(make_topology: Callable[..., netns.Topology], manifests: RecoverableManifests, tmp_path: Any) -> Simulation:
    service = manifests.files["coordinator-service.yaml"]["metadata"]["name"]
    names: dict[int, list[str]] = {i: [] for i in range(WORLD)}
    # The ClusterIP Service's name resolves to its only endpoint, the coordinator pod (departure:
    # kube-proxy's virtual IP is not simulated).
    names[COORDINATOR_HOST] = [service, f"{service}.{podsim.NAMESPACE}.svc.cluster.local"]
    own = {i: [f"{JOB_NAME}-{i}"] for i in range(WORLD)}  # kubelet's /etc/hosts line for the pod itself
    topo = make_topology(WORLD + 1, names=names, own_names=own)
    prober = podsim.Prober(topo, manifests.workers, str(tmp_path / f"{topo.prefix}-probes.jsonl"), lifetime_s=300.0)
    claim = tmp_path / "checkpoints-claim"
    claim.mkdir()
    extra = {"TRAIN_STEPS": str(STEPS), "TRAIN_ELEMENTS": "4096", "TRAIN_STEP_SLEEP_S": str(STEP_SLEEP_S)}
    return Simulation(topo, manifests, podsim.Image.from_dockerfile(), podsim.real_secret(manifests.workers), prober,
                      str(tmp_path / "volumes"), str(claim), extra)


@needs_recovery
@pytest.mark.timeout(240)
def test_worker_pod_killed_is_replaced_and_survivors_rebuild(sim: Simulation, outcome_table: OutcomeTable) -> None:
    sim.start_coordinator()
    for i in range(WORLD):
        sim.start_worker(i)
    started = sim.run_until(lambda: all(sim.ready(i, 0.0) for i in range(WORLD)), podsim.STARTUP_S + podsim.RUN_S,
                            "readiness of every worker")
    first = dict(sim.pods)
    victim = first[VICTIM]
    sim.run_until(lambda: sim.logged(victim, rf"rank {VICTIM}: step {KILL_AFTER_STEP} of {STEPS} done"), podsim.RUN_S,
                  f"step {KILL_AFTER_STEP} on rank {VICTIM}")
    killed = time.monotonic()
    sim.topo.kill9(victim.proc.pid)
    survivors = [i for i in range(WORLD) if i != VICTIM]

    # The controller's verdict on the victim: counted, recreated after its back-off.
    sim.run_until(lambda: VICTIM in sim.due or sim.pods[VICTIM] is not victim, 5.0, "the controller's verdict")
    index, code, decision = sim.decisions[0]
    assert (index, code) == (VICTIM, podsim.SIGKILL_EXIT), sim.report()
    assert (decision.action, decision.recreate, decision.delay_s) == ("Count", True, k8s_jobs.BACKOFF_BASE_S)
    # Meanwhile the survivors notice and go out of service, alive.
    noticed = sim.run_until(lambda: all(any(c.sent >= killed and c.status == "NOT_SERVING"
                                            for c in sim.prober.checks(i, podsim.READINESS)) for i in survivors),
                            podsim.RUN_S, "the survivors' NOT_SERVING") - killed
    replacement_due = killed + decision.delay_s
    sim.run_until(lambda: sim.pods[VICTIM] is not victim, decision.delay_s + 5.0, "the replacement pod")
    replacement = sim.pods[VICTIM]

    # Every rank's first good step in generation 1: the recovery time.
    pattern = r"first good step of generation 1: step \d+"
    last_good = sim.run_until(lambda: all(sim.logged(sim.pods[i], pattern) for i in range(WORLD)),
                              decision.delay_s + RECOVERY_SLACK_S, "a good step of generation 1 on every rank")
    recovery_s = last_good - killed
    sim.run_until(lambda: sim.succeeded == set(range(WORLD)), podsim.RUN_S, "every index to succeed")
    total_s = time.monotonic() - started
    print(f"\nrecoverable pod simulation: pod {VICTIM} SIGKILLed after step {KILL_AFTER_STEP}; survivors NOT_SERVING "
          f"after {noticed:.2f} s; Job controller back-off {decision.delay_s:g} s; replacement started "
          f"{replacement.started - killed:.2f} s after the death; death to first good step of generation 1 on "
          f"every rank: {recovery_s:.2f} s ({recovery_s - (replacement_due - killed):.2f} s after the back-off); "
          f"job done {total_s:.1f} s after all were ready", flush=True)
    outcome_table.add(fault=f"kill -9 worker pod {VICTIM} (recoverable/, rebuild)",
                      expected="replaced after back-off, survivors rebuild, all exit 0", time=recovery_s,
                      outcome="exit " + ", ".join(f"{p.identity.name}:{p.exit_code}" for p in sim.history),
                      bound=f"death to first good step (back-off {decision.delay_s:g} s + <= {RECOVERY_SLACK_S:g})",
                      setup_s=sim.topo.setup_s or 0.0, teardown_s="")

    # What each pod did and printed (its stdout read to the end).
    for pod in sim.history:
        assert pod.proc.wait(5.0) is not None
    assert [p.exit_code for p in sim.history] == [0 if p is not victim else podsim.SIGKILL_EXIT for p in sim.history]
    assert len(sim.history) == WORLD + 1 and sim.decisions == [(VICTIM, podsim.SIGKILL_EXIT, decision)]
    assert replacement.identity.name != victim.identity.name and replacement.identity.uid != victim.identity.uid
    assert replacement.identity.annotations["batch.kubernetes.io/job-index-failure-count"] == "1"
    for i in survivors:
        stderr, stdout = sim.pods[i].proc.stderr(), sim.pods[i].proc.stdout()
        assert re.search(rf"RankFailedError: .*\brank {VICTIM}\b.*recovering with rebuild\(\)", stderr), sim.report()
        assert re.search(rf"^rank {i}/{WORLD}: {STEPS} all_reduce of 4096 float32 correct .*\(generation 1, 1 recoveries, "
                         r"resumed at step 0\)$", stdout, re.M), sim.report()
    assert re.search(rf"train: rank {VICTIM} of {WORLD} joined generation 1 as a replacement", replacement.proc.stderr())
    resumed = re.search(rf"^rank {VICTIM}/{WORLD}: {STEPS} all_reduce .*\(generation 1, 0 recoveries, resumed at step "
                        r"(\d+)\)$", replacement.proc.stdout(), re.M)
    assert resumed and 0 < int(resumed.group(1)) <= KILL_AFTER_STEP, sim.report()
    with open(os.path.join(sim.claim, "checkpoint.json"), encoding="utf-8") as handle:
        assert json.load(handle) == {"step": STEPS, "generation": 1, "members": list(range(WORLD))}
    # Readiness: the survivors were out of service during the recovery and back after it; liveness
    # answered SERVING all along (kubelet must not kill a rank that waits for its replacement).
    for i in survivors:
        after = [c.status for c in sim.prober.checks(i, podsim.READINESS) if c.sent >= killed]
        assert "SERVING" in after[after.index("NOT_SERVING"):], \
            f"pod {i} readiness after the kill: {podsim.summarize(sim.prober.checks(i, podsim.READINESS))}"
        exited = sim.pods[i].exited
        assert exited is not None
        live = [c for c in sim.prober.checks(i, "") if killed <= c.sent and c.got <= exited - 0.5]
        assert live and {c.status for c in live} == {"SERVING"}, podsim.summarize(sim.prober.checks(i, ""))
    assert sim.ready(VICTIM, replacement.started)
    # The coordinator pod served through it all, and the Job is Complete.
    assert sim.coordinator is not None and sim.coordinator.proc.popen.poll() is None
    coordinator_live = [c.status for c in sim.prober.checks(COORDINATOR_HOST, "") if c.sent >= started]
    assert coordinator_live and set(coordinator_live) == {"SERVING"}, coordinator_live
    assert not sim.job_failed and sim.succeeded == set(range(WORLD))
    sim.coordinator.proc.popen.send_signal(signal.SIGTERM)  # what `kubectl delete` of the Deployment does
    assert sim.coordinator.proc.wait(30.0) is not None, "the coordinator did not stop on SIGTERM"


@needs_recovery
@pytest.mark.timeout(240)
def test_coordinator_pod_killed_every_index_restarts_from_the_checkpoint(sim: Simulation,
                                                                        outcome_table: OutcomeTable) -> None:
    """deploy/README.md's limit: the coordinator is not replaced in place. Its pod's container is
    SIGKILLed; kubelet restarts it (restartPolicy Always: a new, empty coordinator at the same
    address; here at once, where kubelet's crash back-off may wait); every worker exits 3, each
    index is recreated through the Count rule, and the new pods resume from the checkpoint."""
    coordinator = sim.start_coordinator()
    for i in range(WORLD):
        sim.start_worker(i)
    sim.run_until(lambda: all(sim.ready(i, 0.0) for i in range(WORLD)), podsim.STARTUP_S + podsim.RUN_S,
                  "readiness of every worker")
    first = dict(sim.pods)
    sim.run_until(lambda: sim.logged(first[0], rf"rank 0: step {KILL_AFTER_STEP} of {STEPS} done"), podsim.RUN_S,
                  f"step {KILL_AFTER_STEP} on rank 0")
    killed = time.monotonic()
    sim.topo.kill9(coordinator.proc.pid)
    assert coordinator.proc.wait(5.0) is not None
    restarted = sim._start(COORDINATOR_HOST, sim.m.coordinator, coordinator.identity, indexed=False, claim_mount=None)
    sim.coordinator = restarted
    sim.run_until(lambda: all(first[i].exit_code is not None for i in range(WORLD)), podsim.RUN_S,
                  "every first worker pod to end")
    codes = {i: first[i].exit_code for i in range(WORLD)}
    sim.run_until(lambda: sim.succeeded == set(range(WORLD)), 2 * k8s_jobs.BACKOFF_BASE_S + podsim.RUN_S,
                  "every index to succeed")
    done_s = time.monotonic() - killed
    outcome_table.add(fault="kill -9 the coordinator pod (recoverable/)", expected="workers exit 3, recreated, exit 0",
                      time=done_s, outcome="exit " + ", ".join(f"{p.identity.name}:{p.exit_code}" for p in sim.history),
                      bound="", setup_s=sim.topo.setup_s or 0.0, teardown_s="")
    print(f"\nrecoverable pod simulation: coordinator SIGKILLed after step {KILL_AFTER_STEP}; first workers exited "
          f"{codes}; every index done {done_s:.1f} s after the kill", flush=True)
    assert codes == {i: podsim.EXIT_PEER_FAILED for i in range(WORLD)}, sim.report()
    assert [d.action for _, _, d in sim.decisions] == ["Count"] * WORLD, sim.decisions
    # The new pods meet at the new coordinator (its first generation) and agree on the checkpoint,
    # which may be a step or two past the kill: the data plane went on until the ranks noticed.
    resumed = set()
    for pod in sim.history[WORLD:]:
        assert pod.proc.wait(5.0) == 0
        found = re.search(r"\(generation 0, 0 recoveries, resumed at step (\d+)\)$", pod.proc.stdout(), re.M)
        assert found, sim.report()
        resumed.add(int(found.group(1)))
    (step,) = resumed
    assert step >= KILL_AFTER_STEP - CHECKPOINT_EVERY and step % CHECKPOINT_EVERY == 0, resumed
