"""The simulator's workloads: what arrives when, how long it is, and what happens to the fleet.

A workload is a list of :class:`Arrival` (sorted by time) plus a list of :class:`FleetEvent`
(nodes joining, leaving, slowing), both from a seed, so a (workload, seed, rate) triple is one
exact run. Rates are requests per simulated second; a named workload is built for a target
mean rate, so the grid sets load as a fraction of a fleet's measured capacity.

Named workloads (``WORKLOADS``; lengths are ``gpumesh_bench.workload.LengthDist`` specs):

- ``lognormal``, ``bimodal``: the policy comparison's chat-like and chat + documents mixes
  (``gpumesh_bench.compare.WORKLOADS``), Poisson arrivals.
- ``long-output``: short prompts, long generations (decode-bound).
- ``long-prompt``: long prompts, short outputs (prefill-bound).
- ``mixed``: a three-way mix of chat, long-output and long-prompt requests.
- ``bursty``: the lognormal lengths with on/off arrivals (a two-state MMPP: bursts at 3x
  the mean rate for 1 s, then 0.2x for 2.5 s, alternating; the mean is the target rate).
- ``ramp``: the lognormal lengths, the rate rising linearly from 20 % to 180 % of the target
  (mean = the target).
- ``join-leave``: lognormal; two nodes leave at 30 % of the run and rejoin at 70 %.
- ``slowdown``: lognormal; the first fast (or first) node runs at a quarter of its speed from
  40 % of the run on.
- ``prompt-N`` (any N >= 1, e.g. ``prompt-8192``): prompts of about N tokens (lognormal,
  median N, sigma 0.25, at most 1.5 N) and outputs lognormal, median 128, sigma 0.5, at most
  512; Poisson arrivals (the disaggregation table's workloads, ``pdtable``).
- ``conversations``: multi-tenant multi-turn chats with shared prefixes: each tenant has a
  system prompt (its own blocks), each conversation grows turn by turn, and every prompt
  carries its token-block structure (``Arrival.blocks``: block ids, equal ids = equal
  16-token blocks, a chain) so a prefix cache can reuse it.

``load_trace`` reads a JSONL trace (``gpumesh_bench.workload.load_trace`` format, plus an
optional ``blocks`` list per record) for replay.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from gpumesh_bench.workload import LengthDist

BLOCK = 16  # tokens per KV block (the engines' kv_block_size)


@dataclass(frozen=True)
class Arrival:
    """One request: arrival (simulated seconds from the start), prompt and output lengths
    (tokens; the output is max_tokens, always generated in full), and optionally the prompt's
    full-block structure (``blocks``: one id per full 16-token block; equal ids = equal
    content with equal content before it); ``routing_key`` the request's session key (a
    live request's ``GenerateRequest.routing_key``; "" = none)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()
    routing_key: str = ""


@dataclass(frozen=True)
class FleetEvent:
    """At ``at_s``: ``kind`` "leave" (the node deregisters and finishes what it holds),
    "join" (it registers again) or "speed" (its GPU speed becomes ``value``)."""

    at_s: float
    kind: str
    node_id: str
    value: float = 0.0


@dataclass(frozen=True)
class Workload:
    name: str
    arrivals: list[Arrival]
    events: list[FleetEvent]


LENGTHS: dict[str, tuple[str, str]] = {
    "lognormal": ("lognormal:256:1.0:3072", "lognormal:48:0.8:384"),
    "bimodal": ("bimodal:128:3072:0.15", "bimodal:48:128:0.15"),
    "long-output": ("lognormal:64:0.5:512", "lognormal:384:0.4:1536"),
    "long-prompt": ("lognormal:1536:0.4:3500", "lognormal:16:0.5:64"),
}
MIXED = (("lognormal", 0.6), ("long-output", 0.2), ("long-prompt", 0.2))
WORKLOADS = ("lognormal", "bimodal", "long-output", "long-prompt", "mixed", "bursty", "ramp",
             "join-leave", "slowdown", "conversations")


