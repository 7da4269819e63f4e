#!/usr/bin/env python3
"""Writes gridcomm's Kubernetes manifests from the few values a user chooses.

    python deploy/k8s/generate.py --name llm --world-size 16 --image registry.example.com/llm:1 \\
        | kubectl apply -f -                       # headless Service + Indexed Job + metrics Service
    python deploy/k8s/generate.py --jobset --name llm --world-size 16 --image ... | kubectl apply -f -
    python deploy/k8s/generate.py --recoverable --name llm --world-size 16 --image ... \\
        | kubectl apply -f -    # coordinator pod + Indexed Job whose lost pods are replaced in place
    python deploy/k8s/generate.py --servicemonitor --name llm | kubectl apply -f -   # Prometheus Operator
    python deploy/k8s/generate.py --out deploy/k8s  # rewrites the committed example files

``--out DIR`` writes one folder per thing to apply, so that ``kubectl apply -f DIR/job/`` creates
the Indexed Job and nothing else (the JobSet is in ``DIR/jobset/``, the ServiceMonitor, which needs
the Prometheus Operator's CRDs, in ``DIR/monitoring/``, the recoverable variant in
``DIR/recoverable/``). There is no Secret to apply: the token
Secret is made with ``kubectl create secret`` (deploy/README.md), never from a placeholder file.
Minimum versions: Kubernetes 1.29 (the Job's ``podReplacementPolicy`` and ``podFailurePolicy``;
tests/test_deploy.py validates against the 1.29 schemas) and JobSet v0.7.0 (``restartStrategy:
BlockingRecreate``); the recoverable variant's Job needs 1.29 too (``backoffLimitPerIndex``), its
NetworkPolicy 1.25 (``endPort``), its other files 1.24 (``MIN_KUBERNETES_RECOVERABLE``).

Every pod template passes the Pod Security Standards' "restricted" profile (and runs with a
read-only root filesystem, no service-account token and non-root groups): the pod runs as the
image's numeric user (``RUN_AS_USER``), with the runtime's default seccomp profile, no capability
and no privilege escalation; what the program writes goes to ``emptyDir`` volumes (``/tmp``, the
image user's home for CuPy's and CUDA's caches, ``/dev/shm`` in memory for NCCL). Each layout has a NetworkPolicy: the job's own pods reach the
coordinator, relay and data-plane ports (the data plane listens on ephemeral ports, so the pods pin
their ephemeral range with the safe sysctl ``net.ipv4.ip_local_port_range``, ``DATA_PORTS``), the
monitoring namespace (``--monitoring-namespace``) reaches the metrics port, and kubelet's probes
come from the node, which NetworkPolicy does not filter.

Why a generator and not a kustomization: the world size has to appear three times (completions,
parallelism, GRIDCOMM_WORLD_SIZE) and the job name is part of composed strings (rank 0's address
``<job>-0.<service>``, the Secret's name), which kustomize's replacements can copy but not compose;
``namePrefix`` would rename the Service without renaming the pods' ``subdomain``. A generator
keeps every derived value consistent, refuses names Kubernetes would reject or truncate, and needs
nothing but Python's standard library. The committed YAML files are its output with the defaults
(tests/test_deploy.py checks they are in sync), so they can also be read and applied as they are.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from string import Template

DEFAULT_NAME = "gridcomm"
DEFAULT_WORLD_SIZE = 2
DEFAULT_IMAGE = "registry.example.com/gridcomm:0.1.0"
DEFAULT_BACKEND = "nccl"
DEFAULT_REPLICATED_JOB = "workers"
BACKENDS = ("auto", "nccl", "host")
COORDINATOR_PORT = 13333
HEALTH_PORT = 13334
METRICS_PORT = 13335
RELAY_PORT = 13336
#: Where the token Secret is mounted, and the file gridcomm reads (GRIDCOMM_TOKEN_FILE).
TOKEN_DIR = "/var/run/secrets/gridcomm"
TOKEN_KEY = "token"
#: The pods' ephemeral port range, pinned by the sysctl net.ipv4.ip_local_port_range (the Linux
#: default): the host backend's data plane, a relay without a fixed address and NCCL's bootstrap and
#: socket transport listen on ports from it, and the NetworkPolicy admits the job's pods to it.
DATA_PORTS = (32768, 60999)
#: The image's user and group (deploy/docker/Dockerfile's USER), and its home, which an emptyDir
#: makes writable under the read-only root filesystem.
RUN_AS_USER = 1000
RUN_AS_GROUP = 1000
HOME_DIR = "/home/gridcomm"
#: The namespace whose pods may scrape the metrics port (--monitoring-namespace), selected by the
#: label the API server puts on every namespace.
DEFAULT_MONITORING_NAMESPACE = "monitoring"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: The longest a whole Job may run, pending pods included (--active-deadline-s).
DEFAULT_ACTIVE_DEADLINE_S = 7 * 24 * 3600
#: Files written by --out, and what each holds.
LAYOUT = {
    "job/service.yaml": "service", "job/job.yaml": "job", "job/metrics-service.yaml": "job_metrics",
    "job/network-policy.yaml": "network_policy",
    "jobset/jobset.yaml": "jobset", "jobset/metrics-service.yaml": "jobset_metrics",
    "jobset/network-policy.yaml": "network_policy",
    "monitoring/servicemonitor.yaml": "servicemonitor",
    "recoverable/coordinator.yaml": "coordinator", "recoverable/coordinator-service.yaml": "coordinator_service",
    "recoverable/checkpoints.yaml": "checkpoints", "recoverable/job.yaml": "recoverable_job",
    "recoverable/metrics-service.yaml": "recoverable_metrics", "recoverable/network-policy.yaml": "network_policy",
}
#: The oldest releases the manifests work on (tests/test_deploy.py validates at MIN_KUBERNETES).
MIN_KUBERNETES = "1.29"
MIN_JOBSET = "v0.7.0"
#: The oldest release each file of recoverable/ works on, and why (the comment in each file says
#: the same). The Job needs backoffLimitPerIndex, maxFailedIndexes and podReplacementPolicy, beta
#: and on by default from 1.29 (alpha, off, in 1.28); the coordinator's gRPC probes are on by
#: default from 1.24 (kubernetes-validate's oldest schemas are 1.25's, so tests check at 1.25); the
#: NetworkPolicy's port range (endPort) is GA from 1.25.
MIN_KUBERNETES_RECOVERABLE = {
    "recoverable/job.yaml": "1.29", "recoverable/coordinator.yaml": "1.24",
    "recoverable/coordinator-service.yaml": "1.24", "recoverable/checkpoints.yaml": "1.24",
    "recoverable/metrics-service.yaml": "1.24", "recoverable/network-policy.yaml": "1.25",
}
#: Pod failures an index of the recoverable Job may have before it fails (and, with
#: maxFailedIndexes 0, the Job with it).
BACKOFF_LIMIT_PER_INDEX = 3
#: Where the recoverable workers mount the shared checkpoint volume (train.py's TRAIN_CHECKPOINT_DIR).
CHECKPOINT_DIR = "/checkpoints"
#: Exit codes of deploy/docker/train.py that no retry of the same pod can fix.
EXIT_CONFIG_ERROR = 2
EXIT_PEER_FAILED = 3

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")

SERVICE = Template("""\
---
# Headless Service: gives every pod of the Job a DNS name <job>-<index>.$service, so rank 0's
# coordinator is reachable at $name-0.$service. Not-ready addresses are published because rank 0
# only turns ready after the other ranks have reached it.
apiVersion: v1
kind: Service
metadata:
  name: $service
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
  ports:
    - name: coordinator
      port: $coordinator_port
      targetPort: coordinator
    - name: health
      port: $health_port
      targetPort: health
