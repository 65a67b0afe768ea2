"""TLS material for a local deployment: a CA, a server certificate for 127.0.0.1 /
localhost and SuperNode key pairs (``cryptography``), what ``flower-superlink --ssl-*``,
``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` take."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Credentials:
    """Paths of the files :func:`make_credentials` writes."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # OpenSSH private keys; public key at ``<key>.pub``


def make_credentials(out: Path, num_nodes: int, days: int = 2) -> Credentials:
    """Generate a CA, a server certificate for 127.0.0.1 / localhost signed by it, and
    ``num_nodes`` SuperNode key pairs (ECDSA P-384, OpenSSH format, what
    ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register``
    take).

    Parameters
    ----------
    out : Path
        Directory to write into (created).
    num_nodes : int
        SuperNode key pairs to generate.
    days : int
        Validity of the certificates, days.

    Returns
    -------
    Credentials
        The written files' paths.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sky-flower local CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    srv_key = ec.generate_private_key(ec.SECP384R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    creds = Credentials(
        ca_cert=out / "ca.crt",
        server_cert=out / "server.pem",
        server_key=out / "server.key",
        node_keys=tuple(out / f"node{i}" for i in range(num_nodes)),
    )
    creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_cert.write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_key.write_bytes(pem_key(srv_key))
    for path in creds.node_keys:
        key = ec.generate_private_key(ec.SECP384R1())
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
        )
        path.with_suffix(".pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )
    for path in [creds.server_key, *creds.node_keys]:
        path.chmod(0o600)
    return creds
