"""``prefix05`` / ``prefix7``: cache-aware routing on real engines. Two nodes of one shape
(``PREFIX_PHASES``: 0.5B or 7B) share GPU 0 with vLLM's prefix caching and KV events on
(heartbeats every 250 ms) and the scheduler limits of ``frontdoors.phases.SCHEDULER`` (in every record as
``scheduler``); four balancers over the same two nodes, interleaved over rounds (order
reversed every round):

- ``least_request``: gpumesh, fewest in flight, no locality;
- ``precise``: gpumesh weighted least-load, prefix locality from the nodes' KV events;
- ``approximate``: gpumesh weighted least-load, locality from the router's own record of
  which prefixes it sent where (no events used);
- ``smg``: SMG's ``cache_aware`` policy in gRPC mode over the nodes' VllmEngine service
  (SMG's defaults otherwise). Which cache state it could have: the record's ``smg_mode``, from
  whether the nodes' ``SubscribeKvEvents`` carried block events during the bench.

The routers hash prompts with the model's own tokenizer (loaded when the nodes register).
``least_request`` and ``precise`` run ``--workers`` processes each (the bench's default 4, as
a router is deployed on a multi-core host; the load opens a connection per worker),
``approximate`` one (its record of what went where is per process).

Every bench spells its prompts with a salt of its own (``prefix.load``): system prompts and
conversations alike, so no bench finds in the engines' caches, or in a router's or SMG's
record, anything an earlier bench left; each starts cold and warms up inside its warm-up.

Workload (``prefix.load``, ``gpumesh_bench.tenants``): ``PrefixWorkload.tenants`` tenants, each
a ``system_words``-token system prompt, multi-turn conversations, ``max_tokens`` output
tokens (``ignore_eos``), in a closed loop at ``concurrency``. Each node's KV cache
(``num_gpu_blocks_override``, ``kv_blocks``) holds its running requests' tokens plus about a
quarter of all tenants' system prompts, so where a tenant's requests go decides whether its
prefix is found. Per bench: TTFT p50/p90/p99, latency p50/p99, completions/s, errors, each
node's share, each node's prefix-cache hit rate (vLLM's, over its last requests, from the
routers' fleet view right after the bench), and when the first request completed
(``first_done_s``, from the load's start: a stall shows there).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from gpumesh_bench.gpu.frontdoors.phases import SCHEDULER
from gpumesh_bench.gpu.env import SERVED, Env, GpuNodeSpec, GpuRouterSpec
from gpumesh_bench.gpu.frontdoors.servers import Smg, stop_all
from gpumesh_bench.gpu.group import Group, fleet_once
from gpumesh_bench.gpu.prefix.load import SpellSpec, tenant_load
from gpumesh_bench.stats import percentile, window_metrics
from gpumesh_bench.tenants import TenantSpec

PREFIX_SETUPS = ("least_request", "precise", "approximate", "smg")
PREFIX_LABEL = {"least_request": "gpumesh least_request", "precise": "gpumesh precise",
                "approximate": "gpumesh approximate", "smg": "SMG cache_aware (gRPC)"}
# policy and prefix_locality of each gpumesh setup's router
_ROUTERS = {"least_request": ("least_request", "off"),
            "precise": ("predicted_latency", "precise"),
            "approximate": ("predicted_latency", "approximate")}
NODES = ("pa", "pb")
GPU_MEM = 0.42
PREFIX_PHASES = {"prefix05": "0.5b", "prefix7": "7b"}   # phase -> model shape
# one node's start on the GPU, by shape (the two start one after the other)
ENGINE_START_S = {"0.5b": 75.0, "7b": 110.0}


@dataclass(frozen=True)
class PrefixWorkload:
    tenants: int = 48           # each with its own system prompt
    system_words: int = 1536    # a system prompt's words (one token each once spelled)
    turn_words: int = 40        # a user message's and an assistant reply's words
    max_turns: int = 6          # a conversation's turns before it ends
    max_tokens: int = 48        # output tokens per request (ignore_eos)
    concurrency: int = 48       # closed-loop streams per balancer

    def spec(self) -> TenantSpec:
        return TenantSpec(tenants=self.tenants, system_words=self.system_words,
                          turn_words=self.turn_words, max_turns=self.max_turns,
                          max_tokens=self.max_tokens, seed=0)

    def max_len(self) -> int:
        """Tokens of the longest request: header, system prompt, earlier turns, the new user
        message and the output."""
        turn = self.turn_words + 1
        return (self.system_words + 3 + (self.max_turns - 1) * 2 * turn + turn
                + self.max_tokens)

    def kv_blocks(self) -> int:
        """16-token blocks per node: a quarter of all system prompts, plus half the
        concurrency's requests at a mean length (system prompt, half the turns, output)."""
        prefixes = self.tenants * (self.system_words + 3)
        request = self.system_words + 3 + self.turn_words * self.max_turns + self.max_tokens
        return math.ceil((prefixes / 4 + math.ceil(self.concurrency / 2) * request) / 16)


