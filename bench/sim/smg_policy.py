"""SMG's ``cache_aware`` routing policy as a comparison policy for the simulator (a reference
for the peer gateway, not a gpumesh policy: the product router never runs it).

A re-implementation, from SMG's published source (``model_gateway/src/policies/
cache_aware.rs`` and ``least_load.rs``) and the ``smg launch --help`` of the release the live
benchmarks run (smg 1.13.0), of what one SMG gateway decides per request:

1. **Eligible workers**: the healthy workers, less those SMG's worker overload protection
   leaves out — a worker whose last load record shows ``overload_waiting`` (8) or more waiting
   requests or KV usage at or above ``overload_token_usage`` (0.8) — while another is under
   both (else all of them).
2. **KV-pressure triggers** (``balance_token_usage_threshold``, ``overload_token_usage_threshold``;
   both 1.0 = off by default): over either, cache affinity is dropped for this request and it
   goes to the expected-wait winner (step 5) among the eligible.
3. **Affinity** — two modes, as SMG's:
   - ``event`` (``smg_cache_aware``; SMG with gRPC workers that stream KV events, as the live
     fleet's nodes do): each worker's overlap is the number of the prompt's leading 16-token
     blocks its KV cache holds, from the nodes' KV events (they reach the gateway one network
     delay after the step that stored or removed them). The affinity group is the workers with
     the highest positive overlap; no overlap is a *miss* (step 5 over all eligible). While the
     event index is still empty (startup) the approximate mode decides, as in SMG.
   - ``approximate`` (``smg_cache_aware_approx``; SMG without KV events): a radix tree of the
     prompts the gateway itself routed (per block of 16 tokens here; tenants = workers). The
     matched share of the prompt must exceed ``cache_threshold`` (0.3) to count as a hit; the
     affinity group is the workers holding the deepest matched prefix; the chosen worker's
     path is inserted (hit, spill or miss alike). Least-recently-used paths are evicted every
     ``eviction_interval_s`` (60 s) while the tree holds more than ``max_tree_size`` tokens
     (2^26; shared by all workers).
4. **Spill gate** (per request, on the affinity group): a worker *requires spill* when its
   in-flight count (requests this gateway sent it that have not ended) exceeds both
   ``balance_rel_threshold`` (1.5) times the eligible fleet's mean and the mean plus
   ``min(balance_abs_threshold, max(4, 2 sqrt(mean)))`` (64 at most; smg 1.13.0 caps the
   absolute margin at the in-flight count's natural swing). The non-spilling members of the
   affinity group go to step 5; when all spill, the eligible workers that do not spill do
   (*spill*; all eligible when none).
5. **Expected wait** (SMG's ``least_load``): the worker with the least
   ``(waiting_uncached_tokens + prompt tokens dispatched to it since its last load record) /
   gen_throughput + kv_pressure_weight_s x k / (1 - k)`` (k = KV usage, ``gen_throughput`` the
   reported generation tokens/s or ``default_throughput`` 2000 when it reports none; weight
   0.15 s); ties by fewer in flight, then at random.

Load records: SMG subscribes to every worker's KV-event stream, whose load records are checked
every 0.1 s and sent when they moved; here a worker's record is refreshed at most every
``load_tick_s`` (0.1 s) from the simulated node's own ``EngineLoad`` and admission ledger (the
figures a live node puts in the record) and the since-record credit restarts. Times are
simulated seconds, so a comparison with a live fleet slowed ``T`` times scales SMG's wall-clock
constants as the live gateway's flags do (``SmgConfig.for_time_scale``).

The gateway's own per-request time (HTTP/SSE, tokenizing the prompt) is one constant,
``front_end_s`` (0 unless set; ``smg_check --front-end-from`` measures it on a live run at low
load), added between the decision and the worker receiving the request. Not modelled: the
worker stall/wedge detectors (no node fails here), the hash under-layer
(``--cache-index hash``), overlap decay and selection temperature (both off by default).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gpumesh.node.engines.base import EngineLoad
from gpumesh.router.scheduling import NoCandidate

#: policy name -> affinity mode
POLICIES = {"smg_cache_aware": "event", "smg_cache_aware_approx": "approximate"}
BLOCK = 16


@dataclass(frozen=True)
class SmgConfig:
    """SMG 1.13.0's defaults (``smg launch --help``); seconds are simulated seconds."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    balance_token_usage_threshold: float = 1.0
    overload_token_usage_threshold: float = 1.0
    overload_waiting: int = 8
    overload_token_usage: float = 0.8
    kv_pressure_weight_s: float = 0.15
    default_throughput: float = 2000.0
    load_tick_s: float = 0.1
    eviction_interval_s: float = 60.0
    max_tree_size: int = 1 << 26
    # the gateway's own time per request before the worker has it (HTTP, tokenization,
    # routing; SMG's CPU, not modelled otherwise): 0 = none; a measured figure comes from
    # ``smg_check --front-end-from``
    front_end_s: float = 0.0

    def for_time_scale(self, time_scale: float) -> SmgConfig:
        """The constants of a gateway in front of a fleet slowed ``time_scale`` times, in
        simulated units: what the live benchmark passes (``smg_gateway.smg_scaled_flags``:
        the KV weight x T and the fallback throughput / T in wall units, i.e. the defaults in
        simulated ones) and SMG's own wall-clock pacing (load records every 0.1 s wall)."""
        return replace(self, load_tick_s=self.load_tick_s / time_scale,
                       eviction_interval_s=self.eviction_interval_s / time_scale,
                       front_end_s=self.front_end_s / time_scale)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load record, the fields SMG reads (``cpb.EngineLoad``)."""

    waiting_requests: int
    token_usage: float
    waiting_uncached_tokens: int
    gen_throughput: float


class _Tree:
    """The approximate prefix tree: block id (a chain hash: equal ids = equal prefixes) ->
    {worker: last use}, with each block's depth for leaf-first eviction."""

    def __init__(self) -> None:
        self.holders: dict[int, dict[str, float]] = {}
        self.depth: dict[int, int] = {}
        self.tokens = 0

    def match(self, blocks: Sequence[int], eligible: set[str]) -> tuple[int, list[str]]:
        """(matched blocks, the eligible workers holding the deepest matched block)."""
        best: tuple[int, list[str]] = (0, [])
        for i, b in enumerate(blocks):
            held = [w for w in self.holders.get(b, ()) if w in eligible]
            if not held:
                break
            best = (i + 1, held)
        return best

    def insert(self, blocks: Sequence[int], worker: str, now: float) -> None:
        for i, b in enumerate(blocks):
            h = self.holders.setdefault(b, {})
            if worker not in h:
                self.tokens += BLOCK
            h[worker] = now
            self.depth[b] = i

    def evict(self, max_tokens: int) -> None:
        if self.tokens <= max_tokens:
            return
        # least recently used first; deeper first among equal times (a path's blocks share
        # its time, and a worker's block is never evicted before its descendants)
        order = sorted(((t, -self.depth[b], b, w) for b, h in self.holders.items()
                        for w, t in h.items()))
        for _, _, b, w in order:
            if self.tokens <= max_tokens:
                break
            del self.holders[b][w]
            if not self.holders[b]:
                del self.holders[b]
                del self.depth[b]
            self.tokens -= BLOCK


