"""Who may register as a node: the membership rule the ControlPlane servicer applies to each
Registration before the registry sees it.

- A caller with a verified certificate (mutual TLS) must have OU=node and a CN equal to the
  node id it registers: a node can never claim another's id (PERMISSION_DENIED otherwise).
- Without a certificate, a configured join token must come in the ``x-gpumesh-join-token``
  metadata (UNAUTHENTICATED when missing or wrong; compared in constant time).
- With TLS on and no join token, a certificate is required (UNAUTHENTICATED).
- With neither TLS nor a join token, membership is open (the plaintext loopback dev loop).

Expired certificates and certificates of another CA never get here: the TLS handshake fails
(the node sees UNAVAILABLE) when the router requires client certificates.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import grpc

from gpumesh.security.tls import JOIN_TOKEN_HEADER, PeerIdentity


class MembershipError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check_node(node_id: str, identity: PeerIdentity, metadata: Sequence[tuple[str, object]],
               *, join_token: str, tls: bool) -> str:
    """Returns how the node proved itself ("certificate", "join token", "open"); raises
    MembershipError otherwise."""
    if identity.present:
        if "node" not in identity.roles:
            raise MembershipError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"certificate {identity.common_name!r} (roles "
                                  f"{sorted(identity.roles)}) is not a node certificate")
        if identity.common_name != node_id:
            raise MembershipError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"certificate is for node {identity.common_name!r}, "
                                  f"not {node_id[:64]!r}")
        return "certificate"
    if join_token:
        given = next((v for k, v in metadata if k == JOIN_TOKEN_HEADER), "")
        given_b = given.encode() if isinstance(given, str) else bytes(given)  # type: ignore[arg-type]
        if not hmac.compare_digest(given_b, join_token.encode()):
            raise MembershipError(grpc.StatusCode.UNAUTHENTICATED,
                                  "a valid join token (x-gpumesh-join-token) is required")
        return "join token"
    if tls:
        raise MembershipError(grpc.StatusCode.UNAUTHENTICATED,
                              "a node certificate (mutual TLS) is required to register")
    return "open"
