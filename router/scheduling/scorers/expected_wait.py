"""The ``expected_wait`` scorer: seconds a new request would wait for prefill on a node.

For node n with a fresh report (age <= freshness window)::

    P    = pending_prefill_tokens from n's last heartbeat (all routers' prompt tokens queued
           or in prefill, as the node counted them)
    C    = prompt tokens of THIS router's requests to n that have not produced their first
           token and were not yet in that report (dispatch ordinal > the report's
           RouterAccount.admitted_requests for this router); U = how many requests that is.
           Each request counts what n will prefill of it: its prompt less the prefix n held
           when it was dispatched (``RequestInfo.cached_tokens``; router/fleet/locality.py
           ``prefill_tokens``, what the dispatch charges), so a node that holds a prefix
           neither queues nor allocates KV for that part; a node without it counts the
           whole prompt
    T    = max(n's prefill_capacity_tokens_per_s, n's prompt_tokens_per_s) when n reports a
           capacity (> 0) and ``prefill_from_capacity`` is on (the default, below); else
           max(n's prompt_tokens_per_s, reference_prompt_tokens_per_s)   (floor / fallback)
    S    = n's decode step time (``Candidate.step_s``, router/fleet/speed.py): the step n
           reports (decode_step_s, its engine's timed steps) or, from a node that reports
           none, its num_running averaged over reports / generation_tokens_per_s (each
           running request samples one token a step); an idle node keeps its last one; a
           node that never measured its own (nor its capacity) takes the model's latest
           measured step x weight / its weight (capacity / weight x its weight)
           (``ModelSpeeds.fill``); 0 = none measured for the model yet
    K    = n's reported kv_capacity_tokens (0 = unknown)
    k    = min(kv_cache_usage + f * (C + U * kv_output_allowance_tokens) / K, kv_usage_cap)
           (the KV the router's own unreported requests will take; without K, k is the
           reported kv_cache_usage alone)
    D    = this router's change to n's requests since that report, whatever their phase:
           its requests in flight now minus those the report held
           (``CreditLedger.decode_delta``). The report holds RouterAccount.admitted_requests -
           finished_requests of them, the node's own count, so a finish that reached the
           node before the report and the router after it is not subtracted twice (nor
           counted as in flight while its end is on the way: that part is capped at 0); a node
           that does not send finished_requests is taken to hold every in-flight request up
           to its admission cutoff (a finish seen later counts as one since the report).
           Lookaside requests (finish unseen) count while their credit is held and not
           reported
    f    = all routers' dispatches per one of this router's (``PeerShare.factor``, from every
           router's admission counts in the reports; 1 for a router alone)
    R    = max(num_running from the report + f * D, 0)
    with T the reported capacity and S measured (every term in n's own seconds; w divides
    only the KV term, whose constant is per unit of weight):
    wait = (P + f * C) / T  +  kv_penalty_s * k / (1 - k) / w  +  decode_steps_per_request * S * R
    with T the reported capacity, S not measured (no node of the model measured one yet):
    wait = (P + f * C) / T  +  (kv_penalty_s * k / (1 - k)  +  decode_s_per_request * R) / w
    with T the floor (no capacity reported: foreign nodes, a vLLM node before its first
    prefill; or ``prefill_from_capacity`` off), the constants throughout:
    wait = ((P + f * C) / T  +  kv_penalty_s * k / (1 - k)  +  decode_s_per_request * R) / w

Why T is the capacity, not the floor: the prompt rate a node reports is throughput (what
arrived and was prefilled), so on a GPU it sits far below what the node could prefill and the
floor decides T. With short prompts a dispatch then costs more estimated wait than a finish
gives back, and when identical requests finish in waves the router sends most of a wave to
the node that just freed slots (docs/benchmarks.md). The reported capacity (a simulated
node's step model; a vLLM node's measured lower bound) is what T stands for, so it replaces
the floor outright, upwards and downwards: a node that measured a slow prefill should look
slow even if the floor is higher, and the floor, a guess for nodes that report nothing,
should not shrink a fast node's queue either. Taking the larger with the observed rate only
guards a capacity estimate that lags the node's own throughput (a vLLM node measures a lower
bound). A measured capacity already holds the node's speed, which w also declares, so w does
not divide that term again (a speed-2 node's prefill queue would otherwise count a quarter,
not a half).

Why the decode term is in steps of the node's own measured speed: with T a capacity the
prefill term is in the node's real seconds, while a constant decode_s_per_request (seconds a
running request per unit of weight, tuned against the floor-sized prefill term) weighs a
running request against a queued prompt token by a ratio that depends on the deployment,
not on the node. In steps of S both terms scale with the node, so their ratio is the same on
every deployment and time scale, and the node's measured speed replaces its declared weight
in that term too. ``decode_steps_per_request`` = 1: a running request costs one of the
node's steps. It is a load proxy, not a physical delay (below a node's running ceiling a
running request adds far less than a step to a new one's first token; at the ceiling a new
request waits for a finish), sized like the constant it replaces on the fleet that constant
was tuned on; smaller fractions and 1 / G per request balanced worse (docs/benchmarks.md).
Why S averages the running count: the rate is a few seconds' average, the count is the
report's instant, and at a few running requests their ratio swings several-fold around the
true step. 0 = the constant; ``prefill_from_capacity`` off = the floor and the constants.

Why D and f, not U alone: a request is in the report's running count only from the next
report on, so if R counted it only while its credit is pending (U), a node not at its
running ceiling would look unchanged once each request's first token came back, and every
request between two reports would go to it; and with several routers (``--workers``) each
one sees only its own dispatches between reports, so all of them chase the node the last
report showed lighter (docs/benchmarks.md).

w is n's declared capacity weight (a TP=2 node or faster GPU declares more). Every term
moves with this router's own dispatches between heartbeats (C and U grow at each one), so when
KV is the binding resource successive picks spread instead of all going to the node that
reported the lowest k; the next report folds those requests into P (and into
kv_cache_usage once the node has scheduled them) as it drops them from C / U, so a heartbeat
does not make a node look suddenly idle. (Not modelled: a request admitted but still waiting
for KV holds none yet, so k dips by its share until it is scheduled; P still counts it.)
kv_output_allowance_tokens is a guess of the output's KV per request (default 128 tokens).
For a STALE node (report older than the window, or none yet) only the router's own counts
are used::

    wait = (C_all / reference_prompt_tokens_per_s + decode_s_per_request * in_flight) / w

with C_all = all of this router's pre-first-token prompt tokens on n and in_flight = all of
this router's requests on n. Credits (C) are released one by one: at each request's first
token in proxy mode, by the node's per-router first-token count (or a time bound) in lookaside
mode, never wholesale at a heartbeat, so a report never makes a node look suddenly idle.

The request's own service time (``expected_service_s``): the profile adds, with weight
``service_weight``, what THIS request itself will take on n once it runs, so that the
estimate is its expected end-to-end time there, not only its wait for the first token::

    service = prompt_tokens / T  +  min(output_tokens, output_tokens_cap) * S
    (S not measured: decode_s_per_request / w per output token; STALE or no capacity
     reported: (prompt_tokens / reference_prompt_tokens_per_s
                + min(output_tokens, output_tokens_cap) * decode_s_per_request) / w)

with ``output_tokens`` the request's max_tokens (0 = unknown: no output term), and
``prompt_tokens`` less the prefix of it that n already holds in its KV cache
(``RequestInfo.cached_tokens``: router/fleet/locality.py, from n's KV events or the router's
record of what it sent n): n prefills only the rest, so a node holding a long shared prefix
saves that prefill in this one number, against its queue, with no separate cache-aware mode;
a node without the prefix pays the whole prompt (with service_weight 0 there is no locality
either). Why the service term at all: the wait
alone is the same for a short and a long generation, so a long generation goes wherever the
queue is shortest, often a slow node that just emptied, and decodes there at that node's
step for its whole length; on a fleet of mixed speeds its end-to-end time is then far above
what a fast node with a slightly longer queue would give (docs/routing.md). The output term
is its length in that node's own steps, so a slow node costs it more in proportion, and on
a fleet of equal nodes it is about the same everywhere and changes little.

By default (``service_step_from_weight``) S in the output term is the node's declared speed,
decode_s_per_request / w per token, not its measured step, which grows with its batch and
lags by its averaging window; multiplied by hundreds of tokens it swung the choice between
equal nodes with their recent load. The output term weighs ``output_weight`` (0.6) of the
whole; the prompt's prefill, part of the first token's wait, keeps weight 1.

The admission wait (``expected_admission_s``, weighted by ``admission_weight``): a node whose
last report had requests waiting (batch or KV full) starts a new one only as running ones
finish. With out = min(output_tokens, output_tokens_cap) (kv_output_allowance_tokens when
unknown) a running request frees its slot after about out steps, so one frees every
out * S / num_running seconds, and the request waits for those still waiting, this router's
unreported ones and itself::

    admission = (Wn + f * U + 1) * out * S / max(num_running, 1)
    Wn = min(num_waiting, f * (this router's pre-first-token requests that were in the report))

Wn drains as the reported waiting requests get their first tokens, so a report does not keep
a node looking blocked until the next one; 0 when the report had none waiting.

The price of a prefix miss (``expected_miss_s``, weighted by ``miss_weight``): a node that
lacks part of the longest prefix of the prompt some node holds (``best``, the largest of
``RequestInfo.cached_tokens``, at most the prompt) would prefill that part inside its running
batch, delaying every request there, and copy into its KV a prefix another node holds::

    miss = (best - min(cached_n, best)) / T * (1 + R)

with T and R as in the wait (T the floor over w where no capacity is reported; for a STALE
node the floor over w and this router's in-flight count for R). 0 on the nodes holding the
longest prefix, and everywhere when no node holds any prefix of the request.

The curve: ``wait_score`` = 1 / (1 + wait / wait_scale_s): 1 at zero wait, 0.5 at
wait_scale_s, falling towards 0 hyperbolically (monotone, so the max picks the least wait).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gpumesh.router.scheduling.types import Candidate, RequestInfo


@dataclass(frozen=True)
class WaitModel:
    """Parameters of the expected-wait estimate (from ``RouterConfig``)."""

    reference_prompt_tokens_per_s: float = 8000.0
    kv_penalty_s: float = 0.2
    kv_usage_cap: float = 0.98
    decode_s_per_request: float = 0.002
    wait_scale_s: float = 0.5
    kv_output_allowance_tokens: float = 512.0  # KV tokens per unreported request's output
    # T from the node's reported prefill capacity (RouterConfig.prefill_from_capacity)
    prefill_from_capacity: bool = True
    # With it, a running request costs this many of the node's measured decode steps
    # (Candidate.step_s) instead of decode_s_per_request / w; 0 = keep the constant.
    decode_steps_per_request: float = 1.0
    # Weight of the request's own expected service time (``expected_service_s``) added to
    # the wait by the weighted_least_load profile; 0 = the wait alone.
    service_weight: float = 1.0
    # Output tokens counted at most per request in that service time (max_tokens above it
    # is taken as an upper bound the request will not reach).
    output_tokens_cap: int = 1024
    # Weight of the admission wait (``expected_admission_s``): the slots a full node must
    # free before this request starts; 0 = none.
    admission_weight: float = 2.0
    # The output term of the service time at decode_s_per_request / w per token (the node's
    # declared speed) instead of its measured, load-dependent step S.
    service_step_from_weight: bool = True
    # Weight of the output term within the service time (the prompt's prefill is part of the
    # first token's wait and keeps weight 1); 1 = the request's whole expected time.
    output_weight: float = 0.6
    # Weight of the prefix-miss price (``expected_miss_s``): the prefill a node would redo of
    # a prefix another node holds, times the requests it stalls there; 0 = none.
    miss_weight: float = 1.0

    @classmethod
    def from_config(cls, config: object) -> WaitModel:
        """The model from a ``RouterConfig`` (its fields of the same names)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


