"""Test certificates made with the openssl command: a CA, a rogue CA, a server, a client and a
rogue client (make_pki; conftest's ``pki`` fixture), and the GRIDCOMM_TLS_* environment that uses them."""

from __future__ import annotations

import os
import subprocess


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: str, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _leaf(d: str, name: str, ca: str, san: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    with open(os.path.join(d, f"{name}.ext"), "w") as ext:
        ext.write(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


def make_pki(d: str) -> dict[str, str]:
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "DNS:localhost,IP:127.0.0.1,DNS:job-0.svc")
    _leaf(d, "client", "ca", "DNS:rank")
    _leaf(d, "rogue-client", "rogue-ca", "DNS:rank")
    return {name: os.path.join(d, name) for name in ("ca", "rogue-ca", "server", "client", "rogue-client")}


def tls_env(pki: dict[str, str], *, mtls: bool = False, client: str | None = None, ca: str = "ca") -> dict[str, str]:
    env = {"GRIDCOMM_TLS_CERT": pki["server"] + ".pem", "GRIDCOMM_TLS_KEY": pki["server"] + ".key",
           "GRIDCOMM_TLS_CA": pki[ca] + ".pem"}
    if mtls:
        env["GRIDCOMM_TLS_REQUIRE_CLIENT_CERT"] = "1"
    if client is not None:
        env["GRIDCOMM_TLS_CLIENT_CERT"] = pki[client] + ".pem"
        env["GRIDCOMM_TLS_CLIENT_KEY"] = pki[client] + ".key"
    return env
