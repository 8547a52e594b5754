"""Dispatch: admission (queue per model), the one attempt loop, retry/failover, records."""

from gpumesh.router.dispatch.admission import AdmissionQueue
from gpumesh.router.dispatch.dispatcher import Dispatcher
from gpumesh.router.dispatch.records import (
    Assignment,
    AttemptHook,
    AttemptRecord,
    ChargeFn,
    DispatchRecord,
)

__all__ = ["AdmissionQueue", "Assignment", "AttemptHook", "AttemptRecord", "ChargeFn",
           "DispatchRecord", "Dispatcher"]