def _running(c: Candidate, reported: float) -> float:
    """R: the ``reported`` running requests plus all routers' change since (f x D)."""
    delta = c.unreported_requests if c.decode_delta is None else c.decode_delta
    return max(reported + max(c.peer_factor, 1.0) * delta, 0.0)


def expected_wait_s(c: Candidate, m: WaitModel) -> float:
    """Seconds a new request is expected to wait for prefill on ``c`` (formula above)."""
    weight = c.capacity_weight if c.capacity_weight > 0 else 1.0
    r = c.report
    if r is None:
        wait = (c.outstanding_prompt_tokens / m.reference_prompt_tokens_per_s
                + m.decode_s_per_request * c.router_in_flight)
        return wait / weight
    k = min(max(effective_kv_usage(c, m), 0.0), m.kv_usage_cap)
    f = max(c.peer_factor, 1.0)
    running = _running(c, r.num_running)
    queued = r.pending_prefill_tokens + f * c.unreported_prompt_tokens
    kv = m.kv_penalty_s * k / (1.0 - k)
    if m.prefill_from_capacity and r.prefill_capacity_tokens_per_s > 0:
        # T = the node's capacity and (when measured) the decode step its own: both hold the
        # node's speed already, so w divides only the KV term (and a constant decode term).
        tps = max(r.prefill_capacity_tokens_per_s, r.prompt_tokens_per_s)
        if c.step_s > 0 and m.decode_steps_per_request > 0:
            return queued / tps + kv / weight + m.decode_steps_per_request * c.step_s * running
        return queued / tps + (kv + m.decode_s_per_request * running) / weight
    tps = max(r.prompt_tokens_per_s, m.reference_prompt_tokens_per_s)
    return (queued / tps + kv + m.decode_s_per_request * running) / weight


