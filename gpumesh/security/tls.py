"""TLS for every hop: server credentials that pick up rotated files without a restart, channel
credentials, the plaintext-bind rule, and the peer's certificate identity.

Who calls it: ``router.app`` / ``node.app`` (server credentials, ``check_bind``), the router's
node channels and the node's heartbeat client (channel credentials), ``gpumesh.client`` and
the CLI (client side), ``router.auth`` (``peer_identity``).

- ``server_credentials``: ``grpc.dynamic_ssl_server_credentials``; gRPC asks for the
  configuration at every new handshake, and the fetcher re-reads the certificate, key and CA
  files only when one of their modification times changed (a stat per handshake). So a
  rotated certificate takes effect for new connections at once; open connections keep theirs.
- ``channel_credentials``: read when a channel is made; channels made after a rotation use
  the new files (nodes reconnect their heartbeat streams, routers re-dial nodes that re-join).
- ``check_bind``: plaintext on a non-loopback address is refused unless ``insecure``.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import re
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

# Metadata a node without a certificate sends on its Connect stream (router.auth.membership).
JOIN_TOKEN_HEADER = "x-gpumesh-join-token"


_PLAIN_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def certificate_name(common_name: str, role: str) -> str:
    """The DNS name that binds a certificate to its CN and role: ``gpumesh certs`` puts it in
    every certificate's subject alternative names, and a router dialling node ``X`` over TLS
    verifies the name ``certificate_name(X, "node")`` instead of the address's host, so only
    node X's certificate (OU=node, CN=X) completes the handshake. ``X.node.gpumesh`` for a
    lower-case DNS label; other ids are hex-encoded (``<hex>.hex.node.gpumesh``, which no
    plain label gives, since node ids hold no '.')."""
    if _PLAIN_LABEL.fullmatch(common_name):
        label = common_name
    else:
        h = common_name.encode().hex()
        label = ".".join([h[i:i + 60] for i in range(0, len(h), 60)] + ["hex"])
    return f"{label}.{role}.gpumesh"


class PlaintextRefused(RuntimeError):
    """Binding plaintext on a non-loopback address without ``insecure``."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths. ``cert``/``key``: this process's own; ``ca``: the authority its peers'
    certificates must chain to. Empty ``cert`` = TLS off (for a server)."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def check(self, what: str) -> None:
        """Raises ValueError naming the missing or unreadable file."""
        if not self.cert and not self.key:
            return
        for label, path in (("tls_cert_file", self.cert), ("tls_key_file", self.key)):
            if not path:
                raise ValueError(f"{what}: {label} is required with TLS")
            if not os.access(path, os.R_OK):
                raise ValueError(f"{what}: cannot read {label} {path}")
        if self.ca and not os.access(self.ca, os.R_OK):
            raise ValueError(f"{what}: cannot read tls_ca_file {self.ca}")


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:   # small PEM files; at startup or after a rotation only
        return fh.read()


class _Watched:
    """The files' bytes, re-read when a modification time changes."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp: tuple[float, ...] = ()
        self.cert = self.key = self.ca = b""
        self.reload()

    def _stamps(self) -> tuple[float, ...]:
        return tuple(os.stat(p).st_mtime_ns if p else 0
                     for p in (self.files.cert, self.files.key, self.files.ca))

    def reload(self) -> bool:
        """True when the files changed since the last read (and were read again)."""
        try:
            stamp = self._stamps()
        except OSError as exc:
            log.error("TLS files unreadable, keeping the loaded ones: %s", exc)
            return False
        if stamp == self._stamp:
            return False
        try:
            cert, key = _read(self.files.cert), _read(self.files.key)
            ca = _read(self.files.ca) if self.files.ca else b""
        except OSError as exc:
            log.error("TLS files unreadable, keeping the loaded ones: %s", exc)
            return False
        self._stamp, self.cert, self.key, self.ca = stamp, cert, key, ca
        return True


def server_credentials(files: TlsFiles, require_client_cert: bool) -> grpc.ServerCredentials:
    """Server credentials over ``files`` that follow rotations (module docstring). With
    ``require_client_cert`` every client must present a certificate chaining to ``files.ca``
    (mutual TLS)."""
    if require_client_cert and not files.ca:
        raise ValueError("a CA file (tls_ca_file) is required to verify client certificates")
    watched = _Watched(files)

    def config() -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(watched.key, watched.cert)], root_certificates=watched.ca or None)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        if watched.reload():
            log.info("TLS certificate files changed: new connections use them")
            return config()
        return None

    return grpc.dynamic_ssl_server_credentials(config(), fetch,
                                               require_client_authentication=require_client_cert)


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS channel credentials: ``ca`` verifies the server (empty: the system roots);
    ``cert``/``key`` present this process's certificate (mutual TLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca) if ca else None,
        private_key=_read(key) if key else None,
        certificate_chain=_read(cert) if cert else None)


def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(what: str, host: str, tls: bool, insecure: bool) -> None:
    """Refuses plaintext on a non-loopback address unless ``insecure``; logs the choice."""
    if tls or is_loopback(host):
        return
    if not insecure:
        raise PlaintextRefused(
            f"{what}: refusing to serve plaintext on {host!r} (not loopback): configure "
            "tls_cert_file / tls_key_file (gpumesh certs DIR makes them), bind 127.0.0.1, or "
            "pass --insecure to accept unauthenticated, unencrypted traffic")
    log.warning("%s: serving PLAINTEXT on %s (--insecure): anyone who can reach the port can "
                "read and send traffic", what, host)


@dataclass(frozen=True)
class PeerIdentity:
    """A TLS peer's verified certificate: its common name and organizational units (the
    roles ``gpumesh certs`` puts in OU). Empty when the peer presented none."""

    common_name: str = ""
    roles: frozenset[str] = frozenset()

    @property
    def present(self) -> bool:
        return bool(self.common_name)


NO_IDENTITY = PeerIdentity()


@functools.lru_cache(maxsize=1024)
def _parse(pem: bytes) -> PeerIdentity:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem)
    cn = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    ous = [a.value for a in cert.subject.get_attributes_for_oid(
        NameOID.ORGANIZATIONAL_UNIT_NAME)]
    return PeerIdentity(str(cn[0]) if cn else "", frozenset(str(o) for o in ous))


def peer_identity(context: grpc.aio.ServicerContext) -> PeerIdentity:
    """The verified client certificate of the call's connection (gRPC verified the chain and
    dates during the handshake); NO_IDENTITY on plaintext or without a client certificate."""
    auth = context.auth_context() or {}
    pems = auth.get("x509_pem_cert")
    if not pems:
        return NO_IDENTITY
    try:
        return _parse(bytes(pems[0]))
    except ValueError:
        return NO_IDENTITY