""")

METRICS_SERVICE = Template("""\
---
$about
apiVersion: v1
kind: Service
metadata:
  name: $name-metrics
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
    app.kubernetes.io/component: metrics
spec:
  # Why: after a failure or at the end of the job, the process keeps /metrics up for
  # GRIDCOMM_METRICS_LINGER_S while its pod is terminating or not ready; the last scrapes must
  # still reach it to see the failure.
  publishNotReadyAddresses: true
  selector:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name$selector
  ports:
    - name: metrics
      port: $metrics_port
      targetPort: metrics
""")

SERVICEMONITOR = Template("""\
---
# Prometheus Operator: scrape rank 0's /metrics through the $name-metrics Service (job/ or jobset/).
# Needs the operator's CRDs; your Prometheus must select this ServiceMonitor (kube-prometheus-stack:
# add the label its serviceMonitorSelector names, e.g. release: <helm release>).
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: $name
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: gridcomm
      app.kubernetes.io/instance: $name
      app.kubernetes.io/component: metrics
  endpoints:
    - port: metrics
      path: /metrics
      interval: 15s
""")

# The start of both Indexed Jobs (job/ and recoverable/): one pod per rank.
_INDEXED_JOB_HEAD = """\
apiVersion: batch/v1
kind: Job
metadata:
  name: $name
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
spec:
  completionMode: Indexed
  completions: $world_size
  parallelism: $world_size
