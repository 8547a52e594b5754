"""The multi-tenant shared-prefix load of the ``prefix05`` phase: ``gpumesh_bench.tenants``'s
request stream, re-spelled for the engine's tokenizer, in a closed loop through one balancer
(a gpumesh router over gRPC, or SMG over OpenAI HTTP/SSE), from several processes.

Spelling: every word of a tenant prompt becomes one token of the engine's tokenizer. The GPU's
dummy models split on whitespace and map ``<tN>`` to id N (any English word to ``<t0>``, which
would make every prompt the same), so a word becomes ``<tN>`` with N from a CRC of the word;
the simulator's tokenizer takes pieces of up to four characters, so there a word becomes its
CRC in base 36 (at most four characters). Every word is salted per bench (``SpellSpec.salt``),
system prompt and conversation alike, so each balancer gets the same tenants, turns and
lengths but text no earlier bench left in the engines' prefix caches or in any balancer's
record of them; within a bench a tenant's system prompt is one spelling, shared by its
requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import multiprocessing
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpumesh_bench.loadgen import LoadConfig, RequestResult
from gpumesh_bench.tenants import TenantSpec, iter_tenant_requests
from gpumesh_bench.workload import BenchRequest


@dataclass(frozen=True)
class SpellSpec:
    """How tenant prompts are spelled: ``vocab`` "dummy" (``<tN>``, vLLM's dummy models) or
    "sim" (base 36, the simulator); ``system_words``: words of a tenant's system prompt
    (``TenantSpec.system_words`` + the 3-word "tenant T system." header); ``salt``: per
    bench, for every word."""

    vocab: str
    system_words: int
    salt: int


_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def _b36(n: int) -> str:
    s = ""
    while True:
        n, d = divmod(n, 36)
        s = _B36[d] + s
        if not n:
            return s


def spell_word(word: str, vocab: str, salt: int) -> str:
    """One word as one token of ``vocab``; deterministic in (word, salt)."""
    h = zlib.crc32(f"{salt}\x00{word}".encode())
    if vocab == "dummy":
        return f"<t{1000 + h % 150_000}>"   # clear of Qwen's special tokens (151643+)
    return _b36(h % 36**4)


def spell(prompt: str, s: SpellSpec, memo: dict[tuple[int, str], str]) -> str:
    """``prompt`` re-spelled, every word with the bench's salt."""
    out = []
    for w in prompt.split():
        salt = s.salt
        t = memo.get((salt, w))
        if t is None:
            t = memo[(salt, w)] = spell_word(w, s.vocab, salt)
        out.append(t)
    return " ".join(out)


@dataclass(frozen=True)
class Prompted(BenchRequest):
    """A tenant request as the load generator's request, with its conversation id."""

    routing_key: str = ""


def requests(tenants: TenantSpec, s: SpellSpec, model: str, k: int = 0,
             n: int = 1) -> Iterator[Prompted]:
    """Process ``k`` of ``n``'s share (index % n == k) of the stream, spelled."""
    memo: dict[tuple[int, str], str] = {}
    for r in iter_tenant_requests(tenants):
        if r.index % n != k:
            continue
        text = spell(r.prompt, s, memo)
        yield Prompted(r.index, 0.0, text.count(" ") + 1, r.max_tokens, text, model,
                       routing_key=r.conversation)


class _Texts:
    """``smg_clients.http_send``'s prompt source: the request's own spelled text."""

    def __init__(self) -> None:
        self.by_index: dict[int, str] = {}

    def prompt(self, n: int, seed: int, index: int) -> tuple[str, list[int]]:
        text = self.by_index.pop(index)
        return text, [0] * n


def _child(kind: str, target: str, model: str, worker_nodes: dict[str, str],
           tenants: TenantSpec, s: SpellSpec, concurrency: int, duration_s: float, k: int,
           n: int, start_at: float) -> tuple[list[dict[str, Any]], dict[int, str]]:
    from gpumesh_bench.loadgen import drive

    keys: dict[int, str] = {}   # request index -> conversation id ("t<tenant>-c<n>")

    def stream() -> Iterator[Prompted]:
        for r in requests(tenants, s, model, k, n):
            keys[r.index] = r.routing_key
            yield r

    cfg = LoadConfig(target=target, concurrency=concurrency, duration_s=duration_s,
                     timeout_s=120.0, progress_s=0.0, label=target)

    async def grpc_go() -> list[RequestResult]:
        import grpc

        from gpumesh.client import SPREAD_OPTIONS, spread_target
        from gpumesh.v1 import inference_pb2 as pb
        from gpumesh.v1 import inference_pb2_grpc as pb_grpc
        from gpumesh_bench.loadgen import send_message

        def msg(r: Prompted) -> Any:
            m = pb.GenerateRequest(model=model, text=r.prompt_text or "",
                                   request_id=f"p-{s.salt}-{r.index}", routing_key=r.routing_key)
            m.sampling.max_tokens = r.max_tokens
            m.sampling.ignore_eos = True
            return m

        # a multi-worker router: a connection per worker, calls round-robin over them
        spread = await spread_target(target)
        opts = [("grpc.max_receive_message_length", 64 << 20),
                *(SPREAD_OPTIONS if spread != target else [])]
        async with grpc.aio.insecure_channel(spread, options=opts) as ch:
            stub = pb_grpc.InferenceStub(ch)
            await asyncio.wait_for(ch.channel_ready(), timeout=30)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            run = await drive(cfg, stream(),
                              lambda r, t0: send_message(stub, msg(r), r, cfg, t0))  # type: ignore[arg-type]
            return run.results

    async def http_go() -> list[RequestResult]:
        import aiohttp

        from gpumesh_bench.peers.smg_clients import http_send

        texts = _Texts()

        def texted() -> Iterator[Prompted]:
            for r in stream():
                texts.by_index[r.index] = r.prompt_text or ""
                yield r

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            run = await drive(cfg, texted(),
                              lambda r, t0: http_send(sess, target, model, texts,  # type: ignore[arg-type]
                                                      worker_nodes, r, cfg, t0))
            return run.results

    res = asyncio.run(grpc_go() if kind == "grpc" else http_go())
    return [dataclasses.asdict(r) for r in res], {r.index: keys[r.index] for r in res}


def tenant_load(kind: str, target: str, model: str, tenants: TenantSpec, s: SpellSpec, *,
                concurrency: int, duration_s: float, procs: int,
                worker_nodes: dict[str, str] | None = None
                ) -> tuple[list[RequestResult], dict[int, str]]:
    """``concurrency`` closed-loop streams in all over ``procs`` processes (each its share of
    the stream and of the concurrency), from one start instant; ``kind`` "grpc" (``target``
    host:port) or "http" (``target`` base URL of an OpenAI server). Results' ``start_s``
    count from that instant. Also each result's conversation id by request index."""
    n = max(1, min(procs, concurrency))
    start_at = time.time() + 2.0 + 0.2 * n
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=ctx) as ex:
        futs = [ex.submit(_child, kind, target, model, dict(worker_nodes or {}), tenants, s,
                          concurrency // n + (k < concurrency % n), duration_s, k, n, start_at)
                for k in range(n)]
        parts = [f.result() for f in futs]
    rows = [d for p, _ in parts for d in p]
    keys = {i: c for _, ks in parts for i, c in ks.items()}
    return sorted((RequestResult(**d) for d in rows), key=lambda r: r.index), keys
