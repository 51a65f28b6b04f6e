"""TLS material for the tests, made with the openssl command line: a CA, certificates it
signs (valid for 127.0.0.1 and localhost), a client's SSL context, and a CA database that
revokes certificates and writes the CRL (:class:`Crl`)."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}")
    return cert, key


def signed_cert(d: Path, name: str, cn: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A certificate for ``cn`` signed by ``ca``, valid for 127.0.0.1 (server and client use)."""
    cert, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
            "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return cert, key


def client_ctx(ca: Path, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


_CA_CONF = """[ ca ]
default_ca = CA_default
[ CA_default ]
database = {d}/index.txt
crlnumber = {d}/crlnumber
default_md = sha256
default_crl_days = 2
"""


class Crl:
    """An openssl CA database for ``ca`` that revokes certificates and writes the CRL file."""

    def __init__(self, d: Path, ca: tuple[Path, Path]) -> None:
        self.d, self.ca = d, ca
        self.conf = d / "ca.cnf"
        self.conf.write_text(_CA_CONF.format(d=d))
        (d / "index.txt").write_text("")
        (d / "crlnumber").write_text("01\n")
        self.path = d / "crl.pem"
        self.write()

    def _ca_args(self) -> list[str]:
        return ["-config", str(self.conf), "-keyfile", str(self.ca[1]), "-cert", str(self.ca[0])]

    def revoke(self, cert: Path) -> None:
        openssl("ca", "-revoke", str(cert), *self._ca_args())
        self.write()

    def write(self) -> None:
        openssl("ca", "-gencrl", "-out", str(self.path), *self._ca_args())
