"""Retry and failover rules for one request's attempts (pure: the clock is passed in), and
``ProxyFailover``: those rules as the router's ``gpumesh.attempts.Failover``.

A node failure before the first chunk reached the client may be retried on another node
(``should_retry``); after it, a retryable failure becomes UNAVAILABLE naming the node
(``mid_stream_error``). A node that sends nothing within the first-token timeout counts as
failed (``first_token_timeout``), unless the request's own deadline is what ran out; the
first-token wait comes from the node's own queue (``first_token_wait``). After output reached
the client, a node fault continues the stream elsewhere (``continuable``; see ``migration``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from gpumesh.router import errors

if TYPE_CHECKING:
    from gpumesh.router.config import RouterConfig
    from gpumesh.router.dispatch.records import DispatchRecord
    from gpumesh.router.dispatch.watch import Tracked
    from gpumesh.router.scheduling import Decision

log = logging.getLogger(__name__)

NodeError = errors.RouterError | grpc.aio.AioRpcError


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


def mid_stream(e: errors.RouterError | grpc.aio.AioRpcError, node_id: str, now: float,
               deadline: float) -> BaseException:
    """``mid_stream_error`` for a node's status or the router's own error (a lost call, a
    first-token timeout of a continuation): what the client sees when a stream that already
    delivered output cannot continue."""
    if isinstance(e, grpc.aio.AioRpcError):
        return mid_stream_error(e, node_id, now, deadline)
    if e.code is grpc.StatusCode.UNAVAILABLE:
        return errors.failed_mid_stream(e.node_id or node_id, e.message)
    return e


def lost_call(exc: BaseException, tracked: Tracked) -> errors.RouterError | grpc.aio.AioRpcError:
    """The attempt's error. A cancellation the in-flight watch caused (``tracked.lost``)
    becomes UNAVAILABLE blaming the node; any other cancellation (the client's) re-raises."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        if not tracked.lost or (task is not None and task.cancelling()):
            raise exc
        return errors.RouterError(grpc.StatusCode.UNAVAILABLE, tracked.lost, tracked.node_id)
    assert isinstance(exc, errors.RouterError | grpc.aio.AioRpcError)
    return exc


def blames_node(e: errors.RouterError | grpc.aio.AioRpcError, now: float,
                deadline: float) -> bool:
    """Whether a failure counts against the node for outlier ejection: a node fault, never a
    client error (bad input, the client's own deadline) nor an overload answer."""
    code = failed_code(e)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return now < deadline - 0.01
    return code in errors.RETRYABLE_NODE_CODES and code is not grpc.StatusCode.RESOURCE_EXHAUSTED


def continuable(e: errors.RouterError | grpc.aio.AioRpcError, migrations: int,
                max_migrations: int, now: float, deadline: float) -> bool:
    """Whether a stream that delivered output continues on another node after ``e``: a node
    fault (as for a retry, plus a node's DEADLINE_EXCEEDED before the request's deadline),
    continuations left, time left."""
    code = failed_code(e)
    fault = (code is grpc.StatusCode.DEADLINE_EXCEEDED and now < deadline - 0.01) or (
        code in errors.RETRYABLE_NODE_CODES and retryable_before_first_chunk(e))
    return fault and migrations < max_migrations and now < deadline


def first_token_wait(decision: Decision, node_id: str, config: RouterConfig) -> float:
    """Seconds an attempt waits for its first token: ``first_token_min_s`` plus
    ``first_token_wait_factor`` x the wait the routing decision expected on this node (from
    its own reported queue), capped by ``first_token_timeout_s``."""
    expected = next((s.expected_wait_s for s in decision.considered
                     if s.node_id == node_id and s.expected_wait_s is not None), 0.0)
    d = config.dispatch
    return min(d.first_token_timeout_s,
               d.first_token_min_s + d.first_token_wait_factor * max(expected, 0.0))


class ProxyFailover:
    """The router's failover for one request (``gpumesh.attempts.Failover``): a failure
    before output is retried on another node (``max_attempts`` attempts in all) when it
    blames the node (``retryable_before_first_chunk``, ``should_retry``); after output the
    stream continues elsewhere (``max_migrations`` times, ``continuable``); otherwise the
    client sees ``mid_stream``. Continuations are counted in ``record``."""

    failures: tuple[type[Exception], ...] = (grpc.aio.AioRpcError, errors.RouterError)

    def __init__(self, config: RouterConfig, clock: Callable[[], float], deadline: float,
                 record: DispatchRecord) -> None:
        self.config = config
        self.clock = clock
        self.deadline = deadline
        self.record = record

    def retry(self, error: Exception, attempt: int, node_id: str) -> bool:
        assert isinstance(error, NodeError)
        code = failed_code(error)
        if not (retryable_before_first_chunk(error) and should_retry(
                code, attempt, self.config.dispatch.max_attempts, self.clock(), self.deadline)):
            return False
        log.info("node %s failed before the first token (%s); retrying elsewhere",
                 node_id, code.name)
        return True

    def migrate(self, error: Exception, migrations: int, node_id: str,
                delivered_tokens: int) -> bool:
        assert isinstance(error, NodeError)
        if not continuable(error, migrations, self.config.dispatch.max_migrations, self.clock(),
                           self.deadline):
            return False
        self.record.migrations += 1
        log.info("node %s failed after %d tokens (%s); continuing the stream elsewhere",
                 node_id, delivered_tokens, failed_code(error).name)
        return True

    def after_output(self, error: Exception, node_id: str) -> BaseException:
        assert isinstance(error, NodeError)
        return mid_stream(error, node_id, self.clock(), self.deadline)
