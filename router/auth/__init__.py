"""Who may do what on a router: API keys and their quotas for clients (``keys``, ``limits``),
operator credentials, node membership identity (``membership``) and the bounds on control
streams yet to register (``streams``), enforced by the server interceptor (``interceptor``)
and, for ``ControlPlane.Connect``, by its servicer. docs/security.md describes the model."""

from gpumesh.router.auth.interceptor import AuthCounters, RouterAuth, current_key_name
from gpumesh.router.auth.keys import KeyStore
from gpumesh.router.auth.membership import (
    Member,
    MembershipError,
    authenticate,
    authorize,
    check_node,
)

__all__ = ["AuthCounters", "KeyStore", "Member", "MembershipError", "RouterAuth",
           "authenticate", "authorize", "check_node", "current_key_name"]
