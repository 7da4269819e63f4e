"""TLS material: :class:`TlsFiles` (the PEM bytes and how they are used) and :func:`read_tls`,
which loads the GRIDCOMM_TLS_* files named in an environment mapping that
:func:`gridcomm._config.readers.tls` hands it, and checks they go together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gridcomm._config.values import _first
from gridcomm._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """TLS material (PEM bytes) from GRIDCOMM_TLS_*; see :func:`gridcomm._config.readers.tls`."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    server_name: str | None = None
    require_client_cert: bool = False

    def client_pair(self) -> tuple[bytes | None, bytes | None]:
        """The certificate a client presents (mTLS): its own, else the shared cert when the
        server requires one."""
        if self.client_cert is not None:
            return self.client_cert, self.client_key
        if self.require_client_cert:
            return self.cert, self.key
        return None, None


_TLS_FILES = {
    "cert": "GRIDCOMM_TLS_CERT",
    "key": "GRIDCOMM_TLS_KEY",
    "ca": "GRIDCOMM_TLS_CA",
    "client_cert": "GRIDCOMM_TLS_CLIENT_CERT",
    "client_key": "GRIDCOMM_TLS_CLIENT_KEY",
}


def read_tls(env: Mapping[str, str]) -> TlsFiles | None:
    """TLS settings from ``env`` (see :func:`gridcomm._config.readers.tls`), or None (plaintext)
    when no GRIDCOMM_TLS_* file is set."""
    loaded: dict[str, bytes | None] = {}
    for field, name in _TLS_FILES.items():
        found = _first(env, (name,))
        if found is None:
            loaded[field] = None
            continue
        try:
            with open(found[1], "rb") as handle:
                loaded[field] = handle.read()
        except OSError as exc:
            raise ConfigError(f"{name}={found[1]!r} cannot be read: {exc.strerror}.") from exc
    if all(v is None for v in loaded.values()):
        return None
    require = _first(env, ("GRIDCOMM_TLS_REQUIRE_CLIENT_CERT",))
    require_flag = require is not None and require[1].lower() in ("1", "true", "yes", "on")
    if (loaded["cert"] is None) != (loaded["key"] is None):
        raise ConfigError("GRIDCOMM_TLS_CERT and GRIDCOMM_TLS_KEY must be set together.")
    if (loaded["client_cert"] is None) != (loaded["client_key"] is None):
        raise ConfigError("GRIDCOMM_TLS_CLIENT_CERT and GRIDCOMM_TLS_CLIENT_KEY must be set together.")
    if require_flag and loaded["ca"] is None:
        raise ConfigError("GRIDCOMM_TLS_REQUIRE_CLIENT_CERT needs GRIDCOMM_TLS_CA to verify client certificates.")
    server_name = _first(env, ("GRIDCOMM_TLS_SERVER_NAME",))
    return TlsFiles(server_name=None if server_name is None else server_name[1], require_client_cert=require_flag,
                    **loaded)
