"""Shared fixtures: a real coordinator on loopback and real OS processes per rank."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

import gridcomm
from tests.support.calls import coordinator

# Re-exported for tests written before tests/support existed; new code imports tests.support.procs.
from tests.support.procs import ROOT, RankProcesses, RankResult, assert_all_ok, report  # noqa: F401
from tests.support.tls import make_pki


@pytest.fixture
def coordinator_factory() -> Iterator:
    started: list[gridcomm.Coordinator] = []

    def make(world_size: int, **kwargs) -> gridcomm.Coordinator:
        kwargs.setdefault("bind", "127.0.0.1")
        kwargs.setdefault("port", 0)
        server = gridcomm.Coordinator(world_size, **kwargs).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def fresh_server() -> Iterator[tuple[gridcomm.Coordinator, grpc.Channel]]:
    """A coordinator for two ranks that nobody joined: garbage first, then the real client flow."""
    with coordinator(2) as pair:
        yield pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """Test certificates (see tests/support/tls.py): name -> path without .pem/.key."""
    return make_pki(str(tmp_path_factory.mktemp("pki")))