"""

# Pieces every pod template shares (the embedded workers' and the coordinator's). They pass the
# Pod Security Standards' "restricted" profile (tests/test_deploy.py checks each of its controls).
_POD_SECURITY = """\
      # Nothing in the pod talks to the Kubernetes API: no service-account token is mounted.
      automountServiceAccountToken: false
      securityContext:
        # The image's numeric user and group (deploy/docker/Dockerfile's USER), never root.
        runAsNonRoot: true
        runAsUser: $run_as_user
        runAsGroup: $run_as_group
        # The token file (mode 0440) belongs to this group, so the container's user can read it.
        fsGroup: $run_as_group
        seccompProfile:
          type: RuntimeDefault
"""

# The workers' data plane (host backend, NCCL's bootstrap and sockets, a relay without a fixed
# port) listens on ephemeral ports; pinning their range (Linux's default, a safe sysctl) keeps the
# NetworkPolicy's data-plane range true whatever the node's default.
_DATA_PORT_SYSCTL = """\
        # The ephemeral ports the data plane listens on (Linux's default range, pinned): the
        # NetworkPolicy admits the job's own pods to them.
        sysctls:
          - name: net.ipv4.ip_local_port_range
            value: "$data_port_first $data_port_last"
"""

# Writable scratch under the read-only root filesystem: /tmp (Python's tempfile).
_TMP_MOUNT = """\
            - name: tmp
              mountPath: /tmp"""

_TMP_VOLUME = """\
        # The root filesystem is read-only: what the program writes goes to volumes.
        - name: tmp
          emptyDir:
            sizeLimit: 1Gi"""

# gRPC probes on the plaintext health port, and the container's privileges.
_PROBES = """\
          startupProbe:
            grpc:
              port: $health_port
              service: ""
            periodSeconds: 2
            failureThreshold: 60
          livenessProbe:
            grpc:
              port: $health_port
              service: ""
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          readinessProbe:
            grpc:
              port: $health_port
              service: gridcomm.v1.Coordinator
            periodSeconds: 5
            timeoutSeconds: 2
            failureThreshold: 2
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
"""

_TOKEN_VOLUME = """\
        - name: token
          secret:
            secretName: $name-token
            optional: true
            defaultMode: 288  # 0440"""

# The pod template shared by the Indexed Job and the JobSet; $extra_env holds what differs.
POD = Template("""\
    metadata:
      labels:
        app.kubernetes.io/name: gridcomm
        app.kubernetes.io/instance: $name
    spec:$subdomain
      restartPolicy: Never
      enableServiceLinks: false
      terminationGracePeriodSeconds: 30
""" + _POD_SECURITY + _DATA_PORT_SYSCTL + """      tolerations:
        - key: nvidia.com/gpu
          operator: Exists
          effect: NoSchedule
      containers:
        - name: worker
          image: $image
          imagePullPolicy: IfNotPresent
          command: ["python", "/app/train.py"]
          ports:$worker_ports
          env:
            - name: GRIDCOMM_WORLD_SIZE
              value: "$world_size"$coordinator_env
            - name: GRIDCOMM_HEALTH_PORT
              value: "$health_port"$metrics_env
            - name: GRIDCOMM_BACKEND
              value: $backend
            # Image pulls and GPU node scale-up can keep a pod pending for minutes.
            - name: GRIDCOMM_TIMEOUT_S
              value: "600"
            # From the Secret $name-token (volume below). Why a file and an optional volume: a
            # missing Secret or key then ends the rank with exit code 2 (FailJob at once), where a
            # secretKeyRef would leave the pod in CreateContainerConfigError until someone looks.
            - name: GRIDCOMM_TOKEN_FILE
              value: $token_dir/$token_key
$job_id_env$extra_env
          resources:
            requests:
              cpu: "4"
              memory: 16Gi
              nvidia.com/gpu: 1
            limits:
              memory: 16Gi
              nvidia.com/gpu: 1
          # Probes run on the plaintext health port of every rank. "" is liveness: SERVING while the
          # process answers, whatever happened to its peers (a survivor reporting a failure or
          # writing a checkpoint is not restarted). gridcomm.v1.Coordinator is readiness: SERVING
          # only while this rank's communicator is up (rank 0 too: not before every rank joined).
          # The startup probe gives the health port 120 s from container start to answer; train.py
          # starts it first thing (gridcomm.start_health_server()), before any slow loading.
""" + _PROBES + """          volumeMounts:
""" + _TMP_MOUNT + """
            - name: home
              mountPath: $home_dir
            - name: dshm
              mountPath: /dev/shm
            - name: token
              mountPath: $token_dir
              readOnly: true$extra_mounts
      volumes:
""" + _TMP_VOLUME + """
        # The image user's home: CuPy keeps its compiled kernels there (~/.cupy), CUDA its JIT cache (~/.nv).
        - name: home
          emptyDir:
            sizeLimit: 1Gi
        # NCCL moves data between processes through /dev/shm (a memory emptyDir, counted in the
        # container's memory limit); the runtime's 64 MiB default is too small.
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: 1Gi
""" + _TOKEN_VOLUME + """$extra_volumes
""")

