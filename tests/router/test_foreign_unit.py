"""router.backends.vllm_grpc's pure parts: spec parsing, config, vLLM load -> LoadReport,
detokenizing."""

from __future__ import annotations

import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2 as smg_common

from gpumesh.router.config import RouterConfig
from gpumesh.router.backends.vllm_grpc import (
    Detokenizer,
    ForeignSpec,
    load_from_record,
    merge_scheduler_loads,
)


def test_spec_parse():
    s = ForeignSpec.parse("10.0.0.1:50061?weight=2&tokenizer=/m&node_id=w1&max_concurrency=8")
    assert (s.address, s.capacity_weight, s.tokenizer, s.resolved_node_id, s.max_concurrency) \
        == ("10.0.0.1:50061", 2.0, "/m", "w1", 8)
    assert ForeignSpec.parse("h:1").resolved_node_id == "vllm@h:1"
    for bad in ("", "nohostport", "h:1?colour=red"):
        with pytest.raises(ValueError):
            ForeignSpec.parse(bad)


def test_config_lists_foreign_nodes():
    cfg = RouterConfig.load(env={"GPUMESH_ROUTER_MEMBERSHIP__FOREIGN_NODES": "a:1?weight=2, b:2"})
    assert cfg.membership.foreign_nodes == ("a:1?weight=2", "b:2")
    assert RouterConfig().membership.foreign_nodes == ()


def test_load_mapping_prefers_the_servicers_prefill_count():
    rec = smg_common.EngineLoad(running_requests=3, waiting_requests=2,
                                waiting_uncached_tokens=100, token_usage=0.25,
                                gen_throughput=50.0)
    s = load_from_record(rec)
    assert (s.num_running, s.num_waiting, s.pending_prefill_tokens, s.kv_cache_usage,
            s.generation_tokens_per_s, s.in_flight) == (3, 2, 100, 0.25, 50.0, 5)
    rec.prefill_pending_tokens = 160   # also counts prompts in prefill: the ledger's meaning
    assert load_from_record(rec).pending_prefill_tokens == 160
    merged = merge_scheduler_loads([
        vpb.SchedulerLoad(num_running_reqs=1, num_waiting_uncached_tokens=10, token_usage=0.2,
                          gen_throughput=5),
        vpb.SchedulerLoad(num_running_reqs=2, num_waiting_uncached_tokens=30, token_usage=0.4,
                          gen_throughput=7)])
    assert (merged.num_running, merged.pending_prefill_tokens, merged.generation_tokens_per_s) \
        == (3, 40, 12)
    assert merged.kv_cache_usage == pytest.approx(0.3)


class _ByteTok:
    """Ids are UTF-8 bytes; decode replaces an incomplete tail with U+FFFD, like HF's."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_splits_a_character():
    d = Detokenizer(_ByteTok())  # type: ignore[arg-type]
    euro = list("€".encode())     # 3 bytes
    assert d.push([ord("a")] + euro[:1]) == "a"
    assert d.push(euro[1:2]) == ""
    assert d.push(euro[2:] + [ord("b")]) == "€b"
    assert d.push(list("é".encode())[:1], final=True) == "\ufffd"
