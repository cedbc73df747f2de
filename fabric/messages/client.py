"""Gateway <-> AW channel: whole requests in, per-step token deltas out."""

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
    max_tokens: int
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




@register
@dataclass
class Abort(Message):
    kind = "abort"
    request_id: str


@register
@dataclass
class StepOutput(Message):
    """One AW step: for each request that produced a token,
    [request_id, token, finish_reason|None, logprob|None, [[token, logprob], ...]|None]."""

    kind = "step_output"
    outputs: list[list[Any]]


@register
@dataclass
class RequestFailed(Message):
    kind = "request_failed"
    request_id: str
    message: str
    status: int