JOB = Template("""\
---
# Indexed Job: one pod per rank, rank = JOB_COMPLETION_INDEX, rank 0 hosts the coordinator.
""" + _INDEXED_JOB_HEAD + """  # Pods that crash before the ranks have met (a bad node, an image pull) are retried; after the
  # ranks have met, one rank's failure ends every rank with exit code $exit_peer and fails the Job.
  backoffLimit: 3
  # A replacement pod starts only once the old one is gone, so two pods never share a rank's name.
  podReplacementPolicy: Failed
  # The longest the whole Job may run, pods waiting for a GPU node or an image included; past it
  # the Job fails with reason DeadlineExceeded. Raise it for longer trainings (--active-deadline-s).
  activeDeadlineSeconds: $active_deadline_s
  # The finished Job and its pods (and logs) are deleted a day later; delete it yourself to re-run
  # under the same name sooner (deploy/README.md).
  ttlSecondsAfterFinished: 86400
  podFailurePolicy:
    rules:
      # Preemption, node drain, eviction: not the program's fault; the pod is recreated, not counted.
      # First, because the first matching rule wins: a drained pod that exited $exit_peer before it
      # was stopped (it saw a peer on the same node go first) is recreated too. Once the ranks have
      # met, the ranks that were not disrupted exit $exit_peer and fail the Job by the next rule
      # (deploy/README.md, "What a failure looks like").
      - action: Ignore
        onPodConditions:
          - type: DisruptionTarget
            status: "True"
      # $exit_config: a configuration error; $exit_peer: another rank failed or the ranks never met.
      # Retrying this pod alone cannot fix either.
      - action: FailJob
        onExitCodes:
          containerName: worker
          operator: In
          values: [$exit_config, $exit_peer]
  template:
$pod""")

JOBSET = Template("""\
---
# JobSet variant: the JobSet controller makes the headless Service (network.enableDNSHostnames)
# and restarts all pods together when one fails (failurePolicy), which a plain Job cannot do.
# Pod hostnames are <jobset>-<replicatedJob>-<jobIndex>-<podIndex>; rank 0 is
# $name-$rjob-0-0.$name. Raising `replicas` adds whole Jobs of `parallelism` pods; keep
# GRIDCOMM_WORLD_SIZE = replicas x parallelism.
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: $name
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
spec:
  network:
    enableDNSHostnames: true
    publishNotReadyAddresses: true
  successPolicy:
    operator: All
  failurePolicy:
    maxRestarts: 3
    # Old pods are gone before new ones start, so rank 0's name never points at a dying pod.
    restartStrategy: BlockingRecreate
    rules:
      # A configuration error (exit code $exit_config, see the Job's podFailurePolicy) fails at once.
      - name: configErrorIsFinal
        action: FailJobSet
        onJobFailureReasons: [PodFailurePolicy]
      # The run took longer than activeDeadlineSeconds: a restart would only wait as long again.
      - name: deadlineIsFinal
        action: FailJobSet
        onJobFailureReasons: [DeadlineExceeded]
  replicatedJobs:
    - name: $rjob
      replicas: 1
      template:
        spec:
          completionMode: Indexed
          completions: $world_size
          parallelism: $world_size
          # Any other failure fails this Job, and the JobSet restarts every Job.
          backoffLimit: 0
          activeDeadlineSeconds: $active_deadline_s
          podFailurePolicy:
            rules:
              - action: FailJob
                onExitCodes:
                  containerName: worker
                  operator: In
                  values: [$exit_config]
          template:
$pod""")

# One per layout (job/, jobset/, recoverable/), each folder being applied on its own. It selects
# every pod of the job (workers, and the recoverable variant's coordinator pod) by the labels all of
# them carry; a pod of another job, or of another name, matches neither the policy nor its sources.
NETWORK_POLICY = Template("""\
---
# Who may open connections to the pods of $name. The job's own pods: the coordinator, relay and
# data-plane ports (the data plane listens on ephemeral ports, which the pods' sysctl pins to
# $data_port_first-$data_port_last). Pods of the namespace $monitoring_namespace: the metrics port.
# Nobody else, other pods of this namespace included. kubelet's probes of the health port come from
# the pod's node, which NetworkPolicy always admits. Egress is not limited. Needs a network plugin
# that enforces NetworkPolicy and supports endPort (one that ignores it admits only the first port).
# Needs Kubernetes $min_policy or newer.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: $name
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
spec:
  podSelector:
    matchLabels:
      app.kubernetes.io/name: gridcomm
      app.kubernetes.io/instance: $name
  policyTypes: ["Ingress"]
  ingress:
    - from:
        - podSelector:
            matchLabels:
              app.kubernetes.io/name: gridcomm
              app.kubernetes.io/instance: $name
      ports:
        - protocol: TCP
          port: $coordinator_port
        - protocol: TCP
          port: $relay_port
        - protocol: TCP
          port: $data_port_first
          endPort: $data_port_last
    # Prometheus: the namespace is selected by the label the API server sets on every namespace.
    - from:
        - namespaceSelector:
            matchLabels:
              $namespace_label: $monitoring_namespace
      ports:
        - protocol: TCP
          port: $metrics_port
""")

