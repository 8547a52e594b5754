"""The router's view of its fleet: membership and leases (``registry``), this router's
per-node accounting (``ledger``), its share among peer routers (``peers``), the request
path's candidate cache (``candidates``) and node speed estimates (``speed``)."""

from gpumesh.router.fleet.entries import (
    ModelSnapshot,
    ModelSummary,
    NodeEntry,
    NodeView,
    Report,
)
from gpumesh.router.fleet.ledger import Credit, CreditLedger
from gpumesh.router.fleet.peers import PeerShare
from gpumesh.router.fleet.registry import Registry

__all__ = [
    "Credit",
    "CreditLedger",
    "ModelSnapshot",
    "ModelSummary",
    "NodeEntry",
    "NodeView",
    "PeerShare",
    "Report",
    "Registry",
]
