"""The prediction: a request's time to first token and completion time on one node, in
seconds, from the node's engine profile and its last load report (pure; no I/O).

Step cost (seconds; ``StepCost``): a step holding ``d`` decode tokens and ``n`` prefill
tokens lasts ``a + b_decode * d + b_prefill * n``, and schedules at most ``budget`` tokens
(vLLM's max_num_batched_tokens; running sequences' decode tokens first, chunked prefill in
what is left). Taken, in this order, from:

1. ``fitted``: the node's own online fit (``LoadReport.step_model``, at least
   ``MIN_FIT_SPANS`` steps);
2. ``profile``: the model's built-in engine profile (``gpumesh.profiles``; a profile whose
   ``model`` or ``name`` is the request's model), its times divided by the node's capacity
   weight (a speed-2 node declares weight 2);
3. ``measured``: the node's reported prefill capacity T (tokens a full-budget prefill step
   does per second: ``b_prefill = 1 / T``, the step's fixed part amortised in it) and its
   measured decode step (``Candidate.step_s`` as ``a``); where no step is measured yet,
   ``a`` = the time of ``STEP_AS_PREFILL_TOKENS`` prefill tokens;
4. ``default``: ``DEFAULT_PREFILL_TOKENS_PER_S`` and ``DEFAULT_STEP_S`` per unit of weight.

The budget is the profile's where one applies, else ``DEFAULT_BUDGET``.

Per candidate node n and request q (f = ``peer_factor``, all routers' dispatches per one of
this router's; the unreported terms are what this router sent since n's last report)::

    R     = max(num_running + f * decode_delta, 0)       decode streams running on n
    Q     = pending_prefill_tokens + f * unreported_prompt_tokens     prefill queued ahead
    h     = prompt tokens of q that n holds: RequestInfo.cached_tokens[n]; on the session's
            node (RequestInfo.session_node) at least the longest prefix any node holds, or
            half the prompt when none is known (a conversation's next turn)
    p     = max(prompt - h, 1)                           q's own prefill on n
    step  = a + b_decode * R                             a step of n's running batch
    chunk = max(budget - R, budget / 4)                  prefill tokens per step
    ttft  = (0.5 + ceil((Q + p) / chunk)) * step + b_prefill * (Q + p)
            + slot wait + KV wait + adapter load
    ttft *= Candidate.prediction_scale                   observed / predicted, per node
    completion = ttft + out * (a + b_decode * (R + 1))   out = q's output tokens
    imposed = R * b_prefill * p          each of n's R streams waits for q's prefill
              + b_prefill * min((best - h) + dup, evicted)
                  (best - h): re-storing a prefix another node holds evicts blocks
                  someone else would hit (best = the longest prefix any node holds of q);
                  dup: refreshing a second copy of a prefix keeps it alive on n and evicts
                  blocks someone else would hit: dup = best when n is one of several nodes
                  holding the longest prefix and not its keeper (``prefix_keeper``), else 0;
                  evicted: what q's stores (p + out) evict from n's prefix cache, the
                  tokens the prefix index holds for n (RequestInfo.indexed_tokens) plus
                  them beyond n's KV capacity (unknown: no bound), so a copy that fits in
                  a cache with room costs nothing
              + R * b_decode * out       q's decode tokens lengthen their steps

The output still to come of the requests on n: ``out_n``, the mean output of the requests n
finished recently (``LoadReport.output_tokens_mean``), else ``output_tokens_default``. The
slot wait: when n's report had requests waiting (its running batch is full), q waits for
(those still waiting + f * unreported + 1) finishes, at R finishes per ``out_n`` steps
(Little's law); where the profile states the engine's running ceiling (max_num_seqs) and
R + 1 exceeds it, for the R + 1 - max_num_seqs beyond it. The KV wait: when q's tokens
(p + out) exceed n's free KV (capacity less the reported usage and this router's unreported
requests, each at its prompt plus ``out_n``), the shortfall frees at the rate the running
requests release KV. The adapter load: q names an adapter
that n's report does not list as loaded: n's measured load time, else
``RoutingSettings.adapter_load_s``. A node without a fresh report (STALE): Q and R are this
router's own outstanding prompt tokens and requests there, at the default step cost.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from gpumesh.kvblocks import BLOCK_SIZE
from gpumesh.profiles import EngineProfile
from gpumesh.router.scheduling.policies.base import node_rank, request_key
from gpumesh.router.scheduling.types import Candidate, RequestInfo

MIN_FIT_SPANS = 8
DEFAULT_BUDGET = 8192
DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
DEFAULT_STEP_S = 0.02
STEP_AS_PREFILL_TOKENS = 256


@dataclass(frozen=True)
class StepCost:
    """A node's step cost in seconds (module doc) and where it came from."""

    a_s: float
    decode_s: float
    prefill_s: float
    budget: int
    source: str   # "fitted" | "profile" | "measured" | "default"
    max_seqs: int = 0   # the engine's running ceiling (max_num_seqs; a profile's), 0 = unknown