# --- the recoverable variant (recoverable/): coordinator pod + Indexed Job that replaces lost pods ---

COORDINATOR = Template("""\
---
# The coordinator as a pod of its own (`gridcomm serve`), so that any worker may fail and be
# replaced while the rendezvous lives on; every rank dials it through the $name-coordinator Service.
# Needs Kubernetes $min_coordinator or newer (gRPC probes are on by default from 1.24, GA in 1.27).
apiVersion: apps/v1
kind: Deployment
metadata:
  name: $name-coordinator
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
    app.kubernetes.io/component: coordinator
spec:
  replicas: 1
  # The old pod is gone before a new one starts: two coordinators would split the ranks between two
  # rendezvous. A new coordinator knows nothing of the old one's ranks: they exit 3 and their pods
  # are restarted (recoverable/job.yaml), then all resume from the checkpoint.
  strategy:
    type: Recreate
  selector:
    matchLabels:
      app.kubernetes.io/name: gridcomm
      app.kubernetes.io/instance: $name
      app.kubernetes.io/component: coordinator
  template:
    metadata:
      labels:
        app.kubernetes.io/name: gridcomm
        app.kubernetes.io/instance: $name
        app.kubernetes.io/component: coordinator
    spec:
      enableServiceLinks: false
      terminationGracePeriodSeconds: 30
""" + _POD_SECURITY + """      containers:
        - name: coordinator
          image: $image
          imagePullPolicy: IfNotPresent
          command: ["gridcomm", "serve", "--world-size", "$world_size"]
          ports:
            - name: coordinator
              containerPort: $coordinator_port
            - name: health
              containerPort: $health_port
            - name: metrics
              containerPort: $metrics_port
          env:
            - name: GRIDCOMM_PORT
              value: "$coordinator_port"
            # Plaintext grpc.health.v1 for the probes below ("" and gridcomm.v1.Coordinator).
            - name: GRIDCOMM_HEALTH_PORT
              value: "$health_port"
            - name: GRIDCOMM_METRICS_PORT
              value: "$metrics_port"
            - name: GRIDCOMM_TOKEN_FILE
              value: $token_dir/$token_key
            # The workers present the same id (the coordinator cannot know the Job's UID).
            - name: GRIDCOMM_JOB_ID
              value: $name
          # One process serving N ranks' control plane: small next to a GPU worker.
          resources:
            requests:
              cpu: "1"
              memory: 1Gi
            limits:
              memory: 1Gi
""" + _PROBES + """          volumeMounts:
""" + _TMP_MOUNT + """
            - name: token
              mountPath: $token_dir
              readOnly: true
      volumes:
""" + _TMP_VOLUME + """
""" + _TOKEN_VOLUME + """
""")

COORDINATOR_SERVICE = Template("""\
---
# The coordinator's address, $name-coordinator:$coordinator_port (GRIDCOMM_HOST of every rank). A
# ClusterIP Service: its virtual IP stays the same when the coordinator pod is replaced.
# Needs Kubernetes $min_service or newer.
apiVersion: v1
kind: Service
metadata:
  name: $name-coordinator
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
    app.kubernetes.io/component: coordinator
spec:
  selector:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
    app.kubernetes.io/component: coordinator
  # Its only backend: a readiness blip must not cut every rank off from the coordinator.
  publishNotReadyAddresses: true
  ports:
    - name: coordinator
      port: $coordinator_port
      targetPort: coordinator
""")

CHECKPOINTS = Template("""\
---
# Where deploy/docker/train.py keeps its checkpoint (TRAIN_CHECKPOINT_DIR): rank 0 writes, and a
# replacement pod on another node reads, so every worker mounts it: ReadWriteMany, which needs a
# storage class that offers it (NFS, CephFS, a cloud file store such as EFS, Filestore or Azure
# Files); set storageClassName if the cluster's default does not. An emptyDir would die with its pod.
# Needs Kubernetes $min_service or newer.
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: $name-checkpoints
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
spec:
  accessModes: ["ReadWriteMany"]
  resources:
    requests:
      storage: 10Gi
""")

