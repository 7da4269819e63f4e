"""Placing a GPU test's ranks: a GPU each where there are enough, else several on one GPU in
NCCL's multi-rank mode (NCCL >= 2.30), as ``gridcomm launch`` does; the test is skipped,
saying why, where neither can run."""

from __future__ import annotations

import pytest


def gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy or no driver: no GPU
        return 0


def ranks_on_gpus(n: int) -> dict[int, dict[str, str]]:
    """Each rank's extra environment (RankProcesses' per_rank_env) for ``n`` ranks."""
    from gridcomm._backends import nccl as _nccl
    from gridcomm._backends.nccl import sharing

    gpus = gpu_count()
    if gpus == 0:
        pytest.skip("needs a GPU")
    if gpus >= n:
        return {r: {"CUDA_VISIBLE_DEVICES": str(r)} for r in range(n)}
    version = _nccl.nccl_version()
    if version < sharing.MULTI_RANK_MIN_NCCL:
        pytest.skip(f"{n} ranks on {gpus} GPU(s) need NCCL >= 2.30 (its multi-rank mode); this NCCL is "
                    f"{sharing.version_text(version)}")
    return {r: {"CUDA_VISIBLE_DEVICES": str(r % gpus), **sharing.MODE_ENV} for r in range(n)}
