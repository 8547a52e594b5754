"""The router's ``[security]`` section: the shared TLS / token keys plus API keys and tickets
(docs/security.md)."""

from __future__ import annotations

from pydantic import Field

from gpumesh.security.settings import SecuritySettings


class RouterSecuritySettings(SecuritySettings):
    """With TLS on, the router dials nodes over mutual TLS with its own certificate; without a
    join token, membership needs a node certificate when TLS is on and is open otherwise."""

    api_keys_file: str = Field(
        "", description="API keys (router.auth.keys): with a file, Inference calls need "
                        "\"authorization: Bearer KEY\" and the operator API (GetFleet, Pick) an "
                        "operator key or certificate. Empty: open.")
    ticket_ttl_s: float = Field(10.0, gt=0, allow_inf_nan=False,
                                description="Lifetime of a lookaside ticket, seconds.")
