"""The relay tree: a node's ranks reach the coordinator through one relay (see relay.py)."""

from gridcomm._relay.relay import Relay

__all__ = ["Relay"]
