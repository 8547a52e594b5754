"""vLLM's request and response messages <-> the node's Engine seam (see the package docstring
for the field semantics)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb

from gpumesh.node.api.sampling import check_sampling_ranges
from gpumesh.node.engines.base import Finish, PromptTooLong, Sampling
from gpumesh.node.errors import RequestError, from_engine_exception, invalid

_FINISH = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.ABORT: "abort"}


@dataclass(frozen=True)
class RequestParams:
    """A Generate request's sampling on the Engine seam, plus what the servicer enforces
    itself: stop token ids (not before ``min_tokens`` generated)."""

    sampling: Sampling
    stop_token_ids: frozenset[int]
    min_tokens: int


def request_params(p: vpb.SamplingParams, prompt_len: int, context_len: int) -> RequestParams:
    """vLLM's proto defaults and limits -> the Engine seam's ``Sampling`` (the package
    docstring lists what is supported). Raises ``RequestError`` (INVALID_ARGUMENT)."""
    if p.n > 1:
        raise invalid("n > 1 is not supported by this node")
    if p.HasField("logprobs") or p.HasField("prompt_logprobs"):
        raise invalid("logprobs are not supported by this node")
    if p.WhichOneof("constraint") is not None:
        raise invalid("structured outputs (constraints) are not supported by this node")
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.top_p != 0.0 else 1.0
    check_sampling_ranges(temperature, top_p, p.stop)
    room = context_len - prompt_len
    if p.HasField("max_tokens"):
        max_tokens = p.max_tokens
        if max_tokens < 1:
            raise invalid("max_tokens must be at least 1")
    else:
        max_tokens = room  # vLLM: None = until the context window is full
    if room < 1 or max_tokens > room:
        raise invalid(
            f"This model's maximum context length is {context_len} tokens; the prompt has "
            f"{prompt_len} tokens and max_tokens is {max_tokens}")
    return RequestParams(
        Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=p.top_k,
                 seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
                 ignore_eos=p.ignore_eos),
        frozenset(p.stop_token_ids), p.min_tokens)


def engine_error(exc: BaseException) -> RequestError:
    """The node's one mapping (gpumesh.node.errors), except that vLLM reports a prompt too long for
    the context window as INVALID_ARGUMENT (a client error), not OUT_OF_RANGE."""
    err = from_engine_exception(exc)
    if isinstance(exc, PromptTooLong) or err.code is grpc.StatusCode.OUT_OF_RANGE:
        return invalid(err.message)
    return err


def chunk_response(ids: list[int], prompt_tokens: int) -> vpb.GenerateResponse:
    return vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=prompt_tokens, completion_tokens=len(ids),
        cached_tokens=0, index=0))


def complete_response(ids: list[int], finish: Finish, prompt_tokens: int,
              matched_token: int | None) -> vpb.GenerateResponse:
    done = vpb.GenerateComplete(
        output_ids=ids, finish_reason=_FINISH[finish], prompt_tokens=prompt_tokens,
        completion_tokens=len(ids), cached_tokens=0, index=0)
    if matched_token is not None:
        done.matched_token_id = matched_token
    return vpb.GenerateResponse(complete=done)