def _router_specs(env: Env, setups: list[str], shape: str) -> list[GpuRouterSpec]:
    """One router per gpumesh setup, named ``p-<setup>``, over both nodes."""
    base: dict[str, str] = {}
    if env.engine == "vllm":   # the dummy model's tokenizer (simulated nodes need none)
        base["GPUMESH_ROUTER_LOCALITY__PREFIX_TOKENIZERS"] = (
            f"{SERVED[shape]}={env.models[shape] / 'tokenizer'}")
    return [GpuRouterSpec(_rname(k), _ROUTERS[k][0], NODES,
                          env={**base, "GPUMESH_ROUTER_LOCALITY__PREFIX_LOCALITY": _ROUTERS[k][1]},
                          workers=1 if k == "approximate" else 0)
            for k in setups]


def _rname(setup: str) -> str:
    return "p-" + setup.replace("_", "-")


def _node_view(router: str) -> dict[str, dict[str, float]]:
    """Each node's prefix-cache hit rate, KV usage and heartbeat age as ``router`` sees it."""
    out: dict[str, dict[str, float]] = {}
    with contextlib.suppress(Exception):
        for n in fleet_once(router).nodes:
            out[n.node_id] = {"prefix_hit_rate": round(n.load.prefix_cache_hit_rate, 4),
                              "kv_usage": round(n.load.kv_cache_usage, 4),
                              "heartbeat_age_s": round(n.last_heartbeat_age_s, 3)}
    return out


class _KvEventProbe:
    """Counts ``SubscribeKvEvents`` batches with block events from one node for a while (a
    thread): whether SMG could have run its exact mode against these nodes."""

    def __init__(self, address: str, seconds: float) -> None:
        self.address, self.seconds = address, seconds
        self.batches = self.with_events = 0
        self.error = ""
        self._th = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _KvEventProbe:
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._th.join(self.seconds + 5)

    def _run(self) -> None:
        import grpc
        from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
        from smg_grpc_proto.generated import common_pb2 as cpb

        try:
            with grpc.insecure_channel(self.address) as ch:
                call = vpb_grpc.VllmEngineStub(ch).SubscribeKvEvents(
                    cpb.SubscribeKvEventsRequest(), timeout=self.seconds)
                for b in call:
                    self.batches += 1
                    self.with_events += bool(len(b.events))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self.error = f"{e.code().name}: {e.details()}"[:200]
        except Exception as e:  # noqa: BLE001 - a diagnostic: never fails a bench
            self.error = f"{type(e).__name__}: {e}"[:200]

    def mode(self) -> str:
        if self.with_events:
            return (f"nodes stream block events ({self.with_events} of {self.batches} "
                    "batches): SMG's exact mode available")
        return (f"nodes stream load records only ({self.batches} batches, no block events): "
                "SMG's own approximate tree" + (f" [probe: {self.error}]" if self.error else ""))


def tenant_stickiness(res: list[Any], keys: dict[int, str], lo: float, hi: float) -> float:
    """Of the requests completed in [lo, hi], the share that went to their tenant's most
    used node: 1 = every tenant on one node; about 1 / nodes when placement ignores tenants."""
    by: dict[str, dict[str, int]] = {}
    for r in res:
        if r.status == "OK" and lo <= r.start_s + r.latency_s <= hi and r.index in keys:
            t = keys[r.index].split("-")[0]
            c = by.setdefault(t, {})
            c[r.node_id] = c.get(r.node_id, 0) + 1
    total = sum(sum(c.values()) for c in by.values())
    return round(sum(max(c.values()) for c in by.values()) / total, 4) if total else math.nan


