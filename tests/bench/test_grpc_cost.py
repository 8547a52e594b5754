"""`gpumesh bench grpc-cost`: grpc.aio's own server CPU per request and per message, measured
on a real loopback server in its own process."""

from __future__ import annotations

import argparse
import json

import pytest

from gpumesh_bench.overhead import grpc_cost


def test_fit_splits_a_fixed_cost_from_a_per_message_cost():
    fixed, per_message = grpc_cost.fit([(1, 230.0), (4, 320.0), (16, 680.0), (64, 2120.0)])
    assert fixed == pytest.approx(200.0)
    assert per_message == pytest.approx(30.0)
    with pytest.raises(ValueError):
        grpc_cost.fit([(4, 1.0), (4, 2.0)])


def test_a_longer_stream_costs_the_server_more(tmp_path, capsys):
    out = tmp_path / "cost.json"
    p = argparse.ArgumentParser()
    grpc_cost.add_arguments(p)
    a = p.parse_args(["--messages", "1,32", "--requests", "120", "--concurrency", "8",
                      "--server-cpu", "-1", "--client-cpu", "-1", "--json", str(out)])
    assert grpc_cost.main(a) == 0
    rows = {r["messages"]: r for r in json.loads(out.read_text())["rows"]}
    # 32 messages per stream cost the server more CPU per request than 1 (31 more messages at
    # ~30 µs each here, against ~230 µs for the request itself).
    assert rows[32]["us_per_request"] > rows[1]["us_per_request"] > 0
    assert "µs per message" in capsys.readouterr().out


def test_one_message_count_is_refused():
    p = argparse.ArgumentParser()
    grpc_cost.add_arguments(p)
    with pytest.raises(SystemExit, match="at least two different counts"):
        grpc_cost.main(p.parse_args(["--messages", "4,4"]))
