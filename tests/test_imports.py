"""Import rules: the forbidden edges between gridcomm's layers (scripts/check_imports.py).

The check must hold on the tree and must bite: a planted client -> coordinator import in a copy of
the package is reported. ``import gridcomm`` imports no CuPy and starts no thread.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

from tests.support.procs import ROOT

PKG = os.path.join(ROOT, "gridcomm")
_spec = importlib.util.spec_from_file_location("check_imports", os.path.join(ROOT, "scripts", "check_imports.py"))
assert _spec and _spec.loader
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


def test_import_rules_hold_on_the_tree():
    assert check_imports.violations(PKG) == []


def _copy(tmp_path) -> str:
    copy = os.path.join(tmp_path, "gridcomm")
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _plant(copy: str, module: str, line: str) -> None:
    path = os.path.join(copy, *module.split("/"))
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"\n\ndef _planted():\n    {line}\n")


def test_a_planted_client_to_coordinator_import_is_caught(tmp_path):
    copy = _copy(tmp_path)
    _plant(copy, "_client/client.py", "from gridcomm._coordinator import server  # noqa: F401")
    bad = check_imports.violations(copy)
    assert len(bad) == 1 and "_client/client.py" in bad[0] and "gridcomm._coordinator" in bad[0], bad
    # The command line form fails too (what `make lint` runs).
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_imports.py"), copy],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "_client imports gridcomm._coordinator" in out.stdout, out.stdout


def test_each_forbidden_edge_bites(tmp_path):
    copy = _copy(tmp_path)
    planted = {
        "_runtime/health.py": "from gridcomm._coordinator import server",
        "_backends/host/backend.py": "from gridcomm._proto import coordinator_pb2",
        "_coordinator/servicer.py": "import gridcomm._client.client",
        "_wire.py": "from gridcomm._client import progress",
        "_communicator/communicator.py": "from gridcomm import _cli",
        "_backends/nccl/engines.py": "import grpc",
        "_backends/nccl/bootstrap.py": "from gridcomm._client import client",
        "_coordinator/state/barriers.py": "import cupy",
        "_relay/upstream.py": "from gridcomm._client import session",
        "_runtime/channel.py": "from gridcomm._relay import server",
    }
    for module, line in planted.items():
        assert os.path.exists(os.path.join(copy, module)), module  # plant into real modules only
        _plant(copy, module, line + "  # noqa")
    open(os.path.join(copy, "_stray.py"), "w").close()
    bad = check_imports.violations(copy)
    for module in planted:
        assert any(b.startswith(f"gridcomm/{module}:") for b in bad), (module, bad)
    assert any("_stray.py" in b and "no layer" in b for b in bad), bad
    assert len(bad) == len(planted) + 1, bad


def test_import_gridcomm_loads_no_cupy_and_starts_no_thread():
    code = (
        "import sys, threading, gridcomm; "
        "assert not [m for m in sys.modules if m.startswith('cupy')], 'cupy imported'; "
        "assert threading.active_count() == 1, threading.enumerate(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_public_all_is_sorted_and_importable():
    import gridcomm

    assert list(gridcomm.__all__) == sorted(gridcomm.__all__)
    for name in gridcomm.__all__:
        assert hasattr(gridcomm, name)