def _metrics(res: list[Any], warmup_s: float, window_s: float) -> dict[str, Any]:
    m = window_metrics(res, warmup_s, window_s)
    lo, hi = warmup_s, warmup_s + window_s
    inwin = [r for r in res if r.status == "OK" and r.start_s >= lo
             and r.start_s + r.latency_s <= hi and r.ttft_s is not None]
    m["ttft_p90"] = round(percentile([r.ttft_s for r in inwin], 90), 4) if inwin else math.nan
    share: dict[str, int] = {}
    for r in res:
        if r.status == "OK" and lo <= r.start_s + r.latency_s <= hi:
            share[r.node_id or "?"] = share.get(r.node_id or "?", 0) + 1
    m["node_share"] = share
    return m


def prefix_need(env: Env, phase: str = "prefix05") -> float:
    """Seconds the phase needs for its two node starts and one round (the cli's check)."""
    per = env.warmup_s + env.window_s + 8.0
    start = 2 * ENGINE_START_S[PREFIX_PHASES[phase]] if env.engine == "vllm" else 30.0
    return start + len(PREFIX_SETUPS) * per + 10.0


def phase_prefix(env: Env, phase: str = "prefix05", rounds: int = 2,
                 work: PrefixWorkload | None = None,
                 setups: tuple[str, ...] = PREFIX_SETUPS) -> None:
    w = work or PrefixWorkload()
    shape = PREFIX_PHASES[phase]
    blocks = w.kv_blocks()
    gp = [s for s in setups if s in _ROUTERS]
    routers = _router_specs(env, gp, shape)
    rnames = tuple(r.name for r in routers)
    args = {"enable_prefix_caching": True, **SCHEDULER}
    nodes = [GpuNodeSpec(NODES[0], shape, "0", GPU_MEM, blocks=blocks, routers=rnames,
                         engine_args=args),
             GpuNodeSpec(NODES[1], shape, "0", GPU_MEM, blocks=blocks, routers=rnames,
                         engine_args=args, after=NODES[0])]
    model = SERVED[shape]
    spell_vocab = "dummy" if env.engine == "vllm" else "sim"
    n_procs = max(1, min(env.procs, 4))
    extra: list[Any] = []
    workload = {**asdict(w), "kv_blocks": blocks, "kv_tokens": blocks * 16,
                "system_prompt_tokens_all": w.tenants * (w.system_words + 3),
                "spelling": spell_vocab, "procs": n_procs,
                "router_workers": {k: 1 if k == "approximate" else env.workers for k in gp},
                "scheduler": {**SCHEDULER, **{k: v for k, v in env.engine_args.items()
                                              if k in SCHEDULER}}}
    saved = dict(env.node_options)
    if env.engine == "sim":
        # a simulated node reports its ``model`` as the model's path to SMG, which loads the
        # tokenizer from there (the served name stays the GPU nodes'); SMG's token ids of the
        # simulator's spelling are all one id, so a dry run's SMG figures are plumbing only
        env.node_options = {**saved, "model": str(env.models[shape])}
    if w.max_len() > env.max_model_len:
        env.node_options = {**env.node_options, "max_model_len": -(-w.max_len() // 256) * 256}
    with Group(env, nodes, routers) as g:
        try:
            t = time.monotonic()
            g.start()
            env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
            cmds: dict[str, Any] = {"gpumesh": g.commands}
            print(f"[prefix] {phase}: nodes and routers up in {time.monotonic() - t:.0f}s "
                  f"(KV {blocks} blocks per node; logged {g.kv_tokens})", flush=True)
            doors: dict[str, tuple[str, str]] = {
                k: ("grpc", g.addr[_rname(k)]) for k in gp}
            worker_nodes = {f"grpc://{g.addr[n]}": n for n in NODES}
            if "smg" in setups:
                try:
                    sm = Smg(f"{phase}-cache-aware", [g.addr[n] for n in NODES],
                             env.models[shape], env.logs, policy="cache_aware",
                             # the tokenizer from the model folder, whatever path a node
                             # reports (a simulated node reports its served name)
                             flags=("--tokenizer-path", str(env.models[shape])))
                    extra.append(sm)
                    sm.wait_ready()
                    cmds["smg"] = [sm.command()]
                    doors["smg"] = ("http", sm.base)
                except Exception as e:  # noqa: BLE001 - the other balancers still run
                    print(f"[prefix] {phase} smg: FAILED: {type(e).__name__}: {e}"[:3000],
                          flush=True)
                    env.meta.setdefault("doors_failed", {})[f"{phase} smg"] = (
                        f"{type(e).__name__}: {e}"[:1500])
            env.meta.setdefault("commands", {})[phase] = cmds
            order = [s for s in setups if s in doors]
            view = g.addr[rnames[0]] if rnames else ""
            _rounds(env, phase, shape, w, order, doors, worker_nodes, view, model,
                    spell_vocab, n_procs, rounds, workload, g.addr[NODES[0]])
        finally:
            stop_all(reversed(extra))
            env.node_options = saved


def _rounds(env: Env, phase: str, shape: str, w: PrefixWorkload, order: list[str],
            doors: dict[str, tuple[str, str]], worker_nodes: dict[str, str], view: str,
            model: str, vocab: str, n_procs: int, rounds: int, workload: dict[str, Any],
            node_a: str) -> None:
    per_round = None
    dur = env.warmup_s + env.window_s
    for k in range(rounds):
        if env.out_of_time("prefix", phase, k, rounds, per_round, margin=10.0):
            break
        t = time.monotonic()
        seq = order if k % 2 == 0 else list(reversed(order))
        for i, s in enumerate(seq):
            kind, target = doors[s]
            spell = SpellSpec(vocab, w.system_words + 3, salt=1 + k * 16 + PREFIX_SETUPS.index(s))
            probe = _KvEventProbe(node_a, min(dur, 10.0)) if s == "smg" else None
            try:
                with probe if probe is not None else contextlib.nullcontext():
                    res, keys = tenant_load(kind, target, model, w.spec(), spell,
                                      concurrency=w.concurrency, duration_s=dur,
                                      procs=n_procs, worker_nodes=worker_nodes)
            except Exception as e:  # noqa: BLE001 - one balancer failing must not stop the rest
                print(f"[prefix] {phase} {s} #{k}: FAILED: {type(e).__name__}: {e}"[:3000],
                      flush=True)
                env.meta.setdefault("doors_failed", {})[f"{phase} {s} #{k}"] = (
                    f"{type(e).__name__}: {e}"[:1500])
                continue
            nodes = _node_view(view) if view else {}
            m = _metrics(res, env.warmup_s, env.window_s)
            m["tenant_stickiness"] = tenant_stickiness(res, keys, env.warmup_s, dur)
            done = [r.start_s + r.latency_s for r in res if r.status == "OK"]
            m["first_done_s"] = round(min(done), 3) if done else math.nan
            rec: dict[str, Any] = {
                "phase": phase, "prefix": s, "balancer": PREFIX_LABEL[s], "kind": kind,
                "shape": shape, "round": k, "position": i, "concurrency": w.concurrency,
                "warmup_s": env.warmup_s, "window_s": env.window_s, "workload": workload,
                **m, "nodes": nodes, "salt": spell.salt, "call": env.call,
                "engine": env.engine, "started": time.time()}
            if probe is not None:
                rec["smg_mode"] = probe.mode()
            env.records.append(rec)
            env.save()
            hits = " ".join(f"{n}:{v['prefix_hit_rate']:.2f}" for n, v in sorted(nodes.items()))
            print(f"[prefix] {phase} {PREFIX_LABEL[s]:26} #{k} done_qps={m['done_qps']:7.1f} "
                  f"first_done={m['first_done_s']:.1f}s "
                  f"ttft p50/p90/p99={m['ttft_p50']:.3f}/{m['ttft_p90']:.3f}/"
                  f"{m['ttft_p99']:.3f}s lat p50={m['lat_p50']:.3f}s errors={m['errors']} "
                  f"share={m['node_share']} stick={m['tenant_stickiness']:.2f} hit {hits}"
                  + (f" [{rec['smg_mode']}]" if probe is not None else ""), flush=True)
            if res and m["errors"] > len(res) / 2:
                env.meta.setdefault("doors_failed", {})[f"{phase} {s} #{k}"] = (
                    f"{m['errors']} of {len(res)} failed: {m.get('error_kinds')}")
        per_round = time.monotonic() - t
