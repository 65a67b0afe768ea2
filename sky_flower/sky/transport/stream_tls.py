"""The ``stream`` endpoint's certificate: self-signed, made per round with
``cryptography`` (:func:`x509_pem`, which makes the deployment's too), pinned by
the SHA-256 fingerprint of its DER encoding that Flower's own authenticated set-up
message carries (:mod:`sky_flower.sky.transport.channel`)."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SERVER_NAME = "sky-flower-stream"  # the certificate's name; the client checks it


class StreamError(RuntimeError):
    """The data plane failed: a link closed, stalled, or sent a malformed frame."""


class StreamRefusedError(StreamError):
    """A connection refused before any tensor moved: a wrong ticket, a certificate
    that is not the pinned one, or an endpoint that cannot be reached."""


@dataclass(frozen=True)
class Certificate:
    """A self-signed endpoint certificate: ``cert_pem``, ``key_pem`` and the SHA-256
    ``fingerprint`` (hex) of its DER encoding."""

    cert_pem: bytes
    key_pem: bytes
    fingerprint: str


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 (hex) of the DER encoding of the PEM certificate ``cert_pem``.

    Raises
    ------
    StreamRefusedError
        If ``cert_pem`` is no PEM certificate.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as err:
        raise StreamRefusedError(f"the endpoint's certificate does not parse: {err}") from err
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def x509_pem(
    name: str,
    key: Any,  # noqa: ANN401 - a cryptography private key
    valid: dt.timedelta,
    *,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    ca: bool = False,
    issuer: tuple[str, Any] | None = None,
) -> tuple[bytes, bytes]:
    """The one certificate builder (``cryptography``; the stream endpoint's here, the
    deployment's CA and server certificate in :mod:`sky_flower.deploy.tls`): a
    certificate for common name ``name`` and ``key``'s public key, signed by ``issuer``
    (its common name and private key; ``None``: self-signed), valid from 5 minutes ago
    for ``valid``, with the ``dns`` and ``ips`` subject alternative names and, if
    ``ca``, CA basic constraints. Returns its PEM and ``key``'s (PKCS8, unencrypted)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    def named(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    issuer_name, issuer_key = issuer or (name, key)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(named(name))
        .issuer_name(named(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + valid)
    )
    alt = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    if ca:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def make_certificate(hours: float = 24.0) -> Certificate:
    """A fresh self-signed ECDSA P-256 certificate for :data:`SERVER_NAME`
    (:func:`x509_pem`), valid ``hours``."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem, key_pem = x509_pem(SERVER_NAME, key, dt.timedelta(hours=hours), dns=[SERVER_NAME], ca=True)
    return Certificate(pem, key_pem, fingerprint(pem))


def pinned(cert_pem: bytes, expected: str) -> bytes:
    """``cert_pem`` if its fingerprint is ``expected`` (the only root the client then
    trusts).

    Raises
    ------
    StreamRefusedError
        Naming both fingerprints, before any connection is made.
    """
    got = fingerprint(cert_pem)
    if not hmac.compare_digest(got, expected.lower()):
        raise StreamRefusedError(
            f"the endpoint's certificate has fingerprint {got[:16]}..., not the pinned "
            f"{expected[:16]}... of the set-up message: refused before connecting"
        )
    return cert_pem
