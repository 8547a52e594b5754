"""Service-level objectives: which TTFT / TPOT objective a request has, and whether admission
lets it go to the best node now, keeps it waiting, or refuses it.

Resolution (``resolve_slo``), per objective separately: the request's own value
(``GenerateRequest.ttft_slo_ms`` / ``tpot_slo_ms``; 0 = none), else its API key's
(``ttft_slo_ms`` / ``tpot_slo_ms`` in the key file, ``router.auth.keys``), else its model's
(the router's ``slo_ttft_ms`` / ``slo_tpot_ms``, ``MODEL=MS`` entries naming the served model),
else none. A request's value is at most ``MAX_SLO_MS``; a larger one is INVALID_ARGUMENT.

Admission (``slo_verdict``, a pure function): a request with a TTFT objective whose routing
decision predicts (``Decision.predicted_ttft_s``) that the best node would give its first token
later than the objective allows (the time it already waited counts), or whose predicted time
per output token exceeds its TPOT objective, is not sent there:

- ``slo_admission = "queue"`` (default): it waits in the model's queue, earliest objective
  first, while a node may free up, until its TTFT budget or its deadline runs out; then
  RESOURCE_EXHAUSTED with a retry-after (``x-gpumesh-retry-after-ms`` and
  ``grpc-retry-pushback-ms`` trailing metadata): the predicted excess, at least
  ``MIN_RETRY_AFTER_S``.
- ``"reject"``: RESOURCE_EXHAUSTED with the retry-after at once.
- ``"off"``: objectives only inform the policy; admission sends every request.

A decision without a prediction (a policy that does not predict) always goes: objectives need a
predictive policy to act on admission.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import grpc

from gpumesh.router import errors
from gpumesh.router.auth.keys import MAX_SLO_MS, current_key_slo
from gpumesh.router.scheduling.types import Decision, RequestInfo

MIN_RETRY_AFTER_S = 0.05
MAX_RETRY_AFTER_S = 60.0
MODES = ("queue", "reject", "off")


@dataclass(frozen=True)
class Slo:
    """Objectives in seconds (0 = none)."""

    ttft_s: float = 0.0
    tpot_s: float = 0.0


NONE = Slo()


def resolve_slo(request: Slo, key: Slo, model: Slo) -> Slo:
    """Per objective: the request's, else the key's, else the model's (0 = none)."""
    return Slo(request.ttft_s or key.ttft_s or model.ttft_s,
               request.tpot_s or key.tpot_s or model.tpot_s)


def ms_to_s(ms: float, what: str) -> float:
    """A configured or requested objective in milliseconds, checked: finite, in
    [0, MAX_SLO_MS]. ValueError naming ``what`` otherwise."""
    if not math.isfinite(ms) or not 0 <= ms <= MAX_SLO_MS:
        raise ValueError(f"{what} must be in [0, {MAX_SLO_MS}] ms, got {ms}")
    return ms / 1000.0


@functools.lru_cache(maxsize=16)
def model_slos(ttft: tuple[str, ...], tpot: tuple[str, ...]) -> dict[str, Slo]:
    """The router's per-model objectives from its ``MODEL=MS`` entries (ValueError when one
    is malformed)."""
    out: dict[str, list[float]] = {}
    for i, entries in enumerate((ttft, tpot)):
        name = ("slo_ttft_ms", "slo_tpot_ms")[i]
        for entry in entries:
            model, sep, ms = entry.partition("=")
            if not sep or not model.strip():
                raise ValueError(f"{name} entries are MODEL=MS, got {entry!r}")
            try:
                value = float(ms)
            except ValueError:
                raise ValueError(f"{name} entry {entry!r}: {ms!r} is not a number") from None
            out.setdefault(model.strip(), [0.0, 0.0])[i] = ms_to_s(value, f"{name} {entry!r}")
    return {m: Slo(v[0], v[1]) for m, v in out.items()}


def request_slo(ttft_slo_ms: int, tpot_slo_ms: int, model: str, config_ttft: tuple[str, ...],
                config_tpot: tuple[str, ...]) -> Slo:
    """A request's resolved objectives (its own, its API key's -- ``current_key_slo``, set by
    the key check --, its model's from the router's entries). RouterError INVALID_ARGUMENT
    for a value out of range."""
    try:
        own = Slo(ms_to_s(ttft_slo_ms, "ttft_slo_ms"), ms_to_s(tpot_slo_ms, "tpot_slo_ms"))
    except ValueError as exc:
        raise errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    key_ttft_ms, key_tpot_ms = current_key_slo.get()
    return resolve_slo(own, Slo(key_ttft_ms / 1000.0, key_tpot_ms / 1000.0),
                       model_slos(config_ttft, config_tpot).get(model, NONE))


class Verdict(enum.Enum):
    ADMIT = "admit"     # send it to the decision's node now
    WAIT = "wait"       # keep it queued: a node may free up within its budget
    REJECT = "reject"   # RESOURCE_EXHAUSTED with a retry-after


@dataclass(frozen=True)
class SloCheck:
    verdict: Verdict
    # REJECT: seconds after which a retry may meet the objective; WAIT: the longest the
    # request may still wait (its TTFT budget left, bounded by its deadline)
    seconds: float = 0.0
    reason: str = ""


ADMIT = SloCheck(Verdict.ADMIT)


def predicted_tpot_s(decision: Decision, output_tokens: int) -> float | None:
    """Seconds per output token after the first, from the decision's two predictions (None
    when either is missing or the request's output length is unknown)."""
    ttft, done = decision.predicted_ttft_s, decision.predicted_completion_s
    if ttft is None or done is None or output_tokens < 2 or not done >= ttft:
        return None
    return (done - ttft) / (output_tokens - 1)


def slo_verdict(decision: Decision, info: RequestInfo, waited_s: float, remaining_s: float,
                mode: str) -> SloCheck:
    """Whether the request may go to ``decision``'s node now (module doc). ``waited_s``: time
    since the request arrived; ``remaining_s``: time left to its deadline."""
    if mode == "off":
        return ADMIT
    miss = 0.0     # seconds by which the prediction misses
    why = ""
    pred = decision.predicted_ttft_s
    if info.ttft_slo_s > 0 and pred is not None and math.isfinite(pred):
        over = waited_s + pred - info.ttft_slo_s
        if over > 0:
            miss = over
            why = (f"predicted time to first token {waited_s + pred:.3f}s exceeds the "
                   f"objective {info.ttft_slo_s:.3f}s")
    tpot = predicted_tpot_s(decision, info.output_tokens) if info.tpot_slo_s > 0 else None
    if tpot is not None and tpot > info.tpot_slo_s:
        miss = max(miss, (tpot - info.tpot_slo_s) * (info.output_tokens - 1))
        why = why or (f"predicted time per output token {tpot * 1000:.1f}ms exceeds the "
                      f"objective {info.tpot_slo_s * 1000:.1f}ms")
    if not why:
        return ADMIT
    budget = min(info.ttft_slo_s - waited_s if info.ttft_slo_s > 0 else 0.0, remaining_s)
    if mode == "queue" and budget > 0:
        return SloCheck(Verdict.WAIT, budget, why)
    return SloCheck(Verdict.REJECT, min(max(miss, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S), why)


def unmet(model: str, check: SloCheck) -> errors.RouterError:
    """What a refused request hears: RESOURCE_EXHAUSTED with a retry-after."""
    return errors.RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"no node of {model!r} is predicted to meet the request's "
                              f"objectives now ({check.reason}); retry after "
                              f"{check.seconds:.2f}s", retry_after_s=check.seconds)
