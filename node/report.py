"""The node's load report (:class:`gpumesh.types.LoadReport`, what its heartbeats carry): built
from the engine's own load and the node's admission ledger, and merged over the front-end
processes of a node that has several (``gpumesh.node.frontends``). ``gpumesh.wire`` converts
it to the heartbeat's protobuf."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpumesh.node.accounting import AdmissionLedger
from gpumesh.node.engines.base import EngineLoad
from gpumesh.types import LoadReport, RouterAccount


def build_load_report(load: EngineLoad, ledger: AdmissionLedger, draining: bool) -> LoadReport:
    """The one conversion of an engine's ``EngineLoad`` into the node's report. Counts that
    an engine may briefly report negative, or not at all, are clamped to 0."""
    return LoadReport(
        num_running=load.num_running, num_waiting=load.num_waiting,
        pending_prefill_tokens=max(0, ledger.pending_prefill_tokens),
        kv_cache_usage=load.kv_cache_usage, prefix_cache_hit_rate=load.prefix_cache_hit_rate,
        generation_tokens_per_s=load.generation_tokens_per_s,
        prompt_tokens_per_s=load.prompt_tokens_per_s,
        kv_capacity_tokens=max(0, load.kv_capacity_tokens),
        prefill_capacity_tokens_per_s=max(0.0, load.prefill_capacity_tokens_per_s),
        decode_step_s=max(0.0, load.decode_step_s),
        output_tokens_mean=max(0.0, load.output_tokens_mean),
        loaded_adapters=tuple(load.loaded_adapters),
        adapter_load_s=max(0.0, load.adapter_load_s),
        step_model=load.step_model,
        in_flight=ledger.in_flight, draining=draining, gpus=tuple(load.gpus),
        router_accounts=ledger.accounts())


def merge_reports(reports: Sequence[tuple[float, LoadReport]]) -> LoadReport:
    """One node's report from its front ends' ``(stats_at, report)`` pairs, the main
    process's first (its GPU samples are the node's).

    - Engine-wide figures (running, waiting, KV usage, prefix hit rate) come from the report
      whose scheduler snapshot is the freshest (``stats_at``, monotonic time of the machine):
      vLLM sends each step's scheduler stats to one front end only. KV capacity: the largest
      reported (a front end that has not seen the engine's sizing yet reports 0).
    - What each front end counts of its own requests is summed: in flight, pending prefill,
      per-router accounts, generated and prompt tokens/s, and the prefill capacity (each
      front end measures the prompt tokens of its own requests over the same spans; the sum
      approximates the engine's).
    - Step model: the fit over the most spans (each front end fits the steps whose stats it
      received; the one that saw most of them is the best informed).
    - Output tokens per finished request: the mean of the front ends' means (each counts
      the requests it finished).
    - Decode step time: the smallest a front end measured. A front end times the intervals
      between the scheduler stats it receives, which span several steps when another front
      end got the stats in between, so larger figures are the inflated ones.
    """
    if not reports:
        raise ValueError("no reports to merge")
    freshest = max(reports, key=lambda r: r[0])[1]
    rs = [r for _, r in reports]
    steps = [r.decode_step_s for r in rs if r.decode_step_s > 0]
    outs = [r.output_tokens_mean for r in rs if r.output_tokens_mean > 0]
    accounts: dict[str, RouterAccount] = {}
    for r in rs:
        for a in r.router_accounts:
            acc = accounts.get(a.router_id)
            accounts[a.router_id] = a if acc is None else acc.merged(a)
    fits = [r.step_model for r in rs if r.step_model is not None]
    return dataclasses.replace(
        freshest,
        step_model=max(fits, key=lambda m: m.spans) if fits else None,
        in_flight=sum(r.in_flight for r in rs),
        pending_prefill_tokens=sum(r.pending_prefill_tokens for r in rs),
        generation_tokens_per_s=sum(r.generation_tokens_per_s for r in rs),
        prompt_tokens_per_s=sum(r.prompt_tokens_per_s for r in rs),
        prefill_capacity_tokens_per_s=sum(r.prefill_capacity_tokens_per_s for r in rs),
        decode_step_s=min(steps) if steps else 0.0,
        output_tokens_mean=sum(outs) / len(outs) if outs else 0.0,
        kv_capacity_tokens=max(r.kv_capacity_tokens for r in rs),
        draining=any(r.draining for r in rs),
        gpus=rs[0].gpus,
        router_accounts=tuple(accounts.values()))
