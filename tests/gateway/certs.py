"""Throwaway certificate authorities, and the server and client certificates they issue, for
backends served over TLS (and asking the gateway for a certificate of its own: mutual TLS)."""

from __future__ import annotations

import datetime
import ipaddress
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["Authority"]

_DAY = datetime.timedelta(days=1)


class Authority:
    """A CA of its own (an EC key, a self-signed certificate) that issues server certificates.

    Args:
        directory: where its files are written.
        name: its common name, and the prefix of its files.
    """

    def __init__(self, directory: Path, name: str) -> None:
        self.directory, self.name = directory, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            _builder(subject, subject, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.ca_file = directory / f"{name}-ca.pem"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, names: list[str]) -> tuple[Path, Path]:
        """A server certificate for `names` (host names or IP addresses), signed by this CA;
        returns (certificate file, key file)."""
        return self._issue(names, ExtendedKeyUsageOID.SERVER_AUTH)

    def issue_client(self, name: str) -> tuple[Path, Path]:
        """A client certificate for `name`, signed by this CA: what a gateway shows a backend
        that asks for one; returns (certificate file, key file)."""
        return self._issue([name], ExtendedKeyUsageOID.CLIENT_AUTH)

    def _issue(self, names: list[str], usage: x509.ObjectIdentifier) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
        alt: list[x509.GeneralName] = [_general_name(n) for n in names]
        cert = (
            _builder(subject, self.cert.subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        stem = self.directory / f"{self.name}-{names[0]}"
        cert_file, key_file = stem.with_suffix(".crt"), stem.with_suffix(".key")
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_file, key_file


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + _DAY)
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
