"""API keys, per-key models and quotas, and operator keys, over a real router and a real
simulated node: a client without a key, with a wrong key, with a key for another model, and
over each of its quotas gets its status and changes nothing; the keys file is reloaded
without a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, build_request
from gpumesh.router.auth.keys import hash_key
from tests.security.mesh import mesh, served_by, wait_for

KEYS = {"alpha": "key-alpha", "ops": "key-ops", "other": "key-other", "slow": "key-slow",
        "single": "key-single", "tokens": "key-tokens"}


def _entry(name: str, role: str = "client", models: tuple[str, ...] = (), **limits) -> str:
    ms = ", ".join(f'"{m}"' for m in models)
    extra = "".join(f"{k} = {v}\n" for k, v in limits.items())
    return (f'[[key]]\nname = "{name}"\nsha256 = "{hash_key(KEYS[name])}"\nrole = "{role}"\n'
            f"models = [{ms}]\n{extra}")


def keys_file(path: Path, extra: str = "") -> None:
    path.write_text("\n".join([
        _entry("alpha", models=("sim",)), _entry("ops", role="operator"),
        _entry("other", models=("not-served",)),
        _entry("slow", requests_per_s=0.2, burst=1), _entry("single", max_concurrency=1),
        _entry("tokens", tokens_per_s=1.0)]) + extra)


@pytest.fixture(scope="module")
async def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    path = tmp / "keys.toml"
    keys_file(path)
    async with mesh(tmp, ("good",), router_args=["--api-keys-file", str(path)],
                    client_kwargs={"api_key": KEYS["ops"]}) as m:
        yield m, path


def _req(max_tokens: int = 4, model: str = "sim"):
    return build_request("hello there", model=model, max_tokens=max_tokens)


async def _code(client: MeshClient, req=None, stream: bool = False):
    try:
        if stream:
            async for _ in client.stream(req or _req(), timeout=60):
                pass
        else:
            await client.generate(req or _req(), timeout=60)
    except grpc.aio.AioRpcError as e:
        return e.code(), dict(e.trailing_metadata() or ())
    return grpc.StatusCode.OK, {}


async def _admitted(m) -> int:
    async with MeshClient(m.router_address, api_key=KEYS["ops"]) as op:
        fleet = await op.fleet(timeout=30)
    return sum(a.admitted_requests for n in fleet.nodes for a in n.load.router_accounts)


@pytest.mark.parametrize("key,code", [
    ("", grpc.StatusCode.UNAUTHENTICATED),
    ("not-a-key", grpc.StatusCode.UNAUTHENTICATED),
    ("key-other", grpc.StatusCode.PERMISSION_DENIED),
])
async def test_refused_clients_get_their_status_and_change_nothing(keyed, key, code):
    m, _ = keyed
    before = await _admitted(m)
    async with MeshClient(m.router_address, api_key=key) as client:
        for stream in (False, True):
            got, trailing = await _code(client, stream=stream)
            assert got == code
            assert not trailing.get(md.NODE_ID)
    assert await _admitted(m) == before
    async with MeshClient(m.router_address, api_key=KEYS["alpha"]) as ok:
        assert await served_by(ok, 4) == {"good": 4}


async def test_request_rate_quota(keyed):
    m, _ = keyed
    async with MeshClient(m.router_address, api_key=KEYS["slow"]) as client:
        assert (await _code(client))[0] == grpc.StatusCode.OK
        code, trailing = await _code(client)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(trailing[md.RETRY_AFTER_MS]) > 0
        assert not trailing.get(md.NODE_ID)


async def test_concurrency_quota(keyed):
    m, _ = keyed
    async with MeshClient(m.router_address, api_key=KEYS["single"]) as client:
        long = client.stream(build_request("long " * 4, model="sim", max_tokens=2000,
                                           ignore_eos=True), timeout=120)
        first = await long.__anext__()   # one request in flight
        assert first is not None
        code, trailing = await _code(client)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and md.RETRY_AFTER_MS in trailing
        await long.aclose()
        # released when it ends: admitted again
        await wait_for(lambda: _ok(client), 30, "the slot released")


async def _ok(client: MeshClient) -> bool:
    return (await _code(client))[0] == grpc.StatusCode.OK


async def test_token_rate_quota(keyed):
    m, _ = keyed
    async with MeshClient(m.router_address, api_key=KEYS["tokens"]) as client:
        assert (await _code(client, _req(max_tokens=1)))[0] == grpc.StatusCode.OK
        code, trailing = await _code(client, _req(max_tokens=1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(trailing[md.RETRY_AFTER_MS]) >= 100


async def test_operator_api_needs_an_operator_key(keyed):
    m, _ = keyed
    for key, code in (("", grpc.StatusCode.UNAUTHENTICATED),
                      (KEYS["alpha"], grpc.StatusCode.PERMISSION_DENIED)):
        async with MeshClient(m.router_address, api_key=key) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.fleet(timeout=30)
            assert e.value.code() == code
    async with MeshClient(m.router_address, api_key=KEYS["ops"]) as op:
        assert [n.node_id for n in (await op.fleet(timeout=30)).nodes] == ["good"]


async def test_keys_file_is_reloaded_without_a_restart(keyed):
    m, path = keyed
    KEYS["late"] = "key-late"
    async with MeshClient(m.router_address, api_key=KEYS["late"]) as client:
        assert (await _code(client))[0] == grpc.StatusCode.UNAUTHENTICATED
        await asyncio.sleep(0.05)
        keys_file(path, "\n" + _entry("late"))
        await wait_for(lambda: _ok(client), 30, "the new key accepted")
    assert m.alive()


@pytest.fixture(scope="module")
async def traced(tmp_path_factory):
    from tests.tracing.otlp_receiver import Receiver

    rx = Receiver().start()
    tmp = tmp_path_factory.mktemp("traced-keys")
    path = tmp / "keys.toml"
    keys_file(path)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_METRIC_EXPORT_INTERVAL": "500"}
    try:
        async with mesh(tmp, ("good",), router_args=["--api-keys-file", str(path)],
                        router_env=env, client_kwargs={"api_key": KEYS["ops"]}) as m:
            yield m, rx
    finally:
        rx.stop()


async def test_the_key_name_is_on_the_span_and_in_metrics_never_the_key(traced):
    m, rx = traced
    async with MeshClient(m.router_address, api_key=KEYS["alpha"]) as client:
        assert (await _code(client, stream=True))[0] == grpc.StatusCode.OK
    async with MeshClient(m.router_address, api_key="not-a-key") as bad:
        assert (await _code(bad))[0] == grpc.StatusCode.UNAUTHENTICATED

    async def span() -> object:
        with rx._lock:
            spans = list(rx.spans)
        return next((s for s in spans if s.attributes.get("gpumesh.api_key") == "alpha"), None)

    s = await wait_for(span, 60, "a router span with the key name")
    assert KEYS["alpha"] not in repr(s.attributes)

    async def metric() -> str:
        with rx._lock:
            text = "".join(str(r) for r in rx.metric_requests)
        return text if "gpumesh.router.key_requests" in text and "auth_rejections" in text \
            else ""

    text = await wait_for(metric, 60, "key and rejection metrics")
    assert '"alpha"' in text and KEYS["alpha"] not in text
