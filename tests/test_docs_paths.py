"""Every repository path the documents name exists, and no document points outside the repository.

The documents are README.md, BENCHMARKS.md, docs/*.md and deploy/README.md, and the comments of
pyproject.toml and the Makefile. A path is a word that
starts with one of the repository's top-level folders (``gridcomm/_relay/server.py``,
``benchmarks/rendezvous.py``, ``tests/test_recovery.py::name``, ``deploy/k8s/recoverable/``) or a
relative Markdown link; deploy/README.md also names files relative to its own folder
(``k8s/job/job.yaml``). Ratios written like paths (``gridcomm/JAX``) are not paths: a candidate
counts when it ends in ``/``, has a file extension, or names a private module (``gridcomm/_wire``);
a module named from inside the package (``_client/watcher.py``) is looked for under gridcomm/.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.support.procs import ROOT

TOP = ("gridcomm", "benchmarks", "scripts", "deploy", "tests", "protos", "docs", "examples")
#: Folders deploy/README.md names relative to itself.
DEPLOY_LOCAL = ("k8s", "docker", "monitoring")
#: Signs of a pointer outside the repository: a sibling checkout, a temporary file, this machine.
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])\.\./|(?<![\w$}])/tmp/|/work/")
CANDIDATE = re.compile(r"(?<![\w./$-])((?:" + "|".join(TOP + DEPLOY_LOCAL) + r")/[\w./*{}<>:-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A module named inside the package (``_client/watcher.py``, ``_proto/``), as the layer table does.
PRIVATE = re.compile(r"(?<![\w./])(_[a-z]+(?:/[\w.]+)*/?)")


def documents() -> list[str]:
    found = ["README.md", "BENCHMARKS.md", "deploy/README.md", "pyproject.toml", "Makefile"]
    found += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return found


def is_path(word: str) -> bool:
    last = word.rstrip("/").rsplit("/", 1)[-1]
    return word.endswith("/") or bool(re.search(r"\.\w+$", last)) or last.startswith("_")


def named_paths(doc: str, text: str) -> list[tuple[str, str]]:
    """(as written, where it should be relative to the root) for each path the document names."""
    here = os.path.dirname(doc)
    out = []
    for match in CANDIDATE.finditer(text):
        word = match.group(1).split("::", 1)[0].rstrip(".,:;")
        if any(c in word for c in "{}<>") or not is_path(word):
            continue
        first = word.split("/", 1)[0]
        if first in DEPLOY_LOCAL:
            if doc != "deploy/README.md":
                continue
            out.append((word, os.path.join("deploy", word)))
        else:
            out.append((word, word))
    for match in PRIVATE.finditer(text):
        word = match.group(1).rstrip(".,:;")
        if "/" in word or word.endswith(".py"):
            out.append((word, os.path.join("gridcomm", word)))
    for match in LINK.finditer(text):
        target = match.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        out.append((target, os.path.normpath(os.path.join(here, target))))
    return out


def missing(doc: str, text: str) -> list[str]:
    bad = []
    for word, rel in named_paths(doc, text):
        full = os.path.join(ROOT, rel)
        exists = glob.glob(full) if "*" in rel else os.path.exists(full)
        inside = not os.path.relpath(os.path.abspath(full), ROOT).startswith("..")
        if not exists or not inside:
            bad.append(word)
    return sorted(set(bad))


def outside(text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {text[max(0, m.start() - 30):m.end() + 30]!r}"
            for m in OUTSIDE.finditer(text)]


@pytest.mark.parametrize("doc", documents())
def test_every_path_a_document_names_exists(doc: str):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    assert named_paths(doc, text), f"{doc} names no path at all: the extraction is broken"
    bad = missing(doc, text)
    assert not bad, f"{doc} names paths that are not in the repository: {bad}"


@pytest.mark.parametrize("doc", documents())
def test_no_document_points_outside_the_repository(doc: str):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    found = outside(text)
    assert not found, f"{doc} points outside the repository: {found}"


def test_the_check_catches_a_planted_bad_path_and_a_pointer_outside():
    text = ("See `gridcomm/_relay/server.py`, `gridcomm/_client/no_such.py`, `tests/test_relay.py::test_x`,\n"
            "benchmarks/gone.py, [design](docs/design.md), [gone](docs/gone.md), gridcomm/JAX 2.1x,\n"
            "and `k8s/job/job.yaml`; `_coordinator/state.py` and `_client/watcher.py`.\n")
    assert missing("README.md", text) == ["_coordinator/state.py", "benchmarks/gone.py", "docs/gone.md",
                                            "gridcomm/_client/no_such.py"]
    assert missing("deploy/README.md", "`k8s/job/job.yaml`, `k8s/job/gone.yaml`") == ["k8s/job/gone.yaml"]
    assert missing("README.md", "[up](../outside.md)") == ["../outside.md"]
    assert outside("run `--json /tmp/x.json`") and outside("see ../shared/DESIGN.md")
    assert not outside("an `emptyDir` at `/tmp` in the pod; `$OUT/x.json`")


#: A commit's abbreviated or full hash: 7-40 hex digits with both a letter and a digit.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("doc", [d for d in documents() if d.endswith(".md")])
def test_no_document_names_a_commit(doc: str):
    """The documents hold current facts; which commit measured or changed what is git history."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    assert not COMMIT.findall(text), f"{doc} names commits: {sorted(set(COMMIT.findall(text)))}"
    assert COMMIT.findall("measured at b85fcfb, before 775c0b2") == ["b85fcfb", "775c0b2"]
