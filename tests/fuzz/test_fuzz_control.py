"""Property-based fuzzing of the router's ControlPlane servicer in-process (fuzz/control.py):
any caller (open, right or wrong join token, node or client certificate, none) sending any
sequence of registrations, heartbeats, KV-cache updates and deregistrations. A stream ends
with a specific status; a stranger changes nothing; a certificate holder touches its own id
only; candidates stay finite. Fast (no processes): GPUMESH_FUZZ_EXAMPLES scales it too."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fuzz.control import CALLERS, control
from tests.fuzz.test_fuzz_rpcs import FUZZ, node_messages


def frame(*msgs) -> bytes:
    out = b""
    for m in msgs:
        raw = m.SerializeToString()
        if len(raw) < 65536:
            out += len(raw).to_bytes(2, "big") + raw
    return out


@FUZZ
@given(caller=st.integers(0, len(CALLERS) - 1),
       messages=st.lists(node_messages(), min_size=1, max_size=8))
def test_control_plane_from_any_caller(caller, messages):
    control(bytes([caller]) + frame(*messages))


def test_a_stranger_is_refused_whatever_it_sends():
    """Not vacuous: the same garbage registration quarantines its id for an open-membership
    caller, and changes nothing for one with a wrong token (the target checks both)."""
    import grpc

    from gpumesh.v1 import control_pb2 as cpb

    bad = cpb.NodeMessage(registration=cpb.Registration(
        node_id="n1", address="h:1", models=[cpb.ServedModel(name="m",
                                                             capacity_weight=float("nan"))]))
    names = [c[0] for c in CALLERS]
    assert control(bytes([names.index("open")]) + frame(bad)) == (
        grpc.StatusCode.INVALID_ARGUMENT, {"n1"})
    assert control(bytes([names.index("node-cert")]) + frame(bad)) == (
        grpc.StatusCode.INVALID_ARGUMENT, {"n1"})
    assert control(bytes([names.index("wrong-token")]) + frame(bad)) == (
        grpc.StatusCode.UNAUTHENTICATED, set())
    assert control(bytes([names.index("client-cert")]) + frame(bad)) == (
        grpc.StatusCode.PERMISSION_DENIED, set())
