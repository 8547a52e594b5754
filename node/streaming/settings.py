"""The node's ``[streaming]`` section: how tokens are coalesced into stream messages
(:mod:`.budget`, :mod:`.coalesce`)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from gpumesh.config import SECTION


class StreamingSettings(BaseModel):
    """Coalescing defaults and the node's stream-message budget."""

    model_config = SECTION

    flush_interval_ms: int = Field(
        20, ge=0, description="Default coalescing interval of a stream (0 = per token); a "
                              "request may ask for its own.")
    stream_messages_per_s: float = Field(
        2000.0, ge=0, allow_inf_nan=False,
        description="Budget of stream messages per second over all streams: with more streams "
                    "sending than budget x interval, the default interval widens to streams / "
                    "budget (at most 250 ms). With several front ends each has budget / "
                    "frontends. 0 = fixed interval.")
    max_tokens_per_chunk: int = Field(64, ge=1,
                                      description="Most tokens in one stream message.")
