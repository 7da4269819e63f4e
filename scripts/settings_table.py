"""Writes (``--write``) or checks (default) README.md's configuration table, generated from
gridcomm/_config/registry.py, between the markers ``<!-- settings:begin -->`` and
``<!-- settings:end -->``. Exit 1 (and a line saying how to fix it) when the README is stale."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table() -> str:
    """The registry's table, loaded from its file alone (the registry imports nothing, so this
    script runs without gridcomm's dependencies installed)."""
    path = os.path.join(ROOT, "gridcomm", "_config", "registry.py")
    spec = importlib.util.spec_from_file_location("_gridcomm_registry", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up while building the class
    spec.loader.exec_module(module)
    return str(module.table())

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def render(readme: str) -> str:
    """``readme`` with the text between the markers replaced by the registry's table."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"README.md lacks the markers {BEGIN} ... {END} around the configuration table.")
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


def main(argv: list[str]) -> int:
    path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as handle:
        readme = handle.read()
    wanted = render(readme)
    if "--write" in argv:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(wanted)
        return 0
    if wanted != readme:
        print("README.md's configuration table differs from gridcomm/_config/registry.py; run "
              "python scripts/settings_table.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
