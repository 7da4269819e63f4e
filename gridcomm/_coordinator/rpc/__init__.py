"""The coordinator's operations, one module per RPC family, each a mixin of
:class:`~gridcomm._coordinator.servicer.Servicer` on the shared plumbing of ``base``:

- ``base``: the caller's checks, the bounded waits and their wakes, a Session operation's charge,
  how a failure is recorded;
- ``join``: Join (the rendezvous, relays' aggregates, the directed join's first contacts, recovery);
- ``store``: Set, Get, Add, CompareSet, DeleteKey and Keys;
- ``barrier``: Barrier;
- ``liveness``: Heartbeat (own and relayed), the liveness watch, ReportFailure and Leave;
- ``status``: Status.

Every operation is one coroutine ``op(request, deadline)`` (``deadline``: the loop time by which
the caller must have its answer, or None), run alike for a unary call and for a message of a
Session stream (:mod:`gridcomm._coordinator.session`); a refusal is raised (:class:`Abort
<gridcomm._coordinator.answers.Abort>`, or the :class:`~gridcomm._coordinator.state.StateError` of
a decision) and turned into a status in one place (:func:`gridcomm._coordinator.answers.status_of`).
The decisions live in :mod:`gridcomm._coordinator.state`; these modules translate the wire into
the state's calls, wait, wake and answer.
"""
