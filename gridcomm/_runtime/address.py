"""This host's address as others reach it (the data plane's endpoints, a relay of the tree)."""

from __future__ import annotations

import socket


def local_address(route_host: str, explicit: str | None = None) -> str:
    """The address of this host on the route to ``route_host`` (the coordinator): what the peers
    can reach. Found by connecting a UDP socket (no packet is sent); if the name does not resolve
    (a headless Service's own record can lag behind its pod), this host's own name is tried, then
    loopback. ``explicit`` (``GRIDCOMM_DATA_HOST``) wins."""
    if explicit:
        return explicit
    for name in (route_host, socket.gethostname()):
        try:
            infos = socket.getaddrinfo(name, 9, type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, _, _, _, sockaddr in infos:
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as probe:
                    probe.connect(sockaddr)
                    return str(probe.getsockname()[0])
            except OSError:
                continue
    return "127.0.0.1"
