"""The node's one error-mapping place: validation failures and engine errors -> gRPC status."""

from __future__ import annotations

from collections.abc import Callable

import grpc


class RequestError(Exception):
    """A request the node refuses, with the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _status(code: grpc.StatusCode) -> Callable[[str], RequestError]:
    """A RequestError factory for one status: ``invalid(message)`` and the rest below."""
    def refuse(message: str) -> RequestError:
        return RequestError(code, message)
    return refuse


invalid = _status(grpc.StatusCode.INVALID_ARGUMENT)
not_found = _status(grpc.StatusCode.NOT_FOUND)
out_of_range = _status(grpc.StatusCode.OUT_OF_RANGE)
unavailable = _status(grpc.StatusCode.UNAVAILABLE)
already_exists = _status(grpc.StatusCode.ALREADY_EXISTS)
permission_denied = _status(grpc.StatusCode.PERMISSION_DENIED)


def from_engine_exception(exc: BaseException) -> RequestError:
    """Engine failures: bad token ids and length errors are the caller's; the rest INTERNAL."""
    from gpumesh.node.engines.base import (
        AdapterLoadFailed,
        EngineOverloaded,
        EngineUnavailable,
        InvalidRequest,
        PromptTooLong,
    )

    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, PromptTooLong):
        return out_of_range(str(exc))
    if isinstance(exc, InvalidRequest):
        return invalid(f"engine rejected the request: {exc}")
    if isinstance(exc, EngineUnavailable):
        return unavailable(f"engine not serving: {exc}")
    if isinstance(exc, AdapterLoadFailed):
        return RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"adapter not loadable: {exc}")
    if isinstance(exc, EngineOverloaded):
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"engine is full: {exc}")
    if isinstance(exc, ValueError):
        return invalid(f"engine rejected the request: {exc}")
    return RequestError(grpc.StatusCode.INTERNAL, f"engine error: {type(exc).__name__}: {exc}")
