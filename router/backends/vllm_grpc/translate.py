"""gpumesh GenerateRequest -> VllmEngine GenerateRequest, and vLLM's finish reasons back.

Text and chat prompts are tokenized with the worker's model tokenizer; token ids are sent
as-is. gpumesh's default ``max_tokens`` (16) is sent explicitly, since vLLM's default would be
"the rest of the context".
"""

from __future__ import annotations

import logging
import uuid

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb

from gpumesh.router.backends.vllm_grpc.call import rpc_error
from gpumesh.router.tokenizers import Tokenizer
from gpumesh.serial_worker import WorkerClosed
from gpumesh.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16   # gpumesh's contract
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}


def finish_reason(vllm_reason: str) -> pb.FinishReason:
    return _FINISH.get(vllm_reason, pb.FINISH_REASON_ABORT)


async def prompt_ids(req: pb.GenerateRequest, tok: Tokenizer, address: str) -> list[int]:
    """The prompt's token ids; a bad or empty prompt raises INVALID_ARGUMENT (the request
    never reaches the worker)."""
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        ids = list(req.token_ids.ids)
    elif kind in ("text", "chat"):
        try:
            if kind == "text":
                ids = await tok.encode_prompt(req.text)
            else:
                ids = await tok.render_chat_prompt(
                    [(m.role, m.content) for m in req.chat.messages])
        except Exception as exc:  # the tokenizer's, mapped once here
            raise tokenize_error(exc, address) from exc
    else:
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                        "request has no prompt: set text, chat or token_ids")
    if not ids:
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
    return ids


def to_vllm_request(req: pb.GenerateRequest, ids: list[int], stream: bool
                    ) -> vpb.GenerateRequest:
    s = req.sampling
    sp = vpb.SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop=list(s.stop), ignore_eos=s.ignore_eos)
    if s.HasField("seed"):
        sp.seed = s.seed & 0x7FFFFFFF   # vLLM's proto takes an int32
    original = req.text if req.WhichOneof("prompt") == "text" else ""
    return vpb.GenerateRequest(
        request_id=req.request_id or uuid.uuid4().hex, stream=stream, sampling_params=sp,
        tokenized=vpb.TokenizedInput(original_text=original, input_ids=ids))


def _is_template_error(exc: BaseException) -> bool:
    """A chat template's own error (e.g. its ``raise_exception`` on a role it refuses)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers renders templates with jinja2
        return False
    return isinstance(exc, TemplateError)


def tokenize_error(exc: Exception, address: str) -> grpc.aio.AioRpcError:
    """A tokenizer failure as the status the dispatcher and client see (the request never
    reached the worker): a bad prompt (ValueError, a chat template's error) is the client's,
    a stopping router UNAVAILABLE (retried elsewhere), anything else INTERNAL."""
    if isinstance(exc, WorkerClosed):
        return rpc_error(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ValueError) or _is_template_error(exc):
        return rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"cannot tokenize the prompt for {address}: {detail}")
    log.warning("tokenizing for %s failed: %s", address, detail)
    return rpc_error(grpc.StatusCode.INTERNAL, f"router tokenizer error: {detail}")
