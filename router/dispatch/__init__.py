"""Dispatch: the request context, admission (queue per model), the router's transport for
the attempt layers (proxy), retry/failover, outlier feedback, the stall watch, records."""

from gpumesh.router.dispatch.admission import AdmissionQueue
from gpumesh.router.dispatch.context import RequestContext
from gpumesh.router.dispatch.dispatcher import Dispatcher
from gpumesh.router.dispatch.records import (
    Assignment,
    AttemptHook,
    AttemptRecord,
    ChargeFn,
    DispatchRecord,
)

__all__ = ["AdmissionQueue", "Assignment", "AttemptHook", "AttemptRecord", "ChargeFn",
           "DispatchRecord", "Dispatcher", "RequestContext"]
