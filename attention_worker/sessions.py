"""Which gateway connection receives each request's tokens, and what happens when it goes away.

A request belongs to the connection that submitted it or last attached to it (`Sequence.client`).
That connection may close (its gateway died), or its HTTP client may leave (`Detach`). A resumable
request (`Submit.resume_grace_s > 0`, a stream) then keeps running *detached*. Its outputs are kept
in `Sequence.outputs`, and any gateway may `Attach` to it, getting every output so far and then the
rest. A request that finishes while detached is *parked* for the rest of its grace. Only its outputs
are kept, and its KV is freed. Past the grace, a detached request is aborted and its KV freed. A
request that is not resumable is aborted as soon as its client is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from attention_worker.request import Sequence
from fabric.messages.client import Attach, Attached, PromptScores, Submit, TokenOut
from fabric.transport.base import Connection

log = logging.getLogger(__name__)


# Finished resumable requests kept for an Attach at once. The oldest go first.
MAX_PARKED = 4096


@dataclass
class Parked:
    """A finished resumable request's outputs, compact.

    It keeps the tokens, the finish reason, and the logprob parts only if the request asked for them."""

    submit: Submit
    tokens: list[int]
    finish: str | None
    logprobs: list[list[Any]] | None  # [logprob, top] per token
    until: float  # monotonic
    prompt: PromptScores | None = None

    @classmethod
    def of(cls, seq: Sequence, until: float) -> Parked:
        assert seq.submit is not None
        lps = [[row.logprob, row.top] for row in seq.outputs] if seq.logprobs >= 0 else None
        return cls(seq.submit, [row.token for row in seq.outputs], seq.outputs[-1].finish if seq.outputs else None,
                   lps, until, seq.prompt_scores)

    def outputs(self) -> list[TokenOut]:
        rid, last = self.submit.request_id, len(self.tokens) - 1
        return [TokenOut(rid, t, self.finish if i == last else None,
                         *(self.logprobs[i] if self.logprobs else (None, None)))
                for i, t in enumerate(self.tokens)]


class Sessions:
    def __init__(self, find: Callable[[str], Sequence | None], remove: Callable[[str, bool], None],
                 requests: Callable[[], Iterable[Sequence]]) -> None:
        self.find = find  # a running, waiting or restoring request by id
        self.requests = requests  # every such request
        # Aborts a request and frees its KV. With True it hands its checkpoints over.
        self.remove = remove
        self.parked: dict[str, Parked] = {}
        self.detaches = 0
        self.attaches = 0
        self.expired = 0

    def let_go(self, seq: Sequence) -> None:
        """Detaches `seq` for its grace, or aborts it, once its client is gone."""
        seq.client = None
        grace = seq.submit.resume_grace_s if seq.submit is not None else 0.0
        if grace > 0:
            seq.detached_until = time.monotonic() + grace
            self.detaches += 1
        else:
            self.remove(seq.request_id, False)

    def connection_lost(self, conn: Connection) -> None:
        """A gateway connection closed. The requests it held go on detached or are aborted."""
        for seq in [s for s in self.requests() if s.client is conn]:
            self.let_go(seq)

    def detach(self, conn: Connection, request_id: str) -> None:
        seq = self.find(request_id)
        if seq is not None and seq.client is conn:  # another gateway may have attached since
            self.let_go(seq)

    def abort(self, conn: Connection, request_id: str, moved: bool = False) -> bool:
        """`conn`'s gateway lets go of its request. `moved` means it resumed it on another AW."""
        seq = self.find(request_id)
        if seq is not None and seq.client is conn:
            self.remove(request_id, moved)
            return True
        return False

    def finished(self, seq: Sequence) -> None:
        """Parks a resumable `seq`'s outputs for its grace once it produced its last token.

        This happens even when a gateway holds it. That gateway may be hung, its last tokens unread,
        and its client about to resume elsewhere."""
        if seq.submit is None or seq.submit.resume_grace_s <= 0:
            return
        until = seq.detached_until or time.monotonic() + seq.submit.resume_grace_s
        self.parked[seq.request_id] = Parked.of(seq, until)
        while len(self.parked) > MAX_PARKED:
            del self.parked[next(iter(self.parked))]

    def attach(self, conn: Connection, msg: Attach) -> Attached:
        """Binds the request to `conn` if it runs (or finished) here as the same generation.

        Send the reply before the loop turns again (`send_nowait`). Later outputs go to `conn` now."""
        rid = msg.submit.request_id
        seq = self.find(rid)
        if seq is not None and seq.submit is not None and seq.submit.same_request(msg.submit):
            seq.client, seq.detached_until = conn, None
            self.attaches += 1
            return Attached(rid, True, list(seq.outputs), seq.submit.deaths, seq.prompt_scores)
        parked = self.parked.get(rid)
        if parked is not None and parked.submit.same_request(msg.submit):
            del self.parked[rid]
            self.attaches += 1
            return Attached(rid, True, parked.outputs(), 0, parked.prompt)
        return Attached(rid, False, [])

    def take_over(self, conn: Connection, submit: Submit) -> Attached | None:
        """Handles a Submit that resumes a request this AW still runs detached, or has parked.

        This comes from a gateway that found this AW hung while it was only slow, and then picked it
        again. It binds the request to `conn`, as an Attach would, so that nothing is computed twice.
        It returns the outputs past the `submit.output_ids` the gateway has, and the prompt scores
        if the gateway has no token yet. It returns None if the request is not detached here as the
        same generation with those tokens."""
        rid, have = submit.request_id, submit.output_ids
        seq = self.find(rid)
        if seq is not None:
            if (seq.client is not None and not seq.client.closed) or seq.submit is None:
                return None
            tokens, found_submit, outputs, prompt = [row.token for row in seq.outputs], seq.submit, seq.outputs, seq.prompt_scores
        elif rid in self.parked:
            parked = self.parked[rid]
            tokens, found_submit, outputs, prompt = parked.tokens, parked.submit, parked.outputs(), parked.prompt
            if len(tokens) <= len(have):
                return None  # nothing left to send: a fresh run ends it
        else:
            return None
        if not found_submit.same_request(submit) or tokens[: len(have)] != have:
            return None
        if seq is not None:
            seq.client, seq.detached_until = conn, None
        else:
            del self.parked[rid]
        self.attaches += 1
        return Attached(rid, True, list(outputs[len(have):]), found_submit.deaths, prompt if not have else None)

    def expire(self, running: list[Sequence], now: float | None = None) -> None:
        """Aborts detached requests past their grace and drops parked outputs past theirs."""
        now = time.monotonic() if now is None else now
        for seq in running:
            if seq.client is None and seq.detached_until is not None and now > seq.detached_until:
                log.info("%s: no client resumed it within its grace; aborted", seq.request_id)
                self.expired += 1
                self.remove(seq.request_id, False)
        for rid in [r for r, p in self.parked.items() if now > p.until]:
            del self.parked[rid]
