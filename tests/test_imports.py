"""Import direction: errors <- config <- coordinator <- communicator <- api <- cli.

gRPC and CuPy never import each other's side; ``import gridcomm`` imports no CuPy.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.support.procs import ROOT

PKG = os.path.join(ROOT, "gridcomm")

# Layer of each private module; a module may import only from its own layer or lower ones.
LAYERS = {
    "_errors": 0,
    "_config": 1,
    "_cluster": 1,
    "_rendezvous": 2,
    "_proto": 2,
    "_wire": 2,
    "_servicer": 2.8,
    "_stream": 2.9,
    "_eventloop": 1,
    "_guard": 2.5,
    "_metrics": 2.6,
    "_progress": 1,
    "_server": 3,
    "_channel": 3.5,
    "_session": 3.7,
    "_client": 4,
    "_liveness": 3.8,  # the watcher a joined client starts (it reads the client through a Protocol)
    "_health": 4.5,
    "_validate": 5,
    "_nccl": 5,
    "_shm": 5,
    "_p2p": 5,
    "_host": 5,
    "_comm": 6,
    "_api": 7,
    "_launch": 8,
    "_demo": 8,
    "_statusview": 8.5,
    "_cli": 9,
    "__init__": 8,
    "__main__": 10,
}
# Modules that may import grpc; the NCCL backend must not, and the control plane never imports cupy.
GRPC_FREE = {"_errors", "_config", "_eventloop", "_rendezvous", "_nccl", "_validate", "_shm", "_p2p"}
CUPY_ALLOWED = {"_nccl", "_comm", "_api", "_demo", "_launch"}


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "gridcomm":
                names.update(f"gridcomm.{a.name}" for a in node.names)
    return names


def _modules() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(PKG) if f.endswith(".py"))


def test_every_module_has_a_layer():
    assert set(_modules()) <= set(LAYERS), set(_modules()) - set(LAYERS)


def test_imports_flow_one_way():
    bad = []
    for mod in _modules():
        for name in _imports(os.path.join(PKG, mod + ".py")):
            if not name.startswith("gridcomm."):
                continue
            target = name.split(".")[1]
            if target in LAYERS and LAYERS[target] > LAYERS[mod]:
                bad.append(f"{mod} imports {target}")
    assert not bad, bad


def test_grpc_and_cupy_stay_apart():
    bad = []
    for mod in _modules():
        names = _imports(os.path.join(PKG, mod + ".py"))
        if mod in GRPC_FREE and any(n == "grpc" or n.startswith(("grpc.", "grpc_")) for n in names):
            bad.append(f"{mod} imports grpc")
        if mod not in CUPY_ALLOWED and any(n == "cupy" or n.startswith(("cupy.", "cupyx")) for n in names):
            bad.append(f"{mod} imports cupy")
    assert not bad, bad


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
