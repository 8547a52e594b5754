"""What differs between the vLLM versions the node runs on, in one place: entry points,
exception types, the platform, the environment cache."""

from __future__ import annotations

from typing import Any

from gpumesh.node.engines.base import (
    EngineError,
    EngineOverloaded,
    EngineRequest,
    InvalidRequest,
    PromptTooLong,
)


def import_entry_points() -> tuple[Any, Any, Any]:
    """(``AsyncEngineArgs``, ``AsyncLLM``, the usage context the node starts engines with)."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncEngineArgs, AsyncLLM, UsageContext.OPENAI_API_SERVER


def cache_vllm_envs() -> None:
    """Freeze ``vllm.envs`` once the engine is built, as vLLM does in its engine-core and worker
    processes but not in the front end: there, every scheduler step's stats update reads
    ``envs.VLLM_COMPUTE_NANS_IN_LOGITS`` per request, two ``os.getenv`` calls each: per-token
    work in the process that limits a GPU node. Environment changes after start-up are then not seen, as in
    vLLM's own processes. Versions without the cache are left as they are."""
    import vllm.envs

    enable = getattr(vllm.envs, "enable_envs_cache", None)
    if callable(enable):
        enable()


def refresh_vllm_envs() -> None:
    """Undo :func:`cache_vllm_envs` before another engine starts in this process: its engine
    core is forked with the parent's ``vllm.envs``, and a frozen cache would hand it the first
    engine's settings (the NIXL side-channel port among them: the second engine's handshake
    listener then fails to bind and vLLM waits for it without end)."""
    import vllm.envs

    disable = getattr(vllm.envs, "disable_envs_cache", None)
    if callable(disable):
        disable()


def vllm_error_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(engine errors to map, overload errors, client errors) of the installed vLLM.

    vLLM >= 0.28 has a ``VLLMError`` hierarchy (``VLLMClientError``, ``QueueOverflowError``,
    ``MaxQueuedTokensError``); 0.26 (the CUDA kit) has none of these, only
    ``VLLMValidationError`` / ``VLLMUnprocessableEntityError`` (ValueError subclasses) and
    ``VLLMNotFoundError`` for bad requests. Names missing from this vLLM are skipped.
    """
    import vllm.exceptions as vex

    def types(*names: str) -> tuple[type, ...]:
        return tuple(t for n in names if isinstance(t := getattr(vex, n, None), type))

    client = types("VLLMClientError", "VLLMValidationError", "VLLMUnprocessableEntityError",
                   "VLLMNotFoundError")
    return (types("VLLMError") + client, types("QueueOverflowError", "MaxQueuedTokensError"),
            client)


def engine_error(e: BaseException) -> EngineError:
    """The node's ``EngineError`` for one of vLLM's request errors (``vllm_error_types``'
    first tuple): ``PromptTooLong`` (over the context window), ``EngineOverloaded`` (vLLM's
    queue limits), ``InvalidRequest`` (a client error), else a plain ``EngineError``."""
    _, overloaded, client_errors = vllm_error_types()
    if "maximum model length" in str(e) or "max_model_len" in str(e):
        return PromptTooLong(str(e))
    if isinstance(e, overloaded):
        return EngineOverloaded(str(e))
    if isinstance(e, client_errors):
        return InvalidRequest(str(e))
    return EngineError(f"{type(e).__name__}: {e}")


def current_platform() -> Any:
    """vLLM's platform of this process (``is_cpu()``, ``is_cuda()``)."""
    from vllm import platforms

    return platforms.current_platform


def nixl_progress_thread_delay(delay_us: int) -> bool:
    """Make NIXL's progress thread wait up to ``delay_us`` for UCX events between polls in the
    agents this process creates (see ``kv_transfer``'s module doc for why). NIXL's Python API
    sets the wait to 0 and offers no option, so the agent constructor it calls is wrapped to
    raise the agent config's ``pthrDelay``. NIXL is imported through vLLM, which sets UCX's
    cache limit first. Returns False, changing nothing, where NIXL is not there."""
    try:
        from vllm.distributed import nixl_utils

        if nixl_utils.NixlWrapper is None:
            return False
        import nixl._bindings as bindings
    except ImportError:
        return False
    make = bindings.nixlAgent
    if getattr(make, "gpumesh_delay_us", None) is not None:
        return True

    def agent(name: str, config: Any) -> Any:
        if config.useProgThread and config.pthrDelay < delay_us:
            config.pthrDelay = delay_us
        return make(name, config)

    agent.gpumesh_delay_us = delay_us  # type: ignore[attr-defined]
    bindings.nixlAgent = agent
    return True


def sampling_params(request: EngineRequest) -> Any:
    """vLLM's ``SamplingParams`` for ``request``: deltas, detokenized, greedy/top-k mapped."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = request.sampling
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1,
        seed=s.seed,
        stop=list(s.stop) or None,
        include_stop_str_in_output=False,
        ignore_eos=s.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        detokenize=True,
        skip_special_tokens=True,
    )
