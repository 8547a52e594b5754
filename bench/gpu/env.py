"""What a GPU bench call runs with: its settings (``Env``), the node and router specs of a
phase, and the node TOML a spec becomes."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumesh.config import nest
from gpumesh.node.config import NodeConfig
from gpumesh.node.streaming.settings import StreamingSettings
from gpumesh_bench.workload import REFERENCE_OUTPUT, REFERENCE_PROMPT

SERVED = {"0.5b": "qwen2.5-0.5b", "7b": "qwen2.5-7b"}
POLICIES = ("predicted_latency", "least_request", "power_of_two", "round_robin")


@dataclass
class GpuNodeSpec:
    name: str
    shape: str = "0.5b"
    gpus: str = "0"
    gpu_mem: float = 0.85
    tp: int = 1
    blocks: int = 0               # num_gpu_blocks_override (0 = what fits)
    routers: tuple[str, ...] = ()  # router names
    after: str = ""               # start once this node serves (same GPU: profiling is per process)
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM: on top of Env.engine_args


@dataclass
class GpuRouterSpec:
    name: str
    policy: str = "predicted_latency"
    members: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)   # on top of Env.router_env
    workers: int = 0   # router processes (--workers); 0 = Env.workers


@dataclass
class Env:
    out: Path
    engine: str
    models: dict[str, Path]
    workers: int
    procs: int
    warmup_s: float
    window_s: float
    max_model_len: int
    sim_time_scale: float
    small_kv_blocks: int
    sim_front_end_tok_s: float = 0.0   # simulated nodes: front-end ceiling (0 = none)
    sim_max_num_seqs: int = 0          # simulated nodes: vLLM's max_num_seqs (0 = default)
    raw_tool: str = ""
    # Simulated nodes: multiply the node's flush interval and heartbeat intervals and the
    # router's freshness window and lease by sim_time_scale, so that heartbeats per request
    # lifetime and messages per token are those of the unscaled (GPU) system.
    sim_scale_intervals: bool = False
    policy: str = "predicted_latency"   # the data-parallel phases' router policy
    router_env: dict[str, str] = field(default_factory=dict)  # extra env for every router
    # dp05/dp7: a second data-parallel router "r2b" with this env on top, fronting the same
    # two nodes, benched interleaved with r2 (an A/B of router settings on the same nodes)
    router_env_b: dict[str, str] = field(default_factory=dict)
    # vLLM nodes: extra AsyncEngineArgs on top of the bench's (e.g. stream_interval=4)
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Every node: top-level node TOML keys on top of the bench's (e.g. stream_messages_per_s=0)
    node_options: dict[str, Any] = field(default_factory=dict)
    # Load processes round-robin over a multi-worker router's processes (bench --spread-workers)
    spread_workers: bool = False
    # Data-parallel phases: "off", "on" (every bench with node processes on physical cores of
    # their own, gpumesh_bench.gpu.affinity), "both" (each setup unpinned then pinned, interleaved)
    pin: str = "off"
    # The reference's workload by default; another output length mix (e.g. uniform:128:384)
    # keeps a closed loop's streams from finishing in lock-step waves
    prompt: str = str(REFERENCE_PROMPT)
    output: str = str(REFERENCE_OUTPUT)
    records: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    # This harness run's 1-based index in meta["calls"] (cmd_run sets it; successive runs
    # append to one results.json), recorded with every record as "call"; 0: not set
    call: int = 0
    # time.monotonic() at which this call's --budget ends (cmd_run sets it); phases of
    # several rounds stop before a round that would not fit
    budget_end: float = math.inf
    # vsraw phases: also the node's engine without gRPC (engine loop) in every round
    vs_eng: bool = False
    # vsraw phases: engine arguments of a second set of nodes benched in the same rounds
    vs_variant: dict[str, Any] = field(default_factory=dict)
    # vsraw phases: only these legs (VSRAW_LEGS names), in their usual order; empty: all
    vs_legs: tuple[str, ...] = ()

    @property
    def logs(self) -> Path:
        p = self.out / "logs"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def out_of_time(self, tag: str, phase: str, k: int, rounds: int,
                    per_round: float | None, margin: float = 0.0) -> bool:
        """Whether round ``k`` of a phase would end past the run's ``--budget``; when so (never
        for the first round, nor before a round's length is known) it is said and recorded in
        ``meta["cut"]``."""
        left = self.budget_end - time.monotonic()
        if not k or per_round is None or left >= per_round + margin:
            return False
        print(f"[{tag}] {phase}: stopped after {k} of {rounds} rounds ({left:.0f}s of the budget "
              f"left, a round takes ~{per_round:.0f}s)", flush=True)
        self.meta.setdefault("cut", []).append(f"{phase}: {k} of {rounds} rounds")
        return True

    def save(self) -> None:
        doc = {"meta": self.meta, "records": self.records}
        (self.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):  # e.g. --engine-arg 'compilation_config={"cudagraph_mode": "FULL"}'
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}"
                                for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def node_toml(env: Env, spec: GpuNodeSpec) -> str:
    top: dict[str, Any] = {"served_name": SERVED[spec.shape], "max_model_len": env.max_model_len,
                           "heartbeat_busy_interval_s": 0.25, "drain_timeout_s": 5.0}
    tables: dict[str, dict[str, Any]] = {}
    if env.engine == "vllm":
        model = env.models[spec.shape]
        top.update(engine="vllm", model=str(model), tokenizer=str(model / "tokenizer"),
                   load_format="dummy", dtype="bfloat16", gpu_memory_utilization=spec.gpu_mem,
                   tensor_parallel_size=spec.tp, num_gpu_blocks_override=spec.blocks)
        tables["engine_args"] = {"enable_prefix_caching": False, "seed": 0, **env.engine_args,
                                 **spec.engine_args}
    else:
        from gpumesh.node.engines.sim import SimEngineConfig

        base = SimEngineConfig.for_shape(spec.shape)
        top.update(engine="sim", model=SERVED[spec.shape], tensor_parallel_size=spec.tp)
        sim: dict[str, Any] = {"time_scale": env.sim_time_scale,
                               "front_end_tokens_per_s": env.sim_front_end_tok_s,
                               "step_a_ms": base.step_a_ms / max(1, spec.tp) ** 0.5,
                               "step_b_decode_ms": base.step_b_decode_ms,
                               "step_b_prefill_ms": base.step_b_prefill_ms,
                               "kv_capacity_tokens": base.kv_capacity_tokens}
        if env.sim_max_num_seqs:
            sim["max_num_seqs"] = env.sim_max_num_seqs
        if spec.blocks:
            sim["kv_capacity_tokens"] = max(spec.blocks * 16, env.max_model_len)
        tables["sim"] = sim
        if env.sim_scale_intervals and env.sim_time_scale > 0:
            t = env.sim_time_scale
            top.update(heartbeat_busy_interval_s=0.25 * t, heartbeat_idle_interval_s=1.0 * t,
                       flush_interval_ms=max(1, round(20 * t)),
                       stream_messages_per_s=StreamingSettings().stream_messages_per_s / t)
    top.update(env.node_options)
    lines = []
    for section, kv in nest(NodeConfig, {**top, **tables}).items():   # keys by their names
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
    return "\n".join(lines) + "\n"
