"""The KV connector a node role sets up, the parameters a node accepts, and the transfer
totals read from vLLM's connector stats (gpumesh.node.engines.vllm.kv_transfer)."""

from __future__ import annotations

import os
import socket

import pytest

from gpumesh.node.config import NodeConfig, NodeServingSettings
from gpumesh.node.engines.vllm.kv_transfer import (
    PROGRESS_DELAY_ENV,
    PROGRESS_DELAY_US,
    KvTransferTotals,
    apply_side_channel,
    check_params,
    default_kv_transfer_config,
    free_port,
    progress_delay_us,
)


@pytest.mark.parametrize(("role", "cpu", "want"), [
    ("both", True, None),
    ("prefill", True, {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                       "kv_buffer_device": "cpu"}),
    ("decode", False, {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                       "kv_buffer_device": "cuda"}),
])
def test_role_sets_the_connector(role: str, cpu: bool, want) -> None:
    assert default_kv_transfer_config(role, cpu) == want


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="role"):
        default_kv_transfer_config("mixed", True)
    with pytest.raises(ValueError, match="role"):
        NodeConfig(serving={"role": "mixed"})
    with pytest.raises(ValueError, match="engine.kind = 'vllm'"):
        NodeConfig(serving={"role": "prefill"}, engine={"kind": "sim"})
    with pytest.raises(ValueError, match="kv_port"):
        NodeConfig(serving={"role": "decode", "kv_port": 70000})


def test_advertised_host() -> None:
    assert NodeServingSettings(host="10.0.0.5").advertised_host() == "10.0.0.5"
    assert NodeServingSettings(host="0.0.0.0",
                               advertise_address="pod-1:50051").advertised_host() == "pod-1"
    assert NodeServingSettings(host="0.0.0.0").advertised_host() not in ("", "0.0.0.0")


def test_side_channel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    assert apply_side_channel(None, "h", 0) is None
    assert apply_side_channel({"kv_connector": "ExampleConnector"}, "h", 0) is None
    host, port = apply_side_channel({"kv_connector": "NixlConnector"}, "10.1.2.3", 0)
    assert host == "10.1.2.3" and 0 < port < 65536
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port)
    free = free_port()
    assert apply_side_channel({"kv_connector": "NixlConnector"}, "h", free) == ("h", free)


def test_side_channel_port_in_use_is_an_error() -> None:
    """A configured port something already listens on: an error at start, not a hang."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=str(port)):
            apply_side_channel({"kv_connector": "NixlConnector"}, "127.0.0.1", port)


@pytest.mark.parametrize("params", [
    {"do_remote_decode": True},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1]],
     "remote_host": "h", "remote_port": 5600},
])
def test_accepted_params(params) -> None:
    check_params(params)


@pytest.mark.parametrize(("params", "match"), [
    ({}, "do_remote"),
    ({"do_remote_decode": "yes"}, "do_remote"),
    ({"do_remote_prefill": True}, "remote_engine_id"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [],
      "remote_host": "h", "remote_port": 0}, "remote_port"),
])
def test_refused_params(params, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_params(params)


def test_totals_add_nixl_payloads() -> None:
    t = KvTransferTotals()
    t = t.add({"transfer_duration": [0.5, 0.25], "bytes_transferred": [100, 300],
               "num_failed_transfers": [], "post_duration": [0.1, 0.1]})
    t = t.add({"data": {"bytes_transferred": [], "num_failed_handshakes": [1]}})
    t = t.add({"unknown": 1})
    t = t.add(None)
    assert t == KvTransferTotals(transfers=2, bytes=400, seconds=0.75, failures=1)


def test_progress_delay_is_set_for_nixl_engines(monkeypatch) -> None:
    for name in (PROGRESS_DELAY_ENV, "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert progress_delay_us() == 0
    apply_side_channel(None, "h", 0)   # no NIXL: nothing set
    assert PROGRESS_DELAY_ENV not in os.environ
    apply_side_channel({"kv_connector": "NixlConnector"}, "h", 0)
    assert progress_delay_us() == PROGRESS_DELAY_US > 0
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "0")   # an operator's choice is kept
    apply_side_channel({"kv_connector": "NixlConnector"}, "h", 0)
    assert progress_delay_us() == 0
    for bad in ("-5", "fast", ""):
        monkeypatch.setenv(PROGRESS_DELAY_ENV, bad)
        assert progress_delay_us() == 0
