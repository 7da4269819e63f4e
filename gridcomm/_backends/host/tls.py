"""TLS for host data-plane links: the server and client contexts built from the job's TLS files."""

from __future__ import annotations

import os
import ssl
import tempfile

from gridcomm import _config
from gridcomm._errors import (
    ConfigError,
)


# ---------------------------------------------------------------------------------------------- TLS
def _load_pair(context: ssl.SSLContext, cert: bytes, key: bytes | None) -> None:
    """ssl loads certificate chains from files only. On Linux the PEMs go to anonymous memory
    files (memfd), read through /proc/self/fd: nothing reaches a disk, and nothing is left behind
    whatever ends the process. Elsewhere a private folder is written and removed at once."""
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None and os.path.isdir("/proc/self/fd"):
        fds = []
        try:
            for name, data in (("gridcomm-cert", cert), ("gridcomm-key", key or b"")):
                fd = memfd(name, getattr(os, "MFD_CLOEXEC", 0))
                fds.append(fd)
                os.write(fd, data)
            context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}" if key else None)
            return
        except OSError:
            pass  # e.g. no /proc inside a sandbox: the folder below
        finally:
            for fd in fds:
                os.close(fd)
    folder = tempfile.mkdtemp(prefix="gridcomm-tls-")
    try:
        cert_path = os.path.join(folder, "cert.pem")
        key_path = os.path.join(folder, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key or b"")):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        context.load_cert_chain(cert_path, key_path if key else None)
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def tls_contexts(tls: _config.TlsFiles) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for links of a job that uses TLS. Every rank serves its links, so
    each needs a certificate: GRIDCOMM_TLS_CERT/_KEY, else its client certificate. Peers are
    dialled by address, so host names are not checked; the job's CA, and the token's HMAC
    inside the TLS session, say who the peer is."""
    cert, key = (tls.cert, tls.key) if tls.cert is not None else (tls.client_cert, tls.client_key)
    if cert is None:
        raise ConfigError("the host backend's data plane uses TLS like the coordinator, and every rank accepts "
                          "connections from its peers, so every rank needs a certificate: set GRIDCOMM_TLS_CERT and "
                          "GRIDCOMM_TLS_KEY (or GRIDCOMM_TLS_CLIENT_CERT and _KEY) on every rank.")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_pair(server, cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    if tls.ca is not None:
        client.load_verify_locations(cadata=tls.ca.decode("ascii", errors="replace"))
    else:
        client.load_default_certs()
    if tls.require_client_cert:
        if tls.ca is None:
            raise ConfigError("GRIDCOMM_TLS_REQUIRE_CLIENT_CERT needs GRIDCOMM_TLS_CA to verify peers' certificates.")
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cadata=tls.ca.decode("ascii", errors="replace"))
    client_cert, client_key = tls.client_pair()
    if client_cert is not None:
        _load_pair(client, client_cert, client_key)
    elif tls.require_client_cert:
        _load_pair(client, cert, key)
    return server, client