def prompt_lengths(name: str) -> tuple[str, str] | None:
    """The length specs of a ``prompt-N`` workload (module docstring); None for another
    name. ValueError for a malformed N."""
    if not name.startswith("prompt-"):
        return None
    try:
        n = int(name[len("prompt-"):])
    except ValueError as e:
        raise ValueError(f"workload {name!r}: prompt-N wants a whole number N") from e
    if n < 1:
        raise ValueError(f"workload {name!r}: N must be >= 1")
    return f"lognormal:{n}:0.25:{max(1, int(1.5 * n))}", "lognormal:128:0.5:512"


def check_name(name: str) -> str:
    """``name`` when it is a named workload or ``prompt-N``; else ValueError listing them."""
    if name in WORKLOADS or prompt_lengths(name) is not None:
        return name
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}, prompt-N")


def _lengths(name: str, rng: random.Random) -> tuple[int, int]:
    if name == "mixed":
        u = rng.random()
        for sub, p in MIXED:
            if u < p:
                return _lengths(sub, rng)
            u -= p
        return _lengths(MIXED[-1][0], rng)
    p, o = (LengthDist.parse(x) for x in (LENGTHS.get(name) or prompt_lengths(name) or ()))
    u = rng.random()
    return p.sample(rng, u), o.sample(rng, u)


def _poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _onoff_times(n: int, rate: float, rng: random.Random, on_s: float = 1.0,
                 high: float = 3.0, low: float = 0.2) -> list[float]:
    """Two-state MMPP: ``high`` x rate for ``on_s``, then ``low`` x rate for the off period
    that keeps the mean at ``rate`` (``on_s * (high - 1) / (1 - low)``), alternating."""
    periods = (on_s, on_s * (high - 1) / (1 - low))
    rates = (rate * high, rate * low)
    t, out, state, until = 0.0, [], 0, periods[0]
    while len(out) < n:
        gap = rng.expovariate(rates[state])
        if t + gap > until:   # memoryless: restart the draw at the switch
            t, state = until, 1 - state
            until += periods[state]
            continue
        t += gap
        out.append(t)
    return out


def _ramp_times(n: int, rate: float, rng: random.Random, lo: float = 0.2,
                hi: float = 1.8) -> list[float]:
    """Rate rising linearly from lo x rate to hi x rate over the run (mean = rate): the
    cumulative arrivals Λ(t) are inverted for unit-rate Poisson points."""
    duration = n / rate
    a, b = lo * rate, (hi - lo) * rate / duration   # λ(t) = a + b t
    out, s = [], 0.0
    for _ in range(n):
        s += rng.expovariate(1.0)
        out.append((-a + math.sqrt(a * a + 2 * b * s)) / b)
    return out


