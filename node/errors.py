"""The node's one error-mapping place: validation failures and engine errors -> gRPC status."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request the node refuses, with the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.NOT_FOUND, message)


def out_of_range(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.OUT_OF_RANGE, message)


def unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message)


def already_exists(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.ALREADY_EXISTS, message)


def permission_denied(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.PERMISSION_DENIED, message)


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
        return RequestError(grpc.StatusCode.UNAVAILABLE, f"engine not serving: {exc}")
    if isinstance(exc, AdapterLoadFailed):
        return RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"adapter not loadable: {exc}")
    if isinstance(exc, EngineOverloaded):
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"engine is full: {exc}")
    if isinstance(exc, ValueError):
        return invalid(f"engine rejected the request: {exc}")
    return RequestError(grpc.StatusCode.INTERNAL, f"engine error: {type(exc).__name__}: {exc}")
