"""The client side of TLS and API keys, for ``gpumesh.client`` and the CLI: channels to a
router or node over TLS (optionally mutual) and the ``authorization: Bearer KEY`` metadata
on every call (client interceptors, so no call site has to remember it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gpumesh.security.tls import channel_credentials


@dataclass(frozen=True)
class ClientTls:
    """PEM paths: ``ca`` verifies the server (empty: the system's roots); ``cert``/``key``:
    a client certificate for servers that require one (operator or client, ``gpumesh
    certs``). ``server_name``: the name to verify when dialling an address the certificate
    does not list."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""


def _with_bearer(details: grpc.aio.ClientCallDetails, header: tuple[str, str]) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(*header)
    return details._replace(metadata=metadata)   # a namedtuple


# One class per call type: grpc.aio files each interceptor under the first type it is.
class _BearerUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_bearer(details, self.header), request)


class _BearerUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_bearer(details, self.header), request)


class _BearerStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(_with_bearer(details, self.header), request_iterator)


def bearer_interceptors(api_key: str) -> list[Any]:
    if not api_key:
        return []
    header = ("authorization", f"Bearer {api_key}")
    return [_BearerUnary(header), _BearerUnaryStream(header), _BearerStreamStream(header)]


def open_channel(target: str, options: Sequence[tuple[str, Any]], tls: ClientTls | None,
                 interceptors: Sequence[Any] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target``: TLS when ``tls`` is given, plaintext otherwise."""
    opts = list(options)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors or None)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    creds = channel_credentials(tls.ca, tls.cert, tls.key)
    return grpc.aio.secure_channel(target, creds, options=opts, interceptors=interceptors or None)
