"""The disaggregated attempt inside the attempt layers (router.dispatch.disagg), over real
gRPC with fake nodes (tests.router.fakenode) in the roles prefill, decode and both: one
attempt runs both legs; a prefill leg that fails is retried whole; a decode node that fails
after output hands the stream on like any stream."""

from __future__ import annotations

import grpc
import pytest

from gpumesh import metadata as md
from tests.router.test_router_grpc import fleet, req


async def _stream(f, **kw):  # type: ignore[no-untyped-def]
    call = f.stub.GenerateStream(req(max_tokens=6, **kw), timeout=10)
    ids = [i for chunk in [c async for c in call] for i in chunk.token_ids]
    return ids, dict(await call.trailing_metadata())


async def test_both_legs_are_one_attempt() -> None:
    async with fleet({"node_id": "pre", "role": "prefill"},
                     {"node_id": "dec", "role": "decode"}) as f:
        ids, trailing = await _stream(f)
        assert ids == list(range(6))
        assert trailing[md.NODE_ID] == "dec" and trailing[md.PREFILL_NODE_ID] == "pre"
        assert trailing[md.ATTEMPTS] == "1"
        pre, dec = f.nodes["pre"], f.nodes["dec"]
        assert [s.max_tokens for s in pre.seen] == [1]
        assert pre.kv_seen == ['{"do_remote_decode": true}']
        assert dec.kv_seen == ['{"remote_engine_id": "pre"}']
        # unary calls are served whole, never by a prefill node
        answer = await f.stub.Generate(req(max_tokens=3), timeout=10)
        assert list(answer.token_ids) == [0, 1, 2] and len(pre.seen) == 1


async def test_failed_prefill_leg_is_retried_whole_on_the_decode_node() -> None:
    async with fleet({"node_id": "pre", "role": "prefill", "fail_mode": "before_first"},
                     {"node_id": "dec", "role": "decode"},
                     disagg_leg_timeout_s=2.0) as f:
        ids, trailing = await _stream(f)
        assert ids == list(range(6))
        assert trailing[md.NODE_ID] == "dec" and md.PREFILL_NODE_ID not in trailing
        assert trailing[md.ATTEMPTS] == "2"
        assert f.nodes["dec"].kv_seen == [""]   # served whole: no parameters


async def test_decode_node_failing_after_output_migrates() -> None:
    async with fleet({"node_id": "pre", "role": "prefill"},
                     {"node_id": "dec", "role": "decode", "fail_mode": "after_first"},
                     {"node_id": "w"}, disagg_min_prompt_tokens=0) as f:
        ids, trailing = await _stream(f)
        assert ids == list(range(6))
        assert trailing[md.NODE_ID] == "w" and trailing[md.MIGRATIONS] == "1"
        assert f.nodes["w"].kv_seen == [""]   # the continuation is an ordinary request


async def test_clients_may_not_send_kv_transfer_params() -> None:
    async with fleet({"node_id": "a"}) as f:
        r = req()
        r.kv_transfer_params = "{}"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await f.stub.Generate(r, timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f.nodes["a"].seen == []
