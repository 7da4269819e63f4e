"""What NCCL this process can use: CuPy and its NCCL binding, nccl4py, imported on first use
(never at ``import gridcomm``), and the engine chosen (``GRIDCOMM_NCCL_ENGINE``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gridcomm import _config
from gridcomm._errors import ConfigError

#: Values of GRIDCOMM_NCCL_ENGINE.
ENGINES = _config.NCCL_ENGINES


#: Ranks per NCCL bootstrap root (GRIDCOMM_RANKS_PER_ROOT), as torch's TORCH_NCCL_RANKS_PER_ROOT.
DEFAULT_RANKS_PER_ROOT = _config.DEFAULT_RANKS_PER_ROOT


#: The oldest libnccl the nccl4py engine uses (NCCL_VERSION_CODE of 2.23.0).
_NCCL4PY_MIN_NCCL = 22300


_cupy: Any = None


_nccl: Any = None


_nccl4py: Any = None  # (nccl.core, nccl.bindings.nccl) once loaded; False when it cannot be used


_nccl4py_why = ""


def _load_cupy() -> Any:
    """Imports CuPy on first use (never at ``import gridcomm``)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA library load errors
            raise ConfigError(f"the nccl backend needs CuPy with NCCL (pip install 'gridcomm[cuda12]' or "
                              f"'gridcomm[cuda13]'); importing it failed: {exc}. On a machine without GPUs use "
                              f"backend='host' (NumPy arrays), or backend='auto', which picks host there "
                              f"(GRIDCOMM_BACKEND=host or auto).") from exc
        _cupy = cupy
    return _cupy


def _load() -> tuple[Any, Any]:
    """CuPy and its NCCL binding (the cupy engine), imported on first use."""
    global _nccl
    cupy = _load_cupy()
    if _nccl is None:
        try:
            from cupy.cuda import nccl
        except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA library load errors
            raise ConfigError(f"CuPy's NCCL binding does not import ({exc}); install nvidia-nccl-cu12 (or -cu13) "
                              "matching your cupy-cuda package, or use backend='host'.") from exc
        if not getattr(nccl, "available", False):
            raise ConfigError("CuPy is installed but NCCL is not available to it; install nvidia-nccl-cu12 "
                              "(or -cu13) matching your cupy-cuda package, or use backend='host' (NumPy arrays) or "
                              "backend='auto' (NCCL where it works, else host); GRIDCOMM_BACKEND sets either.")
        _nccl = nccl
    return cupy, _nccl


def _load_nccl4py() -> tuple[Any, Any] | None:
    """``(nccl.core, nccl.bindings.nccl)`` when nccl4py imports and its libnccl loads, else None
    (the reason is kept for the error message of GRIDCOMM_NCCL_ENGINE=nccl4py)."""
    global _nccl4py, _nccl4py_why
    if _nccl4py is None:
        try:
            import nccl.core as core
            from nccl.bindings import nccl as bindings

            version = int(bindings.get_version())  # loads libnccl: an import alone does not
            if version < _NCCL4PY_MIN_NCCL:
                raise ConfigError(f"libnccl {version} is older than 2.23 (ncclCommInitRankScalable, which nccl4py "
                                  "creates every communicator with)")
            _nccl4py = (core, bindings)
        except Exception as exc:  # noqa: BLE001 - ImportError, library load errors: "not usable here"
            _nccl4py, _nccl4py_why = False, f"{type(exc).__name__}: {exc}"
    return _nccl4py or None


def engine_setting(environ: Mapping[str, str] | None = None) -> str:
    """GRIDCOMM_NCCL_ENGINE as given: ``auto`` (unset or empty), ``nccl4py`` or ``cupy``."""
    return _config.nccl_engine(environ)


def ranks_per_root(environ: Mapping[str, str] | None = None) -> int:
    """GRIDCOMM_RANKS_PER_ROOT: ranks per NCCL bootstrap root (default 128, at least 1)."""
    return _config.ranks_per_root(environ)


def engine(environ: Mapping[str, str] | None = None, *, setting: str | None = None) -> str:
    """The engine a communicator built now uses: ``nccl4py`` or ``cupy`` (``setting``, as the
    job's settings resolved GRIDCOMM_NCCL_ENGINE, else read now; ``auto`` picks nccl4py where it
    imports and loads libnccl)."""
    if setting is None:
        setting = engine_setting(environ)
    if setting == "cupy":
        return "cupy"
    if _load_nccl4py() is not None:
        return "nccl4py"
    if setting == "nccl4py":
        raise ConfigError(f"GRIDCOMM_NCCL_ENGINE=nccl4py, but nccl4py cannot be used here ({nccl4py_why()}); "
                          "pip install 'gridcomm[cuda12]' (or cuda13), or set GRIDCOMM_NCCL_ENGINE=auto or cupy.")
    return "cupy"


def available(setting: str | None = None) -> bool:
    """True when CuPy imports, sees at least one GPU, and an NCCL engine works (what backend='auto'
    asks); ``setting`` is GRIDCOMM_NCCL_ENGINE as the job resolved it."""
    try:
        cupy = _load_cupy()
        if engine(setting=setting) == "cupy":
            _load()
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def require_gpu(setting: str | None = None) -> None:
    """Raises ConfigError, before any rendezvous, when backend='nccl' cannot work here: no CuPy,
    no NCCL engine (see engine; ``setting`` as for :func:`available`), or no GPU that CuPy sees."""
    cupy = _load_cupy()
    if engine(setting=setting) == "cupy":
        _load()
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDA driver errors: no usable GPU
        count, why = 0, f" ({exc})"
    else:
        why = ""
    if count == 0:
        raise ConfigError(f"backend='nccl' needs a GPU, but CuPy sees none{why}; on a machine without GPUs use "
                          "backend='host' (NumPy arrays) or backend='auto' (NCCL where a GPU is, else host); "
                          "GRIDCOMM_BACKEND sets either.")


def nccl4py_why() -> str:
    """Why nccl4py cannot be used here (empty until a load was tried and failed)."""
    return _nccl4py_why
