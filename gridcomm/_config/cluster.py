"""Cluster detection: who am I (rank), how many are we, and where is rank 0's coordinator.

One detector class per environment, tried in the order of :data:`DETECTORS`; the first whose
variables are present decides. Detectors never read the process environment or call the Kubernetes API: they
take a ``Mapping[str, str]`` environment (by default :func:`gridcomm._config.readers.process_environ`) and
the host's names, so each environment is testable with plain inputs.

Within every detector the ``GRIDCOMM_*`` variables still win field by field (``GRIDCOMM_HOST`` over
a name derived from the pod's hostname, ``GRIDCOMM_WORLD_SIZE`` over ``WORLD_SIZE``), because the
:mod:`gridcomm._config.readers` it uses put them first.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from gridcomm._config import readers as _config
from gridcomm._errors import ConfigError

#: Variables that name the coordinator's host; if any is set, no name is derived from the hostname.
_HOST_VARS = ("GRIDCOMM_HOST", "CUPYX_DISTRIBUTED_HOST", "MASTER_ADDR")
#: Set by the manifests from the JobSet's pod label and annotation (downward API), see deploy/k8s.
JOBSET_NAME_VAR = "JOBSET_NAME"
JOBSET_REPLICAS_VAR = "JOBSET_REPLICATED_JOB_REPLICAS"
SUBDOMAIN_VAR = "GRIDCOMM_SUBDOMAIN"

#: Every variable this module reads itself (the rest are read through gridcomm._config.readers).
ENV_NAMES = frozenset({
    "GRIDCOMM_RANK", "RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX", "TORCHELASTIC_USE_AGENT_STORE",
    "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
    JOBSET_NAME_VAR, JOBSET_REPLICAS_VAR, SUBDOMAIN_VAR, *_HOST_VARS,
})


@dataclass(frozen=True)
class ClusterInfo:
    """Where this process stands in the job: its rank, the world size and the coordinator address.

    ``source`` names the detector that produced it ("gridcomm", "torchrun", "kubeflow",
    "jobset", "kubernetes"), so log lines can say why a rank was chosen.
    """

    rank: int
    world_size: int
    host: str
    port: int
    local_rank: int
    source: str
    #: The relay tree's addresses as a template (see readers.relay_addresses), where the
    #: detector can derive every pod's name; None otherwise.
    relay_addresses: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"{self.source}: rank {self.rank} is out of range for world size {self.world_size}; "
                f"ranks are 0..{self.world_size - 1}. Check the world size the job was started with."
            )
        if self.local_rank < 0:
            raise ConfigError(f"{self.source}: local rank {self.local_rank} must be at least 0.")


class _HostNames:
    """The host's short name and fully qualified name, looked up only when a detector needs them,
    because ``socket.getfqdn()`` may wait on a resolver."""

    def __init__(self, hostname: str | None, fqdn: str | None) -> None:
        self._hostname = hostname
        self._fqdn = fqdn

    @property
    def hostname(self) -> str:
        """The short host name (a pod's ``spec.hostname``, or ``<job>-<index>`` in an Indexed Job)."""
        if self._hostname is None:
            self._hostname = socket.gethostname()
        return self._hostname.partition(".")[0]

    @property
    def fqdn(self) -> str:
        if self._fqdn is None:
            self._fqdn = socket.getfqdn(self.hostname)
        return self._fqdn.rstrip(".")


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return None if value is None or not value.strip() else value.strip()


def _int(env: Mapping[str, str], name: str, default: int | None = None, *, minimum: int = 0) -> int:
    value = _get(env, name)
    if value is None:
        if default is None:
            raise ConfigError(f"{name} is not set.")
        return default
    return _config.parse_int(name, value, minimum=minimum)


def _local_rank(env: Mapping[str, str]) -> int:
    found = _config.local_rank(env)
    return 0 if found is None else found


def _address(env: Mapping[str, str], derive: Callable[[], str] | None) -> tuple[str, int]:
    """The coordinator's host and port: GRIDCOMM_HOST and its fellows if any is set, else the name
    ``derive`` builds; the port from GRIDCOMM_PORT and its fellows, else 13333."""
    if derive is None or any(_get(env, name) for name in _HOST_VARS):
        return _config.coordinator_address(environ=env)
    return _config.coordinator_address(host=derive(), environ=env)


class Detector:
    """One environment: present when every variable in ``requires`` is set; ``detect`` reads them."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]

    @classmethod
    def present(cls, env: Mapping[str, str]) -> bool:
        return all(_get(env, name) is not None for name in cls.requires)

    @staticmethod
    def detect(env: Mapping[str, str], names: _HostNames) -> ClusterInfo:
        raise NotImplementedError


def _from_config(env: Mapping[str, str], source: str) -> ClusterInfo:
    """Everything from the readers in gridcomm._config (GRIDCOMM_* first, then RANK, MASTER_ADDR...)."""
    size = _config.world_size(environ=env)
    host, port = _address(env, None)
    return ClusterInfo(_config.rank(None, size, env), size, host, port, _local_rank(env), source)


class GridcommEnv(Detector):
    """``GRIDCOMM_RANK`` set explicitly (``gridcomm launch`` or by hand): everything comes from the
    ``GRIDCOMM_*`` variables and the conventions :mod:`gridcomm._config` understands."""

    name = "gridcomm"
    requires = ("GRIDCOMM_RANK",)

    @staticmethod
    def detect(env: Mapping[str, str], names: _HostNames) -> ClusterInfo:
        return _from_config(env, GridcommEnv.name)


class Torchrun(Detector):
    """torchrun, or a Kubeflow PyTorchJob running the script directly: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_RANK``."""

    name = "torchrun"
    requires = ("RANK", "WORLD_SIZE")

    @staticmethod
    def detect(env: Mapping[str, str], names: _HostNames) -> ClusterInfo:
        if (_get(env, "TORCHELASTIC_USE_AGENT_STORE") or "").lower() == "true":
            # torchrun's agent already listens on MASTER_PORT (its TCPStore) on the master node, so
            # the coordinator must not take it: GRIDCOMM_PORT, else a port every rank of this job
            # derives alike and another job almost never does (see agent_store_port).
            store_port = _get(env, "MASTER_PORT") or ""
            env = {k: v for k, v in env.items() if k != "MASTER_PORT"}
            if not any(_get(env, name) for name in ("GRIDCOMM_PORT", "CUPYX_DISTRIBUTED_PORT")):
                env["GRIDCOMM_PORT"] = str(agent_store_port(_get(env, "TORCHELASTIC_RUN_ID") or "",
                                                            _get(env, "MASTER_ADDR") or "", store_port))
        return _from_config(env, Torchrun.name)


#: The ports agent_store_port picks from: below Linux's ephemeral range (32768-60999), so no
#: connection's local port takes it, and above the well-known services.
AGENT_STORE_PORTS = range(20000, 32000)


def agent_store_port(run_id: str, master_addr: str, master_port: str) -> int:
    """The coordinator's port under torchrun's agent store: derived from torchrun's run id and its
    store's address, which every rank of one job shares and two jobs on one host do not (two
    torchrun jobs there have different store ports). Why not a fixed default: two such jobs on one
    host both bound 13333 ("already in use"). Two jobs meet on one port with odds 1 in 12,000;
    then the bind fails at once naming GRIDCOMM_PORT, which sets the port by hand."""
    digest = hashlib.blake2s(f"{run_id}\0{master_addr}\0{master_port}".encode(), digest_size=8).digest()
    port = AGENT_STORE_PORTS[int.from_bytes(digest, "big") % len(AGENT_STORE_PORTS)]
    return port if str(port) != master_port else port + 1 if port + 1 in AGENT_STORE_PORTS else AGENT_STORE_PORTS[0]


def _fixed_count(env: Mapping[str, str], name: str, default: int) -> int:
    """A torchrun node or process count: an integer, or ``N:N`` (an elastic range that cannot move)."""
    value = _get(env, name)
    if value is not None and ":" in value:
        low, _, high = value.partition(":")
        if low.strip() != high.strip():
            raise ConfigError(
                f"{name}={value!r} is an elastic range; gridcomm needs a fixed size. Set {name} to one "
                f"number, or set GRIDCOMM_WORLD_SIZE and GRIDCOMM_RANK."
            )
        env = {name: low}
    try:
        return _int(env, name, default, minimum=1)
    except ConfigError as exc:
        raise ConfigError(f"{exc} Set GRIDCOMM_WORLD_SIZE and GRIDCOMM_RANK to say it directly.") from None


class KubeflowPet(Detector):
    """A Kubeflow PyTorchJob/TrainJob pod running the script without torchrun: ``PET_NNODES``,
    ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``.

    Rank = node rank x processes per node + local rank, as torchrun would number them.
    """

    name = "kubeflow"
    requires = ("PET_NODE_RANK",)

    @staticmethod
    def detect(env: Mapping[str, str], names: _HostNames) -> ClusterInfo:
        nnodes = _fixed_count(env, "PET_NNODES", 1)
        nproc = _fixed_count(env, "PET_NPROC_PER_NODE", 1)
        node_rank = _int(env, "PET_NODE_RANK")
        local = _local_rank(env)
        if local >= nproc:
            raise ConfigError(f"local rank {local} is out of range for PET_NPROC_PER_NODE={nproc}.")
        # PET_MASTER_* are the operator's names for MASTER_*; GRIDCOMM_* set by the user still win.
        host = None if _get(env, "GRIDCOMM_HOST") else _get(env, "PET_MASTER_ADDR")
        port = None if _get(env, "GRIDCOMM_PORT") or _get(env, "PET_MASTER_PORT") is None else _int(
            env, "PET_MASTER_PORT", minimum=1)
        host, port = _config.coordinator_address(host, port, env)
        size = _config.world_size(environ=env) if _get(env, "GRIDCOMM_WORLD_SIZE") else nnodes * nproc
        return ClusterInfo(node_rank * nproc + local, size, host, port, local, KubeflowPet.name)


def _split_index(hostname: str, index: int, what: str) -> str:
    """The part of ``<prefix>-<index>`` before the index, or a ConfigError that shows the fix."""
    prefix, sep, tail = hostname.rpartition("-")
    if not sep or not prefix or tail != str(index):
        raise ConfigError(
            f"the hostname {hostname!r} does not look like {what} with JOB_COMPLETION_INDEX={index} "
            f"(expected '<name>-{index}'); set GRIDCOMM_HOST to rank 0's address, e.g. '<job>-0.<service>'."
        )
    return prefix


def _domain(env: Mapping[str, str], names: _HostNames, default: str | None = None) -> str:
    """The DNS domain that makes a pod's hostname resolvable: GRIDCOMM_SUBDOMAIN, else what follows
    the hostname in the FQDN (``train-3.train.ns.svc.cluster.local`` -> ``train.ns.svc.cluster.local``)."""
    explicit = _get(env, SUBDOMAIN_VAR)
    if explicit is not None:
        return explicit
    fqdn = names.fqdn
    head, dot, rest = fqdn.partition(".")
    if dot and rest and head == names.hostname:
        return rest
    if default is not None:
        return default
    raise ConfigError(
        f"the pod {names.hostname!r} has no DNS subdomain (its FQDN is {fqdn!r}), so rank 0's name cannot be "
        f"derived: set spec.template.spec.subdomain to the headless Service's name, or set GRIDCOMM_SUBDOMAIN "
        f"or GRIDCOMM_HOST."
    )


def _relay_template(env: Mapping[str, str], size: int, pod: Callable[[], str]) -> str | None:
    """The tree's relay addresses from the pods' names, ``pod()`` with ``{leader}`` for the index
    (GRIDCOMM_RELAY_ADDRESSES's template, port 13336), where the tree may be used (from
    RELAY_AUTO_WORLD ranks, or GRIDCOMM_RELAY=on); None where the pods have no resolvable name
    (no subdomain), which only costs the joins through relays."""
    mode = _config.relay_mode(env)
    if mode == "off" or (mode == "auto" and size < _config.RELAY_AUTO_WORLD):
        return None
    try:
        return f"{pod()}:{_config.DEFAULT_RELAY_PORT}"
    except ConfigError:
        return None


class JobSet(Detector):
    """A pod of a JobSet (jobset.x-k8s.io): hostname ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>``.

    Needs ``JOBSET_NAME`` (the pod label ``jobset.sigs.k8s.io/jobset-name`` through the downward API)
    and ``JOB_COMPLETION_INDEX``. Rank = job index x pods per job + pod index, where pods per job is
    the world size over ``JOBSET_REPLICATED_JOB_REPLICAS`` (default 1). Rank 0 is
    ``<jobset>-<replicatedJob>-0-0`` in the JobSet's subdomain (the JobSet's name unless set).
    Only one replicatedJob is numbered this way; with several, set GRIDCOMM_RANK and GRIDCOMM_HOST.
    """

    name = "jobset"
    requires = (JOBSET_NAME_VAR, "JOB_COMPLETION_INDEX")

    @staticmethod
    def detect(env: Mapping[str, str], names: _HostNames) -> ClusterInfo:
        jobset = _get(env, JOBSET_NAME_VAR) or ""
        pod_index = _int(env, "JOB_COMPLETION_INDEX")
        hostname = names.hostname
        # <jobset>-<rjob>-<jobIndex>-<podIndex>: peel the two indices from the right, because
        # the JobSet's and the replicatedJob's names may both contain dashes.
        job_prefix = _split_index(hostname, pod_index, "a JobSet pod")
        rjob_prefix, _, job_index_text = job_prefix.rpartition("-")
        if not job_index_text.isdigit() or not rjob_prefix.startswith(jobset + "-") or rjob_prefix == jobset + "-":
            raise ConfigError(
                f"the hostname {hostname!r} does not look like a pod of JobSet {jobset!r} "
                f"('{jobset}-<replicatedJob>-<jobIndex>-{pod_index}'); set GRIDCOMM_RANK and GRIDCOMM_HOST."
            )
        job_index = int(job_index_text)
        size = _config.world_size(environ=env)
        replicas = _int(env, JOBSET_REPLICAS_VAR, 1, minimum=1)
        if size % replicas:
            raise ConfigError(
                f"GRIDCOMM_WORLD_SIZE={size} is not a multiple of the {replicas} replicas of the replicatedJob; "
                f"it must be replicas x parallelism."
            )
        per_job = size // replicas
        if pod_index >= per_job or job_index >= replicas:
            raise ConfigError(
                f"pod {hostname!r} (job {job_index}, pod {pod_index}) lies outside {replicas} jobs of {per_job} pods "
                f"(GRIDCOMM_WORLD_SIZE={size}); check parallelism, replicas and the world size."
            )
        host, port = _address(env, lambda: f"{rjob_prefix}-0-0.{_domain(env, names, default=jobset)}")
        # Why only with one job: a group's leader is then pod {leader} of job 0; with several
        # jobs a group may span two, and GRIDCOMM_RELAY_ADDRESSES says where the relays are.
        relays = _relay_template(env, size, lambda: f"{rjob_prefix}-0-{{leader}}.{_domain(env, names, default=jobset)}") \
            if replicas == 1 else None
        return ClusterInfo(job_index * per_job + pod_index, size, host, port, _local_rank(env), JobSet.name,
                           relays)


class IndexedJob(Detector):
    """A pod of a Kubernetes Indexed Job: rank from ``JOB_COMPLETION_INDEX``, hostname ``<job>-<index>``,
    rank 0 at ``<job>-0.<subdomain>`` (the pod's ``subdomain`` is the headless Service). The world
    size must be given (``GRIDCOMM_WORLD_SIZE``): a pod is not told its Job's completions."""

    name = "kubernetes"
    requires = ("JOB_COMPLETION_INDEX",)

    @staticmethod
    def detect(env: Mapping[str, str], names: _HostNames) -> ClusterInfo:
        size = _config.world_size(environ=env)
        rank = _config.rank(None, size, env)

        def pod(index: str) -> str:
            prefix = _split_index(names.hostname, _int(env, "JOB_COMPLETION_INDEX"), "an Indexed Job pod")
            return f"{prefix}-{index}.{_domain(env, names)}"

        host, port = _address(env, lambda: pod("0"))
        relays = _relay_template(env, size, lambda: pod("{leader}"))
        return ClusterInfo(rank, size, host, port, _local_rank(env), IndexedJob.name, relays)


#: Tried in order; the most specific environment first. torchrun comes before Kubernetes because
#: torchrun inside a pod numbers processes itself; JobSet before Indexed Job because a JobSet's pods
#: are Indexed Job pods too.
DETECTORS: tuple[type[Detector], ...] = (GridcommEnv, Torchrun, KubeflowPet, JobSet, IndexedJob)


def detect(
    environ: Mapping[str, str] | None = None,
    *,
    hostname: str | None = None,
    fqdn: str | None = None,
) -> ClusterInfo:
    """Detects rank, world size and coordinator address from the environment.

    ``environ`` defaults to the process environment (read through :mod:`gridcomm._config.readers`);
    ``hostname`` to ``socket.gethostname()`` and ``fqdn`` to ``socket.getfqdn()``, looked up only
    when a Kubernetes detector needs the pod's subdomain.

    >>> env = {"JOB_COMPLETION_INDEX": "1", "GRIDCOMM_WORLD_SIZE": "2"}
    >>> detect(env, hostname="train-1", fqdn="train-1.train.default.svc.cluster.local").host
    'train-0.train.default.svc.cluster.local'
    """
    env = _config.process_environ() if environ is None else environ
    names = _HostNames(hostname, fqdn)
    for detector in DETECTORS:
        if detector.present(env):
            return detector.detect(env, names)
    raise ConfigError(
        "cannot tell this process's rank: none of GRIDCOMM_RANK (gridcomm launch), RANK and WORLD_SIZE "
        "(torchrun), PET_NODE_RANK (Kubeflow) or JOB_COMPLETION_INDEX (Kubernetes Indexed Job) is set. "
        "Pass rank and n_devices, or set GRIDCOMM_RANK and GRIDCOMM_WORLD_SIZE."
    )