@dataclass(frozen=True)
class Prediction:
    """One candidate's prediction for one request, seconds from the decision."""

    node_id: str
    ttft_s: float          # scaled by the node's prediction_scale
    completion_s: float
    imposed_s: float       # delay the request adds to the node's running requests, summed
    source: str            # the step cost's source


def _weight(c: Candidate) -> float:
    return c.capacity_weight if c.capacity_weight > 0 else 1.0


def step_cost(c: Candidate, profile: EngineProfile | None) -> StepCost:
    """``c``'s step cost (module doc, sources 1-4)."""
    budget = profile.max_num_batched_tokens if profile is not None else DEFAULT_BUDGET
    seqs = profile.max_num_seqs if profile is not None else 0
    r = c.report
    sm = r.step_model if r is not None else None
    if sm is not None and sm.spans >= MIN_FIT_SPANS and (sm.a_ms > 0 or sm.b_prefill_ms > 0):
        return StepCost(sm.a_ms / 1e3, sm.b_decode_ms / 1e3, sm.b_prefill_ms / 1e3, budget,
                        "fitted", seqs)
    w = _weight(c)
    if profile is not None:
        return StepCost(profile.a_ms / 1e3 / w, profile.b_decode_ms / 1e3 / w,
                        profile.b_prefill_ms / 1e3 / w, budget, "profile", seqs)
    cap = r.prefill_capacity_tokens_per_s if r is not None else 0.0
    if cap > 0:
        cap = max(cap, r.prompt_tokens_per_s if r is not None else 0.0)
        a = c.step_s if c.step_s > 0 else STEP_AS_PREFILL_TOKENS / cap
        return StepCost(a, 0.0, 1.0 / cap, budget, "measured", seqs)
    a = c.step_s if c.step_s > 0 else DEFAULT_STEP_S / w
    return StepCost(a, 0.0, 1.0 / (DEFAULT_PREFILL_TOKENS_PER_S * w), budget, "default", seqs)


