"""Gateway <-> AW channel: whole requests in, per-step token deltas out.

A request is bound to the gateway connection that submitted (or last attached to) it. When that
gateway goes away, or its HTTP client does (`Detach`), a resumable request keeps running on its AW
for `resume_grace_s`, its outputs kept; any gateway can `Attach` to it meanwhile and gets every
output so far (`Attached`), then the rest as usual. Past the grace the AW aborts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from fabric.messages.base import Message, register


class TokenOut(NamedTuple):
    """One token of a request, as `StepOutput` and `Attached` carry it (an array on the wire)."""

    request_id: str
    token: int
    finish: str | None  # the finish reason, on its last token
    logprob: float | None  # (when logprobs were asked for)
    top: list[list[Any]] | None  # [[token, logprob], ...]: the `logprobs` most likely


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (fabric/grammar.py): `kind` is json_schema, json_object,
    regex, choice or grammar; `spec` the schema as JSON text, the regex, the choices as a JSON list,
    or the EBNF grammar ("" for json_object)."""

    kind: str
    spec: str = ""


@register
@dataclass(kw_only=True)
class Submit(Message):
    """A request's full state, sent once. `output_ids` is non-empty when a request resumes.

    Built by name only: its fields are many and alike."""

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
    prompt_logprobs: int = -1  # -1: none; k >= 0: each prompt token's logprob and rank, and the k most likely
    constraint: Constraint | None = None  # the grammar its output must match (None: free text)

    def same_request(self, other: Submit) -> bool:
        """Whether `other` asks for the same generation (a resumed stream must match what runs)."""
        return (self.prompt_ids, self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed,
                sorted(self.stop_token_ids), self.ignore_eos, self.logprobs, self.prompt_logprobs, self.constraint) == (
            other.prompt_ids, other.max_tokens, other.temperature, other.top_p, other.top_k, other.seed,
            sorted(other.stop_token_ids), other.ignore_eos, other.logprobs, other.prompt_logprobs, other.constraint)


@dataclass
class PromptScores:
    """How likely the model found each prompt token given the ones before it: positions 1..P-1 of a
    P-token prompt (the first token has no context), computed in the request's own prefill."""

    logprobs: np.ndarray  # [P-1] float32
    ranks: np.ndarray  # [P-1] int64: 1 + how many tokens were more likely
    top_ids: np.ndarray  # [P-1, k] int64, most likely first
    top_logprobs: np.ndarray  # [P-1, k] float32

    def __post_init__(self) -> None:
        n = self.logprobs.shape[0]
        if self.logprobs.ndim != 1 or tuple(self.ranks.shape) != (n,) or self.top_ids.ndim != 2 or \
                self.top_ids.shape[0] != n or self.top_logprobs.shape != self.top_ids.shape or self.top_ids.shape[1] > 20:
            raise ValueError("prompt scores: logprobs [P], ranks [P], top ids and logprobs [P, k <= 20]")


@register
@dataclass
class PromptLogprobs(Message):
    """A request's prompt scores (Submit.prompt_logprobs >= 0), sent once, before its first token."""

    kind = "prompt_logprobs"
    request_id: str
    scores: PromptScores


@register
@dataclass
class Abort(Message):
    """Gateway -> AW: stop this request and free its KV. `moved`: the gateway resumed it on another
    AW (it found this one silent): hand its checkpoints over to that AW's restore (`KvHandOff`)."""

    kind = "abort"
    request_id: str
    moved: bool = False


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
    outputs: list[TokenOut]
    deaths: int = 0
    prompt: PromptScores | None = None  # its prompt scores, if it asked for them and has them


@register
@dataclass
class StepOutput(Message):
    """One AW step: a `TokenOut` for each request that produced a token, and the AW's outstanding
    work after the step (tokens to prefill and decode, over every gateway's requests), which every
    gateway routes on."""

    kind = "step_output"
    outputs: list[TokenOut]
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
