#!/usr/bin/env python3
"""Writes gridcomm's Kubernetes manifests from the few values a user chooses.

    python deploy/k8s/generate.py --name llm --world-size 16 --image registry.example.com/llm:1 \\
        | kubectl apply -f -                       # headless Service + Indexed Job
    python deploy/k8s/generate.py --jobset --name llm --world-size 16 --image ... | kubectl apply -f -
    python deploy/k8s/generate.py --out deploy/k8s  # rewrites the committed example files

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

SECRET = Template("""\
---
# The shared token every rank presents to the coordinator. Do not apply this example as it is;
# create the Secret with a random token instead:
#   kubectl create secret generic $name-token --from-literal=token="$$(openssl rand -hex 32)"
apiVersion: v1
kind: Secret
metadata:
  name: $name-token
  labels:
    app.kubernetes.io/name: gridcomm
    app.kubernetes.io/instance: $name
type: Opaque
stringData:
  token: replace-with-the-output-of-openssl-rand-hex-32
""")

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
      securityContext:
        runAsNonRoot: true
        runAsUser: 1000
        runAsGroup: 1000
      tolerations:
        - key: nvidia.com/gpu
          operator: Exists
          effect: NoSchedule
      containers:
        - name: worker
          image: $image
          imagePullPolicy: IfNotPresent
          command: ["python", "/app/train.py"]
          ports:
            - name: coordinator
              containerPort: $coordinator_port
            - name: health
              containerPort: $health_port
          env:
            - name: GRIDCOMM_WORLD_SIZE
              value: "$world_size"
            - name: GRIDCOMM_HOST
              value: $coordinator_host
            - name: GRIDCOMM_PORT
              value: "$coordinator_port"
            - name: GRIDCOMM_HEALTH_PORT
              value: "$health_port"
            - name: GRIDCOMM_BACKEND
              value: $backend
            # Image pulls and GPU node scale-up can keep a pod pending for minutes.
            - name: GRIDCOMM_TIMEOUT_S
              value: "600"
            - name: GRIDCOMM_TOKEN
              valueFrom:
                secretKeyRef:
                  name: $name-token
                  key: token
            # A pod left over from an earlier run of the same name cannot join this one.
            - name: GRIDCOMM_JOB_ID
              valueFrom:
                fieldRef:
                  fieldPath: $job_id_field$extra_env
          resources:
            requests:
              cpu: "4"
              memory: 16Gi
              nvidia.com/gpu: 1
            limits:
              memory: 16Gi
              nvidia.com/gpu: 1
          # Probes run on the plaintext health port of every rank: startup and liveness ask for the
          # whole server (""), readiness for the coordinator service, so a rank whose communicator
          # failed is taken out of service without being restarted in the middle of a report.
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
            capabilities:
              drop: ["ALL"]
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
      volumes:
        # NCCL moves data between processes through /dev/shm; the runtime's 64 MiB default is too small.
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: 1Gi
""")

JOB = Template("""\
---
# Indexed Job: one pod per rank, rank = JOB_COMPLETION_INDEX, rank 0 hosts the coordinator.
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
  # Pods that crash before the ranks have met (a bad node, an image pull) are retried; after the
  # ranks have met, one rank's failure ends every rank with exit code $exit_peer and fails the Job.
  backoffLimit: 3
  # A replacement pod starts only once the old one is gone, so two pods never share a rank's name.
  podReplacementPolicy: Failed
  ttlSecondsAfterFinished: 86400
  podFailurePolicy:
    rules:
      # $exit_config: a configuration error; $exit_peer: another rank failed or the ranks never met.
      # Retrying this pod alone cannot fix either.
      - action: FailJob
        onExitCodes:
          containerName: worker
          operator: In
          values: [$exit_config, $exit_peer]
      # Preemption, node drain, eviction: not the program's fault; the pod is recreated.
      - action: Ignore
        onPodConditions:
          - type: DisruptionTarget
            status: "True"
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
          podFailurePolicy:
            rules:
              - action: FailJob
                onExitCodes:
                  containerName: worker
                  operator: In
                  values: [$exit_config]
          template:
$pod""")

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


def render(args: argparse.Namespace) -> dict[str, str]:
    """The manifests as {file name: YAML text}."""
    _check(args)
    values = {
        "name": args.name, "service": args.service, "world_size": args.world_size, "image": args.image,
        "backend": args.backend, "rjob": args.replicated_job, "coordinator_port": COORDINATOR_PORT,
        "health_port": HEALTH_PORT, "exit_config": EXIT_CONFIG_ERROR, "exit_peer": EXIT_PEER_FAILED,
    }
    job_pod = POD.substitute(values, subdomain=f"\n      subdomain: {args.service}",
                             coordinator_host=f"{args.name}-0.{args.service}", extra_env="",
                             job_id_field="metadata.labels['batch.kubernetes.io/controller-uid']")
    jobset_pod = POD.substitute(values, subdomain="", coordinator_host=f"{args.name}-{args.replicated_job}-0-0.{args.name}",
                                extra_env=_JOBSET_ENV,
                                job_id_field="metadata.labels['jobset.sigs.k8s.io/jobset-uid']")
    return {
        "service.yaml": SERVICE.substitute(values),
        "job.yaml": JOB.substitute(values, pod=job_pod),
        "secret.example.yaml": SECRET.substitute(values),
        "jobset.yaml": JOBSET.substitute(values, pod=_indent(jobset_pod, 8)),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--name", default=DEFAULT_NAME, help=f"Job (or JobSet) name (default {DEFAULT_NAME})")
    p.add_argument("--service", default=None, help="headless Service name (default: the job name)")
    p.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE, help=f"number of ranks = pods = GPUs (default {DEFAULT_WORLD_SIZE})")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="container image built from deploy/docker/Dockerfile")
    p.add_argument("--backend", default=DEFAULT_BACKEND, help=f"GRIDCOMM_BACKEND (default {DEFAULT_BACKEND})")
    p.add_argument("--replicated-job", default=DEFAULT_REPLICATED_JOB, help="the JobSet's replicatedJob name")
    p.add_argument("--jobset", action="store_true", help="print the JobSet instead of the Service and Indexed Job")
    p.add_argument("--out", default=None, help="write every file (service, job, secret example, jobset) into this folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.service is None:
        args.service = args.name
    files = render(args)
    if args.out is not None:
        for name, text in files.items():
            with open(os.path.join(args.out, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        return 0
    chosen = ["jobset.yaml"] if args.jobset else ["service.yaml", "job.yaml"]
    sys.stdout.write("".join(files[name] for name in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
