"""Writes the seed inputs of the corpus (valid messages the fuzzer mutates from).

    python fuzz/seed.py
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from gpumesh.v1 import control_pb2 as cpb  # noqa: E402
from gpumesh.v1 import inference_pb2 as pb  # noqa: E402


def frame(*msgs: cpb.NodeMessage) -> bytes:
    out = b""
    for m in msgs:
        raw = m.SerializeToString()
        out += len(raw).to_bytes(2, "big") + raw
    return out


def seeds() -> dict[str, list[bytes]]:
    reg = cpb.NodeMessage(registration=cpb.Registration(
        node_id="n1", address="127.0.0.1:50051", incarnation="i1", engine="sim",
        models=[cpb.ServedModel(name="m", aliases=["a"], max_context_length=4096,
                                tensor_parallel_size=1, capacity_weight=2.0)]))
    hb = cpb.NodeMessage(heartbeat=cpb.Heartbeat(seq=1, sent_unix_ms=1, load=cpb.LoadReport(
        num_running=3, num_waiting=1, pending_prefill_tokens=100, kv_cache_usage=0.5,
        generation_tokens_per_s=100.0, prompt_tokens_per_s=1000.0, in_flight=4,
        kv_capacity_tokens=10000, prefill_capacity_tokens_per_s=5000.0, decode_step_s=0.02,
        gpus=[cpb.GpuStats(index=0, utilization=0.5, memory_used_bytes=1, memory_total_bytes=2)],
        router_accounts=[cpb.RouterAccount(router_id="fuzz-router", admitted_requests=3,
                                           finished_requests=1)])))
    hb2 = cpb.NodeMessage(heartbeat=cpb.Heartbeat(seq=2, sent_unix_ms=2, load=cpb.LoadReport(
        num_running=1, kv_cache_usage=0.9, decode_step_s=0.0)))
    dereg = cpb.NodeMessage(deregistration=cpb.Deregistration(reason="bye"))
    ingest = [frame(reg), frame(reg, hb), frame(reg, hb, hb2), frame(reg, hb, dereg)]
    # the control target: first byte = the caller (fuzz/control.py CALLERS), then messages
    # in every order, KV-cache updates included
    reg_n1 = cpb.NodeMessage(registration=cpb.Registration(
        node_id="n1", address="127.0.0.1:50051", incarnation="i1", engine="sim",
        models=[cpb.ServedModel(name="m", capacity_weight=1.0)]))
    kv = cpb.NodeMessage(kv_cache=cpb.KvCacheUpdate(model="m", seq=1, stored=[1, 2, 3]))
    kv2 = cpb.NodeMessage(kv_cache=cpb.KvCacheUpdate(model="m", seq=3, removed=[2]))
    sequences = [(reg_n1,), (reg_n1, hb, kv, hb2, kv2, dereg), (dereg, reg_n1),
                 (kv, reg_n1, hb), (hb, reg_n1), (reg_n1, reg_n1, hb, dereg, hb),
                 (reg, hb, kv), (reg_n1, kv2, kv, hb2, hb)]
    control = [bytes([caller]) + frame(*seq) for caller in range(6) for seq in sequences]
    reqs = [pb.GenerateRequest(model="m", text="hello", sampling=pb.SamplingParams(
                max_tokens=8, temperature=0.5, top_p=0.9, stop=["x"])),
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3])),
            pb.GenerateRequest(chat=pb.ChatMessages(messages=[
                pb.ChatMessage(role="user", content="hi")]))]
    return {"control": control, "ingest": ingest,
            "request": [r.SerializeToString() for r in reqs]}


if __name__ == "__main__":
    for target, items in seeds().items():
        d = ROOT / "corpus" / target
        d.mkdir(parents=True, exist_ok=True)
        for raw in items:
            (d / hashlib.sha1(raw).hexdigest()).write_bytes(raw)
