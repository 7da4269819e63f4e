"""Ending NCCL communicators without hanging, checked without a GPU: ncclCommDestroy and
ncclCommAbort are stood in for by objects whose calls block on an event (CUDA does not run on
this machine; on a GPU, tests/test_gpu_ranks.py runs the real ones). What is checked here is
gridcomm's own threading: stop() returns within its bound and aborts what did not end, the
split's parent is destroyed before its child on every rank, and a failure heard of on the
background loop never waits there for an abort."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from gridcomm._backends.nccl import lifecycle
from gridcomm._backends.nccl.backend import NcclBackend
from gridcomm._backends.nccl.engines import _Split
from gridcomm._communicator import communicator as communicator_mod
from gridcomm._communicator.communicator import Communicator
from gridcomm._errors import CommAborted

BOUND_S = 0.5  # the bound under test; every wait below is an event with a generous timeout


class Owner:
    """A communicator whose destroy and abort block until released (as NCCL's do while a CUDA
    graph holds its work, or while a peer never comes)."""

    def __init__(self, destroy_blocks: bool = True, abort_blocks: bool = False) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []
        self.destroy_blocks, self.abort_blocks = destroy_blocks, abort_blocks

    def destroy(self) -> None:
        self.calls.append("destroy")
        if self.destroy_blocks:
            self.release.wait(60)

    def abort(self) -> None:
        self.calls.append("abort")
        if self.abort_blocks:
            self.release.wait(60)


def _backend(owner: Owner) -> NcclBackend:
    backend = object.__new__(NcclBackend)
    backend._owner, backend._c = owner, owner
    backend._engine = SimpleNamespace(null=None)
    backend.rank, backend.world_size, backend.engine = 0, 2, "nccl4py"
    return backend


def test_a_destroy_that_blocks_is_aborted_after_the_bound(monkeypatch):
    monkeypatch.setattr(lifecycle, "DESTROY_WAIT_S", BOUND_S)
    owner = Owner()
    backend = _backend(owner)
    try:
        start = time.monotonic()
        backend.destroy()  # the test's own timeout (pyproject) ends it if it blocks for good
        assert time.monotonic() - start < 30
        assert owner.calls == ["destroy", "abort"]
        backend.destroy()  # idempotent: nothing left to free
        assert owner.calls == ["destroy", "abort"]
    finally:
        owner.release.set()


def test_a_destroy_that_completes_is_not_aborted(monkeypatch):
    monkeypatch.setattr(lifecycle, "DESTROY_WAIT_S", BOUND_S)
    owner = Owner(destroy_blocks=False)
    _backend(owner).destroy()
    assert owner.calls == ["destroy"]


def test_an_abort_that_blocks_too_is_bounded_as_well():
    owner = Owner(abort_blocks=True)
    try:
        assert lifecycle.bounded_destroy(owner, "rank 0 of 2", BOUND_S) is False
        assert owner.calls == ["destroy", "abort"]
    finally:
        owner.release.set()


def _split(parent_destroy: threading.Event) -> tuple[_Split, Owner]:
    """A split whose child is up and whose parent's destroy (the split thread's last act) waits
    for ``parent_destroy``."""
    split = object.__new__(_Split)
    child = Owner(destroy_blocks=False)
    split._lock = threading.Lock()
    split._settled = threading.Event()
    split._settled.set()
    split._error, split._aborted, split._child_state = None, False, ""
    split._comm, split._child, split._what, split._deadline = object(), child, "rank 0 of 2", time.monotonic() + 60
    split._thread = threading.Thread(target=parent_destroy.wait, args=(60,), daemon=True)
    split._thread.start()
    return split, child


def test_the_child_is_destroyed_only_after_the_parent():
    parent_done = threading.Event()
    split, child = _split(parent_done)
    destroyer = threading.Thread(target=split.destroy, daemon=True)
    destroyer.start()
    try:
        destroyer.join(BOUND_S)
        assert destroyer.is_alive() and child.calls == []  # still waiting for the parent's destroy
        parent_done.set()
        destroyer.join(30)
        assert not destroyer.is_alive()
        assert child.calls == ["destroy"]
    finally:
        parent_done.set()


def test_an_abort_while_the_parent_is_destroyed_frees_the_child_once():
    parent_done = threading.Event()
    split, child = _split(parent_done)
    destroyer = threading.Thread(target=split.destroy, daemon=True)
    destroyer.start()
    try:
        destroyer.join(BOUND_S)
        split.abort()  # what bounded_destroy does past its bound
        assert child.calls == ["abort"]
        parent_done.set()
        destroyer.join(30)
        assert not destroyer.is_alive()
        assert child.calls == ["abort"]  # never destroyed after the abort freed it
        split.abort()
        assert child.calls == ["abort"]
    finally:
        parent_done.set()


def _communicator(*backends: object) -> Communicator:
    comm = object.__new__(Communicator)
    comm._backend, comm._children, comm._aborting, comm.rank = backends[0], [], None, 0
    for backend in backends[1:]:
        child = object.__new__(Communicator)
        child._backend, child._children = backend, []
        comm._children.append(child)
    return comm


@pytest.mark.parametrize("may_block", [True, False])
def test_a_failure_does_not_wait_for_an_nccl_abort_on_the_thread_that_heard_of_it(monkeypatch, may_block):
    """_abort_backends runs on the background loop (the watcher heard of a failure): an NCCL abort
    that blocks must not hold it; a host backend's (which never blocks) is done at once."""
    monkeypatch.setattr(communicator_mod, "ABORT_WAIT_S", BOUND_S)
    owner = Owner(abort_blocks=True)
    backend = SimpleNamespace(abort=lambda error: owner.abort(), abort_may_block=may_block)
    if not may_block:
        owner.abort_blocks = False
    comm = _communicator(backend)
    try:
        start = time.monotonic()
        comm._abort_backends(CommAborted("rank 1 failed"))
        assert time.monotonic() - start < 30  # a blocked abort here holds it for 60 s
        comm._await_aborts()  # bounded by ABORT_WAIT_S
        assert owner.calls == ["abort"]
        assert (comm._aborting is not None) == may_block
    finally:
        owner.release.set()
    if comm._aborting is not None:
        comm._aborting.join(30)
        assert not comm._aborting.is_alive()