def _conversations(n: int, rate: float, rng: random.Random) -> list[Arrival]:
    """Tenants x conversations x turns; prompts grow by each turn's user text and answer."""
    tenants = 8
    sys_len = [rng.choice((256, 512, 1024)) for _ in range(tenants)]
    next_id = iter(range(1, 1 << 62))
    tenant_blocks = [tuple(next(next_id) for _ in range(s // BLOCK)) for s in sys_len]
    times = _poisson_times(n, rate, rng)
    live: list[dict[str, object]] = []
    out: list[Arrival] = []
    for i, t in enumerate(times):
        if not live or len(live) < 64 and rng.random() < 0.3:
            k = rng.randrange(tenants)
            live.append({"tenant": k, "tokens": sys_len[k], "blocks": list(tenant_blocks[k]),
                         "turns": rng.randint(2, 8)})
        conv = live[rng.randrange(len(live))]
        user = max(8, round(rng.lognormvariate(math.log(64), 0.6)))
        answer = max(1, round(rng.lognormvariate(math.log(96), 0.6)))
        prompt = int(conv["tokens"]) + user   # type: ignore[call-overload]
        blocks: list[int] = conv["blocks"]   # type: ignore[assignment]
        while len(blocks) < prompt // BLOCK:
            blocks.append(next(next_id))
        out.append(Arrival(i, t, prompt, answer, tuple(blocks[:prompt // BLOCK])))
        conv["tokens"] = prompt + answer
        conv["turns"] = int(conv["turns"]) - 1   # type: ignore[call-overload]
        if int(conv["turns"]) <= 0:   # type: ignore[call-overload]
            live.remove(conv)
    return out


def build(name: str, n: int, rate: float, seed: int, node_ids: list[str],
          fast_node: str = "") -> Workload:
    """``n`` requests of workload ``name`` at a mean of ``rate`` req/s from ``seed``.
    ``node_ids`` (the fleet's, in order) and ``fast_node`` pick the nodes fleet events touch."""
    if rate <= 0 or n < 1:
        raise ValueError("a workload needs rate > 0 and n >= 1")
    rng = random.Random(seed)
    gaps = random.Random(seed ^ 0x5EED)
    events: list[FleetEvent] = []
    if name == "conversations":
        return Workload(name, _conversations(n, rate, rng), events)
    if name == "bursty":
        times = _onoff_times(n, rate, gaps)
    elif name == "ramp":
        times = _ramp_times(n, rate, gaps)
    elif (name in LENGTHS or name in ("mixed", "join-leave", "slowdown")
          or prompt_lengths(name) is not None):
        times = _poisson_times(n, rate, gaps)
    else:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    lengths = "lognormal" if name in ("bursty", "ramp", "join-leave", "slowdown") else name
    arrivals = [Arrival(i, t, *_lengths(lengths, rng)) for i, t in enumerate(times)]
    span = times[-1]
    if name == "join-leave":
        for nid in node_ids[:2]:
            events += [FleetEvent(0.3 * span, "leave", nid), FleetEvent(0.7 * span, "join", nid)]
    elif name == "slowdown":
        events.append(FleetEvent(0.4 * span, "speed", fast_node or node_ids[0], 0.25))
    return Workload(name, arrivals, events)


def load_trace(path: str | Path, rate: float = 0.0) -> Workload:
    """A JSONL trace as a workload: ``{"arrival_s", "prompt_tokens", "max_tokens"}`` per line
    (``t`` for ``arrival_s``; ``prompt`` text counts 4 characters a token; optional
    ``blocks``: block ids). ``rate`` > 0 rescales the arrivals to that mean rate."""
    recs: list[tuple[float, int, int, tuple[int, ...]]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                r = json.loads(line)
                n = (int(r["prompt_tokens"]) if "prompt_tokens" in r
                     else max(1, len(str(r["prompt"])) // 4))
                out = int(r["max_tokens"])
                t = float(r.get("arrival_s", r.get("t", 0.0)))
                if n < 1 or out < 1 or not math.isfinite(t) or t < 0:
                    raise ValueError("lengths must be >= 1 and arrival_s finite, >= 0")
                recs.append((t, n, out, tuple(int(b) for b in r.get("blocks", ()))))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace record ({exc})") from exc
    if not recs:
        raise ValueError(f"{path}: empty trace")
    recs.sort(key=lambda r: r[0])
    t0 = recs[0][0]
    w = Workload(Path(path).stem, [Arrival(i, t - t0, n, o, b)
                                   for i, (t, n, o, b) in enumerate(recs)], [])
    return rescale(w, rate) if rate > 0 else w


def head(w: Workload, n: int | None) -> Workload:
    """The first ``n`` arrivals of ``w`` (all of them when ``n`` is None or larger)."""
    if n is None or n >= len(w.arrivals):
        return w
    if n < 1:
        raise ValueError("a run needs at least 1 request")
    return Workload(w.name, w.arrivals[:n], list(w.events))


def rescale(w: Workload, rate: float) -> Workload:
    """``w`` with its arrival times stretched to a mean of ``rate`` requests per second (the
    order and relative gaps kept); unchanged when all arrivals share one time."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError("rate must be finite and > 0")
    t0 = w.arrivals[0].arrival_s
    span = w.arrivals[-1].arrival_s - t0
    if span <= 0:
        return w
    scale = (len(w.arrivals) - 1) / rate / span
    return Workload(w.name, [Arrival(a.index, (a.arrival_s - t0) * scale, a.prompt_tokens,
                                     a.output_tokens, a.blocks, a.routing_key)
                             for a in w.arrivals], list(w.events))


def mean_rate(w: Workload) -> float:
    span = w.arrivals[-1].arrival_s - w.arrivals[0].arrival_s
    return (len(w.arrivals) - 1) / span if span > 0 else math.inf
