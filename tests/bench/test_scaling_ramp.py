"""The scaling signal on a traffic ramp in the fleet simulator
(gpumesh_bench.reliability.scaling_ramp): the router's real saturation tracker over the
simulator's real registry and engines, with an HPA-like autoscaler acting on nodes_wanted.
Deterministic (virtual time, seeded)."""

from __future__ import annotations

import pytest

from gpumesh_bench.reliability.scaling_ramp import Ramp, check, summary


@pytest.mark.slow
def test_signal_scales_ahead_of_the_slo_and_back_down():
    res = check(Ramp())
    doc = summary(res)
    assert res.checks == {
        "slo_breaks_on_the_fixed_fleet": True,
        "asks_before_the_slo_breaks": True,
        "the_scaled_fleet_meets_the_slo": True,
        "grows_on_the_way_up": True,
        "shrinks_on_the_way_down": True,
    }, {k: doc[k] for k in ("first_ask_s", "first_breach_s")}
    # the fixed fleet's SLO breach is a real one, not a borderline window
    assert doc["fixed"]["worst_window_p90_ttft_s"] > 5 * Ramp().slo_ttft_s
    assert doc["scaled"]["peak_nodes"] < Ramp().max_nodes   # asked for what it needed
