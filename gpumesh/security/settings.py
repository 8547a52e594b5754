"""The security keys a router and a node share (docs/security.md); each extends them with its
own section: ``gpumesh.router.auth.settings.RouterSecuritySettings`` and
``gpumesh.node.access.NodeSecuritySettings``.

TLS is on for the process's port when ``tls_cert_file`` is set (the files are re-read when
they change); plaintext on a non-loopback host refuses to start unless ``insecure``."""

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic_settings import CliSuppress

from gpumesh.config import SECTION


class SecuritySettings(BaseModel):
    """TLS, the plaintext opt-in, the join token and the lookaside ticket secret."""

    model_config = SECTION

    tls_cert_file: str = Field(
        "", description="Certificate (PEM) served on the port; turns TLS on. The same "
                        "certificate is presented when this process dials others (mutual TLS).")
    tls_key_file: str = Field("", description="Private key (PEM) of tls_cert_file.")
    tls_ca_file: str = Field(
        "", description="CA (PEM) that verifies peers' certificates: callers', and the other "
                        "side's when this process dials.")
    tls_require_client_cert: bool = Field(
        False, description="Every caller on the port presents a certificate of tls_ca_file.")
    insecure: bool = Field(
        False, description="Allow plaintext on a non-loopback host (logged as a warning).")
    join_token: CliSuppress[str] = Field(
        "", repr=False,
        description="Shared secret for membership without a certificate "
                    "(x-gpumesh-join-token). Set it through GPUMESH_JOIN_TOKEN or the file, "
                    "not a flag.")
    ticket_secret: CliSuppress[str] = Field(
        "", repr=False,
        description="Secret that signs lookaside tickets, shared by routers and nodes; empty: "
                    "tickets are refused. Set it through GPUMESH_TICKET_SECRET or the file.")

    @property
    def ticket_secret_bytes(self) -> bytes:
        return self.ticket_secret.encode()


#: the short flags of the TLS settings, the same for the router and the node
TLS_SHORT_FLAGS: dict[str, str | list[str]] = {
    "security.tls_cert_file": "tls-cert-file", "security.tls_key_file": "tls-key-file",
    "security.tls_ca_file": "tls-ca-file",
    "security.tls_require_client_cert": "tls-require-client-cert"}
