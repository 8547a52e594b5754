"""The node's per-router counters (node.accounting), the figures heartbeats carry."""

from __future__ import annotations

from gpumesh.node.accounting import AdmissionLedger


def test_finished_counts_every_end_once_per_router() -> None:
    """A request counts as finished once, however it ends: done after its tokens, an error or
    a cancel before its first token (then also as past its first token, so the router's credit
    is released), or a second finish call. Direct clients ("") are not reported."""
    led = AdmissionLedger()
    done = led.admit("r1", 10)
    done.first_token()
    done.finish()
    done.finish()                                  # idempotent
    cancelled = led.admit("r1", 20)
    cancelled.finish()                             # ended before any token
    running = led.admit("r1", 30)
    running.first_token()
    other = led.admit("r2", 5)
    other.finish()
    led.admit("", 7).finish()
    accounts = {a.router_id: a for a in led.accounts()}
    assert set(accounts) == {"r1", "r2"}
    r1 = accounts["r1"]
    assert (r1.admitted_requests, r1.first_token_requests, r1.finished_requests) == (3, 3, 2)
    assert r1.admitted_requests - r1.finished_requests == 1     # held: the running one
    assert accounts["r2"].finished_requests == 1
    assert led.in_flight == 1 and led.pending_prefill_tokens == 0


def test_streaming_counts_requests_past_their_first_token_until_they_end() -> None:
    led = AdmissionLedger()
    queued = led.admit("r1", 10)
    a = led.admit("r1", 10)
    b = led.admit("", 10)
    assert (led.in_flight, led.streaming) == (3, 0)   # none has a token yet
    a.first_token()
    b.first_token()
    b.first_token()                                    # once per request
    assert (led.in_flight, led.streaming) == (3, 2)
    a.finish()
    queued.finish()                                    # ended before any token: never streamed
    assert (led.in_flight, led.streaming) == (1, 1)
    b.finish()
    b.finish()
    assert (led.in_flight, led.streaming) == (0, 0)
