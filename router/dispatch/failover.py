"""Retry and failover rules for one request's attempts (pure: the clock is passed in).

A node failure before the first chunk reached the client may be retried on another node
(``should_retry``); after it, a retryable failure becomes UNAVAILABLE naming the node
(``mid_stream_error``). A node that sends nothing within the first-token timeout counts as
failed (``first_token_timeout``), unless the request's own deadline is what ran out.
"""

from __future__ import annotations

import grpc

from gpumesh.router import errors


def should_retry(code: grpc.StatusCode, attempt: int, max_attempts: int, now: float,
                 deadline: float) -> bool:
    """Whether a failed attempt (1-based ``attempt``) is retried on another node."""
    return code in errors.RETRYABLE_NODE_CODES and attempt < max_attempts and now < deadline


def failed_code(exc: errors.RouterError | grpc.aio.AioRpcError) -> grpc.StatusCode:
    return exc.code if isinstance(exc, errors.RouterError) else exc.code()


def retryable_before_first_chunk(exc: errors.RouterError | grpc.aio.AioRpcError) -> bool:
    """Our own errors are retried only when they blame the node (UNAVAILABLE); a node's
    status is judged by ``should_retry`` alone."""
    return not isinstance(exc, errors.RouterError) or exc.code is grpc.StatusCode.UNAVAILABLE


def admitted(exc: BaseException) -> bool:
    """Whether the node admitted the request before failing (its credit's ordinal then
    appears in the node's admitted count)."""
    return not (isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() in errors.NOT_ADMITTED_CODES)


def first_token_timeout(node_id: str, timeout_s: float, now: float,
                        deadline: float) -> errors.RouterError:
    if now >= deadline:
        return errors.RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "deadline exceeded before the first token", node_id)
    return errors.RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"node {node_id} produced no token within {timeout_s}s", node_id)


def mid_stream_error(e: grpc.aio.AioRpcError, node_id: str, now: float,
                     deadline: float) -> BaseException:
    """What the client sees for a node failure after chunks were forwarded: the request's own
    deadline passes through; a node fault is UNAVAILABLE naming the node."""
    if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED and now >= deadline - 0.01:
        return e
    if e.code() in errors.RETRYABLE_NODE_CODES or e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.failed_mid_stream(node_id, f"{e.code().name}: {e.details()}")
    return e
