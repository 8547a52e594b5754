"""The attempt layers of ``gpumesh.attempts`` (retry before the first token, mid-stream
continuation, the single attempt) over a scripted in-memory transport: each node is a list
of chunks and, optionally, the failure it raises after them. The router's and the client's
real transports are exercised by tests/router, tests/integration and tests/chaos."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest

from gpumesh import attempts
from gpumesh.migration import StreamProgress
from gpumesh.v1 import inference_pb2 as pb


class Fault(Exception):
    """A node fault (retried and continued)."""


class Refused(Exception):
    """A client error (neither retried nor continued)."""


class NoneLeft(Exception):
    """The scripted picker has no node left."""


@dataclass
class Node:
    node_id: str
    chunks: list[pb.GenerateStreamResponse]
    fails: Exception | None = None        # raised after the chunks (None: a clean end)


@dataclass
class ScriptedCall:
    node: Node
    log: list[tuple[str, str]]
    i: int = 0
    node_id: str = ""

    def __post_init__(self) -> None:
        self.node_id = self.node.node_id

    async def first(self) -> pb.GenerateStreamResponse | None:
        return await self.next()

    async def next(self) -> pb.GenerateStreamResponse | None:
        if self.i < len(self.node.chunks):
            self.i += 1
            return self.node.chunks[self.i - 1]
        if self.node.fails is not None:
            raise self.node.fails
        return None

    def close(self, error: Exception | None) -> None:
        self.log.append((self.node_id, type(error).__name__ if error else ""))


@dataclass
class ScriptedTransport:
    nodes: list[Node]
    streaming: bool = True
    prompt_tokens: int = 7
    opened: list[tuple[str, frozenset[str], list[int]]] = field(default_factory=list)
    closed: list[tuple[str, str]] = field(default_factory=list)

    async def open(self, request: pb.GenerateRequest | None,
                   exclude: frozenset[str]) -> ScriptedCall:
        free = [n for n in self.nodes if n.node_id not in exclude]
        if not free:
            raise NoneLeft("no node left")
        node = free[0]
        self.nodes.remove(node)
        self.opened.append((node.node_id, exclude,
                            list(request.resume.ids) if request is not None else []))
        return ScriptedCall(node, self.closed)

    def message(self, chunk: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        return chunk

    def encode(self, message: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        return message


class Policy:
    failures: tuple[type[Exception], ...] = (Fault, Refused, NoneLeft)

    def __init__(self, max_attempts: int = 3, max_migrations: int = 2) -> None:
        self.max_attempts = max_attempts
        self.max_migrations = max_migrations

    def retry(self, error: Exception, attempt: int, node_id: str) -> bool:
        return isinstance(error, Fault) and attempt < self.max_attempts

    def migrate(self, error: Exception, migrations: int, node_id: str,
                delivered_tokens: int) -> bool:
        return isinstance(error, Fault) and migrations < self.max_migrations

    def after_output(self, error: Exception, node_id: str) -> BaseException:
        return RuntimeError(f"{node_id} failed mid-stream: {error}")


def tok(*ids: int, finish: pb.FinishReason = pb.FINISH_REASON_UNSPECIFIED
        ) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(token_ids=ids, finish_reason=finish)


def state(max_tokens: int | None = None, migratable: bool = True) -> attempts.Attempts:
    req = pb.GenerateRequest(model="m", text="hi")
    if max_tokens is not None:
        req.sampling.max_tokens = max_tokens
    return attempts.Attempts(request=req if migratable else None, progress=StreamProgress())


async def run(t: ScriptedTransport, s: attempts.Attempts,
              policy: Policy | None = None) -> list[int]:
    out: list[int] = []
    async with contextlib.aclosing(attempts.send(t, policy or Policy(), s)) as chunks:
        async for c in chunks:
            out.extend(c.token_ids)
    return out


async def test_a_failure_before_the_first_token_is_retried_on_another_node() -> None:
    t = ScriptedTransport([Node("a", [], Fault("down")), Node("b", [tok(1), tok(2)])])
    s = state()
    assert await run(t, s) == [1, 2]
    assert [(n, ex) for n, ex, _ in t.opened] == [("a", frozenset()), ("b", frozenset({"a"}))]
    assert t.closed == [("a", "Fault"), ("b", "")]     # each attempt closed once
    assert s.attempt == 2 and s.progress is not None and s.progress.migrations == 0


async def test_a_client_error_is_not_retried() -> None:
    t = ScriptedTransport([Node("a", [], Refused("bad prompt")), Node("b", [tok(1)])])
    with pytest.raises(Refused):
        await run(t, state())
    assert [n for n, _, _ in t.opened] == ["a"] and t.closed == [("a", "Refused")]


async def test_with_no_node_left_the_previous_failure_is_what_the_client_sees() -> None:
    t = ScriptedTransport([Node("a", [], Fault("a is down"))])
    with pytest.raises(Fault, match="a is down"):
        await run(t, state())


async def test_retries_stop_at_max_attempts() -> None:
    t = ScriptedTransport([Node(n, [], Fault(n)) for n in "abcd"])
    with pytest.raises(Fault, match="b"):
        await run(t, state(), Policy(max_attempts=2))
    assert [n for n, _, _ in t.opened] == ["a", "b"]


async def test_after_output_the_stream_continues_from_the_tokens_delivered() -> None:
    t = ScriptedTransport([Node("a", [tok(1), tok(2)], Fault("died")),
                           Node("b", [tok(3), tok(4, finish=pb.FINISH_REASON_STOP)])])
    s = state(max_tokens=10)
    assert await run(t, s) == [1, 2, 3, 4]                 # no token twice or missing
    assert t.opened[1] == ("b", frozenset({"a"}), [1, 2])  # the continuation resumes at 2
    assert s.progress is not None and s.progress.migrations == 1


async def test_a_continuation_failing_before_its_output_is_another_migration() -> None:
    t = ScriptedTransport([Node("a", [tok(1)], Fault("died")), Node("b", [], Fault("too")),
                           Node("c", [tok(2, finish=pb.FINISH_REASON_STOP)])])
    s = state()
    assert await run(t, s) == [1, 2]
    assert [r for _, _, r in t.opened] == [[], [1], [1]]
    assert s.progress is not None and s.progress.migrations == 2


async def test_a_stream_that_may_not_migrate_fails_mid_stream() -> None:
    t = ScriptedTransport([Node("a", [tok(1)], Fault("died")), Node("b", [tok(2)])])
    with pytest.raises(RuntimeError, match="a failed mid-stream"):
        await run(t, state(migratable=False))
    assert t.closed == [("a", "Fault")]


async def test_no_node_for_a_continuation_fails_mid_stream_with_the_nodes_error() -> None:
    t = ScriptedTransport([Node("a", [tok(1)], Fault("died"))])
    with pytest.raises(RuntimeError, match="a failed mid-stream: died"):
        await run(t, state())


async def test_a_stream_whose_final_chunk_went_out_ends_quietly() -> None:
    t = ScriptedTransport([Node("a", [tok(1, finish=pb.FINISH_REASON_STOP)], Fault("rst")),
                           Node("b", [tok(9)])])
    assert await run(t, state()) == [1]
    assert t.closed == [("a", "")] and len(t.opened) == 1


async def test_a_stream_with_every_token_delivered_gets_its_final_chunk() -> None:
    t = ScriptedTransport([Node("a", [tok(1), tok(2, 3)], Fault("died"))])
    s = state(max_tokens=3)
    got: list[pb.GenerateStreamResponse] = []
    async with contextlib.aclosing(attempts.send(t, Policy(), s)) as chunks:
        async for c in chunks:
            got.append(c)
    assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert (got[-1].usage.prompt_tokens, got[-1].usage.completion_tokens) == (7, 3)
    assert len(t.opened) == 1


async def test_stopping_early_closes_the_call_once() -> None:
    t = ScriptedTransport([Node("a", [tok(1), tok(2), tok(3)])])
    async with contextlib.aclosing(attempts.send(t, Policy(), state())) as chunks:
        async for _ in chunks:
            break
    assert t.closed == [("a", "")]


async def test_a_unary_request_answers_once_and_is_retried_before_its_answer() -> None:
    t = ScriptedTransport([Node("a", [], Fault("down")), Node("b", [tok(5), tok(6)])],
                          streaming=False)
    answer = await attempts.first_answer(t, Policy(), attempts.Attempts())
    assert list(answer.token_ids) == [5] and t.closed == [("a", "Fault"), ("b", "")]