class SmgCacheAware:
    """One SMG gateway's state and decisions (module docstring). ``load_of(worker, now)``
    returns the worker's current load record; the simulator calls :meth:`choose` per
    request, :meth:`finished` at each end and :meth:`kv_events` with each node's block
    events."""

    def __init__(self, mode: str, config: SmgConfig, rng: random.Random,
                 load_of: Callable[[str, float], WorkerLoad]) -> None:
        if mode not in ("event", "approximate"):
            raise ValueError(f"unknown SMG cache_aware mode {mode!r}")
        self.mode = mode
        self.config = config
        self.rng = rng
        self.load_of = load_of
        self.inflight: dict[str, int] = {}
        self._records: dict[str, tuple[float, WorkerLoad]] = {}
        self._credit: dict[str, int] = {}
        self.cached: dict[str, set[int]] = {}   # event index: worker -> block ids
        self.tree = _Tree()
        self._next_eviction = config.eviction_interval_s
        self.branches: dict[str, int] = {}

    # --- inputs ------------------------------------------------------------------------

    def kv_events(self, worker: str, ops: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        held = self.cached.setdefault(worker, set())
        for op, hashes in ops:
            if op == "stored":
                held.update(hashes)
            elif op == "removed":
                held.difference_update(hashes)
            else:
                held.clear()

    def finished(self, worker: str) -> None:
        self.inflight[worker] -= 1

    def _record(self, worker: str, now: float) -> WorkerLoad:
        rec = self._records.get(worker)
        if rec is None or now - rec[0] >= self.config.load_tick_s:
            rec = (now, self.load_of(worker, now))
            self._records[worker] = rec
            self._credit[worker] = 0
        return rec[1]

    # --- the decision ------------------------------------------------------------------

    def choose(self, workers: Sequence[str], prompt_tokens: int, blocks: Sequence[int],
               now: float) -> str:
        """The worker for one request among the healthy ``workers`` (non-empty); records the
        dispatch (in flight, since-record credit, approximate tree)."""
        c = self.config
        loads = {w: self._record(w, now) for w in workers}
        eligible = [w for w in workers if loads[w].waiting_requests < c.overload_waiting
                    and loads[w].token_usage < c.overload_token_usage] or list(workers)
        if now >= self._next_eviction:
            self.tree.evict(c.max_tree_size)
            self._next_eviction = now + c.eviction_interval_s
        usage = [loads[w].token_usage for w in eligible]
        if (max(usage) > c.overload_token_usage_threshold
                or max(usage) - min(usage) > c.balance_token_usage_threshold):
            return self._dispatch("kv_pressure", self._expected_wait(eligible, loads),
                                  prompt_tokens, blocks, now)
        if self.mode == "event" and any(self.cached.values()):
            group = self._overlap_group(eligible, blocks)
            kind = "event"
        else:
            matched, holders = self.tree.match(blocks, set(eligible))
            hit = prompt_tokens > 0 and matched * BLOCK / prompt_tokens > c.cache_threshold
            group = holders if hit else []
            kind = "tree"
        if not group:
            return self._dispatch(f"{kind}_miss", self._expected_wait(eligible, loads),
                                  prompt_tokens, blocks, now)
        mean = sum(self.inflight.get(w, 0) for w in eligible) / len(eligible)
        safe = [w for w in group if not self._spills(w, mean)]
        if safe:
            return self._dispatch(f"{kind}_hit", self._expected_wait(safe, loads),
                                  prompt_tokens, blocks, now)
        targets = [w for w in eligible if not self._spills(w, mean)] or eligible
        return self._dispatch(f"{kind}_spill", self._expected_wait(targets, loads),
                              prompt_tokens, blocks, now)

    def _overlap_group(self, eligible: Sequence[str], blocks: Sequence[int]) -> list[str]:
        best, group = 0, []
        for w in eligible:
            held = self.cached.get(w, ())
            n = 0
            for b in blocks:
                if b not in held:
                    break
                n += 1
            if n > best:
                best, group = n, [w]
            elif n == best and n:
                group.append(w)
        return group

    def _spills(self, worker: str, mean: float) -> bool:
        c = self.config
        load = self.inflight.get(worker, 0)
        margin = min(c.balance_abs_threshold, max(4.0, 2.0 * math.sqrt(mean)))
        return load > mean * c.balance_rel_threshold and load > mean + margin

    def _expected_wait(self, candidates: Sequence[str], loads: dict[str, WorkerLoad]) -> str:
        c = self.config
        best: list[str] = []
        best_key: tuple[float, int] | None = None
        for w in candidates:
            ld = loads[w]
            rate = ld.gen_throughput if ld.gen_throughput > 0 else c.default_throughput
            k = min(max(ld.token_usage, 0.0), 0.999)
            wait = ((ld.waiting_uncached_tokens + self._credit.get(w, 0)) / rate
                    + c.kv_pressure_weight_s * k / (1 - k))
            key = (wait, self.inflight.get(w, 0))
            if best_key is None or key < best_key:
                best_key, best = key, [w]
            elif key == best_key:
                best.append(w)
        return best[0] if len(best) == 1 else self.rng.choice(best)

    def _dispatch(self, branch: str, worker: str, prompt_tokens: int, blocks: Sequence[int],
                  now: float) -> str:
        self.branches[branch] = self.branches.get(branch, 0) + 1
        self.inflight[worker] = self.inflight.get(worker, 0) + 1
        self._credit[worker] = self._credit.get(worker, 0) + prompt_tokens
        if self.mode == "approximate" or not any(self.cached.values()):
            self.tree.insert(blocks, worker, now)
        return worker


# --- the simulator's hook: SMG gateways in the routers' place -----------------------------

def worker_load(load: EngineLoad, pending_prefill_tokens: int) -> WorkerLoad:
    """A simulated node's load record as its VllmEngine service sends it (a gateway's input):
    from its engine's load and its admission ledger's pending prefill tokens."""
    return WorkerLoad(load.num_waiting, load.kv_cache_usage, pending_prefill_tokens,
                      load.generation_tokens_per_s)


def gateways(policy: str, config: SmgConfig | None, seed: int, routers: int,
             load_of: Callable[[str, float], WorkerLoad]) -> list[SmgCacheAware] | None:
    """One gateway per router when ``policy`` is an SMG reference (``POLICIES``), each with
    its own seeded RNG and state (SMG replicas without their mesh); None for a router
    policy."""
    mode = POLICIES.get(policy)
    if mode is None:
        return None
    return [SmgCacheAware(mode, config or SmgConfig(), random.Random(seed * 104729 + i), load_of)
            for i in range(routers)]


def choose_present(gateway: SmgCacheAware, present: Sequence[str], prompt_tokens: int,
                   blocks: Sequence[int], now: float) -> str:
    """The gateway's choice among the nodes present; ``NoCandidate`` when none is (as the
    router's own decision raises)."""
    if not present:
        raise NoCandidate(False, {})
    return gateway.choose(present, prompt_tokens, blocks, now)
