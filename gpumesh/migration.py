"""Mid-stream failover: what a stream has delivered, and the request that continues it.

Who calls it: the migration layer of ``gpumesh.attempts``, which the router (proxy mode) and
the client library (lookaside mode) both run. A ``StreamProgress`` watches every chunk the
client is sent (the output token ids, whether the final chunk went out). When the node fails
after that, ``resume_request`` builds the continuation: the client's request with ``resume``
= the token ids delivered, so that another node generates exactly what comes next (greedy
sampling: the same tokens; else a consistent continuation) and the client sees one stream, no
token twice or missing.
``max_tokens`` and the final chunk's usage count the delivered tokens (the node does it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumesh.v1 import inference_pb2 as pb


@dataclass
class StreamProgress:
    """What the client has been sent so far of one stream. ``observe`` every forwarded chunk
    (serialized ``GenerateStreamResponse``), in order."""

    token_ids: list[int] = field(default_factory=list)
    chunks: int = 0
    finished: bool = False      # the final chunk (with a finish reason) went out
    migrations: int = 0         # continuations started so far

    def observe(self, chunk: bytes) -> None:
        msg = pb.GenerateStreamResponse.FromString(chunk)
        self.observe_message(msg)

    def observe_message(self, msg: pb.GenerateStreamResponse) -> None:
        self.chunks += 1
        self.token_ids.extend(msg.token_ids)
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finished = True

    @property
    def started(self) -> bool:
        """The client has seen output: a failure now is mid-stream."""
        return self.chunks > 0


def migratable(request: pb.GenerateRequest) -> bool:
    """Whether a stream of ``request`` may continue on another node (not opted out)."""
    return not request.no_migration


def resume_request(request: pb.GenerateRequest, progress: StreamProgress
                   ) -> pb.GenerateRequest | None:
    """The request that continues ``request`` after ``progress``; None when nothing is left
    to generate (every ``max_tokens`` token was delivered: the stream only lacks its end)."""
    delivered = list(request.resume.ids) + progress.token_ids
    if request.sampling.HasField("max_tokens") and len(delivered) >= request.sampling.max_tokens:
        return None
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.ClearField("resume")
    out.resume.ids.extend(delivered)
    return out


def final_chunk(request: pb.GenerateRequest, progress: StreamProgress,
                prompt_tokens: int) -> pb.GenerateStreamResponse:
    """The end of a stream whose every ``max_tokens`` token was delivered before its node
    failed: finish LENGTH, usage from what was sent (``prompt_tokens``: the router's count)."""
    return pb.GenerateStreamResponse(
        finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=prompt_tokens,
                       completion_tokens=len(request.resume.ids) + len(progress.token_ids)))
