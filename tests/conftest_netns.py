"""pytest fixtures for network-namespace tests; the machinery itself is in ``tests/netns.py``.

Not a conftest (so it changes nothing for other test modules): a test module imports what it uses::

    from conftest_netns import make_topology, outcome_table  # noqa: F401  (fixtures)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import netns
import pytest


@pytest.fixture(scope="session")
def netns_usable() -> None:
    """Skips, with the reason, unless namespaces can be made here (root, iproute2, CAP_SYS_ADMIN).
    Also removes what crashed earlier runs left behind (never a live run's)."""
    reason = netns.unusable_reason()
    if reason:
        pytest.skip(reason)
    netns.remove_stale()


def skip_unless(reason: str | None) -> None:
    """Skips the calling test when ``reason`` (from ``netns.tool_missing`` and friends) is set."""
    if reason:
        pytest.skip(reason)


@pytest.fixture
def make_topology(netns_usable: None) -> Iterator[Callable[..., netns.Topology]]:
    """``make_topology(n_hosts, **kwargs)`` builds a :class:`netns.Topology`; every one made is
    closed after the test, pass or fail, and a cleanup that left something behind fails the test."""
    made: list[netns.Topology] = []

    def make(n_hosts: int, **kwargs: Any) -> netns.Topology:
        topo = netns.Topology(n_hosts, **kwargs).build()
        made.append(topo)
        return topo

    yield make
    problems = []
    for topo in made:
        try:
            topo.close()
        except netns.NetnsError as exc:
            problems.append(str(exc))
    assert not problems, "; ".join(problems)


class OutcomeTable:
    """Rows of (fault, expected, outcome per rank, time taken, its bound, topology setup and
    teardown seconds), printed at session end."""

    COLUMNS = ("fault", "expected", "outcome", "time", "bound", "setup_s", "teardown_s")

    def __init__(self) -> None:
        self.rows: list[dict[str, str]] = []

    def add(self, **row: object) -> dict[str, str]:
        """Adds a row and returns it (cells can still be filled in, e.g. a teardown time)."""
        unknown = set(row) - set(self.COLUMNS)
        if unknown:
            raise KeyError(f"unknown columns {sorted(unknown)}; use {self.COLUMNS}")
        cells = {k: _fmt(row.get(k, "")) for k in self.COLUMNS}
        self.rows.append(cells)
        return cells

    def render(self) -> str:
        widths = {c: max(len(c), *(len(r[c]) for r in self.rows)) for c in self.COLUMNS}
        line = " | ".join(c.ljust(widths[c]) for c in self.COLUMNS)
        out = [line, "-+-".join("-" * widths[c] for c in self.COLUMNS)]
        out += [" | ".join(r[c].ljust(widths[c]) for c in self.COLUMNS) for r in self.rows]
        return "\n".join(out)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


@pytest.fixture(scope="session")
def outcome_table(request: pytest.FixtureRequest) -> Iterator[OutcomeTable]:
    """A table that tests add rows to; printed once, after the last test that used it."""
    table = OutcomeTable()
    yield table
    if not table.rows:
        return
    text = "netns fault outcomes\n" + table.render()
    # Why through the capture manager: output of a fixture's teardown is captured, and dropped
    # when the test passed; this is how capsys.disabled() gets past it.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        if reporter is None:
            print(text)
            return
        reporter.write_line("")
        for line in text.splitlines():
            reporter.write_line(line)
