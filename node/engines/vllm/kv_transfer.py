"""Disaggregated prefill/decode on vLLM: the KV connector a node role sets up, and the
side channel it listens on.

A node's role decides its engine's ``kv_transfer_config``:

- ``"both"``: none (whole requests only; vLLM runs without a connector).
- ``"prefill"``: vLLM's ``NixlConnector`` as ``kv_producer``. A request carrying
  ``{"do_remote_decode": true}`` runs its prompt, keeps the prompt's KV blocks for a decode
  engine to read, and returns the KV-transfer parameters (engine id, block ids, side-channel
  host and port) on its last output.
- ``"decode"``: ``NixlConnector`` as ``kv_consumer``. A request carrying a prefill leg's
  parameters pulls the prompt's KV from the prefill engine over NIXL (UCX: shared memory or
  TCP on one host, RDMA or TCP between hosts) and continues from it; a request without them
  runs whole, as on a "both" node.

Why NIXL: it is the connector vLLM's own disaggregated-serving examples and llm-d use, it
moves KV directly between the two engines' KV caches (no third store), it runs on vLLM CPU
(host memory, ``kv_buffer_device="cpu"``) and on CUDA (GPU memory) with the same request
protocol, and a failed or expired transfer fails the decode request (vLLM's
``kv_load_failure_policy="fail"``) instead of silently recomputing. The example
shared-storage connector writes every prompt's KV to files keyed by a prompt hash and has
no request-level hand-over, so a decode engine cannot tell a transfer from a cache miss.

The NIXL side channel (vLLM reads ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT`` when the engine
starts) is where decode engines fetch a prefill engine's KV layout; a node sets both from
its config before starting the engine (``apply_side_channel``). Any ``kv_transfer_config``
under ``[engine_args]`` replaces the role's default wholesale.

NIXL's progress thread polls UCX without pause (NIXL's Python API sets its wait between
polls to 0), so every idle prefill or decode engine keeps one core busy. On vLLM CPU that
core is one the engine computes on: two such engines on a 2-core machine starved each
other's start-up, steps and the node's heartbeats for tens of seconds. The thread cannot
simply be left out: an idle engine's UCX worker must still answer a peer's connection and
notifications, which only the thread does while the engine does not step.
``apply_side_channel`` therefore also sets ``GPUMESH_NIXL_PROGRESS_DELAY_US`` (default
1000), which the CPU worker set-up (``worker.py``) reads in vLLM's worker processes: the
thread then waits up to that long for UCX events between polls (2 % of a core when idle).
CUDA workers keep vLLM's default. Set the variable to 0 before starting a CPU node to keep
the busy poll.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumesh.node.engines.base import InvalidRequest

ROLES = ("both", "prefill", "decode")
#: microseconds NIXL's progress thread waits between polls in vLLM CPU workers (module doc)
PROGRESS_DELAY_ENV = "GPUMESH_NIXL_PROGRESS_DELAY_US"
PROGRESS_DELAY_US = 1000
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Bounds on what a request may carry (the router relays a prefill leg's answer): a JSON
# object of at most this many bytes once encoded.
MAX_PARAMS_BYTES = 64 * 1024


def default_kv_transfer_config(role: str, platform_is_cpu: bool) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for a node of ``role``; None for "both".

    The KV buffer is the engine's own KV cache: host memory on vLLM CPU, GPU memory on CUDA.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if role == "both":
        return None
    return {"kv_connector": "NixlConnector", "kv_role": _KV_ROLE[role],
            "kv_buffer_device": "cpu" if platform_is_cpu else "cuda"}


def progress_delay_us() -> int:
    """``GPUMESH_NIXL_PROGRESS_DELAY_US`` as a number of microseconds; 0 (vLLM's busy poll)
    when unset or not a whole number >= 0."""
    try:
        return max(0, int(os.environ.get(PROGRESS_DELAY_ENV) or 0))
    except ValueError:
        return 0


def free_port() -> int:
    """A TCP port free on every interface now (the side channel binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def apply_side_channel(kv_transfer_config: Mapping[str, Any] | None, host: str,
                       port: int) -> tuple[str, int] | None:
    """Point vLLM's NIXL side channel at ``host``:``port`` (``port`` 0: a free one) for the
    engine about to start; returns (host, port), or None when the config uses no NIXL
    connector. Environment variables are vLLM's only interface for these, read once by the
    engine core process it starts."""
    if (not isinstance(kv_transfer_config, Mapping)
            or "Nixl" not in str(kv_transfer_config.get("kv_connector", ""))):
        return None
    if port:
        _check_port_free(port)
    port = port or free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ.setdefault(PROGRESS_DELAY_ENV, str(PROGRESS_DELAY_US))
    return host, port


def _check_port_free(port: int) -> None:
    """``ValueError`` naming the port when something on this machine already listens on it:
    vLLM's handshake listener would die in its thread and the engine wait for it without end.
    (The wildcard address: the check needs no name resolution of the advertised host.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise ValueError(f"KV side-channel port {port} cannot be bound ({e.strerror}); "
                             "choose another kv_port, or 0 for a free one") from e


def check_params(params: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``params`` is one of the two shapes a node accepts: a prefill
    request (``do_remote_decode`` true) or a decode request (``do_remote_prefill`` true with
    the prefill engine's id, block ids, host and port)."""
    if params.get("do_remote_decode") is True and not params.get("do_remote_prefill"):
        return
    if params.get("do_remote_prefill") is True:
        missing = [k for k in ("remote_engine_id", "remote_block_ids", "remote_host",
                               "remote_port") if k not in params]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {', '.join(missing)}")
        if not isinstance(params["remote_port"], int) or not 0 < params["remote_port"] < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a port number")
        return
    raise ValueError("kv_transfer_params must set do_remote_decode (a prefill leg) or "
                     "do_remote_prefill (a decode leg)")


def request_extra_args(params: Mapping[str, Any], connector: bool) -> dict[str, Any]:
    """vLLM's ``SamplingParams.extra_args`` for a request carrying ``kv_transfer_params`` on
    an engine with (``connector``) or without a KV connector; ``InvalidRequest`` when the
    engine has none or the parameters are neither a prefill nor a decode leg's."""
    if not connector:
        raise InvalidRequest("kv_transfer_params needs a node with a KV connector "
                             "(role prefill or decode)")
    try:
        check_params(params)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return {"kv_transfer_params": dict(params)}


@dataclass(frozen=True)
class KvTransferTotals:
    """What an engine's KV connector moved since start, from vLLM's connector stats (a
    decode engine counts the transfers it pulled): completed transfers, their bytes, the
    seconds they took (summed), and failed transfers, handshakes and expired leases."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0

    def add(self, payload: Mapping[str, Any] | None) -> KvTransferTotals:
        """These totals plus one step's ``SchedulerStats.kv_connector_stats`` (NIXL's
        payload: lists per metric); unknown payloads add nothing."""
        data = payload.get("data", payload) if isinstance(payload, Mapping) else None
        if not isinstance(data, Mapping):
            return self

        def values(key: str) -> list[float]:
            v = data.get(key)
            return [float(x) for x in v] if isinstance(v, list) else []

        sizes = values("bytes_transferred")
        failed = sum(len(values(k)) for k in ("num_failed_transfers", "num_failed_handshakes",
                                              "num_kv_expired_reqs"))
        if not sizes and not failed:
            return self
        return KvTransferTotals(self.transfers + len(sizes), self.bytes + int(sum(sizes)),
                                self.seconds + sum(values("transfer_duration")),
                                self.failures + failed)
