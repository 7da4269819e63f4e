"""The relay: the coordinator's service for the ranks of one group or node, carried upstream on one
stream (``server``: the Relay; ``upstream``, ``aggregate``, ``beats``, ``children``, ``silence``,
``tls``: its parts). It runs in a rank's process (started by its client) or in ``gridcomm launch``;
it knows the wire and the process runtime, never a client (see scripts/check_imports.py)."""
