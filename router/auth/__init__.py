"""Who may do what on a router: API keys and their quotas for clients (``keys``, ``limits``),
operator credentials, node membership identity (``membership``), all enforced in one place,
the server interceptor (``interceptor``). docs/security.md describes the model."""

from gpumesh.router.auth.interceptor import AuthCounters, RouterAuth, current_key_name
from gpumesh.router.auth.keys import KeyStore
from gpumesh.router.auth.membership import MembershipError, check_node

__all__ = ["AuthCounters", "KeyStore", "MembershipError", "RouterAuth", "check_node",
           "current_key_name"]
