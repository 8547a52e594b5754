"""A multi-tenant shared-prefix workload: many tenants, each with a long system prompt, and
multi-turn conversations whose history grows (the shape cache-aware routing is built for).

Each arrival (Poisson, ``rate`` per second) belongs to a tenant drawn uniformly; with
probability ``new_conversation_p`` (or when the tenant has none open) it starts a conversation,
else it continues one of the tenant's open conversations (drawn uniformly). A turn's prompt is
the tenant's system prompt, the conversation's earlier turns (each a user message and an
assistant reply of about ``turn_tokens`` tokens each) and a new user message: every turn's
prompt extends the previous one's, so it shares its whole prefix. A conversation ends after
``max_turns`` turns. ``routing_key`` is the conversation's id (session affinity keys on it).

``unique=True`` gives the control workload: the same lengths, every prompt distinct (no
shared prefix at all). Texts are plain words separated by spaces, so a prompt's token ids
are exactly its prefix's ids followed by those of the new text under the simulator's
tokenizer (and practically so under a BPE).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from gpumesh_bench.workload import _WORDS


@dataclass(frozen=True)
class TenantSpec:
    tenants: int = 64
    system_words: int = 4000        # about one simulator token per word
    turn_words: int = 60
    max_turns: int = 8
    new_conversation_p: float = 0.3
    max_tokens: int = 48
    rate: float = 1.0               # arrivals per second
    seed: int = 0
    unique: bool = False


@dataclass(frozen=True)
class TenantRequest:
    index: int
    arrival_s: float
    tenant: int
    conversation: str
    turn: int
    prompt: str
    max_tokens: int


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def iter_tenant_requests(spec: TenantSpec) -> Iterator[TenantRequest]:
    """The infinite deterministic request stream of ``spec``."""
    rng = random.Random(spec.seed)
    text_rng = random.Random(spec.seed ^ 0xC0FFEE)
    systems = [f"tenant {t} system. " + words(random.Random(t * 7919 + 1), spec.system_words)
               for t in range(spec.tenants)]
    open_convs: list[list[list[str]]] = [[] for _ in range(spec.tenants)]  # per tenant: turns
    ids: dict[int, str] = {}
    t = 0.0
    n_conv = 0
    i = 0
    while True:
        if i > 0:
            t += rng.expovariate(spec.rate)
        tenant = rng.randrange(spec.tenants)
        convs = open_convs[tenant]
        if not convs or rng.random() < spec.new_conversation_p:
            conv: list[str] = []
            convs.append(conv)
            ids[id(conv)] = f"t{tenant}-c{n_conv}"
            n_conv += 1
        else:
            conv = convs[rng.randrange(len(convs))]
        user = " user: " + words(text_rng, spec.turn_words)
        if spec.unique:
            prompt = (f"request {i}. " + words(text_rng, spec.system_words)
                      + "".join(conv) + user)
        else:
            prompt = systems[tenant] + "".join(conv) + user
        yield TenantRequest(i, t, tenant, ids[id(conv)], len(conv) // 2 + 1, prompt,
                            spec.max_tokens)
        conv.append(user)
        conv.append(" assistant: " + words(text_rng, spec.turn_words))
        if len(conv) // 2 >= spec.max_turns:
            convs.remove(conv)
            ids.pop(id(conv), None)
        i += 1


def trace(spec: TenantSpec, duration_s: float) -> list[TenantRequest]:
    """The requests arriving in the first ``duration_s`` seconds."""
    out = []
    for r in iter_tenant_requests(spec):
        if r.arrival_s >= duration_s:
            break
        out.append(r)
    return out
