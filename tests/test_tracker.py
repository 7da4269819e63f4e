"""A rank's progress counter (gridcomm._client.tracker): the wrappers it puts around a backend's
collectives forward every argument as the backend takes it, count each call, and date entries
from the watcher's samples."""

from __future__ import annotations

import inspect
import time

import numpy as np
import pytest

from gridcomm._backends.host.backend import HostBackend
from gridcomm._client.tracker import COUNTED, Tracker, fingerprint


@pytest.mark.parametrize("kind", sorted(COUNTED))
def test_a_counted_collective_has_the_backends_signature_and_forwards_every_argument(kind):
    seen = []
    tracker = Tracker("world", 1)

    def call(*args):
        seen.append((args, tracker.inside, tracker.entered, tracker.kind))

    wrapped = tracker.counted(kind, call)
    backend = inspect.signature(getattr(HostBackend, kind))
    assert list(inspect.signature(wrapped).parameters) == [p for p in backend.parameters if p != "self"]
    for name, param in inspect.signature(wrapped).parameters.items():
        assert param.default == backend.parameters[name].default, (kind, name)
    names = list(inspect.signature(wrapped).parameters)
    wrapped(*range(len(names)))
    wrapped(**{n: f"v{i}" for i, n in enumerate(names)})
    assert seen == [(tuple(range(len(names))), True, 1, kind), (tuple(f"v{i}" for i in range(len(names))), True, 2, kind)]
    assert not tracker.inside and tracker.entered == 2


def test_an_error_in_the_call_still_leaves_it():
    tracker = Tracker("world", 1)

    def call(*_):
        raise ValueError("bad")

    with pytest.raises(ValueError):
        tracker.counted("all_reduce", call)(1, 2)
    assert tracker.entered == 1 and not tracker.inside


def test_entries_are_dated_by_the_sample_that_first_sees_them():
    # A call that returned is dated by the sample (one the rank is still in, by its entry: see
    # tests/test_trace.py).
    tracker = Tracker("world", 1)
    first = tracker.progress()
    assert first.entered == 0
    tracker.enter("barrier")
    tracker.leave()
    time.sleep(0.05)
    seen = tracker.progress()
    assert seen.entered == 1 and seen.age_s < 0.02 and not seen.inside and seen.kind == "barrier"
    time.sleep(0.05)
    later = tracker.progress()
    assert later.age_s >= 0.05 and later.entered == 1


def test_fingerprints_name_what_every_rank_must_agree_on():
    x = np.ones(4, dtype=np.float32)
    assert fingerprint("all_reduce", (x, x), {"op": "max"}) == "all_reduce(max, 4 x float32)"
    assert fingerprint("broadcast", (x,), {}) == "broadcast(root=0, 4 x float32)"
    assert fingerprint("reduce_scatter", (np.ones(8), np.ones(2), 2), {}) == "reduce_scatter(sum, 2 x float64)"
    # scatter's input matters only on the root: its output is what every rank shares.
    assert fingerprint("scatter", (None, x), {"root": 1}) == "scatter(root=1, 4 x float32)"
    tracker = Tracker("world", 1, fingerprints=True)
    tracker.counted("all_reduce", lambda *a, **k: None)(x, x, op="max")
    assert list(tracker.progress().recent) == ["all_reduce(max, 4 x float32)"]