RECOVERABLE_JOB = Template("""\
---
# Indexed Job whose lost pods are replaced while the others wait: rank = JOB_COMPLETION_INDEX,
# every rank dials the coordinator pod (recoverable/coordinator.yaml), and on a peer's failure the
# survivors call rebuild() (TRAIN_RECOVERY) until a replacement of the lost index has joined.
# Needs Kubernetes $min_job or newer: backoffLimitPerIndex and maxFailedIndexes (beta, on by
# default, from 1.29; GA in 1.33), podReplacementPolicy (beta from 1.29), podFailurePolicy (beta
# from 1.26, GA in 1.31).
""" + _INDEXED_JOB_HEAD + """  # Each index may fail this often before it is marked failed; the Job controller recreates a
  # failed index's pod after 10 s, 20 s, 40 s ... (per index, capped at 6 min).
  backoffLimitPerIndex: $backoff_per_index
  # A gang cannot finish without one of its ranks: the first index out of retries fails the Job,
  # and the Job controller ends the other pods.
  maxFailedIndexes: 0
  # A replacement pod starts only once the old one is gone, so one index never has two processes
  # (required with podFailurePolicy).
  podReplacementPolicy: Failed
  activeDeadlineSeconds: $active_deadline_s
  ttlSecondsAfterFinished: 86400
  podFailurePolicy:
    rules:
      # Preemption, node drain, eviction, node loss: not the program's fault. The index is
      # recreated without counting (first, so that a disrupted pod's exit code does not count).
      - action: Ignore
        onPodConditions:
          - type: DisruptionTarget
            status: "True"
      # $exit_config: a configuration error, the same in every pod: no retry can fix it.
      - action: FailJob
        onExitCodes:
          containerName: worker
          operator: In
          values: [$exit_config]
      # $exit_peer: this rank gave up recovering (the coordinator went away, a replacement did not
      # come in time, too many recoveries). Restarting it joins the next generation, so it is
      # retried, and counted, so that a loop of them is bounded by backoffLimitPerIndex. The
      # index whose pod was SIGKILLed or OOM-killed (137) or crashed (1) counts the same way
      # (no rule matches: the default).
      - action: Count
        onExitCodes:
          containerName: worker
          operator: In
          values: [$exit_peer]
  template:
$pod""")

_RECOVERABLE_WORKER_ENV = """
            # deploy/docker/train.py: on a peer's failure, rebuild() and resume from the checkpoint.
            - name: TRAIN_RECOVERY
              value: rebuild
            - name: TRAIN_CHECKPOINT_DIR
              value: $checkpoint_dir"""

_RECOVERABLE_WORKER_MOUNTS = """
            - name: checkpoints
              mountPath: $checkpoint_dir"""

_RECOVERABLE_WORKER_VOLUMES = """
        # Shared by every worker (recoverable/checkpoints.yaml): a replacement reads what rank 0 wrote.
        - name: checkpoints
          persistentVolumeClaim:
            claimName: $name-checkpoints"""

# What the embedded (job/, jobset/) and the recoverable workers put in POD's slots.
_EMBEDDED_PORTS = """
            - name: coordinator
              containerPort: $coordinator_port
            - name: health
              containerPort: $health_port
            - name: metrics
              containerPort: $metrics_port
            # From 256 ranks, rank k x K (K: GRIDCOMM_RELAY_FANIN) serves its group's relay here.
            - name: relay
              containerPort: $relay_port"""

_EMBEDDED_COORDINATOR_ENV = """
            - name: GRIDCOMM_HOST
              value: $coordinator_host
            - name: GRIDCOMM_PORT
              value: "$coordinator_port\""""

_EMBEDDED_METRICS_ENV = """
            # Served by rank 0 only (it hosts the coordinator); other ranks ignore it.
            - name: GRIDCOMM_METRICS_PORT
              value: "$metrics_port\""""

_EMBEDDED_JOB_ID_ENV = """\
            # A pod left over from an earlier run of the same name cannot join this one.
            - name: GRIDCOMM_JOB_ID
              valueFrom:
                fieldRef:
                  fieldPath: $job_id_field"""

_RECOVERABLE_PORTS = """
            - name: health
              containerPort: $health_port"""

_RECOVERABLE_COORDINATOR_ENV = """
            # Every rank, rank 0 included, dials the coordinator pod (gridcomm serve), so any may fail.
            - name: GRIDCOMM_COORDINATOR
              value: external
            - name: GRIDCOMM_HOST
              value: $name-coordinator
            - name: GRIDCOMM_PORT
              value: "$coordinator_port\""""

_RECOVERABLE_JOB_ID_ENV = """\
            # The coordinator's GRIDCOMM_JOB_ID: a worker of another job name cannot join.
            - name: GRIDCOMM_JOB_ID
              value: $name"""

_JOBSET_ENV = """
            # Lets gridcomm number ranks across Jobs when `replicas` is raised.
            - name: JOBSET_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.labels['jobset.sigs.k8s.io/jobset-name']
            - name: JOBSET_REPLICATED_JOB_REPLICAS
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']"""


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


