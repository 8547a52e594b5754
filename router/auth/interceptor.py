"""The router's one authorization point: a ``grpc.aio.ServerInterceptor`` that wraps every
method's handler with the check its class of caller needs.

Method classes (docs/security.md, "Who can do what"):
- Inference (Generate, GenerateStream, ListModels) and reflection: a client. With an API-keys
  file, ``authorization: Bearer KEY`` must name a known key (UNAUTHENTICATED otherwise); the
  key's allowed models (PERMISSION_DENIED) and quotas (RESOURCE_EXHAUSTED with
  ``x-gpumesh-retry-after-ms`` in the trailing metadata) apply to Generate calls. The key's
  NAME is the span attribute ``gpumesh.api_key`` and the ``key`` attribute of the key
  metrics; the key itself is never logged.
- Router (GetFleet, Pick): an operator: a certificate with OU=operator, or an operator key.
  Open when the router has neither API keys nor required client certificates.
- ControlPlane.Connect: membership, checked by the servicer when the stream opens and on
  each Registration's node id (``router.auth.membership``).
- Health: open (probes).
Every rejection is logged (at most once per second per kind) and counted (``AuthCounters``).
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gpumesh import metadata as md
from gpumesh.router.auth.keys import ApiKey, KeyStore, current_key_slo
from gpumesh.router.auth.limits import NO_GRANT, Grant, KeyLimits, OverQuota
from gpumesh.security.handlers import wrap_handler
from gpumesh.security.tls import PeerIdentity, peer_identity
from gpumesh.v1 import inference_pb2

log = logging.getLogger(__name__)

current_key_name: contextvars.ContextVar[str] = contextvars.ContextVar("gpumesh_api_key",
                                                                       default="")

_CLIENT = ("/gpumesh.v1.Inference/", "/grpc.reflection.")
_GENERATE = ("/gpumesh.v1.Inference/Generate", "/gpumesh.v1.Inference/GenerateStream")
_OPERATOR = "/gpumesh.v1.Router/"


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailing = code, message, trailing


class AuthCounters:
    """Rejections by (kind, status) and requests by (key name, outcome), read by metrics."""

    def __init__(self) -> None:
        self.rejections: Counter[tuple[str, str]] = Counter()
        self.key_requests: Counter[tuple[str, str]] = Counter()
        self._logged: dict[str, float] = {}

    def reject(self, kind: str, code: grpc.StatusCode, why: str, peer: str) -> None:
        self.rejections[(kind, code.name)] += 1
        now = time.monotonic()
        if now - self._logged.get(kind, -1e9) >= 1.0:   # bounded log volume under attack
            self._logged[kind] = now
            log.warning("%s call from %s rejected (%s): %s", kind, peer, code.name, why)


def _bearer(metadata: Any) -> str:
    for k, v in metadata or ():
        if k == "authorization" and isinstance(v, str) and v.startswith("Bearer "):
            return v[len("Bearer "):].strip()
    return ""


class RouterAuth(grpc.aio.ServerInterceptor):
    """``keys``: None = no API keys (Inference open); ``operator_open``: the operator API needs
    no credential (no keys and no required client certificates); ``resolve``: model name or
    alias -> canonical name (raises for unknown models: the servicer answers those);
    ``prompt_tokens``: the router's prompt-size estimate of a request."""

    def __init__(self, keys: KeyStore | None, *, operator_open: bool,
                 resolve: Callable[[str], str],
                 prompt_tokens: Callable[[inference_pb2.GenerateRequest], int],
                 limits: KeyLimits | None = None, counters: AuthCounters | None = None) -> None:
        self.keys = keys
        self.operator_open = operator_open
        self.resolve = resolve
        self.prompt_tokens = prompt_tokens
        self.limits = limits or KeyLimits()
        self.counters = counters or AuthCounters()

    @property
    def active(self) -> bool:
        """False when there is nothing to enforce (no keys, operator API open): app.py then
        installs no interceptor, so the open dev loop pays nothing per call."""
        return self.keys is not None or not self.operator_open

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None:
            return handler
        if method.startswith(_OPERATOR):
            if self.operator_open:
                return handler
            return self._wrap(handler, "operator",
                              lambda req, ctx: self._operator(ctx, details))
        if method.startswith(_CLIENT) and self.keys is not None:
            generate = method in _GENERATE
            return self._wrap(handler, "client",
                              lambda req, ctx: self._client(req, ctx, details, generate))
        return handler

    def _wrap(self, handler: grpc.RpcMethodHandler, kind: str,
              check: Callable[[Any, grpc.aio.ServicerContext], Grant]
              ) -> grpc.RpcMethodHandler:
        """The handler with ``check`` run first in the call's own task (so
        ``current_key_name`` is visible to the servicer); its grant is released when the call
        ends, and a unary-request call is counted under its key's name."""

        async def admit(request: Any, ctx: grpc.aio.ServicerContext) -> Grant:
            try:
                return check(request, ctx)
            except Denied as d:
                await self._deny(ctx, kind, d)
                raise AssertionError("unreachable") from None   # ctx.abort raises

        return wrap_handler(handler, admit,
                            _release if handler.request_streaming else self._finished)

    def _finished(self, grant: Grant, ok: bool) -> None:
        name = current_key_name.get()
        if name:
            self.counters.key_requests[(name, "OK" if ok else "FAILED")] += 1
        grant.release()

    # --- checks (each returns a Grant or raises Denied) -----------------------------------
    def _operator(self, ctx: grpc.aio.ServicerContext, details: grpc.HandlerCallDetails
                  ) -> Grant:
        # An operator certificate OR an operator key: a key is looked at whenever one is
        # presented, so a client certificate on the connection does not hide it.
        ident: PeerIdentity = peer_identity(ctx)
        if ident.present and "operator" in ident.roles:
            current_key_name.set(f"cert:{ident.common_name}")
            return NO_GRANT
        if ident.present and not _bearer(details.invocation_metadata):
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"certificate {ident.common_name!r} is not an operator certificate, "
                         "and no operator key was presented")
        key = self._key(details)
        if key.role != "operator":
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"key {key.name!r} is not an operator key")
        current_key_name.set(key.name)
        return NO_GRANT

    def _key(self, details: grpc.HandlerCallDetails) -> ApiKey:
        bearer = _bearer(details.invocation_metadata)
        if not bearer:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         "an API key is required (metadata authorization: Bearer KEY)")
        key = self.keys.lookup(bearer) if self.keys is not None else None
        if key is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        current_key_slo.set((key.ttft_slo_ms, key.tpot_slo_ms))   # router.dispatch.slo
        return key

    def _client(self, request: Any, ctx: grpc.aio.ServicerContext,
                details: grpc.HandlerCallDetails, generate: bool) -> Grant:
        key = self._key(details)
        current_key_name.set(key.name)
        if not generate:
            return NO_GRANT
        req = request
        if isinstance(request, bytes | bytearray):
            try:
                req = inference_pb2.GenerateRequest.FromString(request)
            except Exception:  # noqa: BLE001 - the servicer answers INVALID_ARGUMENT
                return NO_GRANT
        if key.models:
            allowed = req.model in key.models
            if not allowed:
                try:
                    allowed = self.resolve(req.model) in key.models
                except Exception:  # noqa: BLE001 - unknown model: not allowed either
                    allowed = False
            if not allowed:
                raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                             f"key {key.name!r} may not use model {req.model[:64]!r}")
        max_tokens = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else 16
        try:
            grant = self.limits.admit(key, self.prompt_tokens(req) + max_tokens)
        except OverQuota as q:
            ms = max(1, int(q.retry_after_s * 1000))
            raise Denied(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"key {key.name!r}: {q.what}; retry after {ms} ms",
                         ((md.RETRY_AFTER_MS, str(ms)),)) from None
        return grant

    async def _deny(self, ctx: grpc.aio.ServicerContext, kind: str, d: Denied) -> None:
        self.counters.reject(kind, d.code, d.message, ctx.peer())
        name = current_key_name.get()
        if name:
            self.counters.key_requests[(name, d.code.name)] += 1
        await ctx.abort(d.code, d.message, trailing_metadata=d.trailing)


def _release(grant: Grant, ok: bool) -> None:
    grant.release()