def expected_service_s(c: Candidate, m: WaitModel, request: RequestInfo) -> float:
    """Seconds ``request`` itself takes on ``c`` once it runs: its prompt's prefill and its
    output's decode steps at the node's speed (``service`` above; 0 for an empty request)."""
    weight = c.capacity_weight if c.capacity_weight > 0 else 1.0
    out = min(max(request.output_tokens, 0), m.output_tokens_cap) * m.output_weight
    # prefix locality: only the prompt tokens the node does not hold in its KV cache
    prompt = max(request.prompt_tokens - request.cached_tokens.get(c.node_id, 0), 0)
    r = c.report
    if r is not None and m.prefill_from_capacity and r.prefill_capacity_tokens_per_s > 0:
        tps = max(r.prefill_capacity_tokens_per_s, r.prompt_tokens_per_s)
        if c.step_s > 0 and not m.service_step_from_weight:
            return prompt / tps + out * c.step_s
        return prompt / tps + out * m.decode_s_per_request / weight
    return (prompt / m.reference_prompt_tokens_per_s + out * m.decode_s_per_request) / weight


def expected_miss_s(c: Candidate, m: WaitModel, request: RequestInfo) -> float:
    """The price of a prefix miss on ``c`` (``miss`` above): the prefill of the part of the
    longest prefix some node holds that ``c`` does not, times (1 + the requests running on
    ``c``); 0 when no node holds a prefix of the request, and on the nodes holding the
    longest one."""
    best = request.best_cached_tokens
    missing = best - min(request.cached_tokens.get(c.node_id, 0), best)
    if missing <= 0:
        return 0.0
    weight = c.capacity_weight if c.capacity_weight > 0 else 1.0
    r = c.report
    if r is None:
        return missing / m.reference_prompt_tokens_per_s / weight * (1 + c.router_in_flight)
    running = _running(c, r.num_running)
    if m.prefill_from_capacity and r.prefill_capacity_tokens_per_s > 0:
        prefill = missing / max(r.prefill_capacity_tokens_per_s, r.prompt_tokens_per_s)
    else:
        prefill = missing / max(r.prompt_tokens_per_s, m.reference_prompt_tokens_per_s) / weight
    return prefill * (1.0 + running)