def held_tokens(c: Candidate, request: RequestInfo) -> int:
    """Prompt tokens of ``request`` that ``c`` is expected to hold (``h``, module doc)."""
    h = request.cached_tokens.get(c.node_id, 0)
    if request.session_node and c.node_id == request.session_node:
        h = max(h, request.best_cached_tokens or request.prompt_tokens // 2)
    return min(h, request.prompt_tokens)


def best_held_tokens(request: RequestInfo) -> int:
    """The longest prefix of ``request`` any node is expected to hold."""
    best = request.best_cached_tokens
    if request.session_node and not best:
        best = request.prompt_tokens // 2
    return best


def output_tokens(request: RequestInfo, default: int, cap: int) -> int:
    """The output tokens a prediction counts for ``request``."""
    return min(request.output_tokens, cap) if request.output_tokens > 0 else default


def prefix_keeper(candidates: Sequence[Candidate], request: RequestInfo,
                  best_held: int) -> str:
    """When several candidates hold the request's longest known prefix (to within a
    block), the one that keeps it: first in the rendezvous order of that prefix's last
    block (``base.node_rank``), so every request sharing the prefix names the same keeper
    on every router replica and the other copies age out of the other nodes' caches. ""
    when fewer than two hold it."""
    if best_held <= 0:
        return ""
    holders = [c.node_id for c in candidates
               if held_tokens(c, request) > best_held - BLOCK_SIZE]
    if len(holders) < 2:
        return ""
    blocks = best_held // BLOCK_SIZE
    if request.prefix_hashes and 0 < blocks <= len(request.prefix_hashes):
        key = zlib.crc32(f"p:{request.prefix_hashes[blocks - 1]}".encode())
    else:
        key = request_key(request)
    return min(holders, key=lambda n: node_rank(key, n))


def predict(c: Candidate, request: RequestInfo, cost: StepCost, *, out: int,
            best_held: int, out_default: int, adapter_load_s: float,
            keeper: str = "") -> Prediction:
    """The prediction for ``request`` on ``c`` (module doc). ``out``: the request's output
    tokens (``output_tokens``); ``best_held``: ``best_held_tokens(request)``; ``keeper``:
    ``prefix_keeper`` of the candidates (a duplicate holder pays ``dup``)."""
    r = c.report
    f = max(c.peer_factor, 1.0)
    if r is not None:
        delta = c.unreported_requests if c.decode_delta is None else c.decode_delta
        running = max(r.num_running + f * delta, 0.0)
        queued = r.pending_prefill_tokens + f * c.unreported_prompt_tokens
    else:
        running = float(c.router_in_flight)
        queued = float(c.outstanding_prompt_tokens)
    total = running            # beyond the running ceiling, requests wait for a slot
    if cost.max_seqs > 0:
        running = min(running, float(cost.max_seqs))
    held = held_tokens(c, request)
    own = max(request.prompt_tokens - held, 1)
    step = cost.a_s + cost.decode_s * running
    chunk = max(cost.budget - running, cost.budget / 4.0)
    work = queued + own
    ttft = (0.5 + math.ceil(work / chunk)) * step + cost.prefill_s * work
    # the output of the requests already on n: what n measured of its recent ones, else the
    # default
    there = r.output_tokens_mean if r is not None and r.output_tokens_mean > 0 else out_default
    if r is not None:
        ttft += _slot_wait(c, r.num_waiting, total, step, f, there, cost.max_seqs)
        ttft += _kv_wait(c, own + out, running, step, f, there)
    if request.adapter and (r is None or request.adapter not in r.loaded_adapters):
        measured = r.adapter_load_s if r is not None else 0.0
        ttft += measured if measured > 0 else adapter_load_s
    ttft *= c.prediction_scale if c.prediction_scale > 0 else 1.0
    completion = ttft + out * (cost.a_s + cost.decode_s * (running + 1.0))
    dup = best_held if keeper and c.node_id != keeper and held > best_held - BLOCK_SIZE else 0
    # a copy stored or refreshed on n costs others' hits only where its stores evict
    copy = max(best_held - held, 0) + dup
    taken = min(copy, _evicted(c, request, own + out)) if copy else 0
    imposed = (running * cost.prefill_s * own
               + cost.prefill_s * taken
               + running * cost.decode_s * out
               + _kv_overflow(c, own + out, running, f, there) * cost.prefill_s
               * (1.0 + running))
    return Prediction(c.node_id, ttft, completion, imposed, cost.source)


def _evicted(c: Candidate, request: RequestInfo, stored: int) -> float:
    """Tokens of other prefixes that storing ``stored`` more tokens on ``c`` evicts from its
    prefix cache: what the index holds for ``c`` plus them, beyond its KV capacity (inf when
    either is unknown: counted as full)."""
    r = c.report
    if r is None or r.kv_capacity_tokens <= 0:
        return math.inf
    indexed = request.indexed_tokens.get(c.node_id)
    if indexed is None:
        return math.inf
    return float(max(indexed + stored - r.kv_capacity_tokens, 0))


def _slot_wait(c: Candidate, waiting: int, running: float, step: float, f: float,
               out_default: int, max_seqs: int) -> float:
    """Seconds until a running slot frees for a new request: when the report had requests
    waiting (this router's reported pre-first-token requests bound how many of those still
    wait), or when the engine's running ceiling is known and the requests there reach it."""
    per_finish = out_default * step   # Little's law: R finish per mean output of steps
    ahead = 0.0
    if waiting > 0:
        still = min(float(waiting), f * max(c.outstanding_requests - c.unreported_requests, 0))
        ahead = still + f * c.unreported_requests + 1.0
    if max_seqs > 0 and running + 1.0 > max_seqs:
        ahead = max(ahead, running + 1.0 - max_seqs)
    if ahead <= 0:
        return 0.0
    return ahead * per_finish / max(min(running, max_seqs or running), 1.0)


def _kv_overflow(c: Candidate, need: int, running: float, f: float, out_default: int) -> float:
    """KV tokens ``c`` lacks to hold ``need`` more beside what it holds, what its running
    requests will still grow by (half of ``out_default`` each) and this router's unreported
    requests will take (0 when it has room or reports no capacity): what the engine must
    preempt (and recompute) to make room."""
    r = c.report
    if r is None or r.kv_capacity_tokens <= 0:
        return 0.0
    used = (r.kv_cache_usage * r.kv_capacity_tokens + running * out_default / 2.0
            + f * (c.unreported_prompt_tokens + out_default * c.unreported_requests))
    return max(used + need - r.kv_capacity_tokens, 0.0)


def _kv_wait(c: Candidate, need: int, running: float, step: float, f: float,
             out_default: int) -> float:
    """Seconds until ``need`` KV tokens are free on ``c`` (0 when they are, or when ``c``
    reports no KV capacity)."""
    r = c.report
    if r is None or r.kv_capacity_tokens <= 0:
        return 0.0
    cap = float(r.kv_capacity_tokens)
    used = r.kv_cache_usage * cap + f * (c.unreported_prompt_tokens
                                         + out_default * c.unreported_requests)
    short = need - (cap - used)
    if short <= 0:
        return 0.0
    # running requests hold ``used`` and finish in about out_default / 2 steps
    per_s = max(used, 1.0) / ((out_default / 2.0) * max(step, 1e-6))
    return short / per_s
