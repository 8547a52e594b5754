"""Service-level objectives (router.dispatch.slo): resolution request > key > model, the
admission verdict table, validation of requested, configured and per-key objectives."""

from __future__ import annotations

import grpc
import pytest

from gpumesh.router import errors
from gpumesh.router.auth.keys import current_key_slo, parse_keys
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import slo
from gpumesh.router.dispatch.slo import ADMIT, Slo, SloCheck, Verdict, slo_verdict
from gpumesh.router.scheduling.types import Decision, RequestInfo


@pytest.mark.parametrize(("request_", "key", "model", "want"), [
    (Slo(), Slo(), Slo(), Slo()),
    (Slo(), Slo(), Slo(2.0, 0.1), Slo(2.0, 0.1)),
    (Slo(), Slo(1.0), Slo(2.0, 0.1), Slo(1.0, 0.1)),        # per objective
    (Slo(0.5), Slo(1.0, 0.05), Slo(2.0, 0.1), Slo(0.5, 0.05)),
    (Slo(0.5, 0.02), Slo(1.0, 0.05), Slo(2.0, 0.1), Slo(0.5, 0.02)),
])
def test_resolution_request_then_key_then_model(request_: Slo, key: Slo, model: Slo,
                                                want: Slo) -> None:
    assert slo.resolve_slo(request_, key, model) == want


def test_request_slo_reads_the_key_and_the_models_entries() -> None:
    entries = ("m=800", "other=100")
    assert slo.request_slo(0, 0, "m", entries, ("m=50",)) == Slo(0.8, 0.05)
    assert slo.request_slo(0, 0, "x", entries, ()) == Slo()
    token = current_key_slo.set((300.0, 0.0))
    try:
        assert slo.request_slo(0, 0, "m", entries, ("m=50",)) == Slo(0.3, 0.05)
        assert slo.request_slo(120, 0, "m", entries, ()) == Slo(0.12, 0.0)
    finally:
        current_key_slo.reset(token)
    with pytest.raises(errors.RouterError) as exc:
        slo.request_slo(slo.MAX_SLO_MS + 1, 0, "m", (), ())
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "ttft_slo_ms" in exc.value.message


@pytest.mark.parametrize("entries", [("m",), ("=5",), ("m=abc",), ("m=-1",), ("m=inf",),
                                     ("m=3600001",)])
def test_bad_model_entries_are_refused(entries: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        RouterConfig(dispatch={"slo_ttft_ms": entries})
    with pytest.raises(ValueError):
        RouterConfig(dispatch={"slo_tpot_ms": entries})


def test_admission_mode_is_checked() -> None:
    assert RouterConfig(dispatch={"slo_admission": "reject"}).dispatch.slo_admission == "reject"
    with pytest.raises(ValueError):
        RouterConfig(dispatch={"slo_admission": "maybe"})


def key_file(extra: str) -> str:
    return f'[[key]]\nname = "k"\nsha256 = "{"a" * 64}"\n{extra}'


def test_key_objectives_parse_and_are_bounded() -> None:
    (k,) = parse_keys(key_file("ttft_slo_ms = 800\ntpot_slo_ms = 40\n")).values()
    assert (k.ttft_slo_ms, k.tpot_slo_ms) == (800.0, 40.0)
    (k,) = parse_keys(key_file("")).values()
    assert (k.ttft_slo_ms, k.tpot_slo_ms) == (0.0, 0.0)
    for bad in ("ttft_slo_ms = -1\n", "tpot_slo_ms = 4000000\n", "ttft_slo_ms = nan\n"):
        with pytest.raises(ValueError, match="slo_ms"):
            parse_keys(key_file(bad))


def info(ttft_slo: float = 0.0, tpot_slo: float = 0.0, output: int = 0) -> RequestInfo:
    return RequestInfo("m", 100, output_tokens=output, ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo)


def dec(ttft: float | None, completion: float | None = None) -> Decision:
    return Decision("p", "n", 1, predicted_ttft_s=ttft, predicted_completion_s=completion)


W, R = Verdict.WAIT, Verdict.REJECT


@pytest.mark.parametrize(("d", "i", "waited", "remaining", "mode", "want"), [
    # no objective, or no prediction: it goes
    (dec(5.0), info(), 0.0, 60.0, "queue", ADMIT),
    (dec(None), info(0.1), 0.0, 60.0, "queue", ADMIT),
    # met, counting what it already waited
    (dec(0.3), info(0.5), 0.1, 60.0, "queue", ADMIT),
    (dec(0.3), info(0.5), 0.3, 60.0, "queue", SloCheck(W, 0.2)),
    # missed: wait while the budget lasts (bounded by the deadline), else refuse
    (dec(0.8), info(0.5), 0.0, 60.0, "queue", SloCheck(W, 0.5)),
    (dec(0.8), info(0.5), 0.0, 0.2, "queue", SloCheck(W, 0.2)),
    (dec(0.8), info(0.5), 0.5, 60.0, "queue", SloCheck(R, 0.8)),
    (dec(0.8), info(0.5), 0.0, 0.0, "queue", SloCheck(R, 0.3)),
    (dec(0.8), info(0.5), 0.0, 60.0, "reject", SloCheck(R, 0.3)),
    (dec(0.51), info(0.5), 0.0, 60.0, "reject", SloCheck(R, slo.MIN_RETRY_AFTER_S)),
    (dec(500.0), info(0.5), 0.0, 60.0, "reject", SloCheck(R, slo.MAX_RETRY_AFTER_S)),
    (dec(0.8), info(0.5), 0.0, 60.0, "off", ADMIT),
    # time per output token: (2.0 - 0.1) / 19 = 0.1 s > 0.05 s, refused (no TTFT budget)
    (dec(0.1, 2.0), info(tpot_slo=0.05, output=20), 0.0, 60.0, "queue", SloCheck(R, 0.95)),
    (dec(0.1, 2.0), info(tpot_slo=0.2, output=20), 0.0, 60.0, "queue", ADMIT),
    (dec(0.1, 2.0), info(tpot_slo=0.05, output=1), 0.0, 60.0, "queue", ADMIT),  # unknown
    (dec(0.1, 2.0), info(1.0, 0.05, 20), 0.0, 60.0, "queue", SloCheck(W, 1.0)),
])
def test_verdict_table(d: Decision, i: RequestInfo, waited: float, remaining: float,
                       mode: str, want: SloCheck) -> None:
    got = slo_verdict(d, i, waited, remaining, mode)
    assert got.verdict is want.verdict
    assert got.seconds == pytest.approx(want.seconds)
    assert bool(got.reason) == (got.verdict is not Verdict.ADMIT)


def test_a_refusal_is_resource_exhausted_with_a_retry_after() -> None:
    check = slo_verdict(dec(2.0), info(0.5), 0.0, 60.0, "reject")
    err = slo.unmet("m", check)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.retry_after_s == pytest.approx(1.5)
    assert "'m'" in err.message and "objective" in err.message
