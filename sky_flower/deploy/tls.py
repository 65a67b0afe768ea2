"""TLS material for a local deployment: a CA, a server certificate for 127.0.0.1 /
localhost and SuperNode key pairs (``cryptography``), what ``flower-superlink --ssl-*``,
``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` take."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from sky_flower.sky.transport.stream_tls import x509_pem


@dataclass(frozen=True)
class Credentials:
    """Paths of the files :func:`make_credentials` writes."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # OpenSSH private keys; public key at ``<key>.pub``


def make_credentials(out: Path, num_nodes: int, days: int = 2) -> Credentials:
    """Generate a CA, a server certificate for 127.0.0.1 / localhost signed by it, and
    ``num_nodes`` SuperNode key pairs (ECDSA P-384; certificates by
    :func:`sky_flower.sky.transport.stream_tls.x509_pem`; keys in OpenSSH format, what
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
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out.mkdir(parents=True, exist_ok=True)
    valid, ca_name = dt.timedelta(days=days), "sky-flower local CA"
    ca_key, srv_key = (ec.generate_private_key(ec.SECP384R1()) for _ in range(2))
    ca_pem, _ = x509_pem(ca_name, ca_key, valid, ca=True)
    srv_pem, srv_key_pem = x509_pem(
        "127.0.0.1", srv_key, valid, dns=["localhost"], ips=["127.0.0.1"], issuer=(ca_name, ca_key)
    )
    creds = Credentials(
        ca_cert=out / "ca.crt",
        server_cert=out / "server.pem",
        server_key=out / "server.key",
        node_keys=tuple(out / f"node{i}" for i in range(num_nodes)),
    )
    creds.ca_cert.write_bytes(ca_pem)
    creds.server_cert.write_bytes(srv_pem)
    creds.server_key.write_bytes(srv_key_pem)
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
