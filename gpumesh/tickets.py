"""Lookaside tickets: a router's signed, short-lived permission to send one request to a node.

Format (URL-safe text): ``v1.<router_id>.<node_id>.<prompt_tokens>.<expires_ms>.<nonce>.<mac>``
where mac = HMAC-SHA256(secret, everything before it), base64url without padding. Routers and
nodes share the secret (config ``ticket_secret`` / env ``GPUMESH_TICKET_SECRET``). Ids must not
contain '.'.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass


class TicketError(ValueError):
    """The ticket is malformed, forged, expired or for another node."""


@dataclass(frozen=True)
class Ticket:
    router_id: str
    node_id: str
    prompt_tokens: int
    expires_ms: int
    nonce: str


def _mac(secret: bytes, body: str) -> str:
    digest = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def issue(secret: bytes, router_id: str, node_id: str, prompt_tokens: int, ttl_s: float,
          now: float | None = None) -> tuple[str, int]:
    """Returns (ticket text, expiry in unix ms)."""
    if "." in router_id or "." in node_id:
        raise ValueError("router and node ids must not contain '.'")
    expires_ms = int(((time.time() if now is None else now) + ttl_s) * 1000)
    body = f"v1.{router_id}.{node_id}.{int(prompt_tokens)}.{expires_ms}.{secrets.token_hex(6)}"
    return f"{body}.{_mac(secret, body)}", expires_ms


def verify(secret: bytes, text: str, node_id: str, now: float | None = None) -> Ticket:
    """Checks signature, node and expiry; raises TicketError saying which failed."""
    parts = text.split(".")
    if len(parts) != 7 or parts[0] != "v1":
        raise TicketError("malformed ticket")
    body, mac = ".".join(parts[:6]), parts[6]
    if not hmac.compare_digest(_mac(secret, body), mac):
        raise TicketError("ticket signature does not match")
    _, router_id, for_node, tokens, expires_ms, nonce = parts[:6]
    if for_node != node_id:
        raise TicketError(f"ticket is for node {for_node!r}, not {node_id!r}")
    if int(expires_ms) < int(((time.time() if now is None else now)) * 1000):
        raise TicketError("ticket expired")
    return Ticket(router_id, for_node, int(tokens), int(expires_ms), nonce)
