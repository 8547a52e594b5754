"""Fuzz targets: what the router does with a control-plane message's bytes, and what router
and node do with a GenerateRequest's bytes before anything is routed or generated.

Each target takes raw bytes and either returns or raises one of the errors that map to a
specific gRPC status; anything else escaping (IndexError, ZeroDivisionError, OverflowError,
a non-finite value reaching the candidate list ...) is a bug. Used by the coverage-guided
harness (``fuzz/run.py``, atheris) and replayed over the committed corpus by
tests/fuzz/test_fuzz_corpus.py.
"""

from __future__ import annotations

import math

from google.protobuf.message import DecodeError

from fuzz.control import control

from gpumesh.node.api.inference import _sampling
from gpumesh.node.errors import RequestError
from gpumesh.router.api.intake import estimate_prompt_tokens
from gpumesh.router.fleet import Registry
from gpumesh.router.fleet.validation import (
    InvalidNodeInput,
    NodeLimits,
    valid_heartbeat,
    valid_registration,
)
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import inference_pb2 as pb
from tests.clock import ManualClock

LIMITS = NodeLimits()


def ingest(data: bytes) -> None:
    """A Connect stream's messages (length-prefixed NodeMessages, 2-byte big-endian length)
    through validation into a fresh registry, then the candidates every model would be scored
    from; every candidate's numbers must be finite."""
    clock = ManualClock()
    registry = Registry("fuzz-router", lease_ttl_s=3.0, freshness_s=1.5, clock=clock)
    node_id = ""
    i = 0
    while i + 2 <= len(data):
        n = int.from_bytes(data[i:i + 2], "big")
        chunk = data[i + 2:i + 2 + n]
        i += 2 + n
        try:
            msg = cpb.NodeMessage.FromString(chunk)
        except DecodeError:
            continue
        kind = msg.WhichOneof("kind")
        try:
            if kind == "registration":
                reg = valid_registration(msg.registration, LIMITS)
                node_id = reg.node_id
                registry.register(reg, 1)
            elif kind == "heartbeat" and node_id:
                load = valid_heartbeat(msg.heartbeat, LIMITS)
                registry.heartbeat(node_id, 1, msg.heartbeat.seq, msg.heartbeat.sent_unix_ms,
                                   load)
            elif kind == "deregistration" and node_id:
                registry.deregister(node_id, 1, msg.deregistration.reason)
                node_id = ""
        except InvalidNodeInput:
            continue
        clock.t += 0.1
    for summary in registry.models():
        assert math.isfinite(summary.capacity_weight)
        for c in registry.candidates(summary.name):
            assert math.isfinite(c.capacity_weight) and c.capacity_weight > 0
            assert 0.0 <= c.kv_cache_usage <= 1.0
            assert math.isfinite(c.step_s) and c.step_s >= 0
            if c.report is not None:
                assert math.isfinite(c.report.decode_step_s)
                assert math.isfinite(c.report.prefill_capacity_tokens_per_s)


def request(data: bytes) -> None:
    """A GenerateRequest's bytes as router intake and the node's sampling checks see them."""
    try:
        req = pb.GenerateRequest.FromString(data)
    except DecodeError:
        return   # the router answers INVALID_ARGUMENT (intake.parse_request)
    tokens = estimate_prompt_tokens(req, 4.0)
    assert tokens >= 0
    try:
        s = _sampling(req.sampling)
    except RequestError:
        return
    assert s.max_tokens >= 1 and math.isfinite(s.temperature) and 0 < s.top_p <= 1


TARGETS = {"control": control, "ingest": ingest, "request": request}   # control: fuzz/control.py