def _check(args: argparse.Namespace) -> None:
    """Refuses values Kubernetes would reject, or silently truncate into names that do not resolve."""
    for what, value in (("--name", args.name), ("--service", args.service), ("--replicated-job", args.replicated_job)):
        if not _DNS_LABEL.match(value):
            raise SystemExit(f"{what} {value!r} must be a DNS label: lower-case letters, digits and '-', "
                             f"starting with a letter, e.g. 'llm-train'.")
    if args.world_size < 1:
        raise SystemExit(f"--world-size {args.world_size} must be at least 1.")
    # Pod hostnames are at most 63 characters; a longer one is cut, and then <job>-0 does not resolve.
    longest = max(f"{args.name}-{args.world_size - 1}", f"{args.name}-{args.replicated_job}-0-{args.world_size - 1}",
                  args.service, key=len)
    if len(longest) > 63:
        raise SystemExit(f"the name {longest!r} would be longer than 63 characters; use a shorter --name.")
    if not _IMAGE.match(args.image):
        raise SystemExit(f"--image {args.image!r} is not an image reference such as 'registry.example.com/app:1.0'.")
    if args.backend not in BACKENDS:
        raise SystemExit(f"--backend {args.backend!r} must be one of {', '.join(BACKENDS)}.")
    if args.active_deadline_s < 1:
        raise SystemExit(f"--active-deadline-s {args.active_deadline_s} must be at least 1.")
    if not _DNS_LABEL.match(args.monitoring_namespace):
        raise SystemExit(f"--monitoring-namespace {args.monitoring_namespace!r} must be a namespace name: lower-case "
                         "letters, digits and '-', starting with a letter, e.g. 'monitoring'.")


