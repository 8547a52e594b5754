"""Disaggregated serving in the simulated engine: the two legs of a request whose prefill runs
on one engine and whose decode runs on another (a mixin of ``SimScheduler``).

- **Prefill leg** (``SimRequest(..., keep_kv=True)``, ``max_out`` 1): prefilled as any
  request; when it finishes its KV blocks stay taken (vLLM's connector delays freeing them
  until the other engine has read them) until the driver calls :meth:`release`.
- **Decode leg** (``SimRequest(..., remote=True)``): its prompt's KV comes from another
  engine. It waits in the queue, in order, until the KV cache can hold its whole prompt
  (never a prefix cache lookup: the blocks arrive whole); then it takes the blocks
  (:meth:`take_started` hands it to the driver, which runs the transfer) and holds them while
  the KV arrives, neither running nor counting against ``max_num_seqs`` (vLLM's
  ``WAITING_FOR_REMOTE_KVS``; it counts as waiting in the load report). At
  :meth:`kv_loaded` it rejoins the head of the queue; its next step computes only its last
  prompt token (priced as one decode token) and emits its first output token; from then on it
  decodes like any request. Preempted, it loses the transferred KV and recomputes its prompt
  locally, as vLLM's recompute preemption does.
"""

from __future__ import annotations

from collections import deque

from gpumesh.node.engines.sim.request import SimRequest


class KvTransfers:
    """The transfer half of ``SimScheduler`` (module docstring); it reads the scheduler's
    KV block counters."""

    _block: int
    _free_blocks: int
    _running: list[SimRequest]
    _waiting: deque[SimRequest]

    def _init_transfers(self) -> None:
        # decode legs whose KV is arriving, those that took their blocks since
        # take_started(), finished prefill legs holding their KV for another engine
        self._loading: dict[str, SimRequest] = {}
        self._started: list[SimRequest] = []
        self._held: dict[str, SimRequest] = {}

    def _free(self, req: SimRequest) -> None:  # SimScheduler's
        raise NotImplementedError

    def take_started(self) -> list[SimRequest]:
        """The decode legs that took their KV blocks since the last call (their transfers
        start now); the driver calls :meth:`kv_loaded` for each when its transfer ends."""
        started, self._started = self._started, []
        return started

    def kv_loaded(self, rid: str) -> bool:
        """The prompt KV of decode leg ``rid`` has arrived: it rejoins the head of the waiting
        queue. False when ``rid`` is not waiting for its KV (aborted meanwhile)."""
        req = self._loading.pop(rid, None)
        if req is None:
            return False
        self._waiting.appendleft(req)
        return True

    def release(self, rid: str) -> bool:
        """Frees the KV blocks finished prefill leg ``rid`` still holds (the other engine has
        read them). False when it holds none."""
        req = self._held.pop(rid, None)
        if req is None:
            return False
        self._free(req)
        return True

    @property
    def held_kv_tokens(self) -> int:
        """KV tokens held by finished prefill legs and by decode legs whose KV is arriving."""
        return (sum(r.blocks for r in self._held.values())
                + sum(r.blocks for r in self._loading.values())) * self._block

    def _free_or_hold(self, req: SimRequest) -> None:
        """A request finished: its KV blocks are freed, or held until :meth:`release` when it
        is a prefill leg (another engine reads them)."""
        if req.keep_kv:
            self._held[req.id] = req
        else:
            self._free(req)

    def _schedule_remote(self, req: SimRequest, scheduled: list[tuple[SimRequest, int]]
                         ) -> int:
        """A decode leg at the head of the waiting queue (``SimScheduler._schedule``): -1 when
        the KV cache cannot hold its prompt now (it waits); 0 when it took its blocks now (its
        transfer starts: it leaves the queue for ``_loading``); 1 when its KV has arrived: it
        leaves the queue to run, its last prompt token scheduled in this step (one decode
        token)."""
        got = self._admit_remote(req)
        if got < 0:
            return got
        self._waiting.popleft()
        if got:
            req.remote = False
            self._running.append(req)
            scheduled.append((req, 1))
        return got

    def _admit_remote(self, req: SimRequest) -> int:
        """``_schedule_remote``'s KV side: -1 (no room now), 0 (took its blocks: the
        transfer starts), 1 (its KV has arrived)."""
        if req.blocks:
            return 1
        need = -(-req.prompt_len // self._block)
        if need > self._free_blocks:
            return -1
        prefix = getattr(self, "prefix", None)
        if prefix is not None:
            prefix.make_room(self._free_blocks, need)
        self._free_blocks -= need
        req.blocks = need
        req.computed = req.prompt_len - 1
        self._loading[req.id] = req
        self._started.append(req)
        return 0
