"""Where ``gridcomm launch`` puts its ranks: one GPU each round-robin, and NCCL's
several-ranks-per-GPU mode where ranks outnumber GPUs. No CuPy here: the GPUs are counted from
``CUDA_VISIBLE_DEVICES`` or the NVIDIA device nodes, and ``--gpus`` says otherwise."""

from __future__ import annotations

import glob
from collections.abc import Mapping

from gridcomm._backends.nccl.sharing import MODE_ENV
from gridcomm._errors import ConfigError


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """GPU ids for CUDA_VISIBLE_DEVICES, without importing CuPy: the parent's list if set, else
    the NVIDIA device nodes."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    return sorted((p[len("/dev/nvidia"):] for p in glob.glob("/dev/nvidia[0-9]*")), key=int)


def placed_gpus(environ: Mapping[str, str], gpus: int | None = None) -> list[str]:
    """The GPUs ranks are placed on: the visible ones, or the first ``gpus`` of them (``--gpus``;
    0: none, every rank sees what the launcher sees)."""
    found = visible_gpus(environ)
    if gpus is None:
        return found
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ConfigError(f"--gpus={gpus!r} must be a whole number >= 0 (0: leave CUDA_VISIBLE_DEVICES alone).")
    if gpus > len(found):
        raise ConfigError(f"--gpus={gpus}, but only {len(found)} GPU(s) are visible here "
                          f"({','.join(found) or 'none'}; CUDA_VISIBLE_DEVICES or /dev/nvidia*).")
    return found[:gpus]


def gpu_sharing(nproc: int, gpus: list[str], backend: str,
                environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """What every rank's environment gets where ``nproc`` ranks outnumber ``gpus`` (NCCL's
    multi-rank mode, each setting only where the user did not set it), and the one line that
    says so; nothing for the host backend or where each rank has a GPU of its own."""
    if backend == "host" or not gpus or nproc <= len(gpus):
        return {}, None
    added = {name: value for name, value in MODE_ENV.items() if name not in environ}
    shown = ", ".join(f"{name}={environ.get(name, value)}" for name, value in MODE_ENV.items())
    most = -(-nproc // len(gpus))
    line = (f"gridcomm launch: {nproc} ranks on {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({','.join(gpus)}), "
            f"up to {most} per GPU: NCCL's several-ranks-per-GPU mode ({shown}), which needs NCCL >= 2.30")
    return added, line