def render(args: argparse.Namespace) -> dict[str, str]:
    """The manifests as {file name: YAML text}."""
    _check(args)
    values = {
        "name": args.name, "service": args.service, "world_size": args.world_size, "image": args.image,
        "backend": args.backend, "rjob": args.replicated_job, "coordinator_port": COORDINATOR_PORT,
        "health_port": HEALTH_PORT, "exit_config": EXIT_CONFIG_ERROR, "exit_peer": EXIT_PEER_FAILED,
        "metrics_port": METRICS_PORT, "relay_port": RELAY_PORT, "token_dir": TOKEN_DIR, "token_key": TOKEN_KEY,
        "active_deadline_s": args.active_deadline_s, "checkpoint_dir": CHECKPOINT_DIR,
        "backoff_per_index": BACKOFF_LIMIT_PER_INDEX, "min_job": MIN_KUBERNETES_RECOVERABLE["recoverable/job.yaml"],
        "min_coordinator": MIN_KUBERNETES_RECOVERABLE["recoverable/coordinator.yaml"],
        "min_service": MIN_KUBERNETES_RECOVERABLE["recoverable/coordinator-service.yaml"],
        "min_policy": MIN_KUBERNETES_RECOVERABLE["recoverable/network-policy.yaml"],
        "run_as_user": RUN_AS_USER, "run_as_group": RUN_AS_GROUP, "home_dir": HOME_DIR,
        "data_port_first": DATA_PORTS[0], "data_port_last": DATA_PORTS[1],
        "monitoring_namespace": args.monitoring_namespace, "namespace_label": NAMESPACE_NAME_LABEL,
    }

    def fill(text: str, **more: object) -> str:
        return Template(text).substitute(values, **more)

    embedded = {"worker_ports": fill(_EMBEDDED_PORTS), "metrics_env": fill(_EMBEDDED_METRICS_ENV), "extra_mounts": "",
                "extra_volumes": ""}

    def embedded_pod(subdomain: str, coordinator_host: str, job_id_field: str, extra_env: str) -> str:
        return POD.substitute(values, **embedded, subdomain=subdomain, extra_env=extra_env,
                              coordinator_env=fill(_EMBEDDED_COORDINATOR_ENV, coordinator_host=coordinator_host),
                              job_id_env=fill(_EMBEDDED_JOB_ID_ENV, job_id_field=job_id_field))

    job_pod = embedded_pod(f"\n      subdomain: {args.service}", f"{args.name}-0.{args.service}",
                           "metadata.labels['batch.kubernetes.io/controller-uid']", "")
    jobset_pod = embedded_pod("", f"{args.name}-{args.replicated_job}-0-0.{args.name}",
                              "metadata.labels['jobset.sigs.k8s.io/jobset-uid']", _JOBSET_ENV)
    recoverable_pod = POD.substitute(values, subdomain="", worker_ports=fill(_RECOVERABLE_PORTS), metrics_env="",
                                     coordinator_env=fill(_RECOVERABLE_COORDINATOR_ENV),
                                     job_id_env=fill(_RECOVERABLE_JOB_ID_ENV), extra_env=fill(_RECOVERABLE_WORKER_ENV),
                                     extra_mounts=fill(_RECOVERABLE_WORKER_MOUNTS),
                                     extra_volumes=fill(_RECOVERABLE_WORKER_VOLUMES))
    rank0 = fill("# Rank 0's Prometheus metrics ($metrics_port, GRIDCOMM_METRICS_PORT): the coordinator lives in rank 0's\n"
                 "# process, so this Service selects that pod only; monitoring/servicemonitor.yaml scrapes it.")
    rank0_selector = '\n    batch.kubernetes.io/job-completion-index: "0"'
    # The JobSet's rank 0 is completion index 0 of its first Job (each Job has an index 0).
    jobset_rank0 = rank0_selector + '\n    jobset.sigs.k8s.io/job-index: "0"'
    coordinator_metrics = fill("# The coordinator pod's Prometheus metrics ($metrics_port, gridcomm serve's GRIDCOMM_METRICS_PORT);\n"
                               "# monitoring/servicemonitor.yaml scrapes it.\n# Needs Kubernetes $min_service or newer.")
    made = {
        "service": SERVICE.substitute(values),
        "job": JOB.substitute(values, pod=job_pod),
        "job_metrics": METRICS_SERVICE.substitute(values, about=rank0, selector=rank0_selector),
        "jobset": JOBSET.substitute(values, pod=_indent(jobset_pod, 8)),
        "jobset_metrics": METRICS_SERVICE.substitute(values, about=rank0, selector=jobset_rank0),
        "servicemonitor": SERVICEMONITOR.substitute(values),
        "coordinator": COORDINATOR.substitute(values),
        "coordinator_service": COORDINATOR_SERVICE.substitute(values),
        "checkpoints": CHECKPOINTS.substitute(values),
        "recoverable_job": RECOVERABLE_JOB.substitute(values, pod=recoverable_pod),
        "recoverable_metrics": METRICS_SERVICE.substitute(
            values, about=coordinator_metrics, selector="\n    app.kubernetes.io/component: coordinator"),
        "network_policy": NETWORK_POLICY.substitute(values),
    }
    return {path: made[what] for path, what in LAYOUT.items()}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--name", default=DEFAULT_NAME, help=f"Job (or JobSet) name (default {DEFAULT_NAME})")
    p.add_argument("--service", default=None, help="headless Service name (default: the job name)")
    p.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE, help=f"number of ranks = pods = GPUs (default {DEFAULT_WORLD_SIZE})")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="container image built from deploy/docker/Dockerfile")
    p.add_argument("--backend", default=DEFAULT_BACKEND, help=f"GRIDCOMM_BACKEND (default {DEFAULT_BACKEND})")
    p.add_argument("--replicated-job", default=DEFAULT_REPLICATED_JOB, help="the JobSet's replicatedJob name")
    p.add_argument("--active-deadline-s", type=int, default=DEFAULT_ACTIVE_DEADLINE_S,
                   help=f"the longest the whole Job may run, pending pods included (default {DEFAULT_ACTIVE_DEADLINE_S}: "
                        "7 days)")
    p.add_argument("--monitoring-namespace", default=DEFAULT_MONITORING_NAMESPACE,
                   help="the namespace whose pods the NetworkPolicy lets scrape the metrics port (default "
                        f"{DEFAULT_MONITORING_NAMESPACE})")
    p.add_argument("--jobset", action="store_true", help="print the JobSet (and its metrics Service) instead of the "
                   "Service and Indexed Job")
    p.add_argument("--recoverable", action="store_true", help="print the recoverable variant instead: the coordinator "
                   "as a pod of its own (Deployment, Service, metrics Service), a shared checkpoint claim, and an "
                   "Indexed Job whose lost pods are replaced while the others rebuild()")
    p.add_argument("--servicemonitor", action="store_true", help="print the Prometheus Operator ServiceMonitor")
    p.add_argument("--out", default=None, help="write every file into this folder (created if missing): job/, "
                   "jobset/, recoverable/ and monitoring/, one folder per `kubectl apply -f`")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.service is None:
        args.service = args.name
    files = render(args)
    if args.out is not None:
        try:
            for name, text in files.items():
                path = os.path.join(args.out, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(text)
        except OSError as exc:
            raise SystemExit(f"--out {args.out!r}: cannot write {exc.filename!r}: {exc.strerror}.") from None
        return 0
    if args.servicemonitor:
        folder = "monitoring/"
    elif args.recoverable:
        folder = "recoverable/"
    else:
        folder = "jobset/" if args.jobset else "job/"
    sys.stdout.write("".join(text for name, text in files.items() if name.startswith(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
