"""One choice of one request.

It submits the choice to an AW, or attaches to the AW that runs it. It turns the AW's tokens into
text deltas, with incremental detokenisation and stop strings held back. It resumes the choice when
its AW dies, and keeps timing for the metrics.

This guards against a query of death. A request can be what kills its AW, through a bug that one
input triggers. Resuming it elsewhere would kill the next AW, and the next. So every choice counts
the AW deaths it saw *before it produced a token* on that AW (`deaths`). A token in between resets
the count. A request that saw two in a row is ended with an in-band error and never replayed a
third time.

Only deaths count. An AW whose connection ended (a process that exited) counts at once. An AW this
gateway found silent (hung) counts only once the orchestrator declared it dead, as it may only have
been slow. Its requests resume elsewhere. The silence counts against them if it was a death:
`hung_on` is looked at when the request needs resuming again.

Until a suspect (one death) produces a token on its new AW, it is the only suspect this gateway has
in flight there (aw_pool.py). So if that AW dies too, the blame is not shared with innocent requests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fabric.errors import PeerDeadError
from fabric.messages.client import PromptScores, Submit
from gateway.aw_client import AwClient, Pending
from gateway.aw_pool import AwPool
from gateway.detokenizer import IncrementalDetokenizer
from gateway.metrics import Metrics
from gateway.protocol import ApiError, GenParams
from gateway.stop_strings import StopMatcher

log = logging.getLogger(__name__)

# AW deaths a request may see before it produces a token. The next is not tried.
MAX_DEATHS = 2


Entry = tuple[int, float | None, list[list[float]] | None]  # (token, its logprob, top [[token, logprob], ...])


@dataclass
class Delta:
    """What a choice produced since the last delta.

    `index` is the token's position in the choice.
    """

    text: str
    token_ids: list[int]
    logprobs: list[Entry]
    index: int
    finish_reason: str | None = None
    prompt: PromptScores | None = None  # with the first delta, when the request scores its prompt


@dataclass
class Choice:
    index: int
    request_id: str
    submit: Submit
    # A stream. When its HTTP client leaves, the AW keeps it for a resume.
    resumable: bool = False
    client: AwClient | None = None
    pending: Pending | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False  # the client got its last delta
    aw_done: bool = False  # its AW finished it (nothing to abort)
    # AW deaths seen since its last token (see the module's docstring).
    deaths: int = 0
    # AWs found hung under it since its last token, not yet dead.
    hung_on: list[str] = field(default_factory=list)
    since_submit: int = 0  # tokens since it was last submitted (or attached)
    resumes: int = 0
    # The HTTP client's address, for its fair share of the waiting queue.
    origin: str = ""
    prompt: PromptScores | None = None  # its prompt's scores (echo with logprobs, prompt_logprobs)


class GenerationError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


async def start_choice(pool: AwPool, choice: Choice, wait: float = 0.0) -> None:
    try:
        choice.client, choice.pending = await pool.submit(choice.submit, wait)
    except PeerDeadError as exc:
        raise ApiError(503, f"no attention worker available: {exc}", type_="service_unavailable",
                       headers={"Retry-After": "1"}) from exc
    choice.since_submit = 0


async def attach_choice(pool: AwPool, choice: Choice, wait: float = 0.0) -> bool:
    """Resumes a stream whose client came back (Last-Event-ID); returns True if attached.

    It binds to the AW that still runs the stream. If none does, because its AW died meanwhile or its
    grace passed, it generates the stream again from the start. Sampling depends only on the seed and
    the token index, so this gives the same tokens.
    """
    t0 = time.monotonic()
    found = await pool.attach(choice.submit)
    if found is None:
        log.info("%s: resumed by its client; no AW runs it any more: generating it again", choice.request_id)
        await start_choice(pool, choice, wait)
        return False
    choice.client, choice.pending, reply = found
    choice.deaths, choice.since_submit = reply.deaths, 0
    log.info("%s: resumed by its client: attached to it on %s (%d tokens so far) in %.1f ms", choice.request_id,
             choice.client.worker_id, len(reply.outputs), (time.monotonic() - t0) * 1e3)
    return True


async def run_choice(pool: AwPool, choice: Choice, params: GenParams, tokenizer: Any, metrics: Metrics,
                     arrived: float, skip: int = 0, resume_wait: float = 0.0) -> AsyncIterator[Delta]:
    """Yields a delta per token from token `skip` on.

    Earlier tokens, which the client has, only advance the detokeniser. Raises GenerationError if
    the fabric fails the choice.
    """
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    stop = StopMatcher(list(params.stop)) if detok is not None else StopMatcher([])
    pending = choice.pending
    assert pending is not None, "start_choice first"
    last = None
    metrics.enter_waiting(choice.origin)
    waiting = True
    try:
        while True:
            ev = await pending.queue.get()
            now = time.monotonic()
            if waiting:
                metrics.leave_waiting(choice.origin, running=True)
                waiting = False
                if ev.error is None:
                    metrics.ttft.observe(now - arrived)
            if ev.error is not None and ev.retryable:
                pending = await _resume(pool, choice, ev.error, resume_wait, ev.death)
                continue
            if ev.error is not None:
                choice.aw_done = True
                raise GenerationError(ev.error, ev.status or 500)
            assert ev.token is not None
            if choice.since_submit == 0 and choice.client is not None:
                pool.cleared(choice.client, choice.request_id)  # it made a token here: not a suspect
            choice.since_submit += 1
            choice.deaths = 0
            choice.hung_on.clear()
            if ev.prompt is not None:
                choice.prompt = ev.prompt
            # Scoring only. The token that ended the prefill is not the client's.
            if params.max_tokens == 0:
                choice.aw_done = choice.done = True
                choice.finish_reason = "length"
                if skip == 0:
                    metrics.finished.labels("length").inc()
                    yield Delta("", [], [], 0, "length", choice.prompt)
                return
            index = len(choice.token_ids)
            choice.token_ids.append(ev.token)
            text = detok.add(ev.token) if detok is not None else ""
            finish = ev.finish_reason
            if finish is not None:
                choice.aw_done = True
                if detok is not None:
                    text += detok.flush()
            text, hit = stop.feed(text)
            if hit:
                finish = "stop"
            elif finish is not None:
                text += stop.flush()
            if index < skip:  # the client has it (a resumed stream)
                if finish is not None:
                    choice.finish_reason, choice.done = finish, True
                    return
                continue
            metrics.streamed.add(now - last if last is not None else None)
            last = now
            lp: list[Entry] = [(ev.token, ev.logprob, ev.top)] if ev.logprob is not None else []
            prompt = choice.prompt if index == 0 else None
            if finish is not None:
                choice.finish_reason = finish
                choice.done = True
                metrics.finished.labels(finish).inc()
                yield Delta(text, [ev.token], lp, index, finish, prompt)
                return
            yield Delta(text, [ev.token], lp, index, prompt=prompt)
    finally:
        if waiting:
            metrics.leave_waiting(choice.origin, running=False)
        else:
            metrics.running.dec()
        if not choice.aw_done and choice.client is not None:
            if choice.resumable and not choice.done:  # the client left: the AW keeps it for a resume
                await pool.detach(choice.client, choice.request_id, choice.pending)
            else:  # a stop string
                await pool.abort(choice.client, choice.request_id, choice.pending)


async def _resume(pool: AwPool, choice: Choice, error: str, wait: float, death: bool) -> Pending:
    """Resumes the choice on a healthy AW after its AW died or went silent.

    It resumes from the store's checkpoint, or by re-prefilling the prompt plus the tokens already
    emitted. Sampling depends only on (seed, token index), so the stream continues with exactly the
    next token.
    """
    dead = choice.client.worker_id if choice.client is not None else ""
    if choice.client is not None:
        pool.cleared(choice.client, choice.request_id)
    # It made no token there, so it may be what killed or froze the AW.
    if choice.since_submit == 0:
        if death:
            choice.deaths += 1
        elif dead:
            choice.hung_on.append(dead)
    declared = [w for w in choice.hung_on if w in pool.dead]  # silent AWs the orchestrator has ruled on
    choice.deaths += len(declared)
    choice.hung_on = [w for w in choice.hung_on if w not in pool.dead]
    if choice.deaths >= MAX_DEATHS:
        choice.aw_done = True
        log.error("%s: ended after %d attention workers died under it before it produced a token (%s); not "
                  "retried: it may be what kills them", choice.request_id, choice.deaths, error)
        raise GenerationError(f"this request was running on {choice.deaths} attention workers that died before "
                              "it produced a token; it is not retried, as it may be what made them fail", 500)
    choice.resumes += 1
    choice.submit = dataclasses.replace(
        choice.submit, output_ids=list(choice.token_ids),
        restore_from=dead if pool.resume == "restore" else "",
        replay_chunk=1 if pool.resume == "sequential" else 0, deaths=choice.deaths)
    log.warning("%s: %s; resuming after %d tokens%s", choice.request_id, error, len(choice.token_ids),
                " (a suspect: it had made no token there)" if choice.deaths else "")
    try:
        await start_choice(pool, choice, wait)
    except ApiError as exc:
        raise GenerationError(exc.message, exc.status) from exc
    assert choice.pending is not None
    return choice.pending
