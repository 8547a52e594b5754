"""`gpumesh health TARGET`: one grpc.health.v1 Check, for probes and scripts.

Kubernetes' own gRPC probes speak plaintext only; with TLS on, an exec probe runs this
instead (deploy/kubernetes/components/tls). Exit 0 when the service answers SERVING, 1
otherwise (NOT_SERVING, unknown service, unreachable, TLS failure), with the reason on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(target: str, ca: str, cert: str, key: str, server_name: str) -> grpc.aio.Channel:
    """Plaintext without ``ca``; TLS verifying ``ca`` (presenting ``cert``/``key`` when
    given) otherwise. Raises OSError when a file cannot be read."""
    if not ca:
        return grpc.aio.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.aio.secure_channel(target, creds, options=options)


async def check(target: str, service: str = "", *, timeout_s: float = 5.0, ca: str = "",
                cert: str = "", key: str = "", server_name: str = "") -> int:
    """0 if ``service`` on ``target`` is SERVING, else 1."""
    try:
        async with _channel(target, ca, cert, key, server_name) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        print(f"{target} {service!r}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:   # unreadable certificate files
        print(f"{target}: {exc}", file=sys.stderr)
        return 1
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        print(f"{target} {service!r}: {name}", file=sys.stderr)
        return 1
    return 0
