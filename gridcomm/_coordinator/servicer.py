"""The coordinator's servicer: every RPC's operation over one
:class:`~gridcomm._coordinator.state.JobState`, gathered from the RPC families of
:mod:`gridcomm._coordinator.rpc` (see there for the layout and how refusals become statuses).

The server (:mod:`gridcomm._coordinator.server`) wires each unary RPC to its operation here, and
the Session stream (:mod:`gridcomm._coordinator.session`) runs the same operations.
"""

from __future__ import annotations

from gridcomm._coordinator.rpc.barrier import BarrierOps
from gridcomm._coordinator.rpc.base import ANSWER_MARGIN_S, Owner
from gridcomm._coordinator.rpc.join import JoinOps
from gridcomm._coordinator.rpc.liveness import LivenessOps
from gridcomm._coordinator.rpc.status import StatusOps
from gridcomm._coordinator.rpc.store import StoreOps
from gridcomm._coordinator.tree import Tree

__all__ = ["ANSWER_MARGIN_S", "Owner", "Servicer"]


class Servicer(JoinOps, StoreOps, BarrierOps, LivenessOps, StatusOps):
    """The coordinator's operations: Join (:mod:`~gridcomm._coordinator.rpc.join`); Set, Get and
    torch's store operations (:mod:`~gridcomm._coordinator.rpc.store`); Barrier
    (:mod:`~gridcomm._coordinator.rpc.barrier`); Heartbeat, ReportFailure, Leave and the liveness
    watch (:mod:`~gridcomm._coordinator.rpc.liveness`); Status
    (:mod:`~gridcomm._coordinator.rpc.status`); on the plumbing of
    :class:`~gridcomm._coordinator.rpc.base.Operations`."""

    def __init__(self, owner: Owner) -> None:
        super().__init__(owner)
        # The families' own state (declared in their mixins).
        self._missing_answer = None
        self._relays = {}
        self._tree = Tree(self._state.world_size, owner.relay_fanin, configured=owner.relay_fanin_configured)
        self._told = {}
