"""Gateway <-> AW channel: whole requests in, per-step token deltas out.

A request is bound to the gateway connection that submitted (or last attached to) it. When that
gateway goes away, or its HTTP client does (`Detach`), a resumable request keeps running on its AW
for `resume_grace_s`, its outputs kept; any gateway can `Attach` to it meanwhile and gets every
output so far (`Attached`), then the rest as usual. Past the grace the AW aborts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fabric.messages.base import Message, register


@register
@dataclass
class Submit(Message):
    """A request's full state, sent once. `output_ids` is non-empty when a request resumes."""

    kind = "submit"
    request_id: str
    prompt_ids: list[int]
    max_tokens: int  # output tokens in all, counting those in output_ids
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: list[int]
    ignore_eos: bool
    output_ids: list[int]
    logprobs: int = -1  # -1: none; 0: the sampled token's; k: also the k most likely
    restore_from: str = ""  # resuming after this AW died: fetch its checkpointed KV first
    replay_chunk: int = 0  # >0: recompute output_ids at most this many per step (1: sequential replay)
    resume_grace_s: float = 0.0  # >0: kept this long for an Attach if its gateway or client goes away
    deaths: int = 0  # workers that died under it before it produced a token (see gateway/generation.py)

    def same_request(self, other: Submit) -> bool:
        """Whether `other` asks for the same generation (a resumed stream must match what runs)."""
        return (self.prompt_ids, self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed,
                sorted(self.stop_token_ids), self.ignore_eos, self.logprobs) == (
            other.prompt_ids, other.max_tokens, other.temperature, other.top_p, other.top_k, other.seed,
            sorted(other.stop_token_ids), other.ignore_eos, other.logprobs)


@register
@dataclass
class Abort(Message):
    kind = "abort"
    request_id: str


@register
@dataclass
class Detach(Message):
    """The HTTP client of a resumable request went away: keep it running for its grace."""

    kind = "detach"
    request_id: str


@register
@dataclass
class Attach(Message):
    """Take over the request `submit.request_id` if this AW runs it (or finished it within its
    grace) and it is the same generation as `submit`. Answered by `Attached`."""

    kind = "attach"
    submit: Submit


@register
@dataclass
class Attached(Message):
    """`found`: the request is now bound to this connection; `outputs` are all of its StepOutput
    rows so far, in order (the last one has a finish reason if it is done). Later rows follow in
    StepOutput messages as usual."""

    kind = "attached"
    request_id: str
    found: bool
    outputs: list[list[Any]]
    deaths: int = 0


@register
@dataclass
class StepOutput(Message):
    """One AW step: for each request that produced a token,
    [request_id, token, finish_reason|None, logprob|None, [[token, logprob], ...]|None]; and the
    AW's outstanding work after the step (tokens to prefill and decode, over every gateway's
    requests), which every gateway routes on."""

    kind = "step_output"
    outputs: list[list[Any]]
    load: int = 0


@register
@dataclass
class RequestFailed(Message):
    """The request cannot go on. `retryable`: not the request's fault (resume it elsewhere)."""

    kind = "request_failed"
    request_id: str
    message: str
    status: int
    retryable: bool = False
