"""``gpumesh certs DIR``: a private certificate authority and the certificates of a mesh, for
development, tests and small deployments (the ``cryptography`` package).

Layout written into DIR (keys mode 0600)::

    ca.pem ca.key                      the CA (keep ca.key offline in production)
    router.pem router.key              CN = router id, OU = router
    <ID>.pem <ID>.key                  CN = node id,   OU = node     (one per --node)
    client.pem client.key              CN = client,    OU = client
    operator.pem operator.key          CN = operator,  OU = operator

Every certificate carries subjectAltNames for ``localhost``, 127.0.0.1, ::1, each ``--host``
and ``<CN>.<OU>.gpumesh`` (``tls.certificate_name``: what a router verifies when it dials a
node), and serves both as a server and as a client certificate (TLS on a node's own port and
mTLS towards a router). The OU is the role the router checks: only OU=node may register,
only OU=operator may use the operator API, only OU=router may call a node directly when
nodes require it (docs/security.md). An existing CA in DIR is reused, so adding a node later
signs it with the same CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpumesh.security.tls import certificate_name

ROLES = ("router", "node", "client", "operator")
ORG = "gpumesh"


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(cn: str, ou: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def ensure_ca(directory: Path, days: int = 3650) -> tuple[x509.Certificate,
                                                          ec.EllipticCurvePrivateKey]:
    """The CA in ``directory`` (ca.pem, ca.key), made when absent."""
    cert_p, key_p = directory / "ca.pem", directory / "ca.key"
    if cert_p.exists() and key_p.exists():
        cert = x509.load_pem_x509_certificate(cert_p.read_bytes())
        key = serialization.load_pem_private_key(key_p.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    name = _name(f"{ORG} CA", "ca")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    _write_key(key_p, key)
    _write_cert(cert_p, cert)
    return cert, key


def issue(directory: Path, stem: str, common_name: str, role: str,
          hosts: Sequence[str] = (), days: int = 365,
          not_before: dt.datetime | None = None) -> Issued:
    """Signs ``<stem>.pem`` / ``<stem>.key`` in ``directory`` with its CA (made if absent).
    ``not_before`` / ``days`` let tests make expired certificates."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    ca_cert, ca_key = ensure_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5))
    # the name a router verifies when it dials this certificate's node (tls.certificate_name)
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                    x509.DNSName(certificate_name(common_name, role))]
    ips = {"127.0.0.1", "::1"}
    for h in hosts:
        try:
            ips.add(str(ipaddress.ip_address(h.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(h))
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in sorted(ips)]
    cert = (x509.CertificateBuilder().subject_name(_name(common_name, role))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = Issued(directory / f"{stem}.pem", directory / f"{stem}.key")
    _write_key(out.key, key)
    _write_cert(out.cert, cert)
    return out


def make_mesh_certs(directory: str | Path, *, router_id: str = "router",
                    node_ids: Sequence[str] = ("node",), hosts: Sequence[str] = (),
                    days: int = 365) -> dict[str, Issued]:
    """CA + router, one per node, client and operator certificates (the module docstring's
    layout). Returns them by stem."""
    d = Path(directory)
    ensure_ca(d)
    clash = set(node_ids) & {"ca", *ROLES}
    if clash:
        raise ValueError(f"node ids {sorted(clash)} would overwrite the CA's or a role's files")
    out = {"router": issue(d, "router", router_id, "router", hosts, days)}
    for n in node_ids:
        out[n] = issue(d, n, n, "node", hosts, days)
    out["client"] = issue(d, "client", "client", "client", hosts, days)
    out["operator"] = issue(d, "operator", "operator", "operator", hosts, days)
    return out
