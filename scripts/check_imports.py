"""The import rules of the ``gridcomm`` package, as forbidden edges between its layers.

Each private module belongs to one layer (its top-level package under ``gridcomm/``); an import
of a forbidden layer anywhere in a module (top level or inside a function) is a violation.
``make lint`` and ``make test`` run this; ``tests/test_imports.py`` also proves it catches a planted
edge. Usage: ``python scripts/check_imports.py [PACKAGE_DIR]``; exit 1 and one line per violation.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator

#: The layer of a module: the name right under ``gridcomm`` (``_client``, ``_errors``, ...).
#: The wire vocabulary, errors and configuration are leaves every layer may use.
LEAVES = {"_errors", "_wire", "_proto", "_config"}
LAYERS = {"_runtime", "_relay", "_client", "_coordinator", "_backends", "_communicator", "_cli"}

#: layer -> (forbidden layers, why)
FORBIDDEN: dict[str, tuple[set[str], str]] = {
    **{leaf: (LAYERS, "the wire vocabulary, errors and configuration are leaves") for leaf in LEAVES},
    "_runtime": ({"_relay", "_coordinator", "_client", "_backends", "_communicator", "_cli"},
                 "the process runtime (background loop, per-rank health) serves every layer"),
    "_relay": ({"_client", "_coordinator", "_backends", "_communicator", "_cli"},
               "a relay is a server that knows the wire and the runtime; a client hosts one, never the reverse"),
    "_client": ({"_coordinator", "_backends", "_communicator", "_cli"},
                "a client never loads the coordinator (a rank of an external coordinator runs none)"),
    "_coordinator": ({"_relay", "_client", "_backends", "_communicator", "_cli"},
                     "the coordinator knows only the wire, never a client or a backend"),
    "_backends": ({"_relay", "_coordinator", "_client", "_proto", "_communicator", "_cli"},
                  "backends move data; they see the control plane only as base.ControlPlane"),
    "_communicator": ({"_cli"}, "nothing imports the command line"),
    "__init__": ({"_cli"}, "nothing imports the command line"),
}
#: Where CuPy may be imported (the NCCL backend and what picks or demonstrates it); gRPC never there.
CUPY_LAYERS = {"_backends", "_communicator", "_cli"}
GRPC_FREE_PREFIXES = ("gridcomm/_backends/nccl", "gridcomm/_errors", "gridcomm/_config")


def _imports(path: str) -> Iterator[tuple[int, str]]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            if node.module == "gridcomm":
                for alias in node.names:
                    yield node.lineno, f"gridcomm.{alias.name}"


def _layer(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "gridcomm" else None


def modules(package_dir: str) -> Iterator[tuple[str, str]]:
    """(path relative to the package's parent, layer) for every module but the generated stubs."""
    top = os.path.dirname(os.path.abspath(package_dir))
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), top)
            parts = rel[:-3].split(os.sep)
            layer = parts[1] if len(parts) > 1 else parts[0]
            if layer == "_proto":
                continue
            yield rel, layer


def violations(package_dir: str) -> list[str]:
    """Every forbidden import under ``package_dir`` (a ``gridcomm`` package), as readable lines."""
    top = os.path.dirname(os.path.abspath(package_dir))
    bad = []
    for rel, layer in modules(package_dir):
        if layer not in LEAVES | LAYERS | {"__init__", "__main__"}:
            bad.append(f"{rel}: belongs to no layer (add it to a package, or to LEAVES or LAYERS here)")
        forbidden, why = FORBIDDEN.get(layer, (set(), ""))
        for line, name in _imports(os.path.join(top, rel)):
            target = _layer(name)
            if target in forbidden:
                bad.append(f"{rel}:{line}: {layer} imports {name} ({why})")
            root = name.split(".")[0]
            if root in ("cupy", "cupyx") and layer not in CUPY_LAYERS:
                bad.append(f"{rel}:{line}: {layer} imports {name} (CuPy only where a communicator is built)")
            if (root == "grpc" or root.startswith("grpc_")) and rel.replace(os.sep, "/").startswith(GRPC_FREE_PREFIXES):
                bad.append(f"{rel}:{line}: imports {name} (gRPC and the NCCL backend never meet)")
    return bad


def main(argv: list[str]) -> int:
    package_dir = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "gridcomm")
    bad = violations(package_dir)
    for line in bad:
        print(line)
    if not bad:
        print(f"import rules hold ({sum(1 for _ in modules(package_dir))} modules)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
