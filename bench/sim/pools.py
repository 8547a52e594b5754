"""Prefill and decode pools in the simulator: the KV link, the choice of a request's prefill
and decode nodes, and the rule that says when disaggregating a request pays (pure functions
over snapshots; the simulator's own rule, not the router's).

A disaggregated request runs its prompt on a *prefill* node (output 1 token, its KV kept),
then its KV moves to a *decode* node over the link, which decodes it without a prefill
(``node.engines.sim.transfer``). ``disagg.PdFlow`` drives that; this module decides:

- **Transfer time** (:meth:`KvLink.transfer_s`): ``latency_s`` + prompt tokens x KV bytes per
  token (the engine profile's ``kv.bytes_per_token``) / ``bandwidth_bytes_per_s``. The
  default link, 25 GB/s and 1 ms, is a 200 Gb/s RDMA NIC per GPU (InfiniBand HDR or 200 GbE,
  about a PCIe Gen4 x16 slot); 100 GbE is 12.5 GB/s; NVLink within one host is over ten
  times faster than either.
- **Prefill node** (:func:`choose_prefill`): the prefill node whose queued prompt tokens and
  this prompt would be done first (backlog seconds + this prefill's seconds), then the fewest
  requests, then node id.
- **Decode node** (:func:`choose_decode`): among the decode nodes whose free KV holds the
  prompt and its output, the least predicted decode load: the decode step it would run with
  this request added (the step model's ``a + b x requests``), then the least backlog, then
  node id. No node with room: the same order over all of them, ``room`` False.
- **When it pays** (:func:`pays`): the prompt's uncached tokens are at least
  ``min_prompt_tokens``; a decode node has room; the transfer is shorter than prefilling on
  the decode node; and the time to first token it would lose against serving the request
  whole on the chosen decode node is less than ``stall_weight`` x the time that local prefill
  would stall each request decoding there (``decode.requests`` x its prefill seconds): one
  cost in seconds, summed over the requests it touches. An idle decode node (nothing to
  stall) therefore serves whole whenever that is faster. An infinite ``stall_weight``
  disaggregates every long enough prompt that has room (the transfer check aside).

``PoolNode`` is what the simulator's router sees of a node: built from the router's own
``Candidate`` (its last load report and this router's unreported dispatches,
:func:`pool_node`) and the node's engine profile (its step model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpumesh.router.scheduling.types import Candidate

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class KvLink:
    """The link a prompt's KV crosses from a prefill node to a decode node. Each node sends
    or receives one transfer at a time (a transfer starts when both ends are free)."""

    bandwidth_bytes_per_s: float = 25e9
    latency_s: float = 0.001

    def __post_init__(self) -> None:
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError("link bandwidth must be finite and > 0")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError("link latency must be finite and >= 0")

    def transfer_s(self, tokens: int, bytes_per_token: int) -> float:
        """Seconds to move ``tokens`` tokens of KV at ``bytes_per_token`` bytes each."""
        if tokens < 0 or bytes_per_token < 0:
            raise ValueError("tokens and bytes_per_token must be >= 0")
        return self.latency_s + tokens * bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class PdRule:
    """The settings of :func:`pays` (module docstring)."""

    min_prompt_tokens: int = 256
    stall_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 0 or not self.stall_weight >= 0:
            raise ValueError("min_prompt_tokens and stall_weight must be >= 0")


@dataclass(frozen=True)
class PoolNode:
    """One node as the pool choice sees it: its role, the prompt tokens queued on it (its
    last report's pending prefill plus this router's dispatches since), its prefill rate
    (tokens/s of a full-budget step), the requests it holds or has on their way, its free KV
    (tokens) and its decode step model (seconds: ``step_a_s + step_b_s x requests``)."""

    node_id: str
    role: str
    backlog_tokens: int
    prefill_tokens_per_s: float
    requests: int
    kv_free_tokens: int
    step_a_s: float
    step_b_s: float

    @property
    def backlog_s(self) -> float:
        return self.backlog_tokens / self.prefill_tokens_per_s

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def decode_step_s(self, requests: int) -> float:
        return self.step_a_s + self.step_b_s * requests


def choose_prefill(nodes: Sequence[PoolNode], prompt_tokens: int) -> PoolNode | None:
    """The prefill node that would finish this prompt first (module docstring); None when
    there is no prefill node."""
    pool = [n for n in nodes if n.role == "prefill"]
    if not pool:
        return None
    return min(pool, key=lambda n: (n.backlog_s + n.prefill_s(prompt_tokens), n.requests,
                                    n.node_id))


def choose_decode(nodes: Sequence[PoolNode], need_tokens: int) -> tuple[PoolNode | None, bool]:
    """(decode node, it has KV room for ``need_tokens``): the least predicted decode load
    among those with room, else among all (module docstring); (None, False) without decode
    nodes."""
    pool = [n for n in nodes if n.role == "decode"]
    room = [n for n in pool if n.kv_free_tokens >= need_tokens]
    among = room or pool
    if not among:
        return None, False
    best = min(among, key=lambda n: (n.decode_step_s(n.requests + 1), n.backlog_s, n.node_id))
    return best, bool(room)


def pays(uncached_tokens: int, prefill: PoolNode, decode: PoolNode, room: bool,
         transfer_s: float, hop_s: float, rule: PdRule) -> tuple[bool, str]:
    """Whether to disaggregate this request on (``prefill``, ``decode``) rather than serve it
    whole on ``decode`` (module docstring), and why. ``hop_s``: the extra message delay the
    second leg costs (prefill node -> router -> decode node)."""
    if uncached_tokens < rule.min_prompt_tokens:
        return False, "short prompt"
    if not room:
        return False, "no decode room"
    if rule.stall_weight == math.inf:
        return True, "disaggregated"
    local_prefill = decode.prefill_s(uncached_tokens)
    if transfer_s >= local_prefill:
        return False, "transfer slower than prefill"
    split_ttft = prefill.backlog_s + prefill.prefill_s(uncached_tokens) + transfer_s + hop_s
    local_ttft = decode.backlog_s + local_prefill
    stall = decode.requests * local_prefill
    if split_ttft - local_ttft > rule.stall_weight * stall:
        return False, "prefill pool too slow" if decode.requests else "whole is faster"
    return True, "disaggregated"


def pool_node(c: Candidate, role: str, step_a_s: float, step_b_s: float,
              fallback_prefill_tokens_per_s: float) -> PoolNode:
    """A router's ``Candidate`` as a ``PoolNode``: with a fresh report, its pending prefill,
    running + waiting requests and free KV plus this router's dispatches since; without one,
    this router's own counts (KV then unknown: taken as free)."""
    r = c.report
    if r is None:
        return PoolNode(c.node_id, role, c.outstanding_prompt_tokens,
                        fallback_prefill_tokens_per_s, c.router_in_flight, 1 << 62,
                        step_a_s, step_b_s)
    delta = c.decode_delta if c.decode_delta is not None else c.unreported_requests
    free = int(r.kv_capacity_tokens * (1.0 - r.kv_cache_usage)) if r.kv_capacity_tokens \
        else 1 << 62
    rate = r.prefill_capacity_tokens_per_s or fallback_prefill_tokens_per_s
    return PoolNode(c.node_id, role, r.pending_prefill_tokens + c.unreported_prompt_tokens,
                    rate, max(0, r.num_running + r.num_waiting + delta), free,
                    step_a_s, step_b_s)
