"""The router's one error-mapping place: routing failures and node errors -> gRPC status.

Inside the router, failures are ``RouterError`` values built by the constructors below; the
servicer turns any exception into a status with ``status_for``. A node's own status (e.g.
INVALID_ARGUMENT for a bad prompt) passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc

# Node errors worth one transparent retry on another node, when no token reached the client.
# CANCELLED here is the node cancelling (its server stopping), never our client: a client
# cancellation cancels our task instead of raising a status.
RETRYABLE_NODE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
})

# Node answers that mean "not admitted": the request never reached the engine.
NOT_ADMITTED_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ALREADY_EXISTS,
})


class RouterError(Exception):
    """A failure with the gRPC status the client should see."""

    def __init__(self, code: grpc.StatusCode, message: str, node_id: str = "",
                 retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.node_id = node_id
        # > 0: the client may retry after this long (sent as grpc-retry-pushback-ms, which
        # gRPC's retry policy honours)
        self.retry_after_s = retry_after_s


def model_not_found(model: str, served: Iterable[str]) -> RouterError:
    names = ", ".join(sorted(served)) or "none"
    return RouterError(grpc.StatusCode.NOT_FOUND,
                       f"model {model!r} is not served by this fleet; served models: {names}")


def fleet_rebuilding(model: str, age_s: float, retry_after_s: float) -> RouterError:
    """An unknown model while a restarted router's fleet may still be incomplete: transient."""
    return RouterError(grpc.StatusCode.UNAVAILABLE,
                       f"model {model!r} is not known yet: this router started {age_s:.1f}s ago "
                       f"and its nodes are still registering; retry shortly",
                       retry_after_s=retry_after_s)


def duplicate_request_id(request_id: str) -> RouterError:
    """A client's request id that one of its requests in flight on this router already
    uses: the client's mistake, never an engine error."""
    return RouterError(grpc.StatusCode.ALREADY_EXISTS,
                       f"request id {request_id[:128]!r} is already in flight: use a unique id "
                       "per request, or none (the node then makes one)")


def model_required(served: Iterable[str]) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"model is required: the fleet serves {', '.join(sorted(served))}")


def no_models() -> RouterError:
    """No node at all (a router just started, or its fleet is gone): retry shortly."""
    return RouterError(grpc.StatusCode.UNAVAILABLE, "no nodes are registered with this router",
                       retry_after_s=0.5)


def no_healthy_node(model: str, reasons: Mapping[str, str] | None = None) -> RouterError:
    why = "; ".join(f"{n}: {r}" for n, r in sorted((reasons or {}).items()))
    return RouterError(grpc.StatusCode.UNAVAILABLE,
                       f"no healthy node serves model {model!r}" + (f" ({why})" if why else ""))


def queue_full(model: str, bound: int) -> RouterError:
    return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"every node serving {model!r} is at max concurrency and its queue is "
                       f"full ({bound} waiting)")


def queue_deadline(model: str, waited_s: float) -> RouterError:
    return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"deadline passed after {waited_s:.3f}s waiting in the queue for {model!r}")


def deadline_exhausted() -> RouterError:
    return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before dispatch")


def failed_mid_stream(node_id: str, detail: str) -> RouterError:
    return RouterError(grpc.StatusCode.UNAVAILABLE,
                       f"node {node_id} failed after streaming started: {detail}", node_id)


def lookaside_disabled() -> RouterError:
    return RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                       "lookaside mode is disabled: the router has no ticket_secret")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a client sees for ``exc``. Node statuses pass through with their details."""
    if isinstance(exc, RouterError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    return grpc.StatusCode.INTERNAL, f"router internal error: {type(exc).__name__}"
