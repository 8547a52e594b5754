"""Who may register as a node: the membership rule the ControlPlane servicer applies in two
steps, both before it reads what a message says.

``authenticate`` runs when a Connect stream opens, before its first message is read:
- A caller with a verified certificate (mutual TLS) must have OU=node (PERMISSION_DENIED).
- Without a certificate, a configured join token must come in the ``x-gpumesh-join-token``
  metadata (UNAUTHENTICATED when missing or wrong; compared in constant time).
- With TLS on and no join token, a certificate is required (UNAUTHENTICATED).
- With neither TLS nor a join token, membership is open (the plaintext loopback dev loop).

``authorize`` runs on each Registration, on its node id alone, before anything else of the
message is validated or recorded: a certificate's CN must equal the node id it registers, so
a node can never claim (or get quarantined) another's id (PERMISSION_DENIED). A join token
holder may claim any id: every holder of the shared token is a member.

Expired certificates and certificates of another CA never get here: the TLS handshake fails
(the node sees UNAVAILABLE) when the router requires client certificates.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from gpumesh.security.tls import JOIN_TOKEN_HEADER, PeerIdentity


class MembershipError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Member:
    """An authenticated Connect caller. ``how``: "certificate", "join token" or "open";
    ``node_id``: the id its certificate binds it to ("" = any id)."""

    how: str
    node_id: str = ""


def authenticate(identity: PeerIdentity, metadata: Sequence[tuple[str, object]], *,
                 join_token: str, tls: bool) -> Member:
    """The caller's membership credential, from the connection and the call's metadata
    only; raises MembershipError (UNAUTHENTICATED / PERMISSION_DENIED)."""
    if identity.present:
        if "node" not in identity.roles:
            raise MembershipError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"certificate {identity.common_name!r} (roles "
                                  f"{sorted(identity.roles)}) is not a node certificate")
        return Member("certificate", identity.common_name)
    if join_token:
        given = next((v for k, v in metadata if k == JOIN_TOKEN_HEADER), "")
        given_b = given.encode() if isinstance(given, str) else bytes(given)  # type: ignore[arg-type]
        if not hmac.compare_digest(given_b, join_token.encode()):
            raise MembershipError(grpc.StatusCode.UNAUTHENTICATED,
                                  "a valid join token (x-gpumesh-join-token) is required")
        return Member("join token")
    if tls:
        raise MembershipError(grpc.StatusCode.UNAUTHENTICATED,
                              "a node certificate (mutual TLS) is required to register")
    return Member("open")


def authorize(member: Member, node_id: str) -> None:
    """Raises PERMISSION_DENIED when ``member`` may not hold ``node_id``."""
    if member.node_id and member.node_id != node_id:
        raise MembershipError(grpc.StatusCode.PERMISSION_DENIED,
                              f"certificate is for node {member.node_id!r}, "
                              f"not {node_id[:64]!r}")


def check_node(node_id: str, identity: PeerIdentity, metadata: Sequence[tuple[str, object]],
               *, join_token: str, tls: bool) -> str:
    """Both steps at once; returns how the node proved itself ("certificate", "join token",
    "open"); raises MembershipError otherwise."""
    member = authenticate(identity, metadata, join_token=join_token, tls=tls)
    authorize(member, node_id)
    return member.how
