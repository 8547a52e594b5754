"""The live serving path outside the engine's steps, as queues: the node's front end and the
router, each one Python process that serves its work one piece at a time.

A live request crosses two such processes besides the engine: the router (routing decision,
opening the node stream, then relaying every stream message to the client) and the node's
front end (the gRPC servicer and vLLM's ``AsyncLLM``: input processing, then per engine step
the output processing of every running request, and the stream messages the coalescer sends).
Each is modelled as one FIFO server with a service time per piece of work, from
:class:`ServingCosts` (CPU ms measured on the real processes, ``gpumesh_bench.sim.frontcal``):

- node front end: ``node_request_ms`` + ``node_prompt_token_ms`` x its prompt tokens when a
  request arrives (the engine gets it when that work is done); ``node_output_ms`` per engine output (one request's token of one step) plus
  ``node_message_ms`` per stream message, when a step ends (its messages leave when that work
  is done);
- router: ``router_request_ms`` + ``router_prompt_token_ms`` x its prompt tokens when a
  request arrives (it is forwarded when done),
  ``router_message_ms`` per stream message relayed (the client gets it when done).

Messages follow the node's coalescing (``node.streaming``): the first token alone and at once,
the final output at once, later tokens merged until ``flush_interval_s`` has passed since the
stream's last message, the interval widened to ``streams / messages_per_s`` with more streams
sending than the budget allows (at most 250 ms). Here a flush happens at the end of the first
step past the interval (the live coalescer also flushes on a timer between steps).

Under load a server's backlog grows, which is what lengthens TTFT tails; with every cost 0
(:attr:`ServingCosts.enabled` false) the simulator runs as without this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

MAX_FLUSH_INTERVAL_S = 0.25   # node.streaming.budget's widest interval


@dataclass(frozen=True)
class ServingCosts:
    """Service times (ms) of the router and the node's front end, and the node's coalescing
    settings (its defaults: 20 ms, 2,000 messages per second)."""

    node_request_ms: float = 0.0
    node_output_ms: float = 0.0
    node_message_ms: float = 0.0
    router_request_ms: float = 0.0
    router_message_ms: float = 0.0
    node_prompt_token_ms: float = 0.0
    router_prompt_token_ms: float = 0.0
    flush_interval_s: float = 0.02
    messages_per_s: float = 2000.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name} must be finite and >= 0, got {v!r}")

    @property
    def enabled(self) -> bool:
        return any(getattr(self, f.name) > 0 for f in fields(self)
                   if f.name.endswith("_ms"))

    def lone_request_ms(self, prompt_tokens: int = 0) -> float:
        """The node front end's work for one request of ``prompt_tokens`` with one output
        token, alone: what a single-request TTFT measurement (``request_overhead_ms``)
        already holds of it."""
        return (self.node_request_ms + self.node_prompt_token_ms * prompt_tokens
                + self.node_output_ms + self.node_message_ms)


class FifoServer:
    """One process serving work in arrival order. Work must be offered in time order."""

    __slots__ = ("busy_s", "free_at")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def serve(self, now: float, work_ms: float) -> float:
        """Offers ``work_ms`` of work at ``now`` (s); returns when it is done (s): after the
        work offered before it (0 ms of work still waits for that)."""
        start = max(now, self.free_at)
        self.free_at = start + work_ms / 1000.0
        self.busy_s += work_ms / 1000.0
        return self.free_at


class NodeFrontEnd:
    """A node's front end: its FIFO server and the streams it coalesces."""

    __slots__ = ("costs", "server", "streams")

    def __init__(self, costs: ServingCosts) -> None:
        self.costs = costs
        self.server = FifoServer()
        self.streams: dict[str, float] = {}   # request id -> time of its last message

    def interval(self) -> float:
        c = self.costs
        if c.messages_per_s <= 0:
            return c.flush_interval_s
        return max(c.flush_interval_s, min(MAX_FLUSH_INTERVAL_S,
                                           len(self.streams) / c.messages_per_s))

    def step(self, now: float, decoding: Iterable[str], firsts: Iterable[str],
             ends: Iterable[str]) -> tuple[float, dict[str, int]]:
        """A step ended at ``now``: ``decoding`` the requests that got a later token in it,
        ``firsts`` those that got their first one, ``ends`` those that finished (either).
        Returns when its messages leave the node and each request's message count."""
        done = set(ends)
        msgs = {rid: 1 for rid in firsts}   # a first token goes alone (with the end if last)
        outputs = len(msgs)
        iv = self.interval()
        for rid in decoding:
            outputs += 1
            last = self.streams.get(rid)
            if last is not None and (rid in done or now - last >= iv):
                msgs[rid] = 1
                self.streams[rid] = now
        for rid in msgs:
            self.streams[rid] = now
        for rid in done:
            self.streams.pop(rid, None)
        c = self.costs
        work = outputs * c.node_output_ms + len(msgs) * c.node_message_ms
        return self.server.serve(now, work), msgs


class ServingPath:
    """The router and node front-end servers of one simulated fleet (module docstring)."""

    def __init__(self, costs: ServingCosts, node_ids: Iterable[str], routers: int) -> None:
        self.costs = costs
        self.fronts = {n: NodeFrontEnd(costs) for n in node_ids}
        self.routers = [FifoServer() for _ in range(routers)]

    def forward(self, router: int, now: float, prompt_tokens: int) -> float:
        """A request reaches router ``router``; returns when it is sent to its node."""
        c = self.costs
        return self.routers[router].serve(
            now, c.router_request_ms + c.router_prompt_token_ms * prompt_tokens)

    def admit(self, node_id: str, now: float, prompt_tokens: int) -> float:
        """A request reaches node ``node_id``; returns when its engine gets it."""
        c = self.costs
        return self.fronts[node_id].server.serve(
            now, c.node_request_ms + c.node_prompt_token_ms * prompt_tokens)

    def step(self, node_id: str, now: float, scheduled: Iterable[str], firsts: list[str],
             ends: list[str], router_of: Callable[[str], int]
             ) -> tuple[float, dict[int, tuple[int, list[str], list[str]]]]:
        """A step of ``node_id`` ended: ``scheduled`` its requests, ``firsts`` and ``ends`` as
        in :meth:`NodeFrontEnd.step`. Returns when its messages leave the node and, per
        router, (messages, first-token ids, end ids)."""
        fe = self.fronts[node_id]
        decoding = [r for r in scheduled if r in fe.streams]
        depart, msgs = fe.step(now, decoding, firsts, ends)
        out: dict[int, tuple[int, list[str], list[str]]] = {}
        for rid, k in msgs.items():
            m, f, e = out.get(router_of(rid), (0, [], []))
            out[router_of(rid)] = (m + k, f, e)
        for rid in firsts:
            out[router_of(rid)][1].append(rid)
        for rid in ends:
            out[router_of(rid)][2].append(rid)
        return depart, out

    def relay(self, router: int, now: float, messages: int) -> float:
        """``messages`` stream messages reach router ``router``; returns when they reach
        the client."""
        return self.routers[router].serve(now, messages * self.costs.router_message_ms)