def expected_admission_s(c: Candidate, m: WaitModel, request: RequestInfo) -> float:
    """Seconds ``request`` waits on ``c`` for a running slot (``admission`` above): 0 unless
    the node's last report had requests waiting to be admitted."""
    r = c.report
    if r is None or r.num_waiting <= 0:
        return 0.0
    f = max(c.peer_factor, 1.0)
    # of the reported waiting, those still before their first token (this router's reported
    # pre-first-token requests, scaled to all routers): the queue drains as they start
    still = min(float(r.num_waiting), f * max(c.outstanding_requests - c.unreported_requests, 0))
    if still <= 0:
        return 0.0
    ahead = still + f * c.unreported_requests + 1
    running = max(r.num_running, 1)
    out = min(max(request.output_tokens, 0), m.output_tokens_cap)
    if out <= 0:
        out = m.kv_output_allowance_tokens
    weight = c.capacity_weight if c.capacity_weight > 0 else 1.0
    step = c.step_s if c.step_s > 0 else m.decode_s_per_request / weight
    return ahead * out * step / running


def effective_kv_usage(c: Candidate, m: WaitModel) -> float:
    """The reported KV usage moved by this router's unreported requests (``k`` above, before
    the cap): kv_cache_usage + (C + U * kv_output_allowance_tokens) / K when the node reports
    its capacity K; the reported usage alone otherwise, or when the report is not fresh."""
    r = c.report
    if r is None:
        return c.kv_cache_usage
    if r.kv_capacity_tokens <= 0:
        return r.kv_cache_usage
    return r.kv_cache_usage + (max(c.peer_factor, 1.0)
                               * (c.unreported_prompt_tokens
                                  + m.kv_output_allowance_tokens * c.unreported_requests)
                               / r.kv_capacity_tokens)


def wait_score(wait_s: float, m: WaitModel) -> float:
    """1 / (1 + wait / wait_scale_s): 1 at 0 s, 0.5 at wait_scale_s, -> 0 as wait grows."""
    return 1.0 / (1.0 + max(wait_s, 0.0) / m.wait_scale_s)
