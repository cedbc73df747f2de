"""Per-request state on an AW."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric.errors import RequestError
from fabric.messages.client import PromptScores, Submit, TokenOut


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """`num_computed` tokens of `prompt_ids + output_ids` have their KV in this AW's cache."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    max_tokens: int  # total output tokens, counting any already in output_ids
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    logprobs: int = -1
    # If > 0, emitted tokens being recomputed go at most this many per step.
    replay_chunk: int = 0
    # The connection that receives this request's tokens. None when detached.
    client: Any = None
    # The Submit as the gateway sent it. An Attach must ask for the same generation.
    submit: Submit | None = None
    # With no client, the request keeps running for an Attach until then (monotonic).
    detached_until: float | None = None
    outputs: list[TokenOut] = field(default_factory=list)  # every token sent so far (see Attached)
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # -1 for none. With k >= 0 the prefill scores the prompt (see PromptScores).
    prompt_logprobs: int = -1
    score_parts: list[PromptScores] = field(default_factory=list)  # the prefill's chunks so far, in order
    prompt_scores: PromptScores | None = None  # all of them, once the prefill is done
    # Its grammar's place (fabric/grammar.py `Matcher`), if its output is constrained.
    matcher: Any = None

    @classmethod
    def from_submit(cls, msg: Submit, client: Any) -> Sequence:
        seq = cls(
            msg.request_id, list(msg.prompt_ids), list(msg.output_ids), msg.max_tokens, msg.temperature,
            msg.top_p, msg.top_k, msg.seed, frozenset(msg.stop_token_ids), msg.ignore_eos, msg.logprobs,
            msg.replay_chunk, client, msg,
        )
        # Tokens made before a resume, on an AW that died. Their logprobs stayed with the gateway.
        seq.outputs = [TokenOut(msg.request_id, t, None, None, None) for t in msg.output_ids]
        seq.prompt_logprobs = msg.prompt_logprobs
        return seq

    def scores(self, start: int, n: int) -> range:
        """The positions of a chunk [start, start + n) whose logits score a prompt token.

        Each position scores the token after it. This happens only in a fresh request's first
        prefill. A resumed request's gateway already has the scores."""
        if self.prompt_logprobs < 0 or self.output_ids:
            return range(0)
        return range(start, min(start + n, len(self.prompt_ids) - 1))

    def add_scores(self, start: int, part: PromptScores) -> None:
        if start == 0:  # a prefill that starts over, after a preemption, scores again
            self.score_parts.clear()
        self.score_parts.append(part)

    def take_scores(self) -> PromptScores | None:
        """Every prompt token's scores, joined, when its first token is sampled."""
        if self.prompt_logprobs < 0 or self.prompt_scores is not None or self.output_ids:
            return None
        k = self.prompt_logprobs  # a one-token prompt has nothing to score
        parts = self.score_parts or [PromptScores(np.zeros(0, np.float32), np.zeros(0, np.int64),
                                                  np.zeros((0, k), np.int64), np.zeros((0, k), np.float32))]
        self.prompt_scores = PromptScores(*(np.concatenate([getattr(p, f) for p in parts])
                                            for f in ("logprobs", "ranks", "top_ids", "top_logprobs")))
        self.score_parts = []
        return self.prompt_scores

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def chunk_limit(self, n: int) -> int:
        """`n` capped for sequential replay.

        The prompt goes in one go, emitted tokens `replay_chunk` a step."""
        if not self.replay_chunk:
            return n
        if self.num_computed < len(self.prompt_ids):
            return min(n, len(self.prompt_ids) - self.num_computed)
        return min(n, self.replay_chunk)

    @property
    def remaining_work(self) -> int:
        """Tokens still to prefill plus tokens still to decode, for load-aware routing."""
        return (self.num_tokens - self.num_computed) + (self.max_tokens - len(self.output_ids))

    def append(self, token: int) -> str | None:
        """Records a sampled token and returns the finish reason if the request is done."""
        self.output_ids.append(token)
        if self.matcher is not None:
            self.matcher.advance(token)
            if self.matcher.done:  # (the grammar takes no more: the output is complete)
                return "stop"
        if not self.ignore_eos and token in self.stop_token_ids:
            return "stop"
        if len(self.output_ids) >= self.max_tokens:
            return "length"
        return None


MAX_RESUME_GRACE_S = 3600.0  # a detached stream is kept at most this long


def check_submit(msg: Submit, vocab_size: int, context: int) -> None:
    """Raises RequestError for a `Submit` no gateway of this fabric sends: the AW trusts no peer's input."""
    if not msg.prompt_ids and not msg.output_ids:
        raise RequestError("empty prompt")
    if any(not 0 <= t < vocab_size for t in msg.prompt_ids + msg.output_ids):
        raise RequestError(f"token ids must be in [0, {vocab_size})")
    if msg.max_tokens < 1 or len(msg.prompt_ids) + msg.max_tokens > context:
        raise RequestError(f"prompt plus max_tokens exceeds the context of {context}")
    if not 0 <= msg.resume_grace_s <= MAX_RESUME_GRACE_S or msg.deaths < 0 or msg.replay_chunk < 0:
        raise RequestError(f"resume_grace_s must be in [0, {MAX_RESUME_GRACE_S}], deaths and replay_chunk >= 0")
    if not (0.0 <= msg.temperature <= 2.0 and 0.0 < msg.top_p <= 1.0 and -1 <= msg.top_k <= vocab_size
            and -1 <= msg.logprobs <= 20 and -1 <= msg.prompt_logprobs <= 20 and len(msg.stop_token_ids) <= 64):
        raise RequestError("sampling parameters out of range (temperature 0..2, top_p (0, 1], top_k -1..vocab, "
                           "logprobs and prompt_logprobs -1..20, at most 64 stop token ids)")
