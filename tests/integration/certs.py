"""Throwaway certificates for the TLS tests: a CA and a server certificate it signs, made with
the openssl command line (no Python package needed)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# One configuration for both steps: the CA's extensions and the server certificate's.
_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = {name}
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = {names}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@dataclass(frozen=True)
class Certificates:
    """A CA and a server certificate it signed, as PEM files."""

    ca: Path
    """The CA's certificate: what clients trust (sslrootcert, ssl.ca.location)."""
    cert: Path
    """The server's certificate."""
    key: Path
    """The server's private key: PKCS#8, not encrypted."""

    @property
    def key_and_cert(self) -> Path:
        """Key and certificate in one file: a PEM key store for Kafka (ssl.keystore.location)."""
        path = self.cert.with_name(f"{self.cert.stem}-keystore.pem")
        if not path.exists():
            path.write_bytes(self.key.read_bytes() + self.cert.read_bytes())
        return path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the TLS tests make their certificates with openssl: install it")
    subprocess.run([openssl, *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str = "cdc-relay test CA") -> tuple[Path, Path]:
    """A self-signed CA valid for two days: (certificate, key)."""
    directory.mkdir(parents=True, exist_ok=True)
    slug = name.lower().replace(" ", "-")
    config = directory / f"{slug}.cnf"
    config.write_text(_CONFIG.format(name=name, names="DNS:localhost"))
    cert, key = directory / f"{slug}.crt", directory / f"{slug}.key"
    _openssl(
        "req", "-x509", "-config", config.name, "-extensions", "ca", "-days", "2",
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key.name, "-out", cert.name,
        cwd=directory,
    )  # fmt: skip
    return cert, key


def make_certificates(
    directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
) -> Certificates:
    """A new CA and a server certificate it signed for ``hosts`` (subject alternative names:
    DNS names and IP addresses), in ``directory``."""
    ca, ca_key = make_ca(directory)
    names = ", ".join(
        f"IP:{host}" if host.replace(".", "").isdigit() or ":" in host else f"DNS:{host}"
        for host in hosts
    )
    config = directory / "server.cnf"
    config.write_text(_CONFIG.format(name=hosts[0], names=names))
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-out", "server.key",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", "-new", "-config", config.name, "-key", "server.key", "-out", "server.csr",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", ca.name, "-CAkey", ca_key.name,
        "-set_serial", str(secrets.randbits(63)), "-days", "2",
        "-extfile", config.name, "-extensions", "server", "-out", "server.crt",
        cwd=directory,
    )  # fmt: skip
    return Certificates(ca=ca, cert=directory / "server.crt", key=directory / "server.key")
